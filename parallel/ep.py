"""Expert parallel (EP): a mixture of experts' experts split over `parallel.ep` ranks; each
token's hidden state travels to the ranks holding its experts and back by all-to-all.

**Which ranks.** An EP group is ep *consecutive* ranks of one replica, in torchrun's order
(dp_shard, cp, tp): the ranks of a replica, dp_shard x cp x tp of them, are expert_shard x ep
(ep the inner factor), so an EP group's all-to-alls run between neighbours on a node's fast
links, as torchtitan places them. For the experts every one of these ranks is data-parallel:
cp ranks hold other tokens of the sequences, and tp ranks each compute other rows (below).
All ranks still read their micro-batches and keep the dense parameters' sharding over dp_shard
x cp (and dp_replicate) and tp. Only the experts are split differently: over ep by expert (rank
e of a group holds experts [e * n/ep, (e+1) * n/ep)), then FSDP-sharded over the ranks EP
leaves: expert_shard (and dp_replicate, replicas for HSDP). So with dp_replicate x dp_shard =
2 x 4 and ep = 2, a replica's 4 ranks are 2 EP groups of 2; rank (q, e) of a replica, q =
expert_shard index, holds FSDP shard q of the experts of EP rank e.

**How.** The expert module's stacked weights (expert as dim 0, `model.MoEFamily`) become
DTensors `Shard(0)` on the `ep` dim of a mesh (dp_replicate, expert_shard, ep) of their own;
`parallel/fsdp.py` then gives the expert module a `fully_shard` of its own on that mesh's data
dims, nested in its block's: FSDP2 shards each parameter on its own, with APIs torch 2.11 has
(newer ones, `shard_placement_fn` returning a per-parameter mesh, added after 2.11, and
`fully_shard(dp_mesh_dims=...)`, could place the experts from the block's own `fully_shard`).
Its gradient divisor is all data-parallel ranks, like the dense parameters', because each EP
rank's expert gradients already sum the tokens of its whole group.
The module's forward gets the all-to-alls around it; routing, dispatch order and combine stay in
the model (model/moe.py). Checkpoint keys and full shapes do not change: DCP reshards the
experts between any ep (a checkpoint saved at ep 2 loads at ep 1 and on one process).

**With tensor parallel: whole experts, rows split over tp (no ETP).** The family's TP plan runs
the MoE layer whole on every tp rank ("replicate": input gathered along the sequence), so the
tp ranks of a group route the same tokens and hold the same (rows, counts) sorted by expert.
Each takes an equal contiguous 1/tp of those rows, sends them through its EP group and
all-gathers the results over tp: every routed row is computed once, by a whole expert, so each
expert sees exactly the tokens it sees at tp 1, and the expert GEMMs keep their full width.
The slice's backward all-gathers the rows' gradients, the gather's takes this rank's slice:
outside the experts every tp rank holds the same values and gradients, as without EP, so the
router, the aux loss and the expert load need nothing new. The cost: two all-gathers over tp
of the routed rows per MoE layer and micro-batch (one forward, one backward), each
(tp-1)/tp x tokens x top_k x dim. Splitting each expert's matrices over tp instead (ETP, as
torchtitan offers) sends every routed row through the all-to-all on every tp rank (tp times
the bytes) and cuts each expert's hidden size by tp (moe_ffn_dim 768 at tp 8: GEMMs 96 wide).

**With torch.compile: regions around the dispatch.** The all-to-all needs its row counts on
the host, and the expert module is an FSDP unit of its own whose hooks Dynamo does not trace:
both would break a block's graph. So a block with experts under EP is compiled in regions
(`parallel/compile.py`, `compile_around`): each of its submodules that holds no experts
(norms, attention, the router) is its own graph, and so is the experts' own compute (three
grouped GEMMs and the SwiGLU between them), compiled here with its row count marked unbacked
(a symbol with no value guarded on: the rows a rank receives change every step, the graph does
not, and a count of 0 or 1 is no special case either). The dispatch, the all-to-alls and the
model's sort and combine around them run eagerly between the graphs. `compile.fullgraph` keeps
its meaning for every region. Measured (BENCHMARKS.md): the graphs, no recompile over 20 steps
of changing loads, and the step time against eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from configs import ConfigError
from model import ModelFamily, moe_family
from parallel.compile import CompileConfig
from parallel.dims import ParallelConfig
from parallel.tp import _not_norm_hint


def check_ep(
    family: ModelFamily,
    args: Any,
    cfg: ParallelConfig,
    dp_shard: int,
    name: str,
    compiled: CompileConfig | None = None,
) -> None:
    """ConfigError for an expert-parallel degree (or MoE compile regions) this model, mesh and
    run cannot take. `dp_shard`: the data-parallel ranks of a replica, dp_shard x cp
    (`build_expert_mesh`); `compiled`: the [compile] section."""
    ep, compiled = cfg.ep, compiled or CompileConfig()
    if compiled.moe_regions and moe_family(family) is None:
        raise ConfigError(f"compile.moe_regions: model {name} has no experts (a dense family)")
    if ep == 1:
        return
    if moe_family(family) is None:
        raise ConfigError(f"parallel.ep={ep}: model {name} has no experts (a dense family)")
    if args.n_experts % ep != 0:
        raise ConfigError(
            f"parallel.ep={ep} must divide model.n_experts={args.n_experts}: each EP rank "
            "holds the same number of experts"
        )
    ranks = dp_shard * cfg.tp
    if ranks % ep != 0:
        fits = [d for d in range(2, ranks + 1) if ranks % d == 0 and args.n_experts % d == 0]
        what = "dp_shard" + " x cp" * (cfg.cp > 1) + " x tp" * (cfg.tp > 1)
        fit = f"ep in {fits} would fit" if fits else "no ep > 1 fits"
        raise ConfigError(
            f"parallel.ep={ep} must divide {what}={ranks}: an EP group is ep consecutive ranks "
            f"of one replica (parallel/ep.py); {fit} this mesh and model"
        )
    plan = getattr(family, "TP_PLAN", None) or {}
    if cfg.tp > 1 and "replicate" not in plan.values():
        raise ConfigError(
            f"parallel.ep={ep} with parallel.tp={cfg.tp}: model {name}'s TP_PLAN must run its "
            "MoE layers whole on every tp rank (style 'replicate'), as EP x tp splits their "
            "routed rows over tp (parallel/ep.py)"
        )


@dataclass(frozen=True)
class ExpertSharding:
    """What `apply_fsdp` needs to shard the experts on their own mesh."""

    modules: list[nn.Module]
    """Each MoE layer's expert module (the family's `expert_modules`)."""
    mesh: DeviceMesh
    """(dp_replicate, expert_shard, ep): the experts are FSDP-sharded over its data dims."""

    def fsdp_mesh(self) -> DeviceMesh:
        """The data-parallel ranks EP leaves: expert_shard, with dp_replicate for HSDP."""
        if self.mesh["dp_replicate"].size() > 1:
            return self.mesh["dp_replicate", "expert_shard"]
        return self.mesh["expert_shard"]


def build_expert_mesh(
    device: torch.device, dp_replicate: int, ranks: int, ep: int, pp: int = 1
) -> DeviceMesh:
    """(dp_replicate, expert_shard, ep) over the same ranks as build_mesh's (dp_replicate,
    dp_shard, cp, tp): dp_shard, cp and tp indices flattened in that order = expert_shard index
    * ep + ep index. Pass `ranks` = dp_shard x cp x tp, a replica's ranks: each holds other
    tokens or, under tp, other routed rows (module docstring), as in torchtitan. Under pipeline
    parallel (pp > 1) a leading pp dimension, as build_mesh's: an EP group is ranks of one
    stage, which run the same micro-batches through the same blocks in the same order."""
    shape, names = (dp_replicate, ranks // ep, ep), ("dp_replicate", "expert_shard", "ep")
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def apply_ep(
    model: nn.Module,
    family: ModelFamily,
    mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None = None,
    compiled: CompileConfig | None = None,
) -> ExpertSharding:
    """Split each expert module's weights over `mesh["ep"]` by expert and wrap its forward in
    the dispatch and combine all-to-alls; at tp > 1 (`tp_mesh`) split its rows over tp first.
    With `compiled` enabled, the experts' own compute is compiled (module docstring). Call on
    the model on meta, after tensor parallel and before compile and FSDP."""
    moe = moe_family(family)
    ep_mesh = mesh["ep"]
    modules = moe.expert_modules(model)
    for experts in modules:
        for name, param in list(experts.named_parameters(recurse=False)):
            # Tensor parallel replicated the MoE layer: the experts leave the tp mesh for
            # their own. src_data_rank=None: every rank keeps its own chunk, no scatter (the
            # weights are on meta here; init_weights draws each rank's experts later).
            whole = (param.to_local() if isinstance(param, DTensor) else param).detach()
            split = distribute_tensor(whole, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(split, requires_grad=param.requires_grad))
        compute = type(experts).forward
        if compiled is not None and compiled.enabled:
            compute = _compiled_compute(compute, compiled)
        dispatch = _Dispatch(compute, ep_mesh.get_group(), tp_mesh)
        experts.forward = MethodType(dispatch, experts)
    # The experts' grad norm reduces over (expert_shard, ep) in two scalar all-reduces: as for
    # tensor parallel, DTensor's hint to flatten the two dims (a private API) is not logged.
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_not_norm_hint)
    return ExpertSharding(modules, mesh)


def experts_apart(
    model: nn.Module, family: ModelFamily, cfg: CompileConfig, experts: ExpertSharding | None
) -> list[nn.Module]:
    """The modules `apply_compile` compiles around (parallel/compile.py `compile_around`): the
    experts under EP (`apply_ep` compiled their compute); with compile.moe_regions and no EP,
    every expert module, its compute compiled here as under EP: the same graphs, for comparing
    them with whole compiled blocks on one GPU (bench/gpu.py). Empty: compile blocks whole."""
    if experts is not None:
        return experts.modules
    moe = moe_family(family)
    if not (cfg.enabled and cfg.moe_regions) or moe is None:
        return []
    modules = moe.expert_modules(model)
    for module in modules:
        module.forward = MethodType(_compiled_compute(type(module).forward, cfg), module)
    return modules


def _compiled_compute(compute: Any, cfg: CompileConfig) -> Any:
    """`compute(module, rows, counts)` compiled once for every row count: the rows a rank
    receives are marked unbacked (torch._dynamo.decorators.mark_unbacked, torch >= 2.5), so
    no value of theirs is guarded on and a new count, 0 and 1 included, reuses the graph."""
    from torch._dynamo.decorators import mark_unbacked

    graph = torch.compile(compute, fullgraph=cfg.fullgraph, backend=cfg.backend)

    def run(module: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        mark_unbacked(rows, 0)
        return graph(module, rows, counts)

    return run


class _Dispatch:
    """An expert module's forward under EP: x (rows, dim) sorted by expert and counts
    (n_experts,) rows per expert -> (rows, dim), computed on the ranks holding the experts."""

    def __init__(self, compute: Any, group: Any, tp_mesh: DeviceMesh | None) -> None:
        self.compute, self.group, self.tp_mesh = compute, group, tp_mesh

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return self.dispatch_compute_combine(experts, x, counts)
        # Every tp rank holds the same rows: each computes an equal contiguous slice of them
        # (DTensor's Shard(0): torch.chunk's sizes) and all-gathers the results.
        mine = _as_replicated(x, self.tp_mesh).redistribute(self.tp_mesh, [Shard(0)]).to_local()
        chunk = -(-x.shape[0] // self.tp_mesh.size())
        lo = min(self.tp_mesh.get_local_rank() * chunk, x.shape[0])
        hi = lo + mine.shape[0]
        ends = torch.cumsum(counts, dim=0)  # this slice's rows of each expert
        mine_counts = ends.clamp(lo, hi) - (ends - counts).clamp(lo, hi)
        out = self.dispatch_compute_combine(experts, mine, mine_counts)
        whole = DTensor.from_local(
            out, self.tp_mesh, [Shard(0)], shape=x.shape, stride=(x.shape[1], 1)
        )
        return whole.redistribute(self.tp_mesh, [Replicate()]).to_local()

    def dispatch_compute_combine(
        self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch: rank r of the group holds experts [r * local, (r+1) * local), a contiguous
        run of x's rows: one all-to-all of the counts, then one of the rows. The rows arrive
        grouped by the rank that sent them, each group sorted by expert; a stable sort by
        expert makes one run per local expert for the grouped GEMM. Combine undoes both, in
        reverse."""
        group = self.group
        ep = dist.get_world_size(group)
        local = counts.numel() // ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # (source, local expert)
        # The split sizes must be on the host: one synchronization per MoE layer and direction.
        send_rows = counts.view(ep, local).sum(1).tolist()
        recv_rows = received.view(ep, local).sum(1).tolist()
        rows = _AllToAll.apply(x, recv_rows, send_rows, group)
        expert_of_row = torch.arange(local, device=x.device).repeat(ep)
        order = torch.argsort(torch.repeat_interleave(expert_of_row, received), stable=True)
        out = self.compute(experts, rows[order], received.view(ep, local).sum(0))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        return _AllToAll.apply(out[inverse], send_rows, recv_rows, group)


def _as_replicated(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """x, the same on every rank of `mesh`, as a replicated DTensor. Its gradient is taken as
    replicated too: DTensor's backward of a slice (Replicate -> Shard) all-gathers the slices'
    gradients, so every tp rank again holds the same gradient of x."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the all-to-all the other way."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None
