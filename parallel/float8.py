"""FP8 training with torchao's float8 Linear, wired into FSDP2.

Order matters: `apply_float8` swaps nn.Linear for torchao's Float8Linear *before* `apply_fsdp`, so
FSDP shards the float8-aware weight wrappers. Where weights are sharded (dp_shard x cp > 1) and
scaling is tensorwise, those wrappers cast to float8 before the all-gather
(`enable_fsdp_float8_all_gather`), halving all-gather bytes against bf16, and
`precompute_float8_scales` computes every layer's weight scale in one all-reduce after each
optimizer step instead of one small all-reduce per layer in the next forward. With
dp_shard x cp = 1 there is nothing to gather: both would only add eager casts of every full
weight (measured on one H100: fp8 at 1.03x bf16 with them, 1.11x without), so both are off, as
in torchtitan.

Which layers: FP8 pays only on GEMMs big enough for the faster matmul to outweigh casting the
inputs and weights; `float8_policy` decides per layer, with reasons (see `fp8.filter`).

The master weights stay float32 with the same names, so checkpoints move freely between fp8 and
bf16 runs. torchao is imported only when fp8 is on: it is an optional dependency and its import
logs warnings about CUDA kernels that a CPU or bf16 run does not need.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from configs import ConfigError

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator

logger = logging.getLogger(__name__)


@dataclass
class Float8Config:
    enabled: bool = False
    """Train the Linear layers in FP8 (torchao float8)."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling: one scale per tensor (fastest; all-gathers sharded weights in float8) or one
    per row (more accurate for outliers; all-gathers in bf16)."""
    skip: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers kept in high precision, by name: a layer matches if its name or a module
    it sits in (`output` for `output.proj`), or a dotted suffix of either, equals an entry.
    The output projection is sensitive to FP8 error."""
    filter: Literal["auto", "none"] = "auto"
    """'auto': convert only Linear layers whose GEMMs are large enough for FP8 to be faster
    (torchao's thresholds on in_features K and out_features N, from H100 benchmarks);
    'none': every 16-aligned Linear not in fp8.skip (small models, tests)."""
    emulate: bool = False
    """Run FP8 numerics on hardware without FP8 matmuls (CUDA compute capability < 8.9)."""


@dataclass(frozen=True)
class Float8Decision:
    """Whether one Linear layer is trained in FP8, and why."""

    fqn: str
    in_features: int
    out_features: int
    converted: bool
    reason: str


def check_float8(cfg: Float8Config, device_type: str) -> None:
    """Fail before training, with one line, when FP8 cannot run here."""
    if not cfg.enabled:
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            "fp8.enabled needs torchao, which is not installed: pip install 'fsdp2-trainer[fp8]'"
        )
    if device_type == "cuda" and not cfg.emulate:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"fp8.enabled: this GPU ({torch.cuda.get_device_name()}, compute capability "
                f"{major}.{minor}) has no FP8 matmuls (needs 8.9+: Ada, Hopper, Blackwell); "
                "set fp8.emulate=true to run FP8 numerics slowly for testing"
            )


@contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    # torchao logs a warning for each CUDA kernel library it cannot load (all of them on CPU) and
    # torch warns about a deprecated pytree registration it makes: noise in the user's log.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def _skipped(fqn: str, skip: list[str]) -> bool:
    # Every run of whole name segments: the layer's name, its modules', their dotted suffixes
    # (an output module that holds its projection and an op after it: model/__init__.py).
    parts = fqn.split(".")
    runs = (".".join(parts[i:j]) for j in range(1, len(parts) + 1) for i in range(j))
    return any(run in skip for run in runs)


def unmatched_skips(model: nn.Module, skip: list[str]) -> list[str]:
    """Entries of fp8.skip that name no Linear layer of `model` (a typo would convert the layer
    it meant to keep in high precision, silently)."""
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [name for name in skip if not any(_skipped(fqn, [name]) for fqn in linears)]


def _too_small(recipe: str, k: int, n: int) -> str | None:
    """Why FP8 would be slower than bf16 for a Linear with in_features k and out_features n
    (its forward GEMM is tokens x k times k x n), or None. The thresholds are torchao's
    (`torchao.float8._auto_filter_for_recipe`, torchao 0.18; torchtitan's
    `filter_fqns=["auto_filter_small_kn"]`), drawn from its H100 forward+backward benchmarks
    with casting included (torchao/float8/README.md, "Performance")."""
    if recipe == "tensorwise":
        return "K <= 4096 and N <= 1024" if k <= 4096 and n <= 1024 else None
    if n <= 2048:
        return "N <= 2048"
    if k <= 1024:
        return "K <= 1024"
    return "N <= 4096 and K <= 2048" if n <= 4096 and k <= 2048 else None


def _kept_because(
    fqn: str, linear: nn.Linear, cfg: Float8Config, tied: bool, candidate: bool
) -> str | None:
    k, n = linear.in_features, linear.out_features
    if not candidate:
        return "not an FP8 candidate of this model family (its fp8_linears)"
    if _skipped(fqn, cfg.skip):
        return "in fp8.skip"
    if tied:
        return "weight tied to another module (the embedding would be cast too)"
    if k % 16 or n % 16:
        return "in/out features not multiples of 16 (FP8 matmuls need them)"
    if cfg.filter == "auto" and (small := _too_small(cfg.recipe, k, n)):
        return f"GEMM too small for FP8 to pay ({cfg.recipe}: {small})"
    return None


def float8_policy(
    model: nn.Module, cfg: Float8Config, candidates: Collection[str] | None = None
) -> list[Float8Decision]:
    """For every nn.Linear of `model`: convert to FP8 or keep in high precision, and why.
    `candidates`: the family's `fp8_linears(model)` (None: every Linear). Pure (no torchao,
    works on a meta model), so the planner and tests can ask it too."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    converted = "GEMM large enough for FP8 to pay" if cfg.filter == "auto" else "fp8.filter=none"
    decisions = []
    for fqn, m in model.named_modules():
        if isinstance(m, nn.Linear):
            candidate = candidates is None or fqn in candidates
            kept = _kept_because(fqn, m, cfg, uses[id(m.weight)] > 1, candidate)
            decisions.append(
                Float8Decision(fqn, m.in_features, m.out_features, kept is None, kept or converted)
            )
    return decisions


def describe_float8(decisions: list[Float8Decision]) -> list[str]:
    """Log lines: one per group of layers that differ only in their block index."""
    groups: dict[tuple[str, int, int, bool, str], int] = {}
    for d in decisions:
        pattern = re.sub(r"\.\d+\.", ".*.", d.fqn)
        key = (pattern, d.in_features, d.out_features, d.converted, d.reason)
        groups[key] = groups.get(key, 0) + 1
    converted = sum(d.converted for d in decisions)
    lines = [f"fp8: {converted} of {len(decisions)} Linear layers converted"]
    if not converted and any("too small" in d.reason for d in decisions):
        lines[0] += " (fp8.filter=none would convert the small ones, slower than bf16)"
    for (pattern, k, n, conv, reason), count in groups.items():
        verdict = "fp8" if conv else "kept"
        lines.append(f"fp8:   {verdict} {pattern} x{count} (K={k}, N={n}): {reason}")
    return lines


def apply_float8(
    model: nn.Module,
    cfg: Float8Config,
    *,
    candidates: Collection[str] | None = None,
    weights_sharded: bool = True,
    in_graph: bool = False,
) -> list[Float8Decision]:
    """Convert the layers `float8_policy` picks among `candidates` (the family's
    `fp8_linears`), in place; log and return its decisions.

    `weights_sharded` (FSDP's shard group, dp_shard x cp, has more than one rank): all-gather
    weights in float8 (tensorwise); with False there is no float8 all-gather and no scale
    precompute. `in_graph` (compile.fsdp='graph'): the compiled graph gathers them in float8
    itself (parallel/graph_fsdp.py), so FSDP2's extension and its precompute stay off.
    """
    with _quiet_torchao_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=weights_sharded and not in_graph)
    else:  # rowwise all-gathers in bf16 whatever the mesh
        config = Float8LinearConfig.from_recipe_name("rowwise")
    config = replace(config, emulate=cfg.emulate)
    decisions = float8_policy(model, cfg, candidates)
    chosen = {d.fqn for d in decisions if d.converted}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    for line in describe_float8(decisions):
        logger.info(line)
    if cfg.recipe == "tensorwise" and chosen:
        gather = "float8" if weights_sharded else "none (dp_shard x cp = 1: nothing to gather)"
        gather += " (inside the compiled graph)" if in_graph and weights_sharded else ""
        logger.info("fp8: all-gather of converted weights: %s", gather)
    return decisions


def precompute_float8_scales(model: nn.Module, cfg: Float8Config) -> None:
    """After optimizer.step(): all float8 weight scales in one all-reduce, where weights are
    all-gathered in float8 (tensorwise, sharded); otherwise there is nothing to precompute."""
    if not (cfg.enabled and cfg.recipe == "tensorwise"):
        return
    if not any(
        getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
        for m in model.modules()
    ):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
