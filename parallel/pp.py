"""Pipeline parallel: this rank's stages (parallel/pp_split.py) run by a schedule of
torch.distributed.pipelining across the pp ranks, the outermost mesh dimension.

    pipeline = Pipeline(built.stages, mesh["pp"], device, job.parallel.pipeline, microbatches)
    loss_sum, stats = pipeline.step(micro_batches, objective, global_tokens, scale, ...)  # train
    logits = pipeline(tokens, document_ids=..., positions=...)   # evaluation: last stage only

`step` is the one call `train_step` makes in place of its micro-batch loop: the loss keeps the
trainer's normalization (the step's units over all ranks), each stage's extra loss (an MoE's
aux loss) joins the backward from its output, and torch's stages keep FSDP's gradients
unreduced until the step's last backward. What the objective prepares before the policy's
forward (DPO's reference log-probs, parallel/objective.py) comes from forward-only passes
through the pipeline (or the reference copy's own) before the schedule runs, and reaches the
last stage's loss with its micro-batch.

A tied weight (parallel/pp_split.py: the first stage's copy trains, the last stage's is a
replica) costs two sends of its shard per step between the ranks of the first and the last
stage (none when one rank holds both, as in the V schedules): after backward the replica's
gradient joins the trained copy's, and the trained copy's value reaches the replica before
the replica is used again (the optimizer, a checkpoint or Hugging Face weights changed it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from configs import ConfigError
from parallel.pp_plan import SCHEDULES, PipelineConfig, stage_ranks
from parallel.pp_split import Stage, probe_layout

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.device_mesh import DeviceMesh

    from model import ModelFamily
    from parallel.objective import Objective

SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


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
    objective: Objective
    global_tokens: torch.Tensor
    scale: float
    extra_scale: float
    sequences: int
    beat: Callable[[str], None] | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    stats: list[torch.Tensor] = field(default_factory=list)
    """The objective's statistics of each loss."""
    last_extra: torch.Tensor | None = None
    """The last stage's extra loss of the micro-batch whose loss comes next."""
    prepared: torch.Tensor | None = None
    """What the objective prepared for the micro-batch whose loss comes next."""


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
        self.parts = nn.ModuleList([s.model for s in stages])  # for the objective's `prepare`
        self.group, self.pp = mesh.get_group(), mesh.size()
        self.rank = mesh.get_local_rank()
        n = self.pp * cfg.local_stages()
        self.owners = stage_ranks(self.pp, cfg.local_stages(), cfg.schedule)
        self.ranks = dist.get_process_group_ranks(self.group)
        self.holds_first, self.holds_last = stages[0].index == 0, stages[-1].index == n - 1
        self._step: _StepInputs | None = None
        self.device, self.ties = device, stages[0].ties
        # The global ranks of the first and the last stage's pp ranks: a tied weight's ends.
        self.ends = (self.ranks[self.owners[0]], self.ranks[self.owners[-1]])
        # Stale until the first use: the initialization, a checkpoint or HF weights set them.
        self._replicas_stale, self._replicas_set = True, False
        self._check_ties()
        # Imported here, not at the top: it imports Dynamo and Inductor (0.5 s of every rank's
        # start, and of every test that starts one), which a run without pp does not need.
        import torch.distributed.pipelining as pipelining

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
            # The objective's prepared values reach each stage with the micro-batch's inputs
            # (the schedule splits them alike); the last stage's loss, which torch computes
            # right after its forward, takes them.
            if stage.index == len(self.owners) - 1:
                step.prepared = kwargs.get("prepared")
            kwargs = {k: v for k, v in kwargs.items() if k != "prepared"}
            return args, kwargs | ({"hidden_only": True} if step.objective.hidden_only else {})

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
        loss, stats = step.objective.loss(out, target, step.prepared)
        loss = loss.to_local() if hasattr(loss, "to_local") else loss
        step.stats.append(stats)
        # Every pp rank counted the step's targets into global_tokens: x pp undoes it.
        loss = loss / step.global_tokens * self.pp
        step.losses.append(loss.detach())
        extra, step.last_extra = step.last_extra, None
        return loss * step.scale + (extra if extra is not None else 0.0)

    def step(
        self,
        batches: list[Any],
        objective: Objective,
        global_tokens: torch.Tensor,
        scale: float,
        extra_scale: float,
        sequences: int,
        beat: Callable[[str], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of the step's micro-batches (`batches`, MicroBatch) through the
        pipeline, gradients accumulated in each stage. The loss of each micro-batch is the
        `objective`'s sum over `global_tokens` (the step's, over all ranks), and backward runs
        from it times `scale` (and from each stage's extra loss times `extra_scale`), as
        train.py's loop does without pp. `beat(phase)`: the heartbeat, told which stage runs.
        Returns this rank's share of the step's loss (the last stage's; 0 elsewhere) and its
        statistics: its stages' step terms', then the objective's (zeros off the last stage)."""
        self._refresh_replicas()
        # Before the schedule, one forward-only pass per micro-batch where the objective needs
        # one (DPO's reference log-probs, on the last stage's ranks).
        prepared = [objective.prepare(self, self.parts, b) for b in batches]
        self._step = _StepInputs(objective, global_tokens, scale, extra_scale, sequences, beat)
        for stage in self.stages:
            stage.stats.clear()
        present = [k for k in ("document_ids", "positions") if getattr(batches[0], k) is not None]
        kwargs = {k: torch.cat([getattr(b, k) for b in batches]) for k in present}
        if prepared[0] is not None:
            kwargs["prepared"] = torch.cat(prepared)
        args = (torch.cat([b.inputs for b in batches]),) if self.holds_first else ()
        target = torch.cat([b.targets for b in batches]) if self.holds_last else None
        try:
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        finally:
            step, self._step = self._step, None
        self._gather_replica_grads()
        self._replicas_stale = True  # the optimizer steps next
        # The last `microbatches` calls: torch may run a stage once more first, to learn shapes.
        m, zeros = self.microbatches, global_tokens.new_zeros
        losses = step.losses[-m:]
        loss_sum = torch.stack(losses).sum() if losses else zeros(())
        terms = [torch.stack(s.stats[-m:]).sum(0) for s in self.stages if s.stats]
        ours = torch.stack(step.stats[-m:]).sum(0) if step.stats else zeros(objective.stats_size)
        return loss_sum, torch.cat([torch.stack(terms).sum(0) if terms else zeros(0), ours])

    @torch.no_grad()
    def __call__(self, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor | None:
        """The model's output for `inputs` (and `kwargs`: document ids, positions, hidden_only)
        on the rank that holds the last stage, None on the others: each stage runs in turn,
        its output sent to the next stage's rank. For evaluation (any shape, one batch at a
        time; every pp rank calls it with the same inputs)."""
        self._refresh_replicas()
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
        # No reshard here: the chunked loss applies the last stage's output layer next, and a
        # checkpoint's state_dict reshards by FSDP's own hooks.
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

    def _tie_copies(self) -> list[tuple[Any, Any]]:
        """For each tied weight, this rank's (trained copy, replica): a Parameter where this
        rank holds the first (last) stage, else None."""
        local = {s.index: s.model for s in self.stages}
        ends = [local.get(0), local.get(len(self.owners) - 1)]
        return [tuple(None if m is None else m.get_parameter(names[0]) for m in ends)
                for names in self.ties]  # fmt: skip

    def _check_ties(self) -> None:
        """Before the first send: each tied weight's two copies are split alike (by the tp
        styles of the two modules that hold them, then FSDP), or the sends would mix up their
        shards. Both ranks compare and raise."""
        first_rank, last_rank = self.ends
        for names, (trained, replica) in zip(self.ties, self._tie_copies(), strict=True):
            if trained is None and replica is None:
                continue
            ours = _split_of(trained if trained is not None else replica, self.device)
            if trained is not None and replica is not None:
                theirs = _split_of(replica, self.device)
            else:
                theirs = torch.empty_like(ours)
                if trained is not None:
                    dist.send(ours, last_rank, group=self.group)
                    dist.recv(theirs, last_rank, group=self.group)
                else:
                    dist.recv(theirs, first_rank, group=self.group)
                    dist.send(ours, first_rank, group=self.group)
            if not torch.equal(ours, theirs):
                held = trained if trained is not None else replica
                raise ValueError(
                    f"parallel.pp: the first and the last stage split the tied {names[0]} "
                    f"differently (here {getattr(held, 'placements', None)}, local shape "
                    f"{tuple(_local(held).shape)}): the TP_PLAN styles of {' and '.join(names)} "
                    "must shard it alike"
                )

    @torch.no_grad()
    def _gather_replica_grads(self) -> None:
        """Add each replica's gradient to the trained copy's (sent from the last stage's rank
        to the first's), and drop it: the optimizer steps the trained copy alone."""
        first_rank, last_rank = self.ends
        for trained, replica in self._tie_copies():
            if not any(c is not None and c.requires_grad for c in (trained, replica)):
                continue  # a middle stage's rank, or frozen (train.freeze freezes both copies)
            for copy_ in (c for c in (trained, replica) if c is not None and c.grad is None):
                copy_.grad = torch.zeros_like(copy_)  # not used in this step: no gradient
            if trained is not None and replica is not None:  # one rank holds both stages
                _local(trained.grad).add_(_local(replica.grad))
            elif replica is not None:
                dist.send(_local(replica.grad).to(self.device), first_rank, group=self.group)
            elif trained is not None:
                grad = _local(trained.grad)
                received = torch.empty_like(grad, device=self.device)
                dist.recv(received, last_rank, group=self.group)
                grad.add_(received.to(grad.device))
            if replica is not None:
                replica.grad = None

    @torch.no_grad()
    def _refresh_replicas(self) -> None:
        """Copy each trained copy's value into its replica, once after each change (a frozen
        one's only the first time)."""
        if not self._replicas_stale:
            return
        for stage in self.stages:  # sharded (an evaluation leaves the stages gathered): shards
            if hasattr(stage.model, "reshard"):  # FSDP's root unit, which holds the weight
                stage.model.reshard()
        first_rank, last_rank = self.ends
        for trained, replica in self._tie_copies():
            held = trained if trained is not None else replica
            if held is None or (self._replicas_set and not held.requires_grad):
                continue  # a middle stage's rank; a frozen weight that has not changed
            if trained is not None and replica is not None:
                _local(replica).copy_(_local(trained))
            elif trained is not None:
                dist.send(_local(trained).to(self.device), last_rank, group=self.group)
            elif replica is not None:
                value = _local(replica)
                received = torch.empty_like(value, device=self.device)
                dist.recv(received, first_rank, group=self.group)
                value.copy_(received)
        self._replicas_stale, self._replicas_set = False, True

    def total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every stage, from this rank's stages' `norm` (the same on
        every rank of a stage): the square root of the sum of the stages' squares, in float64
        as each stage's own (train.py's clip_grad_norm)."""
        squared = norm.double() ** 2
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _split_of(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """How `param` is split, as a tensor two ranks can compare: its global and local shapes
    and a checksum of its placements."""
    import zlib

    shapes = [*param.shape, -1, *_local(param).shape, -1]
    placements = zlib.crc32(repr(getattr(param, "placements", None)).encode())
    return torch.tensor([*shapes, placements], dtype=torch.long, device=device)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP's parameters and gradients), a view of it: written
    in place, the DTensor changes."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def check_pp(cfg: Any, compiled: bool, family: ModelFamily, model: nn.Module, accum: int) -> None:
    """ConfigError, before any collective, for a pipeline this model and config cannot run
    (`cfg`: ParallelConfig; `model`: built on meta; `accum`: the step's micro-batches)."""
    from parallel.pp_plan import check_pipeline

    if cfg.pp == 1:
        return
    import torch.distributed.pipelining as pipelining  # see Pipeline.__init__

    name = SCHEDULE_CLASSES[cfg.pipeline.schedule]
    if not hasattr(pipelining, name):
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.pipeline.schedule!r}: torch {torch.__version__} "
            f"has no {name}; choose another schedule"
        )
    n_blocks = len(family.fsdp_units(model))
    check_pipeline(cfg.pipeline, cfg.pp, n_blocks, accum, compiled)
    probe_layout(copy.deepcopy(model), family)
