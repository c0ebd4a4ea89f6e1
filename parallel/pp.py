"""Pipeline parallel: the model cut into stages of contiguous blocks, run by a schedule of
torch.distributed.pipelining across the pp ranks (the outermost mesh dimension).

    stages = split_model(model, family, job, pp_rank)   # parallel/build.py, step 1b
    pipeline = Pipeline(stages, pp_mesh, device, job.parallel.pipeline, microbatches)
    loss_sum, stats = pipeline.step(micro_batches, loss_fn, global_tokens, scale, ...)

The family never learns that it is pipelined. Each stage is a copy of the model on meta in
which the blocks of other stages are `SkippedBlock`s (the hidden state passes through, the
block's other outputs are zeros) and the modules that run before the first block (the
embeddings) or after the last (final norm, output projection) are `PassThrough`s outside the
first (last) stage. Which modules those are is read once from a forward on meta
(`probe_layout`), through the contract alone: `fsdp_units` names the blocks in order. Block
names keep their index (checkpoint keys are the same as without pp), and zeros for a skipped
block's extra outputs make a sum over blocks (an MoE's aux loss and expert load) add up across
stages: each stage's step terms are its part, and the all-reduce over every rank adds them.

Each stage is then parallelized by parallel/build.py like the whole model would be (tp, cp,
float8, LoRA, AC, compile, FSDP over its own data-parallel ranks), and `merged_view` gathers a
rank's stages into one module with the unsplit model's parameter names for the optimizer,
the gradient norm and the checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.fsdp import FSDPModule

from configs import ConfigError
from parallel.pp_plan import (
    SCHEDULES,
    PipelineConfig,
    balanced_split,
    block_costs,
    stage_ranks,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.device_mesh import DeviceMesh

    from model import ModelFamily, StepTerms

# The schedule classes by name; DualPipeV is newer than the others (a missing one: check_config).
SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


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


def stage_split(model: nn.Module, family: ModelFamily, cfg: PipelineConfig, pp: int,
                seq_len: int) -> list[int]:  # fmt: skip
    """Blocks per stage: parallel.pipeline.split, or balanced by the planner's cost of each
    block with the output projection's on the last stage (parallel/pp_plan.py)."""
    if cfg.split:
        return list(cfg.split)
    from parallel.plan import model_shape  # the planner reads the model on meta too

    costs, output = block_costs(model_shape(family, model.args), seq_len)
    return balanced_split(costs, output, pp * cfg.local_stages())


def split_model(
    model: nn.Module, family: ModelFamily, cfg: PipelineConfig, pp: int, pp_rank: int,
    seq_len: int,
) -> list[Stage]:  # fmt: skip
    """This rank's stages of `model` (on meta), each a copy with the other stages' blocks
    skipped and the embeddings (the output side) passed through outside the first (last)."""
    layout = probe_layout(model, family)
    sizes = stage_split(model, family, cfg, pp, seq_len)
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


class _AddLoss(torch.autograd.Function):
    """A copy of `out`; in backward, `extra` gets gradient 1: the stage's extra loss (an MoE's
    aux loss) joins the backward that the schedule runs from the stage's output. A copy, not a
    view: the zero-bubble schedules detach the stage's output in place after backward."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra = (extra.shape, extra.dtype, extra.device)
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.extra
        return grad, torch.ones(shape, dtype=dtype, device=device)


@dataclass
class _StepInputs:
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    global_tokens: torch.Tensor
    scale: float
    extra_scale: float
    sequences: int
    hidden_only: bool
    beat: Callable[[str], None] | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    last_extra: torch.Tensor | None = None
    """The last stage's extra loss of the micro-batch whose loss comes next."""


class Pipeline:
    """This rank's stages on torch's schedule: `step` runs forward and backward of a step's
    micro-batches; calling it, a forward-only pass for evaluation."""

    def __init__(
        self,
        stages: list[Stage],
        mesh: DeviceMesh,
        device: torch.device,
        cfg: PipelineConfig,
        microbatches: int,
    ) -> None:
        self.stages, self.microbatches = stages, microbatches
        self.group, self.pp = mesh.get_group(), mesh.size()
        self.rank = mesh.get_local_rank()
        n = self.pp * cfg.local_stages()
        self.owners = stage_ranks(self.pp, cfg.local_stages(), cfg.schedule)
        self.ranks = dist.get_process_group_ranks(self.group)
        self.holds_first, self.holds_last = stages[0].index == 0, stages[-1].index == n - 1
        self._step: _StepInputs | None = None
        torch_stages = []
        for stage in stages:
            stage.model.register_forward_pre_hook(self._pre_forward(stage), with_kwargs=True)
            stage.model.register_forward_hook(self._hook(stage))
            torch_stages.append(
                pipelining.PipelineStage(stage.model, stage.index, n, device, group=self.group)
            )
        schedule = getattr(pipelining, SCHEDULE_CLASSES[cfg.schedule])
        single = SCHEDULES[cfg.schedule][0] == 1
        # scale_grads=False: the loss is already the step's global mean (train.py).
        self.schedule = schedule(
            torch_stages[0] if single else torch_stages, n_microbatches=microbatches,
            loss_fn=self._loss, scale_grads=False,
        )  # fmt: skip

    def _pre_forward(self, stage: Stage) -> Callable[..., Any]:
        def before_forward(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            step = self._step
            if step is None:
                return None
            if step.beat is not None:  # the hang line names the stage
                step.beat(f"pipeline stage {stage.index}")
            return (args, kwargs | {"hidden_only": True}) if step.hidden_only else None

        return before_forward

    def _hook(self, stage: Stage) -> Callable[..., Any]:
        def after_forward(module: nn.Module, args: tuple, out: torch.Tensor) -> Any:
            step = self._step
            if step is None or stage.terms is None:
                return None
            extra, stats = stage.terms.collect(step.sequences)
            stage.stats.append(stats)
            if stage.index == len(self.owners) - 1:  # added to the loss: no copy of the logits
                step.last_extra = extra * step.extra_scale
                return None
            return _AddLoss.apply(out, extra * step.extra_scale)

        return after_forward

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        step = self._step
        assert step is not None  # noqa: S101 - only the schedule calls it, inside step()
        loss = step.loss_fn(out, target)
        loss = loss.to_local() if hasattr(loss, "to_local") else loss
        # Every pp rank counted the step's targets into global_tokens: x pp undoes it.
        loss = loss / step.global_tokens * self.pp
        step.losses.append(loss.detach())
        extra, step.last_extra = step.last_extra, None
        return loss * step.scale + (extra if extra is not None else 0.0)

    def step(
        self,
        batches: list[Any],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        global_tokens: torch.Tensor,
        scale: float,
        extra_scale: float,
        sequences: int,
        beat: Callable[[str], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward and backward of the step's micro-batches (`batches`, MicroBatch) through the
        pipeline, gradients accumulated in each stage. The loss of each micro-batch is
        `loss_fn`'s sum over `global_tokens` (the step's, over all ranks), and backward runs
        from it times `scale` (and from each stage's extra loss times `extra_scale`), as
        train.py's loop does without pp. `beat(phase)`: the heartbeat, told which stage runs.
        Returns this rank's share of the step's loss (the last stage's; 0 elsewhere) and its
        stages' step statistics (None without step terms)."""
        from parallel.loss import ChunkedLoss

        hidden_only = isinstance(loss_fn, ChunkedLoss)
        self._step = _StepInputs(loss_fn, global_tokens, scale, extra_scale, sequences,
                                 hidden_only, beat)  # fmt: skip
        for stage in self.stages:
            stage.stats.clear()
        present = [k for k in ("document_ids", "positions") if getattr(batches[0], k) is not None]
        kwargs = {k: torch.cat([getattr(b, k) for b in batches]) for k in present}
        args = (torch.cat([b.inputs for b in batches]),) if self.holds_first else ()
        target = torch.cat([b.targets for b in batches]) if self.holds_last else None
        try:
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        finally:
            step, self._step = self._step, None
        # The last `microbatches` calls: torch may run a stage once more first, to learn shapes.
        losses = step.losses[-self.microbatches :]
        loss_sum = torch.stack(losses).sum() if losses else global_tokens.new_zeros(())
        stats = [torch.stack(s.stats[-self.microbatches :]).sum(0) for s in self.stages if s.stats]
        return loss_sum, torch.stack(stats).sum(0) if stats else None

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor | None:
        """The model's output for `inputs` (and `kwargs`: document ids, positions, hidden_only)
        on the rank that holds the last stage, None on the others: each stage runs in turn,
        its output sent to the next stage's rank. For evaluation (any shape, one batch at a
        time; every pp rank calls it with the same inputs)."""
        x: torch.Tensor | None = inputs
        local = {s.index: s for s in self.stages}
        for s, owner in enumerate(self.owners):
            if owner != self.rank:
                continue
            if s > 0 and self.owners[s - 1] != self.rank:
                x = self._recv(self.owners[s - 1], inputs.device)
            x = local[s].model(x, **kwargs)
            if s + 1 < len(self.owners) and self.owners[s + 1] != self.rank:
                self._send(x, self.owners[s + 1])
        self.reshard()
        return x if self.holds_last else None

    def _send(self, x: torch.Tensor, rank: int) -> None:
        meta = torch.tensor([*x.shape, _DTYPES.index(x.dtype)], device=x.device)
        dist.send(meta, self.ranks[rank], group=self.group)
        dist.send(x.contiguous(), self.ranks[rank], group=self.group)

    def _recv(self, rank: int, device: torch.device) -> torch.Tensor:
        meta = torch.empty(4, dtype=torch.long, device=device)  # (batch, seq, dim) and dtype
        dist.recv(meta, self.ranks[rank], group=self.group)
        *shape, dtype = meta.tolist()
        x = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        dist.recv(x, self.ranks[rank], group=self.group)
        return x

    def reshard(self) -> None:
        """Free every stage's gathered parameters (after a forward-only pass: under pp no unit
        frees them after forward, and a checkpoint must see the shards)."""
        for stage in self.stages:
            for module in stage.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every stage, from this rank's stages' `norm` (the same on
        every rank of a stage): the square root of the sum of the stages' squares."""
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt().to(norm.dtype)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_pp(cfg: Any, compiled: bool, family: ModelFamily, model: nn.Module, accum: int) -> None:
    """ConfigError, before any collective, for a pipeline this model and config cannot run
    (`cfg`: ParallelConfig; `model`: built on meta; `accum`: the step's micro-batches)."""
    from parallel.pp_plan import check_pipeline

    if cfg.pp == 1:
        return
    name = SCHEDULE_CLASSES[cfg.pipeline.schedule]
    if not hasattr(pipelining, name):
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.pipeline.schedule!r}: torch {torch.__version__} "
            f"has no {name}; choose another schedule"
        )
    if cfg.ep > 1:
        raise ConfigError(
            f"parallel.ep={cfg.ep} with parallel.pp={cfg.pp}: expert parallel's mesh does not "
            "have a pp dimension yet; use ep=1 (each stage's experts are then FSDP-sharded)"
        )
    n_blocks = len(family.fsdp_units(model))
    check_pipeline(cfg.pipeline, cfg.pp, n_blocks, accum, compiled)
    probe_layout(copy.deepcopy(model), family)
