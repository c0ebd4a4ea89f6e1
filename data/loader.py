"""Read prepared token shards as fixed-length sequences, in one global order shared by all ranks.

The training data is a single *global stream* of positions k = 0, 1, 2, ...; what position k
holds (which source, which sample) is a pure function of the seed and k (data/stream.py: the
mixture of data.sources, then each source's shuffle per epoch). Micro-step j covers positions
``[j*D*B, (j+1)*D*B)`` (D = data-parallel size, B = micro-batch size) and data-parallel rank r
reads the contiguous slice ``[j*D*B + r*B, j*D*B + (r+1)*B)``. Hence:

- an optimizer step with A accumulation micro-steps covers the same A*D*B positions for every
  (D, B, A) with the same global batch, so the mesh and micro-batching do not change training;
- the loader's state is the global positions consumed (plus the mixture's segments, the same
  small list everywhere), identical on every rank, so a checkpoint resumes on a different mesh
  as long as D*B divides it.

Nothing here talks to the process group: the trainer passes ``dp_rank`` and ``dp_size``.
How the stream, the shuffle and the mixture work, and why they do not depend on the mesh:
docs/data.md.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from configs import ConfigError
from data.stream import GlobalStream, GlobalStreamBatchSampler, quantize

# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: a warning per loader that tells
# the user nothing actionable.
warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)

Split = Literal["train", "val"]
# cross_entropy's ignore_index: a position that is no target.
NO_TARGET = -100


@dataclass
class SourceConfig:
    path: str
    """Directory made by `python -m data.prepare`."""
    weight: float = 1.0
    """Share of the training stream, relative to the other sources' weights (> 0)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ConfigError(f"weight must be a number > 0, got {self.weight}")


@dataclass
class DataConfig:
    path: str | None = None
    """Directory made by `python -m data.prepare`: the one training dataset (or data.sources)."""
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    """A mixture instead of data.path: tables [data.sources.NAME] with path and weight."""
    seq_len: int = 256
    """Tokens per training sequence."""
    num_workers: int = 0
    """DataLoader worker processes; 0 reads in the training process (enough for a memmap)."""
    shuffle: bool = True
    """Shuffle training sequences (deterministically from the seed) each epoch."""
    attention_mask: Literal["causal", "document"] = "causal"
    """'causal': a token attends to every earlier token of its window; 'document': only to
    earlier tokens of its own document, which ends at the dataset's EOS id (docs/data.md)."""
    document_positions: bool = False
    """With attention_mask='document': RoPE positions restart at 0 at each document's first
    token instead of counting from the window start (data/documents.py)."""

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len must be >= 1, got {self.seq_len}")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.path is not None and self.sources:
            raise ConfigError(
                f"data.path ({self.path!r}) and data.sources ({', '.join(self.sources)}) are "
                "both set: a run reads one dataset (data.path) or a mixture (data.sources)"
            )
        for name in self.sources:
            if not re.fullmatch(r"[A-Za-z0-9_]+", name):
                raise ConfigError(
                    f"data.sources: the name {name!r} may hold letters, digits and underscores "
                    "only (it names command-line keys and TensorBoard tags)"
                )
        if self.document_positions and self.attention_mask != "document":
            raise ConfigError(
                "data.document_positions=true needs data.attention_mask='document' (positions "
                "restarting inside a window where every token sees the previous document would "
                "place tokens of two documents at the same positions)"
            )


@dataclass(frozen=True)
class Shard:
    """One flat token file of a split."""

    file: Path
    num_tokens: int
    mask: Path | None = None
    """Fine-tuning examples (data/sft.py): one byte per token, 1 where it is a target."""
    pairs: Path | None = None
    """Preference pairs (data/preference.py): int64 rows (chosen start, rejected start,
    rejected end, prompt tokens)."""
    num_pairs: int = 0
    keys: Path | None = None
    """Preference pairs: each pair's file:LINE, one a line."""


@dataclass(frozen=True)
class DatasetIndex:
    """The contents of a prepared dataset's index.json, with shard paths resolved."""

    path: Path
    dtype: Literal["uint16", "uint32"]
    vocab_size: int
    eos_id: int | None
    """The id that ends every document; None (JSON null): the documents are not delimited."""
    tokenizer: dict[str, Any]
    splits: dict[str, list[Shard]]
    bos_id: int | None = None
    """None (JSON null) for a tokenizer without BOS."""
    examples: dict[str, Any] | None = None
    """Fine-tuning examples with a loss mask per shard: their format (data/sft.py); None for
    documents, whose every token is a target."""

    def num_tokens(self, split: Split) -> int:
        return sum(shard.num_tokens for shard in self.splits.get(split, []))

    @property
    def preference(self) -> bool:
        """Preference pairs (data/preference.py): a sample is a pair, not a window."""
        return (self.examples or {}).get("format") == "preference"

    def num_sequences(self, split: Split, seq_len: int) -> int:
        """Samples of `seq_len` (+1 target) tokens in `split`; see TokenSequences (pairs, for
        preference pairs)."""
        if self.preference:
            return sum(s.num_pairs for s in self.splits.get(split, []))
        return sum(max(s.num_tokens - 1, 0) // seq_len for s in self.splits.get(split, []))


_INDEX_KEYS = ("version", "dtype", "vocab_size", "eos_id", "bos_id", "tokenizer", "splits")


def read_index(path: str | Path, key: str = "data.path") -> DatasetIndex:
    """Parse ``path/index.json`` without opening any shard; ConfigError naming the file and
    what is wrong with it (after `key`, the setting that names `path`)."""
    root = Path(path)
    index_file = root / "index.json"
    if not index_file.is_file():
        raise ConfigError(
            f"{key}: no prepared dataset at '{path}' (index.json not found); "
            f"create it with: python -m data.prepare --out {path}"
        )
    remedy = f"re-create it with: python -m data.prepare --out {path}"
    try:
        raw = json.loads(index_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: '{index_file}' is not valid JSON ({e}); {remedy}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: '{index_file}' is not a JSON object; {remedy}")
    if missing := [name for name in _INDEX_KEYS if name not in raw]:
        raise ConfigError(f"{key}: '{index_file}' has no {', '.join(missing)}; {remedy}")
    # Version 2: fine-tuning examples, whose shards carry loss masks (data/prepare.py).
    if raw["version"] not in (1, 2, 3) or raw["dtype"] not in ("uint16", "uint32"):
        raise ConfigError(
            f"{key}: '{index_file}' has version {raw['version']!r} and dtype "
            f"{raw['dtype']!r}; this trainer reads versions 1 to 3 with uint16 or uint32; "
            f"{remedy}"
        )
    # What tells two Hugging Face tokenizers of the same size and ids apart (open_sources).
    tokenizer = raw["tokenizer"]
    if isinstance(tokenizer, dict) and tokenizer.get("kind") == "hf" and "sha256" not in tokenizer:
        raise ConfigError(f"{key}: '{index_file}' has no tokenizer.sha256; {remedy}")
    # Version 3: preference pairs, with their pair table (data/preference.py).
    masked, paired = raw["version"] == 2, raw["version"] == 3
    try:
        splits = {
            split: [
                Shard(
                    root / entry["file"],
                    int(entry["num_tokens"]),
                    root / entry["mask"] if masked else None,
                    root / entry["pairs"] if paired else None,
                    int(entry["num_pairs"]) if paired else 0,
                    root / entry["keys"] if paired else None,
                )
                for entry in shards
            ]
            for split, shards in raw["splits"].items()
        }
        return DatasetIndex(
            path=root,
            dtype=raw["dtype"],
            vocab_size=int(raw["vocab_size"]),
            eos_id=None if raw["eos_id"] is None else int(raw["eos_id"]),
            tokenizer=dict(raw["tokenizer"]),
            splits=splits,
            bos_id=None if raw["bos_id"] is None else int(raw["bos_id"]),
            examples=dict(raw["examples"]) if masked or paired else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        problem = f"a shard entry has no key {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{key}: '{index_file}' is malformed ({problem}); {remedy}") from e


def open_dataset(path: str | Path, key: str = "data.path") -> DatasetIndex:
    """Read ``path/index.json`` and check the shards exist. Cheap, no collectives, no data read."""
    index = read_index(path, key)
    itemsize = np.dtype(index.dtype).itemsize
    for shard in (shard for shards in index.splits.values() for shard in shards):
        # A mask has a byte per token: a size check finds a truncated or missing one, too.
        expected = [(shard.file, shard.num_tokens * itemsize, f"{index.dtype} tokens"),
                    (shard.mask, shard.num_tokens, "mask bytes"),
                    (shard.pairs, shard.num_pairs * 32, "pair rows of 32 bytes")]  # fmt: skip
        for file, size, what in expected:
            if file is None:
                continue
            if not file.is_file():
                raise ConfigError(f"{key}: shard '{file}' listed in index.json is missing")
            # A size check catches a truncated copy now instead of as garbage tokens mid-run.
            if file.stat().st_size != size:
                raise ConfigError(
                    f"{key}: shard '{file}' has {file.stat().st_size} bytes, index.json "
                    f"expects {size} ({what})"
                )
    return index


@dataclass(frozen=True)
class DataSource:
    """One prepared dataset of the training stream, opened and checked."""

    name: str
    index: DatasetIndex
    weight: float
    key: str
    """The setting that names it, for messages: data.path or data.sources.NAME."""


def _identity(index: DatasetIndex) -> dict[str, Any]:
    """What must match between the sources of a mixture: the tokenizer and the token type.
    Not its name or where its file was (a path, absolute in the index.json of datasets
    prepared before relative_path): the same tokenizer.json may have been copied."""
    tokenizer = {k: index.tokenizer[k] for k in ("kind", "sha256") if k in index.tokenizer}
    ids = {"vocab_size": index.vocab_size, "eos_id": index.eos_id, "bos_id": index.bos_id}
    return tokenizer | ids | {"dtype": index.dtype}


def open_sources(cfg: DataConfig) -> list[DataSource]:
    """The training sources, sorted by name: data.path (named after its folder), or the
    data.sources mixture. ConfigError, naming the source, for one that is not a dataset, and
    for sources that cannot be mixed (another tokenizer or dtype, the same dataset twice)."""
    if cfg.path is None and not cfg.sources:
        raise ConfigError(
            "data: no training data: set data.path=DIR (made by python -m data.prepare), or "
            "[data.sources.NAME] tables with path and weight for a mixture"
        )
    if cfg.path is not None:
        name = Path(os.path.abspath(cfg.path)).name or "data"
        wanted = {name: ("data.path", SourceConfig(cfg.path))}
    else:
        wanted = {name: (f"data.sources.{name}", s) for name, s in cfg.sources.items()}
    sources = [
        DataSource(name, open_dataset(source.path, key), source.weight, key)
        for name, (key, source) in sorted(wanted.items())
    ]
    first, seen = sources[0], {}
    for source in sources:
        mine, theirs = _identity(first.index), _identity(source.index)
        if theirs != mine:
            raise ConfigError(
                f"data.sources: {first.name} and {source.name} were prepared with different "
                f"tokenizers or token types ({mine} vs {theirs}); a mixture needs one: prepare "
                "every source with the same --tokenizer"
            )
        if (where := source.index.path.resolve()) in seen:
            raise ConfigError(
                f"data.sources: {seen[where]} and {source.name} are the same dataset ({where}); "
                "list it once, with the sum of their weights"
            )
        seen[where] = source.name
    quantize([source.weight for source in sources])  # a weight too small to ever be read
    return sources


def check_eval_split(
    index: DatasetIndex, seq_len: int, global_batch_size: int, eval_batches: int
) -> None:
    """ConfigError unless every evaluation reads distinct validation sequences: at least one,
    and `eval_batches` global batches of them. Run at startup, when evaluation is enabled:
    found at the first evaluation, the steps before it would be lost."""
    available = index.num_sequences("val", seq_len)
    where = f"the val split of '{index.path}'"
    if available == 0:
        raise ConfigError(
            f"data: {where} has {index.num_tokens('val')} tokens, and no shard of it holds one "
            f"sequence of data.seq_len={seq_len} (+1 target token): prepare more validation "
            "data (python -m data.prepare --val-fraction), lower data.seq_len, or set "
            "train.eval_interval=0"
        )
    wanted = eval_batches * global_batch_size
    if wanted > available:
        # The val loader wraps around past its end, so more batches would repeat the same data.
        largest = available // global_batch_size
        fix = (
            f"set train.eval_batches <= {largest}"
            if largest
            else "lower train.global_batch_size or data.seq_len, or prepare more validation data"
        )
        raise ConfigError(
            f"train.eval_batches={eval_batches} x train.global_batch_size={global_batch_size} "
            f"= {wanted} sequences per evaluation, but {where} holds {available} sequences of "
            f"data.seq_len={seq_len} (at most {largest} eval_batches): {fix}"
        )


class TokenSequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i: ``(inputs, targets)``, two int64 tensors of ``seq_len`` tokens, shifted by one.

    Windows of ``seq_len + 1`` tokens start every ``seq_len`` tokens and never cross a shard, so a
    shard of n tokens holds ``(n - 1) // seq_len`` samples. Each target token is predicted once.
    In a dataset of fine-tuning examples, targets that are not (the loss mask's 0s, and the
    example that the window cuts at its start, whose prompt lies before it) are NO_TARGET.
    """

    def __init__(self, index: DatasetIndex, split: Split, seq_len: int) -> None:
        self.shards = index.splits.get(split, [])
        self.dtype = np.dtype(index.dtype)
        self.seq_len = seq_len
        self.masked, self.eos_id = index.examples is not None, index.eos_id
        counts = [max(shard.num_tokens - 1, 0) // seq_len for shard in self.shards]
        # starts[i] is the first sample of shard i; bisect over it finds a sample's shard.
        self.starts = np.cumsum([0, *counts]).tolist()
        if self.starts[-1] == 0:
            raise ConfigError(
                f"data: the '{split}' split of '{index.path}' has {index.num_tokens(split)} "
                f"tokens, too few for one sequence of data.seq_len={seq_len} (+1 target token)"
            )
        # Opened on first access, in whichever process reads: worker processes get their own maps.
        self._maps: list[np.memmap] | None = None
        self._masks: list[np.memmap] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        if self._maps is None:
            self._maps = [np.memmap(s.file, dtype=self.dtype, mode="r") for s in self.shards]
            if self.masked:
                self._masks = [np.memmap(s.mask, dtype=np.uint8, mode="r") for s in self.shards]
        shard = bisect.bisect_right(self.starts, i) - 1
        begin = (i - self.starts[shard]) * self.seq_len
        window = self._maps[shard][begin : begin + self.seq_len + 1].astype(np.int64)
        if not self.masked:
            return torch.from_numpy(window[:-1]), torch.from_numpy(window[1:])
        targets = np.where(self._is_target(shard, begin, window), window[1:], NO_TARGET)
        return torch.from_numpy(window[:-1]), torch.from_numpy(targets)

    def _is_target(self, shard: int, begin: int, window: np.ndarray) -> np.ndarray:
        """Which positions of the window at token `begin` of `shard` have a target: where the
        loss mask has a 1, except in an example begun before the window. Its targets, the
        tokens up to its EOS, would be learned without their prompt: they are learned in the
        window that holds its beginning (data.seq_len longer than the examples keeps this loss
        small)."""
        assert self._masks is not None and self._maps is not None
        keep = self._masks[shard][begin + 1 : begin + self.seq_len + 1].astype(bool)
        if begin:
            before = self._maps[shard][begin - 1]
        else:  # an example may run on from the previous shard
            before = self._maps[shard - 1][-1] if shard else self.eos_id
        if before != self.eos_id:
            eos = np.flatnonzero(window[:-1] == self.eos_id)
            keep[: eos[0] if len(eos) else len(keep)] = False
        return keep

    def __getstate__(self) -> dict[str, Any]:
        # Pickling a memmap copies all its data; workers started by spawn reopen the files instead.
        return {**self.__dict__, "_maps": None, "_masks": None}


class SourceSequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Item ``(s, i)``: sample i of source s, as its TokenSequences gives it."""

    def __init__(self, sources: Sequence[TokenSequences]) -> None:
        self.sources = list(sources)

    def __getitem__(self, item: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        source, i = item
        return self.sources[source][i]


def build_dataloader(
    cfg: DataConfig,
    split: Split,
    *,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    seed: int,
    sources: Sequence[DataSource] | None = None,
    reference: np.ndarray | None = None,
) -> StatefulDataLoader:
    """An infinite loader of ``(inputs, targets)`` micro-batches, each ``[micro_batch_size,
    seq_len]`` int64, for this data-parallel rank. `sources`: as open_sources(cfg) gives them
    (the default); the val split reads one source, each is evaluated on its own.

    ``loader.state_dict()`` / ``load_state_dict()`` save and restore the exact position, with or
    without workers (resuming needs the same ``num_workers``: torchdata asserts it). The state is
    the same on every rank and loads on any mesh whose ``dp_size * micro_batch_size`` divides it.
    ``loader.batch_sampler.stream`` is the stream (data/stream.py), for per-source accounting.

    Train: iterate once (``batches = iter(loader)``). With workers the sampler runs ahead of the
    batches returned, so a second ``iter(loader)`` would skip the prefetched ones; to continue
    exactly, ``loader.load_state_dict(loader.state_dict())`` first. Val: never shuffled, and
    every ``iter(loader)`` restarts at the first batch, so each evaluation sees the same data.

    Preference pairs (data/preference.py) give ``(inputs, targets)`` of ``[micro_batch_size,
    2, seq_len]`` (and, with `reference`, each pair's precomputed reference log-probabilities,
    ``[micro_batch_size, 2]``): a sample is a pair.
    """
    sources = list(sources) if sources is not None else open_sources(cfg)
    if split == "val" and len(sources) != 1:
        raise ValueError(f"the val split reads one source, got {[s.name for s in sources]}")
    from data.pairs import PreferencePairs

    sequences = {
        s.name: PreferencePairs(s.index, split, cfg.seq_len, reference)
        if s.index.preference
        else TokenSequences(s.index, split, cfg.seq_len)
        for s in sources
    }
    stream = GlobalStream(
        {name: len(seqs) for name, seqs in sequences.items()},
        {s.name: s.weight for s in sources},
        seed,
        shuffle=cfg.shuffle and split == "train",
    )
    sampler = GlobalStreamBatchSampler(
        stream,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batch_size=micro_batch_size,
        restart_each_iter=split == "val",
    )
    return StatefulDataLoader(
        SourceSequences([sequences[name] for name in stream.names]),
        batch_sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=torch.cuda.is_available(),
        # A snapshot at every batch makes state_dict() exact without replaying batches on load.
        snapshot_every_n_steps=1,
        # Each iter() draws the workers' base seed: from this generator, not from torch's
        # global RNG, which a checkpoint restores before the resumed run's first iter()
        # (that draw would shift it by one from the run that never stopped), and which every
        # evaluation's iter() of the val loader would advance mid-training.
        generator=torch.Generator().manual_seed(seed),
    )


class StepBatches:
    """The train loader a step (`micro_steps` micro-batches) at a time. With `rewind`, a step
    can be read `again()` (one the replica groups did not commit, parallel/ft.py); `restart()`
    continues from a state just loaded into the loader (a group healed from a peer)."""

    def __init__(self, loader: StatefulDataLoader, micro_steps: int, rewind: bool) -> None:
        self.loader, self.micro_steps, self.rewind = loader, micro_steps, rewind
        self._step_start: dict[str, Any] | None = None
        self.restart()

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.rewind:
            self._step_start = self.loader.state_dict()
        return [next(self._batches) for _ in range(self.micro_steps)]

    def again(self) -> None:
        if self._step_start is None:
            raise RuntimeError("StepBatches.again needs rewind=True and a step read")
        self.loader.load_state_dict(self._step_start)
        self.restart()

    def restart(self) -> None:
        # A new iterator continues from the loader's state (see build_dataloader).
        self._batches = iter(self.loader)


# Up to this many tokens per split are scanned whole (uint16: 512 MB at memory bandwidth, a
# fraction of a second from the page cache); a larger split is sampled: about SAMPLE_BLOCKS
# blocks spread over it in proportion to each shard's size, and at least one per shard.
FULL_SCAN_TOKENS = 256 * 2**20
SAMPLE_BLOCK = 2**16
SAMPLE_BLOCKS = 256


def check_token_ids(index: DatasetIndex, vocab_size: int, key: str = "data.path") -> None:
    """ConfigError naming the shard when a token id is >= the model's vocabulary: the embedding
    would fail inside every rank with "index out of range". A split of at most FULL_SCAN_TOKENS
    is read whole; a larger one in evenly spaced blocks (a damaged or foreign shard almost never
    holds only valid ids there), so opening a 1T-token corpus on every rank stays fast."""
    for split, shards in index.splits.items():
        total = sum(shard.num_tokens for shard in shards)
        full = total <= FULL_SCAN_TOKENS
        for shard in shards:
            if shard.num_tokens == 0:
                continue
            tokens = np.memmap(shard.file, dtype=index.dtype, mode="r")
            if full or len(tokens) <= SAMPLE_BLOCK:
                starts = np.zeros(1, dtype=np.int64)
                size = len(tokens)
            else:
                n = max(1, round(SAMPLE_BLOCKS * len(tokens) / total))
                starts = np.linspace(0, len(tokens) - SAMPLE_BLOCK, n, dtype=np.int64)
                size = SAMPLE_BLOCK
            for start in starts.tolist():
                block = tokens[start : start + size]
                if (top := int(block.max())) >= vocab_size:
                    at = start + int(np.argmax(block >= vocab_size))
                    raise ConfigError(
                        f"{key}: shard '{shard.file}' ({split}) holds token id {top} (the first "
                        f"too large at token {at}), but the model has {vocab_size} embedding "
                        "rows: the shard "
                        "is damaged or was prepared with another tokenizer; re-create it with "
                        f"python -m data.prepare --out {index.path}"
                    )
