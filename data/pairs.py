"""Preference pairs as the loader reads them: sample i is pair i, two padded rows.

A pair's two sequences (prompt + chosen + EOS, prompt + rejected + EOS; data/preference.py) are
each one row of `data.seq_len` tokens: `inputs` the sequence without its last token, `targets`
the sequence without its first, NO_TARGET over the prompt and the padding, padded with EOS. So
a row's targets are the completion and its EOS, as TRL's `completion_mask` shifted by one, and
`data.seq_len` is TRL's `max_length`: a longer sequence keeps its first `data.seq_len` tokens
(TRL's default `truncation_mode = "keep_start"`). A pair whose prompt alone fills
`data.seq_len` would keep no target (TRL drops it); here it is refused at start
(`check_pairs`), naming the pair, so that what a run trains on is what the dataset holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from configs import ConfigError

# data.loader builds these datasets, so the import arrow runs from it to here: its
# DatasetIndex is `index: Any` below, its Split a str.
NO_TARGET = -100  # data.loader's: cross_entropy's ignore_index


def read_pairs_table(index: Any, split: str) -> np.ndarray:
    """The split's pair rows (pairs, 4), over its shards (one, as prepare writes it)."""
    tables = [np.fromfile(s.pairs, dtype=np.int64).reshape(-1, 4) for s in index.splits[split]]
    return np.concatenate(tables) if tables else np.zeros((0, 4), np.int64)


def check_pairs(index: Any, seq_len: int, key: str = "data.path") -> None:
    """ConfigError naming the first pair (of the train split, then the val split) whose prompt
    fills `seq_len`: no completion token of it would be scored."""
    if not len(read_pairs_table(index, "train")):
        raise ConfigError(f"{key}: '{index.path}' holds no training pair")
    for split in ("train", "val") if index.splits.get("val") else ("train",):
        table = read_pairs_table(index, split)
        if not (long := np.flatnonzero(table[:, 3] >= seq_len)).size:
            continue
        shard = index.splits[split][0]
        keys = shard.keys.read_text().splitlines() if shard.keys else []
        where = keys[long[0]] if long[0] < len(keys) else f"pair {long[0]}"
        raise ConfigError(
            f"{key}: the prompt of {split} pair {long[0]} ({where}) has {table[long[0], 3]} "
            f"tokens, so no completion token fits in data.seq_len={seq_len} ({long.size} such "
            "pairs; TRL drops them): raise data.seq_len or leave them out of the dataset"
        )


class PreferencePairs(Dataset):
    """Item i: ``(inputs, targets)`` of pair i, each ``(2, seq_len)`` int64 (chosen, rejected),
    and with `reference` the pair's reference log-probabilities ``(2,)`` float64."""

    def __init__(
        self,
        index: Any,
        split: str,
        seq_len: int,
        reference: np.ndarray | None = None,
    ) -> None:
        [self.shard] = index.splits.get(split, [])  # prepare writes one shard per split
        self.dtype, self.seq_len, self.eos_id = np.dtype(index.dtype), seq_len, index.eos_id
        self.table = read_pairs_table(index, split)
        if not len(self.table):
            raise ConfigError(f"data: the '{split}' split of '{index.path}' holds no pair")
        if reference is not None and reference.shape != (len(self.table), 2):
            raise ValueError(f"reference log-probs {reference.shape} for {len(self.table)} pairs")
        self.reference = reference
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        if self._tokens is None:
            self._tokens = np.memmap(self.shard.file, dtype=self.dtype, mode="r")
        chosen, rejected, end, prompt = self.table[i].tolist()
        rows = [self._row(chosen, rejected, prompt), self._row(rejected, end, prompt)]
        inputs = torch.from_numpy(np.stack([r[0] for r in rows]))
        targets = torch.from_numpy(np.stack([r[1] for r in rows]))
        if self.reference is None:
            return inputs, targets
        return inputs, targets, torch.from_numpy(self.reference[i].copy())

    def _row(self, start: int, end: int, prompt: int) -> tuple[np.ndarray, np.ndarray]:
        assert self._tokens is not None
        sequence = self._tokens[start : min(end, start + self.seq_len)].astype(np.int64)
        n = len(sequence) - 1  # positions with a next token
        inputs = np.full(self.seq_len, self.eos_id, dtype=np.int64)
        targets = np.full(self.seq_len, NO_TARGET, dtype=np.int64)
        inputs[:n] = sequence[:-1]
        # Target j is token j + 1: a completion token from position prompt - 1 on.
        targets[max(prompt - 1, 0) : n] = sequence[max(prompt, 1) :]
        return inputs, targets

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}
