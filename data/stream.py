"""The global stream as index arithmetic: which source and which sample serve stream position k.

Every position k = 0, 1, 2, ... of the training stream is read by one data-parallel rank in one
micro-step (GlobalStreamBatchSampler, at the end; data/loader.py says how). What it holds is a
pure function of the seed, k and the mixture's *segments* (the weights in effect from a
position on), computed in two steps:

1. The mixture picks the source s and the source-local index j: position k is the j-th sample
   source s serves in this run. Over every PERIOD positions each source gets its share of the
   weights exactly (to 1/PERIOD), spread evenly over the period, and shuffled inside blocks of
   BLOCK positions (class Mixture).
2. The source's epoch permutation picks the sample: epoch e = j // N_s, offset j % N_s, sample
   ``permute(offset, N_s, key(seed, s, e))`` (data/shuffle.py). A source that runs out starts its
   next epoch in a fresh order on its own; the others do not notice.

Nothing here grows with k or with the corpus: a stream position costs the same at k = 10^12 on a
corpus of 10^9 windows as at k = 0 on ten. Nothing talks to the process group either, so every
rank computes the same answers, and rank 0 alone can count tokens per source (SourceMeter).

Weights changed on resume (annealing) start a new segment at the resumed position, where each
source continues from the sample it had reached (`Segment.offsets`): nothing within a source's
epoch repeats or is skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from configs import ConfigError
from data.shuffle import derive_key, permute, subkeys

logger = logging.getLogger(__name__)

VERSION = 2
"""Of the loader state (GlobalStream.state_dict), the only one load_state_dict reads."""
PERIOD = 1 << 16
"""Positions over which each source's share is exact: weights count in units of 1/65536."""
BLOCK = 64
"""Positions shuffled together: enough that a micro-batch is no fixed pattern of sources, few
enough that a stretch of the stream misses the weights by a few positions at its ends only
(20,000 consecutive positions: within 0.5% of each weight, tests/test_stream.py)."""


def quantize(weights: Sequence[float]) -> list[int]:
    """Samples of each source per PERIOD positions: the weights' shares rounded by largest
    remainder, so they sum to PERIOD exactly. ConfigError for a share that rounds to nothing."""
    exact = [PERIOD * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    largest_remainder_first = sorted(range(len(exact)), key=lambda s: counts[s] - exact[s])
    for s in largest_remainder_first[: PERIOD - sum(counts)]:
        counts[s] += 1
    if 0 in counts:
        raise ConfigError(
            f"data.sources: a weight below 1/{PERIOD} of their sum (weights {list(weights)}) "
            "would never be read"
        )
    return counts


class Mixture:
    """Where each source's samples fall within a period, for one set of weights.

    Stride scheduling spreads them: the m-th of source s's n_s samples belongs at the ideal point
    (m + 1/2) / n_s of the period, and sorting every source's ideal points gives their order.
    Each prefix of that order holds each source's share to within about a sample. The order
    itself is never kept: `before[b, s]` counts source s's samples in the first b blocks, and a
    block's positions are shuffled (seeded per block) among its slots, which hold the sources
    in turn: the first `in_block[b, 0]` slots are source 0's, and so on.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        self.counts = np.array(quantize(weights), dtype=np.int64)
        sources = len(self.counts)
        ideal = np.concatenate([(np.arange(n) + 0.5) / n for n in self.counts])
        order = np.repeat(np.arange(sources), self.counts)[np.argsort(ideal, kind="stable")]
        bounds = np.arange(0, PERIOD + 1, BLOCK)
        self.before = np.stack(
            [np.searchsorted(np.flatnonzero(order == s), bounds) for s in range(sources)], axis=1
        )
        self.in_block = np.diff(self.before, axis=0)
        self.slot_ends = np.cumsum(self.in_block, axis=1)

    def locate(self, p: np.ndarray, block_keys: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """(source, index within the source) of positions `p` counted from the segment start;
        `block_keys`: each position's block shuffle key, None for no shuffle."""
        if len(self.counts) == 1:  # one source reads its samples in stream order
            return np.zeros_like(p), p
        period, q = np.divmod(p, PERIOD)
        block, r = np.divmod(q, BLOCK)
        slot = r if block_keys is None else permute(r, BLOCK, block_keys)
        ends = self.slot_ends[block]
        source = (slot[:, None] >= ends).sum(axis=1)
        rank_in_block = slot - ends[np.arange(len(p)), source] + self.in_block[block, source]
        return source, period * self.counts[source] + self.before[block, source] + rank_in_block


@dataclass
class Segment:
    """From global position `start` on, the stream mixes the sources with `weights`; source s's
    first sample in the segment is its `offsets[s]`-th of the run (where it stood then)."""

    start: int
    weights: dict[str, float]
    offsets: dict[str, int]


class GlobalStream:
    """The training stream of one or more sources (`sizes`: samples per epoch, by name)."""

    def __init__(
        self, sizes: Mapping[str, int], weights: Mapping[str, float], seed: int, shuffle: bool
    ) -> None:
        self.names = sorted(sizes)  # the order of the arithmetic: by name, not by config order
        self.sizes = np.array([sizes[name] for name in self.names], dtype=np.int64)
        self.weights = {name: float(weights[name]) for name in self.names}
        self.seed, self.shuffle = seed, shuffle
        self._source_keys = [derive_key(seed, "source", name) for name in self.names]
        self.segments = [Segment(0, dict(self.weights), dict.fromkeys(self.names, 0))]
        self._mixtures: dict[tuple[int, ...], Mixture] = {}

    def _mixture(self, segment: Segment) -> Mixture:
        counts = tuple(quantize([segment.weights[name] for name in self.names]))
        if counts not in self._mixtures:
            self._mixtures[counts] = Mixture([segment.weights[name] for name in self.names])
        return self._mixtures[counts]

    def _in_segment(self, i: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, source-local index) of positions of segment i."""
        segment = self.segments[i]
        p = positions - segment.start
        keys = None
        if self.shuffle:
            keys = subkeys(derive_key(self.seed, "blocks", segment.start), p // BLOCK)
        source, local = self._mixture(segment).locate(p, keys)
        offsets = np.array([segment.offsets[name] for name in self.names], dtype=np.int64)
        return source, local + offsets[source]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source number in `names`, sample index within the source) of each stream position."""
        source, local = self.source_and_index(positions)
        return source, self.sample(source, local)

    def source_and_index(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, source-local index j) of each position: the j-th sample the source serves."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        starts = [segment.start for segment in self.segments]
        segment_of = np.searchsorted(starts, positions, side="right") - 1
        source, local = np.empty_like(positions), np.empty_like(positions)
        for i in np.unique(segment_of):
            at = segment_of == i
            source[at], local[at] = self._in_segment(int(i), positions[at])
        return source, local

    def sample(self, source: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The sample that source-local index `local` reads: its epoch's permutation of it."""
        epoch, offset = np.divmod(local, self.sizes[source])
        if not self.shuffle:
            return offset
        sample = np.empty_like(offset)
        for s in np.unique(source):
            at = source == s
            keys = subkeys(self._source_keys[s], epoch[at])
            sample[at] = permute(offset[at], int(self.sizes[s]), keys)
        return sample

    def consumed(self, position: int) -> np.ndarray:
        """Samples each source served at the positions before `position` (O(BLOCK) work)."""
        i = int(np.searchsorted([s.start for s in self.segments], position, side="right")) - 1
        segment = self.segments[i]
        mixture = self._mixture(segment)
        period, q = divmod(position - segment.start, PERIOD)
        block, r = divmod(q, BLOCK)
        offsets = np.array([segment.offsets[name] for name in self.names], dtype=np.int64)
        served = offsets + period * mixture.counts + mixture.before[block]
        if r:  # the start of a block: which sources its first r positions went to
            source, _ = self._in_segment(i, np.arange(position - r, position))
            served += np.bincount(source, minlength=len(self.names))
        return served

    def set_weights(self, position: int, weights: Mapping[str, float]) -> bool:
        """Mix with `weights` from `position` on (a resume's); False when the mixture is the
        same (weights of the same proportions included)."""
        new = {name: float(weights[name]) for name in self.names}
        last = self.segments[-1]
        if quantize(list(new.values())) == quantize([last.weights[n] for n in self.names]):
            return False
        offsets = dict(zip(self.names, self.consumed(position).tolist(), strict=True))
        segment = Segment(position, new, offsets)
        if last.start == position:  # resumed twice at the same position: the last one counts
            self.segments[-1] = segment
        else:
            self.segments.append(segment)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": dict(zip(self.names, self.sizes.tolist(), strict=True)),
            # Keyed by `names` whatever the segments were read from: equal streams then pickle
            # to equal bytes (pickle writes a repeated object once, such as these strings).
            "segments": [
                {
                    "start": segment.start,
                    "weights": {name: segment.weights[name] for name in self.names},
                    "offsets": {name: segment.offsets[name] for name in self.names},
                }
                for segment in self.segments
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any], position: int) -> None:
        """Continue a saved stream at `position` with this stream's weights (logged if new)."""
        if (version := state.get("version")) != VERSION:
            what = "no version" if version is None else f"version {version!r}"
            raise ConfigError(
                f"data: the checkpoint's loader state has {what}, this trainer reads version "
                f"{VERSION}: start over from its weights with checkpoint.load_model_only=true"
            )
        saved_sizes = state["num_samples"]
        segments = [Segment(**segment) for segment in state["segments"]]
        if sorted(saved_sizes) != self.names:
            raise ConfigError(
                f"data: the checkpoint's stream reads sources {sorted(saved_sizes)}, this "
                f"run {self.names}: a resume cannot add, remove or rename sources"
            )
        mine = {"num_samples": dict(zip(self.names, self.sizes.tolist(), strict=True)),
                "seed": self.seed, "shuffle": self.shuffle}  # fmt: skip
        saved = {"num_samples": saved_sizes, "seed": state["seed"], "shuffle": state["shuffle"]}
        if changed := [k for k in mine if saved[k] != mine[k]]:
            logger.warning(
                "data: resuming at position %d, but %s changed since the checkpoint (%s -> %s); "
                "the stream continues in a different order",
                position, ", ".join(changed), {k: saved[k] for k in changed},
                {k: mine[k] for k in changed},
            )  # fmt: skip
        self.segments = segments
        before = {name: self.segments[-1].weights[name] for name in self.names}
        if self.set_weights(position, self.weights):
            change = ", ".join(f"{n} {before[n]:g} -> {self.weights[n]:g}" for n in self.names)
            stood = ", ".join(f"{n} {j:,}" for n, j in self.segments[-1].offsets.items())
            logger.info(
                "data: mixture weights change at stream position %d: %s; each source continues "
                "from the sample it had reached (%s)", position, change, stood,
            )  # fmt: skip


class SourceMeter:
    """Rank 0's account of what each source has served, from the stream position alone (no
    collective, nothing from worker processes): tokens per source for TensorBoard, and a log
    line when a source runs out and starts its next epoch."""

    def __init__(self, stream: GlobalStream, seq_len: int, position: int) -> None:
        self.stream, self.seq_len = stream, seq_len
        self.epochs = self._epochs(stream.consumed(position))

    def _epochs(self, served: np.ndarray) -> np.ndarray:
        return np.maximum(served - 1, 0) // self.stream.sizes  # the last served sample's epoch

    def update(self, position: int, step: int) -> dict[str, float]:
        """After `step`, which ended at stream `position`: the scalars to log (per source)."""
        served = self.stream.consumed(position)
        epochs = self._epochs(served)
        for s in np.flatnonzero(epochs > self.epochs):
            name, size = self.stream.names[s], int(self.stream.sizes[s])
            logger.info(
                "data: source %s ran out of samples (%s per epoch); it is in epoch %d after "
                "step %d, reading in a fresh order", name, f"{size:,}", epochs[s], step,
            )  # fmt: skip
        self.epochs = epochs
        if len(self.stream.names) == 1:
            return {}
        return {
            f"data/tokens/{name}": float(n * self.seq_len)
            for name, n in zip(self.stream.names, served.tolist(), strict=True)
        }


class GlobalStreamBatchSampler(Sampler[list[tuple[int, int]]]):
    """Infinite batch sampler: this rank's slice of each micro-step of the global stream, as
    ``(source, sample)`` pairs for SourceSequences.

    State (``state_dict``) is the global number of stream positions consumed, the same on every
    rank for any D and B, and the stream's description (seed, sizes, mixture segments). It
    advances when a batch is *drawn*, which with worker prefetching is ahead of what training
    has used; ``StatefulDataLoader`` snapshots it at the batch it returns, so save and restore
    the loader, not this sampler. The sampler runs in the training process, also with workers.
    """

    def __init__(
        self,
        stream: GlobalStream,
        *,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        restart_each_iter: bool = False,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"data: need 0 <= dp_rank < dp_size, got {dp_rank=} {dp_size=}")
        if micro_batch_size < 1:
            raise ConfigError(f"data: micro_batch_size must be >= 1, got {micro_batch_size}")
        self.stream = stream
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        self.restart_each_iter = restart_each_iter
        self.consumed = 0
        self._loaded = False

    @property
    def positions_per_micro_step(self) -> int:
        return self.dp_size * self.micro_batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        # Train continues the stream on a new iterator; val restarts at 0 for every evaluation.
        # Either way a state loaded just before wins: that is how StatefulDataLoader resumes.
        if self.restart_each_iter and not self._loaded:
            self.consumed = 0
        self._loaded = False
        return self._batches()

    def _batches(self) -> Iterator[list[tuple[int, int]]]:
        while True:
            first = self.consumed + self.dp_rank * self.micro_batch_size
            source, sample = self.stream.locate(np.arange(first, first + self.micro_batch_size))
            # Advance before yielding: StatefulDataLoader reads the state right after drawing.
            self.consumed += self.positions_per_micro_step
            yield list(zip(source.tolist(), sample.tolist(), strict=True))

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, **self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed = int(state["consumed"])
        per_step = self.positions_per_micro_step
        if consumed < 0 or consumed % per_step:
            raise ConfigError(
                f"data: cannot resume at global stream position {consumed}: it is not a multiple "
                f"of dp_size * micro_batch_size = {self.dp_size} * {self.micro_batch_size} = "
                f"{per_step}. Every micro-step reads {per_step} consecutive positions, so the "
                "data-parallel size times the micro-batch size must divide the positions already "
                "consumed (keep the checkpoint's global batch, or one that divides it)"
            )
        self.stream.load_state_dict(state, consumed)  # logs weights changed since the save
        self.consumed = consumed
        self._loaded = True
