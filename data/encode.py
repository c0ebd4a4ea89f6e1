"""Tokenize chunks of documents on N worker processes, handing results back in input order.

The parent reads the corpus and cuts it into chunks; workers only tokenize. Results are taken
strictly in submission order, so the output does not depend on the number of workers, and at
most ``2 * workers`` chunks are in flight, so memory stays bounded however large the corpus.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import NamedTuple

import numpy as np

from data.sft import ExampleFormat, encode_examples
from data.tokenizer import Tokenizer, build_tokenizer


class Chunk(NamedTuple):
    """Consecutive documents of the corpus, tokenized as one task."""

    keys: list[str]
    docs: list[bytes]
    position: int
    """Input bytes read once this chunk was complete (for the progress bar)."""


class Encoded(NamedTuple):
    keys: list[str]
    tokens: np.ndarray
    """Every document's tokens followed by EOS, concatenated, in the dataset's dtype."""
    ends: np.ndarray
    """Where each document (with its EOS) ends in ``tokens``."""
    position: int
    mask: np.ndarray | None = None
    """With examples (data.sft): uint8 per token of ``tokens``, 1 where it is a target."""


def encode(tok: Tokenizer, dtype: np.dtype, docs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """``docs`` as one flat token array with EOS after each, and each document's end offset."""
    eos = np.array([tok.eos_id], dtype=dtype)
    encoded = tok.encode_documents(docs)
    tokens = np.concatenate([a for ids in encoded for a in (ids, eos)]).astype(dtype, copy=False)
    return tokens, np.cumsum([len(ids) + 1 for ids in encoded])


def encode_chunk(
    tok: Tokenizer,
    dtype: np.dtype,
    examples: ExampleFormat | None,
    keys: list[str],
    docs: list[bytes],
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A chunk's tokens, document ends and, for examples (data.sft), the loss mask."""
    if examples is None:
        return (*encode(tok, dtype, docs), None)
    return encode_examples(tok, dtype, examples, keys, docs)


# Set once per worker process by _start_worker.
_worker: tuple[Tokenizer, np.dtype, ExampleFormat | None] | None = None


def _exit_with(parent_pid: int) -> None:
    # A parent killed with SIGKILL cannot stop its workers, and they would wait for work forever:
    # each worker watches its parent and exits once it is gone (then it is reparented).
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    os._exit(1)


def _start_worker(
    parent_pid: int,
    tokenizer_path: str | None,
    eos_token: str | None,
    dtype: str,
    examples: ExampleFormat | None,
) -> None:
    # One thread per worker: N workers fill N cores, and a tokenizer.json's own thread pool
    # would only compete with the other workers for them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which stops the pool
    threading.Thread(target=_exit_with, args=(parent_pid,), daemon=True).start()
    global _worker
    _worker = (build_tokenizer(tokenizer_path, eos_token), np.dtype(dtype), examples)


def _encode_in_worker(
    keys: list[str], docs: list[bytes]
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    assert _worker is not None, "the pool's initializer did not run"
    return encode_chunk(*_worker, keys, docs)


def encode_in_order(
    chunks: Iterator[Chunk],
    tok: Tokenizer,
    dtype: np.dtype,
    workers: int,
    tokenizer_path: str | None,
    eos_token: str | None,
    examples: ExampleFormat | None = None,
) -> Iterator[Encoded]:
    """Each chunk tokenized, in input order; ``workers`` processes, or this one for 1.
    `examples`: the chunks hold examples of this format (data.sft), not text.

    Workers build their own tokenizer from ``tokenizer_path`` and ``eos_token`` (``tok`` is used
    only in this process).
    """
    if workers == 1:
        for chunk in chunks:
            tokens, ends, mask = encode_chunk(tok, dtype, examples, chunk.keys, chunk.docs)
            yield Encoded(chunk.keys, tokens, ends, chunk.position, mask)
        return
    # "spawn": fresh interpreters, so no thread of this process (pyarrow's pool, tqdm's monitor)
    # is forked half-way through a lock; it works the same on Linux and macOS.
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_start_worker,
        initargs=(os.getpid(), tokenizer_path, eos_token, dtype.str, examples),
    )
    pending: deque[tuple[list[str], int, Future]] = deque()

    def oldest() -> Encoded:
        keys, position, future = pending.popleft()
        tokens, ends, mask = future.result()
        return Encoded(keys, tokens, ends, position, mask)

    try:
        for chunk in chunks:
            # The documents' bytes go to the worker; keys too, to name an example that fails.
            future = pool.submit(_encode_in_worker, chunk.keys, chunk.docs)
            pending.append((chunk.keys, chunk.position, future))
            # Two chunks per worker: one being tokenized, one queued while results are written.
            if len(pending) >= 2 * workers:
                yield oldest()
        while pending:
            yield oldest()
    finally:
        # On an error or Ctrl-C, queued chunks are dropped; running ones finish (one chunk each).
        pool.shutdown(wait=True, cancel_futures=True)
