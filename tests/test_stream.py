"""The global stream's index arithmetic: the per-index shuffle is a permutation (exhaustively for
small sizes, spot-checked at 10^9), a mixture's proportions, one stream for every mesh, resume
and annealing, epoch rollovers; all without data files or processes."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest

from configs import ConfigError
from data.shuffle import _ROUND_CONSTANTS, _mix, derive_key, permute
from data.stream import BLOCK, PERIOD, GlobalStream, GlobalStreamBatchSampler, SourceMeter

# --- the permutation -------------------------------------------------------------------------


@pytest.mark.parametrize("key", [0, 1, derive_key(7, "source", "web", 3)])
def test_permutation_is_a_bijection_for_every_small_size(key: int) -> None:
    sizes = [*range(1, 300), 1000, 4095, 4096, 4097, 65535, 65536, 65537, 99_991]
    for n in sizes:
        assert np.array_equal(np.sort(permute(np.arange(n), n, key)), np.arange(n)), n


def test_permutation_depends_on_the_key_and_shuffles() -> None:
    n = 10_000
    a, b = permute(np.arange(n), n, 1), permute(np.arange(n), n, 2)
    assert not np.array_equal(a, b)
    # Neither the identity nor close to it: few fixed points, no correlation with the index.
    assert (a == np.arange(n)).sum() < 10 and abs(np.corrcoef(a, np.arange(n))[0, 1]) < 0.05
    # One key per element gives each element its own permutation's image.
    keys = np.array([1, 2] * (n // 2), dtype=np.uint64)
    mixed = permute(np.arange(n), n, keys)
    assert np.array_equal(mixed[::2], a[::2]) and np.array_equal(mixed[1::2], b[1::2])
    with pytest.raises(IndexError):
        permute(np.array([n]), n, 1)


def _inverse(y: np.ndarray, n: int, key: int) -> np.ndarray:
    """The Feistel network run backwards, cycle-walking while outside [0, n)."""
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift, keys = np.uint64((1 << half_bits) - 1), np.uint64(half_bits), np.uint64(key)

    def backwards(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for constant in reversed(_ROUND_CONSTANTS):
            left, right = right ^ (_mix(left ^ keys ^ constant) & mask), left
        return (left << shift) | right

    out = backwards(y.astype(np.uint64))
    while (outside := out >= n).any():
        out[outside] = backwards(out[outside])
    return out.astype(np.int64)


def test_permutation_at_a_billion_windows_spot_checks() -> None:
    """10^9 windows: random indices come back through the inverse, a million consecutive
    ones land on a million distinct samples, all in range (time and memory: BENCHMARKS.md)."""
    n, key = 10**9, derive_key(0, "source", "web", 0)
    x = np.random.default_rng(0).integers(0, n, 200_000)
    x = np.concatenate([x, [0, 1, n - 2, n - 1]])
    y = permute(x, n, key)
    assert y.min() >= 0 and y.max() < n
    assert np.array_equal(_inverse(y, n, key), x)
    run = permute(np.arange(500_000_000, 501_000_000), n, key)
    assert len(np.unique(run)) == 1_000_000 and run.max() < n


# --- the mixture -----------------------------------------------------------------------------

SIZES = {"code": 777, "tiny": 5, "web": 1000}


def _stream(weights: dict[str, float], shuffle: bool = True, seed: int = 1) -> GlobalStream:
    return GlobalStream({n: SIZES[n] for n in weights}, weights, seed, shuffle)


@pytest.mark.parametrize(
    "weights",
    [
        {"web": 0.7, "code": 0.3},
        {"web": 0.5, "code": 0.3, "tiny": 0.2},
        {"web": 1, "code": 1, "tiny": 1},
        {"web": 0.9, "code": 0.05, "tiny": 0.05},
        {"web": 3, "code": 1},
    ],
)
def test_proportions_over_20000_sequences_are_within_half_a_percent(weights: dict) -> None:
    """Measured shares within 0.5% of each weight (relative, so also absolute) over 20,000
    consecutive positions from 200 starts, far into the stream too; exact over every period."""
    stream = _stream(weights)
    share = np.array([weights[n] / sum(weights.values()) for n in stream.names])
    for first in (0, 10**9 + 123):
        sources, _ = stream.locate(np.arange(first, first + 3 * PERIOD))
        served = np.cumsum(np.eye(len(weights), dtype=np.int64)[sources], axis=0)
        starts = np.random.default_rng(first).integers(0, 2 * PERIOD, 200)
        measured = (served[starts + 20_000] - served[starts]) / 20_000
        assert np.abs(measured - share).max() <= 0.005 * share.min(), measured
    sources, _ = stream.locate(np.arange(3 * PERIOD, 4 * PERIOD))
    assert np.allclose(np.bincount(sources) / PERIOD, share, rtol=0, atol=1 / PERIOD)


def test_each_source_reads_every_sample_once_per_epoch() -> None:
    stream = _stream({"web": 0.5, "code": 0.3, "tiny": 0.2})
    sources, local = stream.source_and_index(np.arange(313 * BLOCK))  # whole blocks
    for s, name in enumerate(stream.names):
        n = SIZES[name]
        # The j-th sample a source serves, for j = 0, 1, 2, ...: none repeated or skipped.
        assert np.array_equal(np.sort(local[sources == s]), np.arange((sources == s).sum()))
        epochs = [stream.sample(np.full(n, s), np.arange(e * n, (e + 1) * n)) for e in (0, 1)]
        assert all(np.array_equal(np.sort(e), np.arange(n)) for e in epochs)
        assert not np.array_equal(epochs[0], epochs[1])  # a fresh order each epoch
    # consumed() counts what locate() does, at any position, without walking the stream.
    for position in (0, 1, 63, 64, 1000, 20_001):
        expected = np.bincount(sources[:position], minlength=3)
        assert np.array_equal(stream.consumed(position), expected)
    # Unshuffled: each block holds its sources' slots in turn, each source in sample order.
    sources, samples = _stream({"web": 0.5, "code": 0.5}, shuffle=False).locate(np.arange(128))
    assert sources.tolist() == ([0] * 32 + [1] * 32) * 2
    assert samples.tolist() == [*range(32)] * 2 + [*range(32, 64)] * 2


def _sampler(stream: GlobalStream, d: int, r: int, b: int) -> GlobalStreamBatchSampler:
    return GlobalStreamBatchSampler(stream, dp_rank=r, dp_size=d, micro_batch_size=b)


def _steps(weights: dict, d: int, b: int, steps: int, state: dict | None = None) -> list[list]:
    """Each optimizer step's (source, sample) pairs, gathered from d ranks in rank order."""
    accum = 8 // (d * b)  # global batch 8
    samplers = [_sampler(_stream(weights), d, r, b) for r in range(d)]
    for sampler in samplers if state else ():
        sampler.load_state_dict(state)
    ranks = [list(itertools.islice(iter(s), steps * accum)) for s in samplers]
    return [
        [pair for j in range(step * accum, (step + 1) * accum) for r in range(d)
         for pair in ranks[r][j]]
        for step in range(steps)
    ]  # fmt: skip


@pytest.mark.parametrize(("d", "b"), [(2, 4), (4, 1), (2, 1), (8, 1), (1, 2)])
def test_the_mixed_stream_is_the_same_for_any_mesh_and_micro_batching(d: int, b: int) -> None:
    weights = {"web": 0.5, "code": 0.3, "tiny": 0.2}
    assert _steps(weights, d, b, 12) == _steps(weights, 1, 8, 12)


def test_mixed_stream_resumes_exactly_on_another_mesh() -> None:
    weights = {"web": 0.5, "code": 0.3, "tiny": 0.2}
    reference = _steps(weights, 1, 8, 10)
    saved = [_sampler(_stream(weights), 4, r, 2) for r in range(4)]  # 3 steps on 4 ranks
    for sampler in saved:
        list(itertools.islice(iter(sampler), 3))
    state = saved[0].state_dict()
    assert all(s.state_dict() == state for s in saved) and state["consumed"] == 24
    assert _steps(weights, 2, 2, 7, state) == reference[3:]


def test_annealing_changes_the_mixture_from_the_resumed_position(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old, new = {"web": 0.7, "code": 0.3}, {"web": 0.2, "code": 0.8}
    before = _sampler(_stream(old), 1, 0, 64)
    list(itertools.islice(iter(before), 100))  # 6,400 positions
    state = before.state_dict()
    after = _sampler(_stream(new), 1, 0, 64)
    with caplog.at_level(logging.INFO, logger="data.stream"):
        after.load_state_dict(state)
    assert "mixture weights change at stream position 6400: code 0.3 -> 0.8, web 0.7 -> 0.2" in (
        caplog.text
    )
    stream = after.stream
    # The positions before the resume are what the old weights gave; after it, the new shares.
    old_stream = _stream(old)
    head = np.arange(6400)
    for a, b in zip(stream.locate(head), old_stream.locate(head), strict=True):
        assert np.array_equal(a, b)
    sources, local = stream.source_and_index(np.arange(6400 + 313 * BLOCK))
    share = np.bincount(sources[6400 : 6400 + 20_000]) / 20_000
    assert np.allclose(share, [0.8, 0.2], rtol=0.005, atol=0)
    # Each source continues where it stood: its local indices run on without a gap or repeat.
    for s in range(2):
        assert np.array_equal(np.sort(local[sources == s]), np.arange((sources == s).sum()))
    # The new segment is in the state, so a later resume continues the annealed stream.
    state2 = after.state_dict()
    assert [seg["start"] for seg in state2["segments"]] == [0, 6400]
    again = _sampler(_stream(new), 1, 0, 64)
    again.load_state_dict(state2 | {"consumed": 12_800})
    assert len(again.stream.segments) == 2
    # Weights of the same proportions are the same mixture: no new segment.
    same = _sampler(_stream({"web": 1.4, "code": 0.6}), 1, 0, 64)
    same.load_state_dict(state)
    assert len(same.stream.segments) == 1


def test_a_source_running_out_is_logged_once_per_epoch(caplog: pytest.LogCaptureFixture) -> None:
    stream = _stream({"web": 0.5, "code": 0.3, "tiny": 0.2})
    meter = SourceMeter(stream, seq_len=32, position=0)
    with caplog.at_level(logging.INFO, logger="data.stream"):
        scalars = [meter.update(8 * step, step) for step in range(1, 9)]  # 64 positions
    served_tiny = stream.consumed(64)[stream.names.index("tiny")]
    assert served_tiny > 2 * SIZES["tiny"]  # so "tiny" starts epochs 1 and 2
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "source tiny" in line] == [
        f"data: source tiny ran out of samples (5 per epoch); it is in epoch {e} after step {s}, "
        "reading in a fresh order"
        for e, s in _first_steps_of_epochs(stream, "tiny", steps=8)
    ]
    assert not any("source web" in line or "source code" in line for line in lines)
    # Tokens per source: what each served, times seq_len; together, every position.
    served = dict(zip(stream.names, stream.consumed(64).tolist(), strict=True))
    assert scalars[-1] == {f"data/tokens/{n}": float(c * 32) for n, c in served.items()}
    assert sum(scalars[-1].values()) == 64 * 32


def _first_steps_of_epochs(stream: GlobalStream, name: str, steps: int) -> list[tuple[int, int]]:
    """(epoch, step) for each epoch >= 1 of source `name`, at 8 positions per step."""
    s, size = stream.names.index(name), SIZES[name]
    out, epoch = [], 0
    for step in range(1, steps + 1):
        if (stream.consumed(8 * step)[s] - 1) // size > epoch:
            epoch = (stream.consumed(8 * step)[s] - 1) // size
            out.append((epoch, step))
    return out


def test_a_loader_state_of_another_version_or_sources_is_one_config_error() -> None:
    """The loader state is read in the one version state_dict writes; a resume cannot change
    which sources the stream reads."""
    unversioned = {"consumed": 24, "num_samples": 1000, "seed": 1, "shuffle": True}
    for state, what in ((unversioned, "no version"), (unversioned | {"version": 3}, "version 3")):
        with pytest.raises(ConfigError) as err:
            _sampler(_stream({"web": 1.0}), 2, 0, 4).load_state_dict(state)
        assert str(err.value) == (
            f"data: the checkpoint's loader state has {what}, this trainer reads version 2: "
            "start over from its weights with checkpoint.load_model_only=true"
        )
    state = _sampler(_stream({"web": 0.5, "code": 0.5}), 1, 0, 8).state_dict()
    with pytest.raises(ConfigError, match="cannot add, remove or rename sources"):
        _sampler(_stream({"web": 0.5, "tiny": 0.5}), 1, 0, 8).load_state_dict(state)
