"""FSDP2: shard every transformer block, then the root."""

from __future__ import annotations

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

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def apply_fsdp(
    model: nn.Module, units: list[nn.Module], mesh: DeviceMesh, cfg: ParallelConfig
) -> None:
    """Shard `model` in place: each of `units` is one FSDP unit, the rest go to the root.

    `mesh` is 1D for FSDP (parameters Shard(0)) or 2D (dp_replicate, dp_shard) for HSDP
    (parameters (Replicate(), Shard(0)): sharded within a replica, all-reduced across them).
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]
    )
    offload: OffloadPolicy = OffloadPolicy()
    if cfg.cpu_offload:
        # Pinned host memory only helps (and only exists) with a GPU on the other side.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for i, unit in enumerate(units):
        if cfg.reshard_after_forward == "default":
            # The last block's parameters are needed again as soon as backward starts, so
            # freeing and re-gathering them would only add an all-gather.
            reshard = i < len(units) - 1
        else:
            reshard = cfg.reshard_after_forward == "always"
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload,
            reshard_after_forward=reshard,
        )
    # The root holds the embeddings, final norm and output projection. Its parameters are used
    # at both ends of the step, so resharding them after forward saves nothing but time.
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload,
        reshard_after_forward=cfg.reshard_after_forward == "always",
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


@torch.no_grad()
def assign_local_shard(param: torch.Tensor, full_value: torch.Tensor) -> None:
    """Store this rank's shard of `full_value` into a (possibly sharded) parameter.

    Passed to `Transformer.init_weights`: every rank computes the same full value and keeps its
    own slice, with no communication (src_data_rank=None), so initial weights do not depend on
    the mesh. DTensor's own random ops cannot promise that on CPU.
    """
    if isinstance(param, DTensor):
        local = distribute_tensor(
            full_value, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full_value)
