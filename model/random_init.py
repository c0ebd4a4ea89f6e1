"""Random initial values that are a pure function of (seed, parameter name, element index).

Why not `torch.Generator`: CUDA's random stream differs from the CPU's, so one seed gave a
different model on a GPU than on a laptop; and a stream can only be read from its start, so
every rank had to draw each full parameter to keep its own slice, O(model) work per rank.

Here the element at global flat index i of parameter `name` is

    u = hash(seed, name, i)          32 random bits, integer arithmetic only
    z = +-quantile(q(u))             the top bit picks the sign, the other 31 a probability
                                     q in (0, 1/2) (in (Phi(-3), 1/2) when truncated at 3 std)

so any slice of a parameter can be drawn on its own (a sharded rank draws only its shard) and
every step is exact, hence bit-identical, on any device:

- `hash` runs on int64 tensors holding 32-bit values. Each product is a 32-bit value times a
  constant of magnitude below 2^31, so it stays below 2^63: int64 never overflows (signed
  overflow is undefined behaviour in C++, and CPU and GPU kernels could resolve it differently).
- `quantile` is read from a table by linear interpolation. The table is built on the host with
  float64 + - * /, sqrt and frexp alone (no exp, log or erfinv, whose last bits differ between
  glibc, Sleef and CUDA's math library), then copied to the device. q takes two float64 ops;
  the table row and the interpolation weight are integer fields of q's IEEE-754 bits (exponent
  and mantissa); then one multiply, one add, the sign, the std and the casts. Each of these is
  correctly rounded by IEEE-754 on every device, and each runs as its own eager kernel, so
  nothing is contracted into an FMA.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Sequence

import torch

Draw = Callable[[tuple[slice, ...]], torch.Tensor]
"""Values of one parameter inside a region (one slice per dimension, global indices), float32."""

_M32 = 0xFFFFFFFF
# lowbias32 (C. Wellons, "hash-prospector"): xorshift-multiply rounds with near-ideal avalanche.
# 0x846CA68B exceeds 2^31; multiplying by it minus 2^32 gives the same product mod 2^32.
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B - (1 << 32))
# Quantile table: one row per binary octave of q from [2^-33, 2^-32) to [1/4, 1/2), 1024 steps
# each (2^10: the top 10 bits of q's mantissa). Linear interpolation is then within 6e-8 of the
# exact quantile: one float32 step at |z| = 0.5, less than one beyond.
_OCTAVES, _STEP_BITS = 32, 10
_MANTISSA_BITS = 52  # float64
_FIRST_KEY = (1023 - _OCTAVES - 1) << _STEP_BITS  # exponent field and step of q = 2^-33
_TRUNCATE = 3.0  # truncated draws stay within 3 std, like nn.init.trunc_normal_(a=-3s, b=3s)
_INV_SQRT_2PI = 0.3989422804014327
# Elements per chunk: bounds the int64 temporaries (8 B each, ~10 alive). On CPU each op also
# costs a thread-pool barrier, which busy cores make expensive: not too many, not too small.
_CHUNK = {"cpu": 1 << 19}
_CHUNK_DEFAULT = 1 << 22


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, in place, on int64 values in [0, 2^32)."""
    x ^= x >> 16
    x.mul_(_MULTIPLIERS[0]).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(_MULTIPLIERS[1]).bitwise_and_(_M32)  # negative before the mask: fine, and exact
    x ^= x >> 16
    return x


def _keys(seed: int, name: str) -> tuple[int, int]:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def random_bits(seed: int, name: str, index: torch.Tensor, wide: bool = True) -> torch.Tensor:
    """32 random bits (int64 in [0, 2^32)) for each global flat index (int64, >= 0).
    `wide=False` promises every index is below 2^32 (it skips folding in the high bits, which
    are then 0: the same values, fewer operations)."""
    k0, k1 = _keys(seed, name)
    # Two keyed rounds: the first spreads the low 32 bits of the index, the second folds in its
    # high bits and a second key, so parameters are not shifted copies of each other.
    x = _mix32((index & _M32).add_(k0).bitwise_and_(_M32) if wide else (index + k0) & _M32)
    x ^= (index >> 32) ^ k1 if wide else k1
    return _mix32(x)


def _exp(h: torch.Tensor) -> torch.Tensor:
    """e^h for 0 <= h <= 21: (e^(h/4))^2^2, e^(h/4) by 40 terms of its Taylor series."""
    x = h / 4  # exact: a power of two
    term, total = torch.ones_like(x), torch.ones_like(x)
    for n in range(1, 40):
        term = term * x / n
        total = total + term
    for _ in range(2):
        total = total * total
    return total


def _log(q: torch.Tensor) -> torch.Tensor:
    """ln(q) for q > 0: q = m 2^e (frexp, exact), ln m = 2 atanh((m - 1) / (m + 1)) by series."""
    m, e = torch.frexp(q)
    s = (m - 1) / (m + 1)  # |s| <= 1/3: 20 terms reach 1e-19
    term, total = s.clone(), s.clone()
    for k in range(1, 20):
        term = term * s * s
        total = total + term / (2 * k + 1)
    return 2 * total + e.double() * 0.6931471805599453


def _normal_cdf_pdf(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi(z) and phi(z) in float64 for -6.5 <= z <= 2, with + - * / only."""
    pdf = _INV_SQRT_2PI / _exp(z * z / 2)
    # |z| <= 2: Phi(z) = 1/2 + phi(z) * sum_n z^(2n+1) / (1*3*...*(2n+1))  (Marsaglia 2004).
    term, total = z.clone(), z.clone()
    for n in range(1, 45):
        term = term * (z * z) / (2 * n + 1)
        total = total + term
    near = 0.5 + pdf * total
    # z < -2: Phi(z) = phi(z) * R(-z), Laplace's continued fraction for the Mills ratio
    # R(x) = 1 / (x + 1 / (x + 2 / (x + 3 / ...))): depth 100 converges to 1e-16 for x >= 2,
    # where the series above would lose digits to cancellation.
    x = -z
    t = x.clone()
    for k in range(100, 0, -1):
        t = x + k / t
    return torch.where(z < -2, pdf / t, near), pdf


@functools.cache
def _host_tables() -> tuple[torch.Tensor, torch.Tensor, float]:
    # ~2,000 small elementwise ops: one thread avoids a thread-pool barrier per op, which on a
    # busy machine costs more than the op (measured 7-28 s on 2 shared cores, 0.1 s with one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build_tables()
    finally:
        torch.set_num_threads(threads)


def _build_tables() -> tuple[torch.Tensor, torch.Tensor, float]:
    """Quantiles z(q) < 0 at q = 2^(E - 1023) * (1 + step / 1024), keyed by (E << 10) + step
    (E: q's exponent field, step: the top 10 bits of its mantissa) minus _FIRST_KEY, up to
    q = 1/2; their differences; and Phi(-3)."""
    keys = torch.arange(_OCTAVES << _STEP_BITS) + _FIRST_KEY
    exponent = (keys >> _STEP_BITS) - 1023
    mantissa = (keys & ((1 << _STEP_BITS) - 1)).double() / (1 << _STEP_BITS)
    powers = torch.tensor([2.0**e for e in range(-_OCTAVES - 1, 0)], dtype=torch.float64)
    q = torch.cat([powers[exponent + _OCTAVES + 1] * (1 + mantissa), torch.tensor([0.5])])
    # Start within 4.5e-4 (Abramowitz & Stegun 26.2.23), then Newton: a fixed number of steps
    # of fixed operations gives the same table on every machine.
    t = (-2 * _log(q)).sqrt()  # sqrt is correctly rounded (IEEE-754), like + - * /
    num = 2.515517 + t * (0.802853 + t * 0.010328)
    den = 1 + t * (1.432788 + t * (0.189269 + t * 0.001308))
    z = num / den - t
    for _ in range(5):  # quadratic convergence: 4.5e-4, 1e-7, 1e-14, then rounding
        cdf, pdf = _normal_cdf_pdf(z)
        z = z - (cdf - q) / pdf
    lower_tail = float(_normal_cdf_pdf(torch.tensor([-_TRUNCATE], dtype=torch.float64))[0])
    return z[:-1], z[1:] - z[:-1], lower_tail


@functools.cache
def _device_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
    table, slope, lower_tail = _host_tables()
    return table.to(device), slope.to(device), lower_tail


def normal_quantile(bits: torch.Tensor, truncated: bool) -> torch.Tensor:
    """Standard normal values (float64) from 32-bit integers, truncated to +-3 if asked."""
    table, slope, lower_tail = _device_tables(bits.device)
    # q in (0, 1/2) (truncated: (Phi(-3), 1/2)) from the low 31 bits: its cell's midpoint.
    a, b = (lower_tail, (0.5 - lower_tail) / 2**31) if truncated else (0.0, 2.0**-32)
    q = ((bits & 0x7FFFFFFF).double() + 0.5).mul_(b).add_(a)
    # q's bits: exponent and top 10 mantissa bits are the table key, the other 42 mantissa
    # bits the position between this entry and the next (exactly linear in q inside an octave).
    q_bits = q.view(torch.int64)
    key = (q_bits >> (_MANTISSA_BITS - _STEP_BITS)).sub_(_FIRST_KEY)
    weight = (q_bits & ((1 << (_MANTISSA_BITS - _STEP_BITS)) - 1)).double()
    weight.mul_(2.0 ** -(_MANTISSA_BITS - _STEP_BITS))
    z = table[key].add_(slope[key].mul_(weight))
    return torch.where(bits >= 1 << 31, z.neg(), z)  # the top bit: which half


def _flat_indices(
    shape: Sequence[int], region: tuple[slice, ...]
) -> tuple[range, torch.Tensor, int]:
    """The region's rows along dimension 0, the flat offsets of the region's elements inside
    one row, and the flat stride of dimension 0 (a 0-d parameter is one row of one element)."""
    if not shape:
        return range(1), torch.zeros(1, dtype=torch.int64), 1
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    inner = torch.zeros((), dtype=torch.int64)
    for d in range(1, len(shape)):
        idx = torch.arange(*region[d].indices(shape[d]), dtype=torch.int64) * strides[d]
        inner = inner.unsqueeze(-1) + idx
    return range(*region[0].indices(shape[0])), inner.flatten(), strides[0]


def region_shape(shape: Sequence[int], region: tuple[slice, ...]) -> list[int]:
    return [len(range(*r.indices(n))) for r, n in zip(region, shape, strict=True)]


def ones(shape: Sequence[int], region: tuple[slice, ...], device: torch.device) -> torch.Tensor:
    """The `region` of a parameter of ones (RMSNorm gains), float32."""
    return torch.ones(region_shape(shape, region), device=device)


def normal(
    seed: int,
    name: str,
    shape: Sequence[int],
    region: tuple[slice, ...],
    std: float,
    truncated: bool,
    device: torch.device,
) -> torch.Tensor:
    """float32 values of parameter `name` (full shape `shape`) inside `region`: normal with
    mean 0 and `std`, truncated at 3 std if asked, as a pure function of the seed, the name and
    each element's global index."""
    rows, inner, row_stride = _flat_indices(shape, region)
    wide = math.prod(shape) > 1 << 32
    out = torch.empty(region_shape(shape, region), dtype=torch.float32, device=device)
    if out.numel() == 0:  # an empty shard (more ranks than rows)
        return out
    flat = out.view(len(rows), -1)
    inner = inner.to(device)
    per_chunk = max(1, _CHUNK.get(device.type, _CHUNK_DEFAULT) // max(1, inner.numel()))
    for i in range(0, len(rows), per_chunk):
        chunk = rows[i : i + per_chunk]
        first = torch.arange(chunk.start, chunk.stop, chunk.step, dtype=torch.int64, device=device)
        index = (first * row_stride).unsqueeze(-1) + inner
        z = normal_quantile(random_bits(seed, name, index, wide), truncated)
        flat[i : i + len(chunk)] = (z * std).float()
    return out
