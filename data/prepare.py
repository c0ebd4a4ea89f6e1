"""Turn text into token shards: ``python -m data.prepare [--input PATH ...] [--out DIR]``.

With no ``--input`` the corpus is the running Python's standard-library sources: every machine
has them, so the trainer works end to end with no download. Output layout (read by
``data.loader.open_dataset``)::

    DIR/index.json          dtype, tokenizer, vocab_size, eos_id, bos_id, shards per split
    DIR/train-00000.bin     flat uint16 (or uint32) token ids, documents separated by EOS
    DIR/val-00000.bin
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import logging
import os
import shutil
import sysconfig
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np

from configs import ConfigError
from data.tokenizer import Tokenizer, build_tokenizer

logger = logging.getLogger(__name__)

Split = Literal["train", "val"]
SPLITS: tuple[Split, ...] = ("train", "val")
DEFAULT_OUT = "outputs/data/stdlib"
DEFAULT_PATTERN = "*.txt,*.py,*.md,*.jsonl"
# Third-party packages are not the standard library and differ from machine to machine.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
INDEX_VERSION = 1
# Documents are tokenized in chunks so a Hugging Face tokenizer can batch across its threads
# while memory stays bounded for large corpora.
CHUNK_DOCS = 1024
CHUNK_BYTES = 64 * 2**20


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_val(doc_key: str, val_fraction: float) -> bool:
    """Hash-based split: stable per document, independent of corpus order and size."""
    return zlib.crc32(doc_key.encode("utf-8")) % 1_000_000 < val_fraction * 1_000_000


def _has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _glob_root(raw: str) -> Path:
    """The directory before the first wildcard: the keys of ``docs/**/*.md`` are under ``docs``."""
    parts = Path(raw).parts
    fixed = next(i for i, part in enumerate(parts) if _has_glob(part))
    return Path(*parts[:fixed]) if fixed else Path(".")


def _walk(root: Path, patterns: list[str], excluded_dirs: frozenset[str]) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden directories (.git, .venv, our own .tmp outputs) are never corpus.
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs and not d.startswith(".")]
        for name in filenames:
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                files.append(Path(dirpath, name))
    return files


def find_files(
    inputs: list[str], pattern: str, excluded_dirs: frozenset[str] = frozenset()
) -> list[tuple[Path, str]]:
    """``(path, doc_key)`` for every input file, in deterministic order.

    The key is the path relative to its input (directory, glob base or the file's parent), so the
    train/val split does not depend on where the corpus lives on this machine.
    """
    patterns = [p.strip() for p in pattern.split(",") if p.strip()]
    found: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.is_dir():
            root, files = path, _walk(path, patterns, excluded_dirs)
            if not files:
                raise ConfigError(
                    f"data prepare: --input '{raw}' has no files matching '{pattern}'"
                )
        elif path.is_file():
            root, files = path.parent, [path]
        elif _has_glob(raw):
            root = _glob_root(raw)
            files = [Path(p) for p in glob.glob(raw, recursive=True)]
            files = [p for p in files if p.is_file()]
            if not files:
                raise ConfigError(f"data prepare: --input '{raw}' matched no files")
        else:
            raise ConfigError(f"data prepare: --input '{raw}' does not exist")
        keyed = sorted((p.relative_to(root).as_posix(), p) for p in files)
        for key, p in keyed:
            if p.resolve() not in seen:  # the same file named by two inputs is read once
                seen.add(p.resolve())
                found.append((p, key))
    return found


def iter_documents(files: list[tuple[Path, str]], jsonl_field: str) -> Iterator[tuple[str, bytes]]:
    """``(doc_key, utf-8 bytes)`` per document: one per file, or one per line of a .jsonl."""
    for path, key in files:
        if path.suffix != ".jsonl":
            yield key, path.read_bytes()
            continue
        with path.open("rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"data prepare: {path}:{lineno}: invalid JSON ({e})") from e
                text = record.get(jsonl_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(
                        f"data prepare: {path}:{lineno}: no string field '{jsonl_field}' "
                        "(choose the field with --jsonl-field)"
                    )
                # "replace": JSON may escape lone surrogates, which UTF-8 cannot encode.
                yield f"{key}:{lineno}", text.encode("utf-8", errors="replace")


def _chunks(docs: Iterator[tuple[str, bytes]]) -> Iterator[list[tuple[str, bytes]]]:
    chunk: list[tuple[str, bytes]] = []
    size = 0
    for key, doc in docs:
        if not doc:  # an empty file would add a lone EOS and nothing to learn from
            continue
        chunk.append((key, doc))
        size += len(doc)
        if len(chunk) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _ShardWriter:
    """Appends tokens to ``{split}-00000.bin``, ``-00001``, ... of at most ``shard_tokens`` each."""

    def __init__(
        self, directory: Path, split: Split, dtype: np.dtype, shard_tokens: int, eos_id: int
    ) -> None:
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens = shard_tokens
        self.eos = np.array([eos_id], dtype=dtype)
        self.shards: list[dict[str, Any]] = []
        self.num_documents = 0
        self._file: BinaryIO | None = None

    def write_documents(self, docs: list[np.ndarray]) -> None:
        """Each document's tokens followed by EOS, in one write per chunk of documents."""
        if docs:
            self.write(np.concatenate([a for tokens in docs for a in (tokens, self.eos)]))
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


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``, replacing an older prepared dataset there."""
    if not out.exists():
        tmp.rename(out)
        return
    # Two renames, not an in-place rewrite: a reader never sees a mix of old and new shards.
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)


def _write_splits(
    docs: Iterator[tuple[str, bytes]],
    tok: Tokenizer,
    val_fraction: float,
    writers: dict[Split, _ShardWriter],
) -> int:
    """Tokenize ``docs`` into the train and val writers; returns the number of documents."""

    def write(keyed: list[tuple[str, np.ndarray]], to_val: bool = False) -> None:
        for split, writer in writers.items():
            want_val = split == "val"
            writer.write_documents(
                [t for k, t in keyed if (to_val or is_val(k, val_fraction)) == want_val]
            )

    # The corpus's last document is held back: if no document hashed into val, it becomes
    # the val split, so a small corpus still gets validation instead of silently having none.
    last: tuple[str, np.ndarray] | None = None
    count = 0
    for chunk in _chunks(docs):
        encoded = tok.encode_documents([doc for _, doc in chunk])
        keys = [key for key, _ in chunk]
        keyed = ([last] if last else []) + list(zip(keys, encoded, strict=True))
        last = keyed.pop()
        write(keyed)
        count += len(chunk)
    if last is None:
        return 0
    fallback = val_fraction > 0 and writers["val"].num_documents == 0
    if fallback and not is_val(last[0], val_fraction):
        logger.warning("no document hashed into val; using the last one (%s) as val", last[0])
    write([last], to_val=fallback)
    return count


def prepare(
    inputs: list[str] | None,
    out_dir: str | Path,
    tokenizer_path: str | None = None,
    val_fraction: float = 0.005,
    shard_tokens: int = 2**28,
    jsonl_field: str = "text",
    pattern: str = DEFAULT_PATTERN,
    eos_token: str | None = None,
) -> Path:
    """Tokenize ``inputs`` (None: the stdlib's ``*.py``) into shards under ``out_dir``."""
    start = time.perf_counter()
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"data prepare: --val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"data prepare: --shard-tokens must be >= 1, got {shard_tokens}")
    if inputs:
        files = find_files(inputs, pattern)
    else:
        inputs, pattern = [str(stdlib_dir())], "*.py"
        files = find_files(inputs, pattern, STDLIB_EXCLUDED_DIRS)
    out = Path(out_dir)
    # Guard against `--out .` or a typo wiping unrelated files: only a prepared dataset is replaced.
    if out.is_dir() and any(out.iterdir()) and not (out / "index.json").is_file():
        raise ConfigError(f"data prepare: --out '{out}' exists and is not a prepared dataset")

    tok = build_tokenizer(tokenizer_path, eos_token)
    # uint16 halves disk and page-cache use for any vocabulary up to 65536 ids.
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    out.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling of `out`: the final rename stays on one filesystem, hence atomic.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run that had this pid
    tmp.mkdir()
    try:
        writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens, tok.eos_id) for s in SPLITS}
        if _write_splits(iter_documents(files, jsonl_field), tok, val_fraction, writers) == 0:
            raise ConfigError(f"data prepare: no text found in {', '.join(inputs)}")
        for w in writers.values():
            w.close()
        num_docs = {s: w.num_documents for s, w in writers.items()}
        if num_docs["train"] == 0:
            raise ConfigError(
                f"data prepare: the train split is empty ({num_docs['val']} document(s), all val); "
                "give more documents or a smaller --val-fraction"
            )

        index = {
            "version": INDEX_VERSION,
            "dtype": dtype.name,
            "tokenizer": tok.describe(),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            # Read by the Hugging Face export (config.json); absent from older index files.
            "bos_id": tok.bos_id,
            "splits": {s: w.shards for s, w in writers.items()},
            "sources": {"num_documents": num_docs, "inputs": inputs, "pattern": pattern},
        }
        # index.json last: a dataset directory without it is never treated as complete.
        (tmp / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    tokens = {s: f"{sum(sh['num_tokens'] for sh in w.shards):,}" for s, w in writers.items()}
    logger.info(
        "prepared %s in %.1fs: train %d docs %s tokens, val %d docs %s tokens (%s, vocab %d, %s)",
        out, time.perf_counter() - start, num_docs["train"], tokens["train"], num_docs["val"],
        tokens["val"], tok.describe()["kind"], tok.vocab_size, dtype.name,
    )  # fmt: skip
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare", description="Tokenize text into shards for training."
    )
    p.add_argument(
        "--input",
        action="append",
        help="a directory, glob or file (repeatable); .jsonl gives one document per line. "
        "Default: this Python's standard-library *.py sources",
    )
    p.add_argument("--pattern", default=DEFAULT_PATTERN, help="file names to take from directories")
    p.add_argument("--jsonl-field", default="text", help="the text field of .jsonl records")
    p.add_argument("--tokenizer", help="a local tokenizer.json (default: byte-level, vocab 258)")
    p.add_argument("--eos-token", help="the --tokenizer's end-of-document token")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share of documents for val")
    p.add_argument("--shard-tokens", type=int, default=2**28, help="max tokens per shard file")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepare(
            args.input,
            args.out,
            tokenizer_path=args.tokenizer,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            jsonl_field=args.jsonl_field,
            pattern=args.pattern,
            eos_token=args.eos_token,
        )
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
