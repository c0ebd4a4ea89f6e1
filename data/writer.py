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
    """Appends tokens to ``{split}-00000.bin``, ``-00001``, ... of at most ``shard_tokens`` each."""

    def __init__(self, directory: Path, split: Split, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.num_documents = 0
        self._file: BinaryIO | None = None

    def write_documents(self, docs: list[np.ndarray]) -> None:
        """Documents, each already followed by its EOS, in one write per chunk of documents."""
        if docs:
            self.write(np.concatenate(docs))
            self.num_documents += len(docs)

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._file = (self.directory / name).open("wb")
                self.shards.append({"file": name, "num_tokens": 0})
            shard = self.shards[-1]
            part = tokens[: self.shard_tokens - shard["num_tokens"]]
            part.tofile(self._file)
            shard["num_tokens"] += len(part)
            tokens = tokens[len(part) :]
            if shard["num_tokens"] == self.shard_tokens:
                self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
