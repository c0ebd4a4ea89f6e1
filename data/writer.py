"""Write a dataset directory: shard files of bounded size, swapped into place only when complete.

``data.prepare`` writes into a hidden sibling ``.NAME.tmp-PID`` and renames it to ``NAME`` after
index.json, so a prepare that is killed never leaves a directory that passes for a dataset.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from configs import ConfigError

logger = logging.getLogger(__name__)

Split = Literal["train", "val"]


class ShardWriter:
    """Appends tokens to ``{split}-00000.bin``, ``-00001``, ... of at most ``shard_tokens`` each;
    with `masked`, each token's loss-mask byte to ``{split}-00000.mask.bin``, ... beside them."""

    def __init__(
        self, directory: Path, split: Split, dtype: np.dtype, shard_tokens: int, masked: bool
    ) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens, self.masked = shard_tokens, masked
        self.shards: list[dict[str, Any]] = []
        self.num_documents = 0
        self.num_targets = 0
        self._files: list[BinaryIO] = []

    def write_documents(self, docs: list[np.ndarray], masks: list[np.ndarray] | None) -> None:
        """Documents, each already followed by its EOS, in one write per chunk of documents;
        `masks`: their loss masks (uint8, 1 for a target), when the writer is `masked`."""
        if docs:
            self.write(np.concatenate(docs), np.concatenate(masks) if masks else None)
            self.num_documents += len(docs)

    def write(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        if (mask is not None) != self.masked:
            raise ValueError(f"a {'masked' if self.masked else 'plain'} writer got mask={mask}")
        tokens = tokens.astype(self.dtype, copy=False)
        if mask is not None:
            self.num_targets += int(mask.sum())
        while len(tokens):
            if not self._files:
                name = f"{self.split}-{len(self.shards):05d}"
                self.shards.append({"file": f"{name}.bin", "num_tokens": 0})
                if self.masked:
                    self.shards[-1]["mask"] = f"{name}.mask.bin"
                names = [self.shards[-1][k] for k in ("file", "mask") if k in self.shards[-1]]
                self._files = [(self.directory / n).open("wb") for n in names]
            shard = self.shards[-1]
            n = min(len(tokens), self.shard_tokens - shard["num_tokens"])
            # Token and mask files cut at the same token: shard i's mask is shard i's alone.
            for f, data in zip(self._files, (tokens, mask), strict=False):
                data[:n].tofile(f)
            shard["num_tokens"] += n
            tokens = tokens[n:]
            mask = None if mask is None else mask[n:]
            if shard["num_tokens"] == self.shard_tokens:
                self.close()

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that is not ours to replace, before anything is written."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"data prepare: --out '{out}' is a file; give a directory to write to")
    # Guard against `--out .` or a typo wiping unrelated files: only a prepared dataset is replaced.
    if out.is_dir() and any(out.iterdir()) and not (out / "index.json").is_file():
        raise ConfigError(f"data prepare: --out '{out}' exists and is not a prepared dataset")
    existing = next(p for p in out.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"data prepare: --out '{out}' is inside '{existing}', which is a file")


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a leftover of an earlier run that had this process's pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(out: Path) -> None:
    """Delete what killed runs left beside ``out``: their ``.NAME.tmp-PID`` directories (never
    complete, but up to a whole dataset's bytes), and a ``.NAME.old-PID`` copy of the dataset they
    replaced once ``out`` is in place again."""
    for kind in ("tmp", "old") if out.exists() else ("tmp",):
        prefix = f".{out.name}.{kind}-"
        for path in out.parent.iterdir():
            pid = path.name.removeprefix(prefix)
            if path.name.startswith(prefix) and pid.isdigit() and not _running(int(pid)):
                logger.info("removing %s, left by a prepare that was killed", path)
                shutil.rmtree(path, ignore_errors=True)


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``, replacing an older prepared dataset there."""
    if not out.exists():
        tmp.rename(out)
        return
    # Two renames, not an in-place rewrite: a reader never sees a mix of old and new shards.
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)
