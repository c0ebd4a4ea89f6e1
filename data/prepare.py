"""Turn text into token shards: ``python -m data.prepare [--input PATH ...] [--out DIR]``.

With no ``--input`` the corpus is the running Python's standard-library sources: every machine
has them, so the trainer works end to end with no download. Inputs may be text files, JSONL,
gzip- or zstd-compressed JSONL and parquet (``data.inputs``). Output layout (read by
``data.loader.open_dataset``)::

    DIR/index.json          dtype, tokenizer, vocab_size, eos_id, bos_id, shards per split
    DIR/train-00000.bin     flat uint16 (or uint32) token ids, documents separated by EOS
    DIR/val-00000.bin
    DIR/next_line.jsonl     with no --input: a task of held-out files (data/make_eval_task.py)
    DIR/train-00000.mask.bin  with --format prompt_response or chat (data/sft.py): one byte per
                              token, 1 where it is a target (a response's), 0 for context

This process reads the corpus in order and writes the shards; ``--workers`` processes tokenize
(``data.encode``). The bytes written do not depend on the number of workers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
from tqdm import tqdm

from configs import ConfigError
from data.encode import Chunk, Encoded, encode_in_order
from data.inputs import (
    DEFAULT_PATTERN,
    STDLIB_EXCLUDED_DIRS,
    NotText,
    check_inputs,
    find_files,
    is_val,
    iter_documents,
    stdlib_dir,
)
from data.make_eval_task import write_task
from data.preference import prepare_pairs
from data.sft import KINDS, load_format
from data.sft import PATTERN as EXAMPLE_PATTERN
from data.sft import Kind as ExampleKind
from data.tokenizer import build_tokenizer, index_entry
from data.writer import ShardWriter, Split, check_out, remove_leftovers, replace_dir

logger = logging.getLogger(__name__)

SPLITS: tuple[Split, ...] = ("train", "val")
DEFAULT_OUT = "outputs/data/stdlib"
INDEX_VERSION = 1
# The next-line task written beside the stdlib dataset (data/make_eval_task.py).
NEXT_LINE_TASK = "next_line.jsonl"
# Datasets with loss masks: a reader of version 1 would ignore the masks and train on prompts.
MASKED_INDEX_VERSION = 2
# One chunk is one task for a worker: big enough that sending it costs little next to
# tokenizing it, small enough that 2 chunks per worker in flight keep memory low.
CHUNK_DOCS = 1024
CHUNK_BYTES = 4 * 2**20


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a Slurm allocation)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _chunks(docs: Iterator[tuple[str, bytes, int]]) -> Iterator[Chunk]:
    keys: list[str] = []
    texts: list[bytes] = []
    size = position = 0
    for key, doc, position in docs:
        if not doc:  # an empty document would add a lone EOS and nothing to learn from
            continue
        keys.append(key)
        texts.append(doc)
        size += len(doc)
        if len(keys) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield Chunk(keys, texts, position)
            keys, texts, size = [], [], 0
    if keys:
        yield Chunk(keys, texts, position)


class Progress:
    """Input MB/s, tokens/s and ETA: a tqdm bar on a terminal, else a log line now and then.

    A bar redrawn with carriage returns would turn a log file (Slurm, CI, nohup) into one long
    line, so without a terminal the same figures go through ``logging`` every ``log_every`` s.
    """

    def __init__(self, total_bytes: int, stream: TextIO | None = None, log_every: float = 30.0):
        stream = stream or sys.stderr
        self.total, self.log_every = total_bytes, log_every
        self.position = self.tokens = 0
        self.start = self.logged = time.perf_counter()
        self.bar = tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="prepare", file=stream,
            disable=not stream.isatty(), dynamic_ncols=True,
        )  # fmt: skip

    def update(self, position: int, tokens: int) -> None:
        """``position`` input bytes read so far; ``tokens`` more were written."""
        now = time.perf_counter()
        step, self.position = position - self.position, position
        self.tokens += tokens
        tokens_per_s = self.tokens / max(now - self.start, 1e-9)
        if not self.bar.disable:
            self.bar.set_postfix_str(f"{tqdm.format_sizeof(tokens_per_s)} tok/s", refresh=False)
            self.bar.update(step)
        elif now - self.logged >= self.log_every:
            self.logged = now
            elapsed = now - self.start
            bytes_per_s = position / max(elapsed, 1e-9)
            eta = (self.total - position) / bytes_per_s if bytes_per_s else 0.0
            logger.info(
                "prepare: %sB of %sB read (%.0f%%), %sB/s, %s tok/s, eta %s",
                tqdm.format_sizeof(position), tqdm.format_sizeof(self.total),
                100 * position / max(self.total, 1), tqdm.format_sizeof(bytes_per_s),
                tqdm.format_sizeof(tokens_per_s), tqdm.format_interval(eta),
            )  # fmt: skip

    def close(self) -> None:
        self.bar.close()


Keyed = tuple[str, np.ndarray, np.ndarray | None]
"""A document's key, tokens (with EOS) and loss mask (None for text)."""


def _write_splits(
    encoded: Iterator[Encoded],
    total_bytes: int,
    val_fraction: float,
    writers: dict[Split, ShardWriter],
) -> int:
    """Write each tokenized document to train or val; returns the number of documents."""

    def write(keyed: list[Keyed], to_val: bool = False) -> None:
        for split, writer in writers.items():
            want_val = split == "val"
            mine = [(t, m) for k, t, m in keyed if (to_val or is_val(k, val_fraction)) == want_val]
            masks = [m for _, m in mine] if writer.masked else None
            writer.write_documents([t for t, _ in mine], masks)

    # The corpus's last document is held back: if no document hashed into val, it becomes
    # the val split, so a small corpus still gets validation instead of silently having none.
    last: Keyed | None = None
    count = 0
    progress = Progress(total_bytes)
    try:
        for chunk in encoded:
            docs = np.split(chunk.tokens, chunk.ends[:-1])  # views, one per document, with EOS
            masks = [None] * len(docs)
            if chunk.mask is not None:  # examples: each one's loss mask, cut as its tokens
                masks = np.split(chunk.mask, chunk.ends[:-1])
            keyed = ([last] if last else []) + list(zip(chunk.keys, docs, masks, strict=True))
            last = keyed.pop()
            write(keyed)
            count += len(chunk.keys)
            progress.update(chunk.position, len(chunk.tokens))
    finally:  # the bar ends its line before any error or warning is printed
        progress.close()
    if last is None:
        return 0
    fallback = val_fraction > 0 and writers["val"].num_documents == 0
    if fallback and not is_val(last[0], val_fraction):
        logger.warning("no document hashed into val; using the last one (%s) as val", last[0])
    write([last], to_val=fallback)
    return count


def _input_files(
    inputs: list[str] | None, pattern: str | None, field: str, examples: ExampleKind | None
) -> tuple[list[str], str, list[tuple[Path, str]]]:
    """The inputs and pattern in effect, and the files they name, checked (data.inputs)."""
    if examples is not None and not inputs:
        raise ConfigError(f"data prepare: --format {examples} needs --input (JSONL examples)")
    if examples is not None and field != "text":
        raise ConfigError(
            f"data prepare: --field names the text of --format text; --format {examples} reads "
            f"the fields {'prompt and response' if examples == 'prompt_response' else 'messages'}"
        )
    if inputs:
        pattern = pattern or (DEFAULT_PATTERN if examples is None else EXAMPLE_PATTERN)
        files = find_files(inputs, pattern)
    else:
        inputs, pattern = [str(stdlib_dir())], "*.py"
        files = find_files(inputs, pattern, STDLIB_EXCLUDED_DIRS)
    check_inputs(files, field, examples)
    return inputs, pattern, files


def _index(
    tok: Any,
    out: Path,
    dtype: np.dtype,
    writers: dict[str, ShardWriter],
    num_docs: dict[str, int],
    inputs: list[str],
    pattern: str | None,
    example_format: Any,
) -> dict[str, Any]:
    """What index.json records of a prepared dataset: its shards, token type and tokenizer, and
    (for examples) what the loss masks mean."""
    index = {
        "version": INDEX_VERSION if example_format is None else MASKED_INDEX_VERSION,
        "dtype": dtype.name,
        "tokenizer": index_entry(tok.describe(), out),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        # Read by the Hugging Face export (config.json); null for a tokenizer without BOS.
        "bos_id": tok.bos_id,
        "splits": {s: w.shards for s, w in writers.items()},
        "sources": {"num_documents": num_docs, "inputs": inputs, "pattern": pattern},
    }
    if example_format is not None:  # what the masks mean, and how many targets they hold
        targets = {s: w.num_targets for s, w in writers.items()}
        index["examples"] = example_format.describe() | {"num_targets": targets}
    return index


def _log_prepared(
    out: Path,
    seconds: float,
    tok: Any,
    dtype: np.dtype,
    writers: dict[str, ShardWriter],
    num_docs: dict[str, int],
    not_text: NotText,
) -> None:
    """What a finished prepare logs: the inputs it skipped, then one line of what it wrote."""
    masked = writers["train"].masked
    for warning in not_text.warnings():  # one line per kind, naming the first few files
        logger.warning("%s", warning)
    tokens = {s: f"{sum(sh['num_tokens'] for sh in w.shards):,} tokens" for s, w in writers.items()}
    if masked:  # "train 7329 examples 70,371 tokens (26,397 targets)"
        tokens = {s: f"{n} ({writers[s].num_targets:,} targets)" for s, n in tokens.items()}
    logger.info(
        "prepared %s in %.1fs: train %d %s %s, val %d %s %s (%s, vocab %d, %s%s)",
        out, seconds, num_docs["train"], "examples" if masked else "docs",
        tokens["train"], num_docs["val"], "examples" if masked else "docs", tokens["val"],
        tok.describe()["kind"], tok.vocab_size, dtype.name, not_text.summary(),
    )  # fmt: skip


def _check_numbers(
    val_fraction: float, shard_tokens: int, workers: int | None, tokenizer_path: str | None
) -> int:
    """ConfigError for a number prepare cannot use; returns the worker count (by default 1
    for bytes, the usable CPUs for a tokenizer.json)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"data prepare: --val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ConfigError(f"data prepare: --shard-tokens must be >= 1, got {shard_tokens}")
    if workers is None:
        workers = 1 if tokenizer_path is None else usable_cpus()
    if workers < 1:
        raise ConfigError(f"data prepare: --workers must be >= 1, got {workers}")
    return workers


def prepare(
    inputs: list[str] | None,
    out_dir: str | Path,
    tokenizer_path: str | None = None,
    val_fraction: float = 0.005,
    shard_tokens: int = 2**28,
    field: str = "text",
    pattern: str | None = None,
    eos_token: str | None = None,
    workers: int | None = None,
    format: Literal["text", "prompt_response", "chat", "preference"] = "text",
) -> Path:
    """Tokenize ``inputs`` (None: the stdlib's ``*.py``) into shards under ``out_dir``.

    ``field`` is the text field of JSONL records and the text column of parquet files.
    ``pattern``: the files taken from directories (default: every format ``format`` reads).
    ``format``: ``text`` (documents), or JSONL examples for fine-tuning, written with a loss
    mask: ``prompt_response`` or ``chat`` (data/sft.py).
    ``workers`` defaults to 1 for the byte tokenizer (its tokens are the bytes: nothing to share
    out) and to the usable CPUs for a tokenizer.json. Workers are spawned, fresh interpreters
    that import the caller's main module: a script calling this needs ``if __name__ == "__main__"``.
    """
    start = time.perf_counter()
    workers = _check_numbers(val_fraction, shard_tokens, workers, tokenizer_path)
    if format == "preference":  # pairs, not packed: their own files (data/preference.py)
        return _prepare_pairs(inputs, Path(out_dir), tokenizer_path, val_fraction, pattern,
                              eos_token)  # fmt: skip
    examples = None if format == "text" else format
    stdlib = not inputs
    inputs, pattern, files = _input_files(inputs, pattern, field, examples)
    out = Path(out_dir)
    check_out(out)
    tok = build_tokenizer(tokenizer_path, eos_token)
    example_format = None if examples is None else load_format(examples, tokenizer_path)

    # uint16 halves disk and page-cache use for any vocabulary up to 65536 ids.
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    with _staged(out) as tmp:
        masked = example_format is not None
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens, masked) for s in SPLITS}
        # A byte tokenizer keeps any byte; a tokenizer.json reads text, decoded from UTF-8.
        not_text = NotText(decodes=tok.describe()["kind"] != "byte")
        chunks = _chunks(iter_documents(files, field, examples, not_text))
        # Workers rebuild the tokenizer from its resolved path: this process's cwd is not theirs.
        resolved = tok.describe()["path"]
        total_bytes = sum(path.stat().st_size for path, _ in files)
        encoded = encode_in_order(chunks, tok, dtype, workers, resolved, eos_token, example_format)
        with closing(encoded):
            if _write_splits(encoded, total_bytes, val_fraction, writers) == 0:
                skipped = "".join(f" ({line})" for line in not_text.warnings())
                raise ConfigError(f"data prepare: no text found in {', '.join(inputs)}{skipped}")
        for w in writers.values():
            w.close()
        num_docs = {s: w.num_documents for s, w in writers.items()}
        if num_docs["train"] == 0:
            raise ConfigError(
                f"data prepare: the train split is empty ({num_docs['val']} document(s), all val); "
                "give more documents or a smaller --val-fraction"
            )

        index = _index(tok, out, dtype, writers, num_docs, inputs, pattern, example_format)
        # The quick start's task (configs/debug.toml), from the files this run holds out.
        if stdlib and val_fraction > 0:
            write_task(tmp / NEXT_LINE_TASK, val_fraction)
        # index.json last: a dataset directory without it is never treated as complete.
        (tmp / "index.json").write_text(json.dumps(index, indent=2) + "\n")

    _log_prepared(out, time.perf_counter() - start, tok, dtype, writers, num_docs, not_text)
    return out


def _prepare_pairs(
    inputs: list[str] | None,
    out: Path,
    tokenizer_path: str | None,
    val_fraction: float,
    pattern: str | None,
    eos_token: str | None,
) -> Path:
    """`--format preference`: DPO pairs, written whole into a temporary sibling of `out`,
    then renamed (an interrupted prepare leaves no dataset, as for text)."""
    if not inputs:
        raise ConfigError("data prepare: --format preference needs --input (JSONL or parquet)")
    files = find_files(inputs, pattern or f"{EXAMPLE_PATTERN},*.parquet")
    check_out(out)
    with _staged(out) as tmp:
        index = prepare_pairs(files, tmp, out, tokenizer_path, eos_token, val_fraction)
        (tmp / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A fresh hidden sibling of `out` to write a dataset into: renamed to `out` when the block
    ends (on one filesystem, hence atomic), removed if it raises, so an interrupted prepare
    leaves no dataset."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare", description="Tokenize text into shards for training."
    )
    p.add_argument(
        "--input",
        action="append",
        help="a directory, glob or file (repeatable): .txt/.py/.md (one document per file), "
        ".jsonl[.gz|.zst] (one per line), .parquet (one per row). "
        "Default: this Python's standard-library *.py sources",
    )
    p.add_argument(
        "--pattern",
        help=f"file names to take from directories (default: {DEFAULT_PATTERN}; with "
        f"--format prompt_response or chat: {EXAMPLE_PATTERN})",
    )
    p.add_argument(
        "--format",
        choices=("text", *KINDS, "preference"),
        default="text",
        help="text: documents; prompt_response: JSONL {prompt, response} examples; chat: JSONL "
        "{messages} rendered with the tokenizer's chat template (or a plain one). Examples are "
        "written with a loss mask: only response tokens are targets; preference: JSONL or parquet "
        "DPO pairs {prompt, chosen, rejected} in TRL's layouts (docs/data.md)",
    )
    p.add_argument(
        "--field",
        default="text",
        help="the text field of JSONL records, and the text column of parquet files",
    )
    p.add_argument("--tokenizer", help="a local tokenizer.json (default: byte-level, vocab 258)")
    p.add_argument("--eos-token", help="the --tokenizer's end-of-document token")
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share of documents for val")
    p.add_argument("--shard-tokens", type=int, default=2**28, help="max tokens per shard file")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizing processes (default: 1 with the byte tokenizer, whose tokens are the "
        "bytes themselves; the CPUs this process may use with --tokenizer)",
    )
    return p


class _Terminated(Exception):
    """SIGTERM (Slurm, timeout, kill), raised where prepare is, so its temporary directory is
    removed on the way out."""


def _stop(signum: int, frame: object) -> None:
    raise _Terminated


def _index_identity(out: Path) -> tuple[int, int] | None:
    """Which index.json `out` holds (inode, mtime), or None: a stop tells from it whether the
    dataset there is the one from before, a new one, or none."""
    try:
        stat = (out / "index.json").stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _interrupted(how: str, out: Path, before: tuple[int, int] | None) -> str:
    """The one line a stopped prepare ends with: what `out` holds now."""
    if _index_identity(out) != before:  # stopped after the final rename, before returning
        return f"interrupted by {how} after '{out}' was written: that dataset is complete"
    kept = "; the dataset already there is kept" if before else ""
    return f"interrupted by {how}: nothing written to '{out}'{kept}"


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    before = _index_identity(Path(args.out))
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        prepare(
            args.input,
            args.out,
            tokenizer_path=args.tokenizer,
            val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens,
            field=args.field,
            pattern=args.pattern,
            eos_token=args.eos_token,
            workers=args.workers,
            format=args.format,
        )
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit(_interrupted("Ctrl-C", Path(args.out), before)) from None
    except _Terminated:
        logger.error("%s", _interrupted("SIGTERM", Path(args.out), before))
        raise SystemExit(128 + signal.SIGTERM) from None  # the status a shell gives SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
