"""Counter-based init (model/random_init.py): values depend on (seed, name, global index) only,
are computed by operations that give the same bits on any device, and have the right
distribution.

No GPU here, so device independence is checked by construction: the int64 hash against exact
Python integers (no overflow, no wrap-around to depend on), and the vectorized quantile against
a scalar Python-float reimplementation (one IEEE-754 operation at a time, no vector unit, no
fusion). tests/test_gpu.py compares CUDA with the CPU bit for bit where a GPU is visible.
"""

from __future__ import annotations

import math
import statistics
import struct

import pytest
import torch

from model import random_init
from model.random_init import normal, normal_quantile, random_bits

CPU = torch.device("cpu")
M32 = 0xFFFFFFFF


def _mix32_exact(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _bits_exact(seed: int, name: str, i: int) -> int:
    k0, k1 = random_init._keys(seed, name)
    x = _mix32_exact(((i & M32) + k0) & M32)
    return _mix32_exact(x ^ (i >> 32) ^ k1)


def _quantile_scalar(bits: int, truncated: bool) -> float:
    """normal_quantile, one Python float (IEEE-754 double) operation at a time."""
    table, slope, lower_tail = random_init._host_tables()
    a, b = (lower_tail, (0.5 - lower_tail) / 2**31) if truncated else (0.0, 2.0**-32)
    q = ((bits & 0x7FFFFFFF) + 0.5) * b + a
    q_bits = struct.unpack("<q", struct.pack("<d", q))[0]
    key = (q_bits >> 42) - random_init._FIRST_KEY
    weight = (q_bits & (2**42 - 1)) * 2.0**-42
    z = table[key].item() + slope[key].item() * weight
    return -z if bits >= 2**31 else z


def test_int64_hash_equals_exact_integer_arithmetic() -> None:
    """Every intermediate stays below 2^63, so int64 gives the exact integer result: nothing
    depends on how a device wraps an overflow."""
    edges = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 3 * 2**40 + 5, 2**62 - 1]
    index = torch.tensor(
        edges + list(range(1000, 1400)) + [int(x) for x in torch.randint(0, 2**62, (200,))]
    )
    for seed, name in [(0, "layers.0.attention.wq.weight"), (2**40 + 3, "output.weight")]:
        got = random_bits(seed, name, index).tolist()
        assert got == [_bits_exact(seed, name, i) for i in index.tolist()]


def test_vectorized_quantile_equals_scalar_ieee_reimplementation() -> None:
    bits = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, *range(12345, 12400)]
    bits += torch.randint(0, 2**32, (500,)).tolist()
    for truncated in (True, False):
        got = normal_quantile(torch.tensor(bits), truncated).tolist()
        assert got == [_quantile_scalar(b, truncated) for b in bits], truncated


def test_quantile_table_matches_statistics_inv_cdf() -> None:
    """The table, built with + - * / and sqrt only, is the normal quantile to 1e-13."""
    table, _, lower_tail = random_init._host_tables()
    dist = statistics.NormalDist()
    for key in range(0, len(table), 29):
        exponent, step = divmod(key + random_init._FIRST_KEY, 1024)
        q = 2.0 ** (exponent - 1023) * (1 + step / 1024)
        assert table[key].item() == pytest.approx(dist.inv_cdf(q), abs=1e-13), q
    assert lower_tail == pytest.approx(dist.cdf(-3.0), rel=1e-12)


def test_interpolated_quantile_is_within_float32_resolution() -> None:
    bits = torch.randint(0, 2**32, (3000,))
    dist = statistics.NormalDist()
    _, _, lower_tail = random_init._host_tables()
    for truncated, (a, b) in [
        (True, (lower_tail, (0.5 - lower_tail) / 2**31)),
        (False, (0.0, 2.0**-32)),
    ]:
        z = normal_quantile(bits, truncated)
        exact = [
            (-1 if u >> 31 else 1) * dist.inv_cdf(a + b * ((u & 0x7FFFFFFF) + 0.5))
            for u in bits.tolist()
        ]
        assert (z - torch.tensor(exact, dtype=torch.float64)).abs().max() < 1e-7


@pytest.mark.parametrize("shape", [(12, 7), (5, 4, 3), (9,), ()], ids=["2d", "3d", "1d", "0d"])
def test_any_region_equals_the_same_slice_of_the_whole(shape: tuple[int, ...]) -> None:
    """A parameter drawn whole, or as two halves, or as any block, gives the same values."""
    whole_region = tuple(slice(0, n) for n in shape)
    whole = normal(7, "w", shape, whole_region, 0.02, True, CPU)
    assert whole.shape == shape
    if not shape:
        return
    half = shape[0] // 2
    top = normal(7, "w", shape, (slice(0, half), *whole_region[1:]), 0.02, True, CPU)
    bottom = normal(7, "w", shape, (slice(half, shape[0]), *whole_region[1:]), 0.02, True, CPU)
    assert torch.equal(torch.cat([top, bottom]), whole)
    block = tuple(slice(n // 3, n - n // 4) for n in shape)
    assert torch.equal(normal(7, "w", shape, block, 0.02, True, CPU), whole[block])
    empty = (slice(shape[0], shape[0]), *whole_region[1:])
    assert normal(7, "w", shape, empty, 0.02, True, CPU).numel() == 0


def test_chunk_size_and_threads_do_not_change_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    shape, region = (300, 70), (slice(0, 300), slice(0, 70))
    reference = normal(1, "w", shape, region, 1.0, False, CPU)
    monkeypatch.setitem(random_init._CHUNK, "cpu", 100)  # several rows per chunk, then one
    assert torch.equal(normal(1, "w", shape, region, 1.0, False, CPU), reference)
    monkeypatch.setitem(random_init._CHUNK, "cpu", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(normal(1, "w", shape, region, 1.0, False, CPU), reference)
    finally:
        torch.set_num_threads(threads)


def _trunc_std(a: float) -> float:
    pdf = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    return math.sqrt(1 - 2 * a * pdf / math.erf(a / math.sqrt(2)))


def test_distribution_mean_std_and_truncation() -> None:
    n = 1 << 20
    region = (slice(0, n),)
    dist = statistics.NormalDist()
    trunc = normal(0, "t", (n,), region, 0.02, True, CPU).double() / 0.02
    assert abs(trunc.mean().item()) < 5 / math.sqrt(n)
    assert trunc.std().item() == pytest.approx(_trunc_std(3.0), rel=3e-3)
    assert trunc.abs().max().item() <= 3.0 and trunc.abs().max().item() > 2.99
    mass = dist.cdf(3) - dist.cdf(-3)
    for x in (-2.0, -1.0, 0.0, 0.5, 1.5):  # the CDF, renormalized to [-3, 3]
        expected = (dist.cdf(x) - dist.cdf(-3)) / mass
        assert (trunc <= x).double().mean().item() == pytest.approx(expected, abs=2e-3), x
    plain = normal(0, "p", (n,), region, 1.0, False, CPU).double()
    assert abs(plain.mean().item()) < 5 / math.sqrt(n)
    assert plain.std().item() == pytest.approx(1.0, rel=3e-3)
    beyond = (plain.abs() > 3).double().mean().item()
    assert beyond == pytest.approx(2 * dist.cdf(-3), rel=0.1)  # ~2,800 of 1M values
    assert plain.abs().max().item() > 4.0


def test_names_seeds_and_neighbours_are_uncorrelated() -> None:
    n = 1 << 18
    index = torch.arange(n)
    u = [random_bits(s, name, index).double() for s, name in [(0, "a"), (0, "b"), (1, "a")]]
    corr = torch.corrcoef(torch.stack([*u, torch.roll(u[0], 1)]))
    off_diagonal = corr - torch.eye(4, dtype=corr.dtype)
    assert off_diagonal.abs().max().item() < 5 / math.sqrt(n)
    top = torch.bincount((u[0] / 2**24).long(), minlength=256).double()
    chi2 = ((top - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 350  # 255 degrees of freedom: p < 1e-4 above 350
