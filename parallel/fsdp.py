"""FSDP2: shard every transformer block, then the root."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from parallel.dims import ParallelConfig
from parallel.workarounds import set_gradient_divide_factor

if TYPE_CHECKING:
    from model.random_init import Draw
    from parallel.ep import ExpertSharding

Reshard = Literal["default", "always", "never"]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reshard_plan(
    n_blocks: int, mode: Reshard, dp_shard: int, cpu_offload: bool = False, pipelined: bool = False
) -> list[bool]:
    """Whether each FSDP unit frees its gathered parameters after forward: one entry per block
    in order, then the root. The one place this is decided (the planner and train.py ask here).

    - 'always': every unit (ZeRO-3, least memory).
    - 'never': none; each unit stays gathered from its forward to its backward.
    - 'default': every block but the last, whose backward starts right away (freeing and
      re-gathering it would only add an all-gather); never the root, whose parameters are used
      at both ends of the step. With dp_shard = 1 nothing is sharded and an "all-gather" is a
      local copy of each weight (the bf16 cast): 'default' then keeps every block gathered, as
      'never' does (measured +1.7-2.7% on one H100; torchtitan applies no FSDP there at all), for
      one compute-dtype copy of the blocks held through backward, as autocast would. Not with
      cpu_offload: freeing the GPU copy after use is the point of offloading.
    - 'default' under pipeline parallel (`pipelined`, one call per stage): no unit, as
      torchtitan does. A schedule runs the forwards and backwards of different micro-batches
      in turn, and torch's stages keep units gathered through backward until the step's last
      one (parallel/pp.py): a unit freed after each forward would be gathered twice per
      micro-batch instead of once per step, for memory of 1/pp of the blocks.
    """
    if mode == "always":
        return [True] * (n_blocks + 1)
    if mode == "never" or (dp_shard == 1 and not cpu_offload) or pipelined:
        return [False] * (n_blocks + 1)
    return [i < n_blocks - 1 for i in range(n_blocks)] + [False]


def apply_fsdp(
    model: nn.Module,
    units: list[nn.Module],
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    experts: ExpertSharding | None = None,
) -> None:
    """Shard `model` in place: each of `units` is one FSDP unit, the rest go to the root.

    `mesh` is 1D for FSDP (parameters Shard(0)) or 2D (dp_replicate, dp_shard) for HSDP
    (parameters (Replicate(), Shard(0)): sharded within a replica, all-reduced across them).
    `experts` (expert parallel, parallel/ep.py): each expert module first becomes an FSDP unit
    of its own on the data-parallel ranks EP leaves, inside its block's unit.
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]
    )
    offload: OffloadPolicy = OffloadPolicy()
    if cfg.cpu_offload:
        # Pinned host memory only helps (and only exists) with a GPU on the other side.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    dp_shard = mesh.size(mesh.ndim - 1)
    reshard = reshard_plan(len(units), cfg.reshard_after_forward, dp_shard, cfg.cpu_offload,
                           cfg.pp > 1)  # fmt: skip
    for module in experts.modules if experts is not None else []:
        # Freed after forward when its block is; inner units before outer ones, as the root.
        block = next(i for i, u in enumerate(units) if any(m is module for m in u.modules()))
        fully_shard(
            module,
            mesh=experts.fsdp_mesh(),
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=reshard[block],
        )
        # FSDP divides gradients by the ranks of its mesh; these already sum over the EP group
        # (the all-to-all brought the group's tokens), so divide by every data-parallel rank,
        # as for the dense parameters: the trainer's loss scaling then holds for both.
        set_gradient_divide_factor(module, float(mesh.size()), experts.fsdp_mesh())
    for unit, free in zip([*units, model], reshard, strict=True):
        # The blocks first, the root (embeddings, final norm, output projection) last: FSDP2
        # gives a module the parameters that no unit inside it has claimed.
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=free,
        )
    _set_prefetch(units, cfg.forward_prefetch, cfg.backward_prefetch)


def _set_prefetch(units: list[nn.Module], forward: int, backward: int) -> None:
    """Explicit prefetch: issue the all-gathers of the next `forward` blocks (previous
    `backward` blocks) early, trading memory for more overlap on slow links."""
    fsdp_units: list[FSDPModule] = [u for u in units if isinstance(u, FSDPModule)]
    for i, unit in enumerate(fsdp_units):
        if forward > 0:
            unit.set_modules_to_forward_prefetch(fsdp_units[i + 1 : i + 1 + forward])
        if backward > 0:
            unit.set_modules_to_backward_prefetch(fsdp_units[max(0, i - backward) : i][::-1])


def local_region(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the full parameter this rank holds, one slice per dimension (global
    indices); None where it is not one block of the full tensor, or the rank is outside the
    parameter's mesh.

    A plain tensor is all local. For a DTensor, the answer is the one DCP saves by: the chunk
    `__create_chunk_list__` reports (offsets and sizes in the full tensor). That covers every
    layout FSDP2 and tensor parallel make, including FSDP's shard of a TP shard along the same
    dimension (a strided placement: chunk (FSDP) of chunk (TP), still one block), without
    re-deriving DTensor's chunking rules here.
    """
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    if param.device_mesh.get_coordinate() is None:
        return None
    chunks = param.__create_chunk_list__()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(param.to_local().shape):
        return None  # not one block: the caller takes the draw-whole path
    return tuple(slice(o, o + n) for o, n in zip(chunks[0].offsets, chunks[0].sizes, strict=True))


@torch.no_grad()
def assign_local_shard(param: torch.Tensor, draw: Draw) -> None:
    """Store this rank's shard of a parameter, drawing only that shard's values.

    Passed to `init_weights`: `draw(region)` computes the values of any region of the full
    parameter from the seed alone (model/random_init.py), so each rank draws exactly its own
    slice, O(shard) work and no communication, and the initial weights do not depend on the
    mesh. Where `local_region` finds no block, every rank draws the whole parameter and keeps
    its part.
    """
    region = local_region(param)
    if not isinstance(param, DTensor):
        param.copy_(draw(region))
    elif region is not None:
        param.to_local().copy_(draw(region))
    else:
        full = draw(tuple(slice(0, n) for n in param.shape))
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
