"""A seeded permutation of [0, n), computed one index at a time in O(1) memory.

The loader shuffles every epoch of every source with it: offset i of epoch e of a source reads
sample ``permute(i, n, key)`` with a key drawn from (seed, source, epoch). Nothing of size n is
ever built, so a corpus of 10^9 windows shuffles in the memory of a corpus of ten (the cost per
index is in BENCHMARKS.md), where ``torch.randperm(n).tolist()`` held n Python ints per rank.

How it is a permutation:

- A Feistel network is a bijection of [0, 4^h) for *any* round function: a round maps
  (left, right) to (right, left XOR F(right)), and knowing its output gives back its input.
  Here the halves have h bits, with 4^h the smallest power of four >= n (so 4^h < 4n).
- Cycle walking restricts it to [0, n): apply the network again while the result is >= n.
  The walk from x follows x's cycle of the bijection to the next element below n, which exists
  because x itself is one; two starts below n cannot meet, as each cycle's elements below n are
  visited in turn. On average fewer than four rounds of the network per index.

Vectorized over numpy arrays: the loader asks for a micro-batch of indices at once.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6
"""Feistel rounds; any number gives a bijection, six mix well enough for a data order."""
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / phi: spreads consecutive integers apart
_ROUND_CONSTANTS = [np.uint64((r + 1) * 0x632BE59BD9B4E019 % 2**64) for r in range(ROUNDS)]


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, a bijection of uint64 in which every input bit flips about half
    of the output bits. numpy wraps uint64 array arithmetic modulo 2^64, as intended here."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int | str) -> int:
    """A 64-bit key from integers and strings; the same in every process and Python version
    (unlike ``hash()`` of a string, which is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def subkeys(key: int, counters: np.ndarray) -> np.ndarray:
    """One key per element: `key` combined with a counter (an epoch, a block number)."""
    return _mix(np.uint64(key) + counters.astype(np.uint64) * _GOLDEN)


def _feistel(x: np.ndarray, keys: np.ndarray, half_bits: int) -> np.ndarray:
    mask, shift = np.uint64((1 << half_bits) - 1), np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for constant in _ROUND_CONSTANTS:
        left, right = right, left ^ (_mix(right ^ keys ^ constant) & mask)
    return (left << shift) | right


def permute(indices: np.ndarray, n: int, keys: int | np.ndarray) -> np.ndarray:
    """Where a seeded permutation of [0, n) sends each of `indices` (int64, 1-D, all in
    [0, n)). `keys`: one key for all, or one per index (the same key, the same permutation)."""
    if n < 1:
        raise ValueError(f"cannot permute [0, {n})")
    x = np.asarray(indices, dtype=np.int64).reshape(-1)
    if x.size and (x.min() < 0 or x.max() >= n):
        raise IndexError(f"indices outside [0, {n})")
    keys = np.broadcast_to(np.asarray(keys, dtype=np.uint64), x.shape)
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)  # 4^half_bits >= n
    out = _feistel(x.astype(np.uint64), keys, half_bits)
    walking = np.flatnonzero(out >= n)
    while walking.size:  # cycle walking: step again where the network left [0, n)
        out[walking] = _feistel(out[walking], keys[walking], half_bits)
        walking = walking[out[walking] >= n]
    return out.astype(np.int64)
