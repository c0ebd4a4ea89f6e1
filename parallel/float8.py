"""FP8 training with torchao's float8 Linear, wired into FSDP2.

Order matters: `apply_float8` swaps nn.Linear for torchao's Float8Linear *before* `apply_fsdp`, so
FSDP shards the float8-aware weight wrappers. With tensorwise scaling those wrappers cast to
float8 before the all-gather (`enable_fsdp_float8_all_gather`), halving all-gather bytes against
bf16, and `precompute_float8_scales` computes every layer's weight scale in one all-reduce after
each optimizer step instead of one small all-reduce per layer in the next forward.

The master weights stay float32 with the same names, so checkpoints move freely between fp8 and
bf16 runs. torchao is imported only when fp8 is on: it is an optional dependency and its import
logs warnings about CUDA kernels that a CPU or bf16 run does not need.
"""

from __future__ import annotations

import importlib.util
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from configs import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterator


@dataclass
class Float8Config:
    enabled: bool = False
    """Train the Linear layers in FP8 (torchao float8)."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """Scaling: one scale per tensor (fastest; enables float8 all-gather) or one per row
    (more accurate for outliers; all-gathers in bf16)."""
    skip: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers kept in high precision, by name (a layer matches if its name or any
    dotted suffix equals an entry). The output projection is sensitive to FP8 error."""
    emulate: bool = False
    """Run FP8 numerics on hardware without FP8 matmuls (CUDA compute capability < 8.9)."""


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
    parts = fqn.split(".")
    return any(".".join(parts[i:]) in skip for i in range(len(parts)))


def unmatched_skips(model: nn.Module, skip: list[str]) -> list[str]:
    """Entries of fp8.skip that name no Linear layer of `model` (a typo would convert the layer
    it meant to keep in high precision, silently)."""
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [name for name in skip if not any(_skipped(fqn, [name]) for fqn in linears)]


def apply_float8(model: nn.Module, cfg: Float8Config) -> list[str]:
    """Convert eligible nn.Linear layers in place; returns the names of converted layers.

    Layers whose in/out features are not multiples of 16 stay in high precision: FP8 matmul
    kernels need 16-aligned shapes.
    """
    with _quiet_torchao_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if cfg.recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name("rowwise")
    config = replace(config, emulate=cfg.emulate)
    converted: list[str] = []

    def eligible(module: nn.Module, fqn: str) -> bool:
        ok = (
            isinstance(module, nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and not _skipped(fqn, cfg.skip)
        )
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    return converted


def precompute_float8_scales(model: nn.Module, cfg: Float8Config) -> None:
    """After optimizer.step(): all weight scales in one all-reduce (tensorwise recipe only)."""
    if cfg.enabled and cfg.recipe == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
