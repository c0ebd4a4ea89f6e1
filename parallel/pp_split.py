"""Pipeline parallel's cut: the model split into stages of contiguous blocks, without the family
knowing (parallel/pp.py runs them).

Each stage is a copy of the model on meta in which the blocks of other stages are
`SkippedBlock`s (the hidden state passes through, the block's other outputs are zeros) and the
modules that run before the first block (the embeddings) or after the last (final norm, output
projection) are `PassThrough`s outside the first (last) stage. Which modules those are is read
once from a forward on meta (`probe_layout`), through the contract alone: `fsdp_units` names the
blocks in order.

A weight that the first and the last stage both use (tied embeddings: the output projection's
weight is the input embedding's) is a parameter of each: the first stage's copy is the one the
optimizer trains and checkpoints hold, the last stage's a replica (`Stage.replicas`) that
parallel/pp.py keeps equal to it, sending the replica's gradient to it after backward and its
value back before the replica is used again. Each stage holds its copy under the same names as
the whole model (the stand-in of the other side's module keeps it), so the family's own code
that restores a tie, its initialization and every name-based setting see what they would
without pp. Block names keep their index (checkpoint keys are the same as without pp), and
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
    final norm and output projection outside the last): returns its first input.

    It answers the `replaced` module's own parameter names (a family's `init_buffers` reads
    them to restore a tie): with the parameter itself where it is in `kept` (a tied weight this
    stage holds through another module), None for the others."""

    def __init__(
        self, replaced: nn.Module | None = None, kept: frozenset[int] = frozenset()
    ) -> None:
        super().__init__()
        own = replaced._parameters if replaced is not None else {}
        for name, param in own.items():
            self.register_parameter(name, param if id(param) in kept else None)

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
    ties: list[list[str]] = field(default_factory=list)
    """The names of each weight shared by a head and a tail module (tied embeddings), in the
    order `named_parameters` lists them (the first is the one `Stage.replicas` uses)."""


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
    ties = _ties(model, blocks, head, tail)
    return Layout(blocks, [_extras(outputs[b], b) for b in blocks], head, tail, ties)


def _ties(model: nn.Module, blocks: list[str], head: list[str], tail: list[str]) -> list[list[str]]:
    """The names of each parameter shared by a head and a tail module (`Layout.ties`). A weight
    shared inside one block, or inside the head or the tail, is one stage's; ConfigError for
    one shared by a block and another module, which stages cannot hold apart, or tied inside a
    submodule of a head or tail module (the stand-ins keep only a module's own parameters)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    ties = []
    for shared in (n for n in names.values() if len(n) > 1):
        owners = [next((m for m in (*blocks, *head, *tail) if n.startswith(m + ".")), n)
                  for n in shared]  # fmt: skip
        if len(set(owners)) == 1 and owners[0] in blocks:
            continue
        if all(o in head for o in owners) or all(o in tail for o in owners):
            continue
        if not all(o in head + tail and n.count(".") == o.count(".") + 1
                   for n, o in zip(shared, owners, strict=True)):  # fmt: skip
            raise ConfigError(
                f"parallel.pp: {', '.join(shared)} are one weight that pipeline stages cannot "
                "hold apart (only a weight of the modules before the first block and after the "
                "last, such as tied embeddings, can be): untie it or use parallel.pp=1"
            )
        # The last stage's module holding the replica stays out of the merged view: a weight
        # of its own beside the replica (a bias) would train nowhere.
        for name, owner in zip(shared, owners, strict=True):
            if owner in tail and (more := [f"{owner}.{n}" for n, p in
                                           model.get_submodule(owner).named_parameters()
                                           if f"{owner}.{n}" != name]):  # fmt: skip
                raise ConfigError(
                    f"parallel.pp: {owner} holds {', '.join(more)} beside the tied {name}; "
                    "under pp the last stage's copy of a tied weight needs a module of its own "
                    "(move the other weights to another module), or untie it, or use "
                    "parallel.pp=1"
                )
        ties.append(shared)
    return ties


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
    ties: list[list[str]] = field(default_factory=list)
    """`Layout.ties` of the whole model (the same on every stage)."""
    replicas: list[str] = field(default_factory=list)
    """The names (each tie's first) under which the last stage holds a replica of a weight
    the first stage trains; empty on the other stages."""


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

        if kind == "params":  # under each of a tied weight's names, as train.freeze applies them
            params = self._model.named_parameters(remove_duplicate=False)
            names = [canonical_name(n) for n, _ in params]
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
    last = len(sizes) - 1
    stages = []
    for s in [s for s, r in enumerate(owners) if r == pp_rank]:
        part = copy.deepcopy(model)
        for i, name in enumerate(layout.blocks):
            if not starts[s] <= i < starts[s] + sizes[s]:
                _replace(part, name, SkippedBlock(layout.extras[i]))
        # A tie's weight stays in the first and the last stage: the stand-in of the other
        # side's module keeps it, under the names it had.
        kept = frozenset(id(part.get_parameter(t[0])) for t in layout.ties if s in (0, last))
        for name in layout.head if s > 0 else []:
            _replace(part, name, PassThrough(part.get_submodule(name), kept))
        for name in layout.tail if s < last else []:
            _replace(part, name, PassThrough(part.get_submodule(name), kept))
        replicas = [t[0] for t in layout.ties] if s == last else []
        stages.append(Stage(s, part, StageFamily(family, part), ties=layout.ties,
                            replicas=replicas))  # fmt: skip
    return stages


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent), attr, new)


def merged_view(model: nn.Module, stages: list[Stage]) -> nn.Module:
    """`model` (the unsplit one, on meta) holding this rank's stages' modules, as they were
    parallelized, where they belong, and stand-ins elsewhere: one module with the unsplit
    model's parameter names for the optimizer, the gradient norm and DCP. Never run: each
    stage runs its own copy, whose modules these are. A tied weight's replica (the last
    stage's copy) is not in it: the first stage's copy is the one that trains."""
    family = stages[0].family._family
    layout_blocks = [n for n, m in model.named_modules() if m in family.fsdp_units(model)]
    outside = _outside_modules(model, layout_blocks)
    replicas = {id(s.model.get_parameter(n)) for s in stages for n in s.replicas}
    for name in layout_blocks + outside:
        found = [s.model.get_submodule(name) for s in stages]
        usable = [m for m in found if not any(id(p) in replicas for p in m.parameters())]
        real = [m for m in usable if not isinstance(m, PassThrough | SkippedBlock)]
        if real or usable:
            _replace(model, name, (real or usable)[0])
        else:  # only a replica's holders here (the last stage's rank): a stand-in without it
            _replace(model, name, PassThrough(model.get_submodule(name)))
    return model
