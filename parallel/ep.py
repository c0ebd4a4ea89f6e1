"""Expert parallel (EP): a mixture of experts' experts split over `parallel.ep` ranks; each
token's hidden state travels to the ranks holding its experts and back by all-to-all.

**Which ranks.** The EP ranks come from inside dp_shard, as in torchtitan: dp_shard =
expert_shard x ep, and the ep ranks of one group are *consecutive* dp_shard ranks (ep is the
inner factor), so on a node they are neighbours and the all-to-alls run over its fast links.
Under context parallel, dp_shard x cp in place of dp_shard: cp ranks are data-parallel ranks
with other tokens, to EP as to FSDP.
They stay data-parallel ranks: each still reads its own micro-batches, and the dense parameters
keep today's sharding over all of dp_shard (and dp_replicate). Only the experts are split
differently: over ep by expert (rank e of a group holds experts [e * n/ep, (e+1) * n/ep)), then
FSDP-sharded over the data-parallel ranks EP leaves: expert_shard (and dp_replicate, replicas
for HSDP). So with dp_replicate x dp_shard = 2 x 4 and ep = 2, a replica's 4 ranks are 2 EP
groups of 2; rank (q, e) of a replica, q = expert_shard index, holds FSDP shard q of the experts
of EP rank e.

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

Not combined with tensor parallel (the MoE layer runs whole on every tp rank there) or with
torch.compile (the all-to-all needs the row counts on the host, a graph break): both are config
errors, checked with the rest before any process group exists.
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
from torch.distributed.tensor import Shard, distribute_tensor

from configs import ConfigError
from model import ModelFamily, moe_family
from parallel.dims import ParallelConfig
from parallel.tp import _not_norm_hint


def check_ep(
    family: ModelFamily, args: Any, cfg: ParallelConfig, dp_shard: int, compiled: bool, name: str
) -> None:
    """ConfigError for an expert-parallel degree this model, mesh and run cannot take.
    `dp_shard`: the ranks FSDP shards over, dp_shard x cp (`build_expert_mesh`)."""
    ep = cfg.ep
    if ep == 1:
        return
    if moe_family(family) is None:
        raise ConfigError(f"parallel.ep={ep}: model {name} has no experts (a dense family)")
    if args.n_experts % ep != 0:
        raise ConfigError(
            f"parallel.ep={ep} must divide model.n_experts={args.n_experts}: each EP rank "
            "holds the same number of experts"
        )
    if dp_shard % ep != 0:
        ranks = f"dp_shard={dp_shard}" if cfg.cp == 1 else f"dp_shard x cp={dp_shard}"
        raise ConfigError(
            f"parallel.ep={ep} must divide {ranks}: the EP ranks are groups of "
            "consecutive dp_shard (x cp) ranks (parallel/ep.py)"
        )
    if cfg.tp > 1:
        raise ConfigError(f"parallel.ep={ep} with parallel.tp={cfg.tp} is not supported")
    if compiled:
        raise ConfigError(
            f"parallel.ep={ep} with compile.enabled is not supported: the all-to-all needs its "
            "row counts on the host, a graph break inside every block"
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
    device: torch.device, dp_replicate: int, dp_shard: int, ep: int
) -> DeviceMesh:
    """(dp_replicate, expert_shard, ep) over the same ranks as build_mesh's (dp_replicate,
    dp_shard, cp, 1): dp_shard index * cp + cp index = expert_shard index * ep + ep index.
    Pass `dp_shard` x cp: under context parallel an EP group may span cp ranks, which hold
    other tokens like any data-parallel ranks (dispatch is per token), as in torchtitan."""
    return init_device_mesh(
        device.type,
        (dp_replicate, dp_shard // ep, ep),
        mesh_dim_names=("dp_replicate", "expert_shard", "ep"),
    )


def apply_ep(model: nn.Module, family: ModelFamily, mesh: DeviceMesh) -> ExpertSharding:
    """Split each expert module's weights over `mesh["ep"]` by expert and wrap its forward in
    the dispatch and combine all-to-alls. Call on the model on meta, before FSDP."""
    moe = moe_family(family)
    ep_mesh = mesh["ep"]
    modules = moe.expert_modules(model)
    for experts in modules:
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: every rank keeps its own chunk, no scatter (the weights are
            # on meta here; init_weights draws each rank's experts later).
            split = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(split, requires_grad=param.requires_grad))
        experts.forward = MethodType(_expert_parallel_forward(type(experts).forward), experts)
        experts.ep_group = ep_mesh.get_group()
    # The experts' grad norm reduces over (expert_shard, ep) in two scalar all-reduces: as for
    # tensor parallel, DTensor's hint to flatten the two dims (a private API) is not logged.
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_not_norm_hint)
    return ExpertSharding(modules, mesh)


def _expert_parallel_forward(local_forward: Any) -> Any:
    def forward(self: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return _dispatch_compute_combine(local_forward, self, x, counts, self.ep_group)

    return forward


def _dispatch_compute_combine(
    local_forward: Any, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor, group: Any
) -> torch.Tensor:
    """x (rows, dim) sorted by expert, counts (n_experts,) rows per expert -> (rows, dim).

    Dispatch: rank r of the group holds experts [r * local, (r+1) * local), a contiguous run of
    x's rows: one all-to-all of the counts, then one of the rows. The rows arrive grouped by
    the rank that sent them, each group sorted by expert; a stable sort by expert makes one run
    per local expert for the grouped GEMM. Combine undoes both, in reverse.
    """
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # (source, local expert), flattened
    # The split sizes must be on the host: one synchronization per MoE layer and direction.
    send_rows = counts.view(ep, local).sum(1).tolist()
    recv_rows = received.view(ep, local).sum(1).tolist()
    rows = _AllToAll.apply(x, recv_rows, send_rows, group)
    expert_of_row = torch.arange(local, device=x.device).repeat(ep)
    order = torch.argsort(torch.repeat_interleave(expert_of_row, received), stable=True)
    out = local_forward(experts, rows[order], received.view(ep, local).sum(0))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=x.device)
    return _AllToAll.apply(out[inverse], send_rows, recv_rows, group)


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
