"""Pipeline parallel's cut: the model split into stages of contiguous blocks, without the family
knowing (parallel/pp.py runs them).

Each stage is a copy of the model on meta in which the blocks of other stages are
`SkippedBlock`s (the hidden state passes through, the block's other outputs are zeros) and the
modules that run before the first block (the embeddings) or after the last (final norm, output
projection) are `PassThrough`s outside the first (last) stage. Which modules those are is read
once from a forward on meta (`probe_layout`), through the contract alone: `fsdp_units` names the
blocks in order. Block names keep their index (checkpoint keys are the same as without pp), and
zeros for a skipped block's extra outputs make a sum over blocks (an MoE's aux loss and expert
load) add up across stages: each stage's step terms are its part, and the all-reduce over every
rank adds them.

Each stage is then parallelized by parallel/build.py like the whole model would be (tp, cp,
float8, LoRA, AC, compile, FSDP over its own data-parallel ranks), and `merged_view` gathers a
rank's stages into one module with the unsplit model's parameter names for the optimizer, the
gradient norm and the checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from configs import ConfigError
from parallel.pp_config import PipelineConfig, stage_ranks

if TYPE_CHECKING:
    from collections.abc import Callable

    from model import ModelFamily, StepTerms


class PassThrough(nn.Module):
    """Stands in for a module another stage holds (the embeddings outside the first stage, the
    final norm and output projection outside the last): returns its first input."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x


class SkippedBlock(nn.Module):
    """A block another stage computes: the hidden state passes through, and each of the block's
    other outputs (an MoE layer's aux loss and expert load) is zeros of its shape, so that what
    the model sums over its blocks is this stage's part of the whole model's sum."""

    def __init__(self, extras: tuple[tuple[tuple[int, ...], torch.dtype], ...] | None) -> None:
        super().__init__()
        self.extras = extras

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.extras is None:
            return x
        return (x, *(x.new_zeros(shape, dtype=dtype) for shape, dtype in self.extras))


@dataclass
class Layout:
    """Where a model's parts sit, by module name: its blocks in forward order (with the shapes
    of their outputs beyond the hidden state), and the modules holding parameters outside
    the blocks that run before the first block (`head`) or after the last (`tail`)."""

    blocks: list[str]
    extras: list[tuple[tuple[tuple[int, ...], torch.dtype], ...] | None]
    head: list[str]
    tail: list[str]


def _outside_modules(model: nn.Module, blocks: list[str]) -> list[str]:
    """The largest submodules that hold parameters and neither are, contain nor sit inside a
    block: the embeddings, the final norm, the output projection."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f) for f in (f"{n}." for n in found)):
            continue
        inside = any(name == b or name.startswith(b + ".") for b in blocks)
        contains = any(b.startswith(name + ".") for b in blocks)
        if not inside and not contains and any(True for _ in module.parameters()):
            found.append(name)
    return found


def probe_layout(model: nn.Module, family: ModelFamily, seq_len: int = 8) -> Layout:
    """Run the model on meta once, watching its blocks and the modules outside them, and read
    off the `Layout`; ConfigError for a model that pipeline parallel cannot split (a module
    between blocks, a weight shared by the first and last stage, a block whose first output
    is not the hidden state)."""
    names = {id(m): n for n, m in model.named_modules()}
    blocks = [names[id(b)] for b in family.fsdp_units(model)]
    outside = _outside_modules(model, blocks)
    calls: dict[str, list[int]] = {}
    outputs: dict[str, Any] = {}
    handles = []

    def pre(name: str) -> Callable[..., None]:
        return lambda module, args: calls.setdefault(name, []).append(len(calls))

    for name in blocks + outside:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(pre(name)))
    for name in blocks:
        hook = (lambda n: lambda m, a, out: outputs.__setitem__(n, out))(name)
        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.device("meta"), torch.no_grad():
            model.init_buffers(seq_len)
            model(torch.zeros(1, seq_len, dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()
    order = [calls[b][0] for b in blocks if b in calls]
    if len(order) != len(blocks) or order != sorted(order):
        raise ConfigError(
            "parallel.pp: the model's forward does not run its blocks (fsdp_units) once "
            "each, in order: it cannot be cut into stages"
        )
    first, last = order[0], order[-1]
    head = [n for n in outside if n not in calls or calls[n][0] < first]
    tail = [n for n in outside if n in calls and calls[n][0] > last]
    if between := [n for n in outside if n not in head + tail]:
        raise ConfigError(
            f"parallel.pp: {', '.join(between)} runs between blocks; pipeline stages are "
            "ranges of blocks with nothing in between"
        )
    head_params = {id(p) for n in head for p in model.get_submodule(n).parameters()}
    tail_params = {n: {id(p) for p in model.get_submodule(n).parameters()} for n in tail}
    if shared := [n for n in tail if head_params & tail_params[n]]:
        raise ConfigError(
            f"parallel.pp: {', '.join(shared)} shares a weight with the embeddings (tied "
            "embeddings), but the first and the last stage would each train a copy: untie "
            "them (model.tie_embeddings=false) or use parallel.pp=1"
        )
    return Layout(blocks, [_extras(outputs[b], b) for b in blocks], head, tail)


def _extras(out: Any, name: str) -> tuple[tuple[tuple[int, ...], torch.dtype], ...] | None:
    if isinstance(out, torch.Tensor):
        return None
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return tuple((tuple(t.shape), t.dtype) for t in out[1:])
    raise ConfigError(
        f"parallel.pp: block {name} returns {type(out).__name__}, not a tensor or a tuple of "
        "tensors whose first is the hidden state"
    )


@dataclass
class Stage:
    """One pipeline stage this rank holds: its index, its copy of the model, and the family
    as the stage sees it (its own blocks, its part of the TP plan)."""

    index: int
    model: nn.Module
    family: Any
    terms: StepTerms | None = None
    """Its step terms (set by parallel/build.py once the stage is built)."""
    stats: list[torch.Tensor] = field(default_factory=list)


class StageFamily:
    """The family, as one stage sees it: `fsdp_units` lists the stage's own blocks only, and the
    TP plan leaves out the modules another stage holds. Everything else is the family's."""

    def __init__(self, family: ModelFamily, model: nn.Module) -> None:
        self._family, self._model = family, model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._family, name)

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        units = self._family.fsdp_units(model)
        return [u for u in units if not isinstance(u, SkippedBlock)]

    def own(self, patterns: list[str], kind: str) -> list[str]:
        """The glob `patterns` (train.freeze's over parameter names, kind "params"; lora.targets'
        over Linear layers, kind "linears") that match something in this stage: check_config
        checked them against the whole model, and a stage holds only part of it."""
        from fnmatch import fnmatchcase

        from model import canonical_name

        if kind == "params":
            names = [canonical_name(n) for n, _ in self._model.named_parameters()]
        else:
            names = [n for n, m in self._model.named_modules() if isinstance(m, nn.Linear)]
        return [p for p in patterns if any(fnmatchcase(n, p) for n in names)]

    @property
    def TP_PLAN(self) -> dict[str, Any] | None:  # noqa: N802 - the family's attribute
        from parallel.tp import _matches

        plan = self._family.TP_PLAN
        if plan is None:
            return None
        real = [n for n, m in self._model.named_modules()
                if not isinstance(m, PassThrough | SkippedBlock)]  # fmt: skip
        return {p: kind for p, kind in plan.items() if any(_matches(n, p) for n in real)}


def split_model(
    model: nn.Module, family: ModelFamily, cfg: PipelineConfig, pp: int, pp_rank: int,
    sizes: list[int],
) -> list[Stage]:  # fmt: skip
    """This rank's stages of `model` (on meta), each a copy with the other stages' blocks
    skipped and the embeddings (the output side) passed through outside the first (last).
    `sizes`: blocks per stage (launch.check's `stage_sizes`: the setting, or balanced)."""
    layout = probe_layout(model, family)
    owners = stage_ranks(pp, len(sizes) // pp, cfg.schedule)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    stages = []
    for s in [s for s, r in enumerate(owners) if r == pp_rank]:
        part = copy.deepcopy(model)
        for i, name in enumerate(layout.blocks):
            if not starts[s] <= i < starts[s] + sizes[s]:
                _replace(part, name, SkippedBlock(layout.extras[i]))
        for name in layout.head if s > 0 else []:
            _replace(part, name, PassThrough())
        for name in layout.tail if s < len(sizes) - 1 else []:
            _replace(part, name, PassThrough())
        stages.append(Stage(s, part, StageFamily(family, part)))
    return stages


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent), attr, new)


def merged_view(model: nn.Module, stages: list[Stage]) -> nn.Module:
    """`model` (the unsplit one, on meta) holding this rank's stages' modules, as they were
    parallelized, where they belong, and stand-ins elsewhere: one module with the unsplit
    model's parameter names for the optimizer, the gradient norm and DCP. Never run: each
    stage runs its own copy, whose modules these are."""
    family = stages[0].family._family
    layout_blocks = [n for n, m in model.named_modules() if m in family.fsdp_units(model)]
    outside = _outside_modules(model, layout_blocks)
    for name in layout_blocks + outside:
        owner = [s for s in stages if not isinstance(s.model.get_submodule(name),
                                                     PassThrough | SkippedBlock)]  # fmt: skip
        if owner:
            _replace(model, name, owner[0].model.get_submodule(name))
        else:
            _replace(model, name, stages[0].model.get_submodule(name))
    return model
