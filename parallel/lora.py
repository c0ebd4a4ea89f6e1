"""LoRA: trainable low-rank adapters on chosen Linear layers, every other parameter frozen
(Hu et al. 2021; the layout PEFT and torchtune use).

    apply_lora(model, cfg)           # after tensor parallel, before AC, compile and FSDP
    init_lora(model, seed, assign)   # after the model's own init, or its Hugging Face weights
    merge_lora(model)                # export: W + alpha/rank * B @ A, the adapters gone

A targeted layer keeps its weight, frozen, under its own name (`layers.0.attention.wq.weight`:
checkpoints, `init_from_hf` and export keep their keys), and gains two children of its own,
`lora_a` (rank x in_features) and `lora_b` (out_features x rank). Its output becomes

    y = base(x) + (alpha / rank) * B A dropout(x)

B starts at zero, so until the first update the model is exactly the base model. A is drawn
from the seed, its name and each element's index (model/random_init.py), like every weight of
the model, so the adapters are the same on any mesh: normal with std (3 in_features)^-1/2, the
variance of PEFT's default (kaiming-uniform with a = sqrt(5)).

The layer keeps its class and forward; `LoRALayer` is mixed into it (as `fully_shard` mixes
FSDPModule into a module's class), so a torchao Float8Linear stays one and its base matmul stays
float8 while the adapters run in the compute dtype.

Tensor parallel: a split base layer has DTensor weights and sees DTensor inputs. The adapters
take placements that keep the layer's output placement without extra communication: for a
column-split base (output features split: q, k, v, w1, w3) A is replicated and B split like
the base; for a row-split base (input features split: wo, w2) A is split like the base, so
A x is a partial sum, and B is replicated: B A x stays partial and joins the base's partial
output in its one reduce-scatter.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from configs import ConfigError
from model import canonical_name, random_init


def _attention_projections() -> list[str]:
    return ["*.attention.wq", "*.attention.wk", "*.attention.wv", "*.attention.wo"]


@dataclass
class LoRAConfig:
    enabled: bool = False
    """Train LoRA adapters on the lora.targets Linear layers; every other parameter is frozen."""
    rank: int = 16
    """Rank r of each adapter: A is r x in_features, B is out_features x r."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1). Above 0 the masks are drawn per rank, so the
    losses then depend on the mesh."""
    targets: list[str] = field(default_factory=_attention_projections)
    """Glob patterns over Linear module names ('*.attention.wq', 'layers.1[0-5].*'); default:
    the attention projections."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ConfigError("lora.targets is empty: name the Linear layers to adapt")


class LoRALayer:
    """Mixed into a Linear layer's class by `apply_lora`: the layer's own forward, plus the
    scaled low-rank path."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_dropout: nn.Module
    lora_scale: float
    lora_off: bool = False
    """The base layer alone (`adapters_off`): DPO's reference without a second copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = super().forward(x)  # type: ignore[misc]  (the Linear class mixed with)
        if self.lora_off:
            return base
        return base + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.lora_scale


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """`model` as its base model (every adapter skipped) inside the block."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.lora_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_off = False


@functools.cache
def _lora_class(base: type[nn.Module]) -> type[nn.Module]:
    return type(f"LoRA{base.__name__}", (LoRALayer, base), {})


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALayer]]:
    """(canonical name, layer) of every layer with adapters."""
    return [(canonical_name(n), m) for n, m in model.named_modules() if isinstance(m, LoRALayer)]


def adapter_names(model: nn.Module) -> set[str]:
    """Canonical names of the adapters' parameters (not in any Hugging Face base model)."""
    return {f"{name}.{ab}.weight" for name, _ in lora_layers(model) for ab in ("lora_a", "lora_b")}


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze every parameter of `model` and add adapters to the Linear layers whose names
    match `cfg.targets`, in place; returns those names. ConfigError for a pattern that matches
    no Linear layer, or a target whose weight is shared with another module (a tied output
    projection: merging would change the embedding too)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if unmatched := [p for p in cfg.targets if not any(fnmatchcase(n, p) for n in linears)]:
        example = next(iter(linears), "none")
        raise ConfigError(
            f"lora.targets: {', '.join(map(repr, unmatched))} matches no Linear layer of this "
            f"model (globs over module names such as {example!r})"
        )
    chosen = [n for n in linears if any(fnmatchcase(n, p) for p in cfg.targets)]
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    if tied := [n for n in chosen if uses[id(linears[n].weight)] > 1]:
        raise ConfigError(
            f"lora.targets: {', '.join(tied)} shares its weight with another module (tied "
            "embeddings); leave it out of lora.targets"
        )
    for param in model.parameters():
        param.requires_grad_(False)
    for name in chosen:
        _add_adapters(linears[name], cfg)
    return chosen


def _add_adapters(layer: nn.Linear, cfg: LoRAConfig) -> None:
    weight = layer.weight
    kwargs = {"bias": False, "device": weight.device, "dtype": weight.dtype}
    lora_a = nn.Linear(layer.in_features, cfg.rank, **kwargs)
    lora_b = nn.Linear(cfg.rank, layer.out_features, **kwargs)
    if isinstance(weight, DTensor):  # split by tensor parallel: see the module docstring
        for adapter, placements in zip((lora_a, lora_b), _placements(weight), strict=True):
            # src_data_rank=None: no broadcast (the model is on meta; init_lora fills it)
            local = distribute_tensor(adapter.weight, weight.device_mesh, placements,
                                      src_data_rank=None)  # fmt: skip
            adapter.weight = nn.Parameter(local)
    layer.__class__ = _lora_class(type(layer))
    layer.lora_a, layer.lora_b = lora_a, lora_b
    layer.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
    layer.lora_scale = cfg.alpha / cfg.rank


def _placements(weight: DTensor) -> tuple[list[Placement], list[Placement]]:
    """Placements of A and B on the base weight's (tensor-parallel) mesh."""
    if weight.device_mesh.ndim != 1:
        raise ValueError(f"LoRA expects a 1-D tensor-parallel mesh, got {weight.device_mesh}")
    (placement,) = weight.placements
    if placement == Shard(0):  # output features split: A x whole, B A x split like W x
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):  # input features split: A x partial, B A x partial like W x
        return [Shard(1)], [Replicate()]
    if placement == Replicate():
        return [Replicate()], [Replicate()]
    raise ValueError(f"LoRA cannot adapt a weight placed {weight.placements}")


def _zeros(shape: tuple[int, ...], region: tuple[slice, ...], device: torch.device) -> torch.Tensor:
    return torch.zeros(random_init.region_shape(shape, region), device=device)


@torch.no_grad()
def init_lora(
    model: nn.Module, seed: int, assign: Callable[[torch.Tensor, random_init.Draw], None]
) -> None:
    """A from the seed, B = 0, for every adapter, through `assign` (as `init_weights`: the
    sharded trainer keeps only this rank's shard). Call after the base weights are in place:
    the model's own `init_weights` draws every parameter, the adapters too, by its own rule."""
    for name, layer in lora_layers(model):
        a, b = layer.lora_a.weight, layer.lora_b.weight
        std = (3 * a.shape[1]) ** -0.5
        draw_a = partial(random_init.normal, seed, f"{name}.lora_a.weight", tuple(a.shape),
                         std=std, truncated=False, device=a.device)  # fmt: skip
        assign(a, draw_a)
        assign(b, partial(_zeros, tuple(b.shape), device=b.device))


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold each adapter into its base weight (W + alpha/rank * B @ A, in float32) and turn the
    layer back into a plain one of its original class: a model with the base model's names and
    shapes, for export. Plain (unsharded) models only."""
    for _, layer in lora_layers(model):
        delta = layer.lora_b.weight.float() @ layer.lora_a.weight.float() * layer.lora_scale
        layer.weight.copy_(layer.weight.float() + delta)
        del layer.lora_a, layer.lora_b, layer.lora_dropout, layer.lora_scale
        layer.__class__ = type(layer).__bases__[1]  # (LoRALayer, the original class)
