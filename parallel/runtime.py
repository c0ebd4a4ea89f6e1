"""Process group, device and the (dp_replicate, dp_shard, cp, tp) DeviceMesh (a rank's life around
them, signals and locks, is in launch/lifecycle.py)."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from configs import ConfigError
from parallel.dims import LaunchEnv

logger = logging.getLogger(__name__)


def pick_device(requested: str, env: LaunchEnv) -> torch.device:
    """CUDA (one GPU per local rank) when available or requested, else CPU. Never assumed."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("parallel.device='cuda' but no CUDA device is visible")
    if env.local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"LOCAL_RANK={env.local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
            "start at most one process per GPU (--nproc-per-node)"
        )
    return torch.device("cuda", env.local_rank)


def init_distributed(
    device: torch.device,
    env: LaunchEnv,
    timeout_s: int,
    trace_entries: int = 0,
    trace_dir: Path | None = None,
) -> None:
    """Join the default process group: NCCL on GPUs, gloo on CPU.

    A plain `python train.py` (no torchrun) gets a one-rank group on an in-memory store, so the
    same FSDP code path runs everywhere and no port is needed. `trace_entries` > 0 turns on
    torch's flight recorder (`flight_recorder_env`).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if trace_entries and trace_dir is not None:
        # Read when the process group is created: set before it.
        for name, value in flight_recorder_env(trace_entries, trace_dir).items():
            os.environ.setdefault(name, value)  # what the user exported wins
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size == 1 and not launched_by_torchrun():
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        # device_id binds NCCL to this GPU eagerly, so a wrong mapping fails here, not mid-step.
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)


def flight_recorder_env(entries: int, trace_dir: Path) -> dict[str, str]:
    """torch's flight recorder: a ring of each rank's last `entries` collectives (kind, sizes,
    sequence number, state). NCCL's watchdog dumps it on a timeout, as
    `<trace_dir>/rank_<N>`; gloo records it too and the rank dumps it itself
    (launch/health.py). `python -m launch.hangs <run dir>` reads the dumps."""
    return {
        "TORCH_FR_BUFFER_SIZE": str(entries),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(trace_dir / "rank_"),
    }


def set_timeout(seconds: int) -> int:
    """The timeout of every process group, from now on (the steady-state one after warm-up).

    After a barrier under the old timeout: a rank still in its slow first step must not be
    waited for under the short one. torch has no public call for either part: the groups are
    enumerated from c10d's registry and set with `_set_pg_timeout` (torchtitan does the same).
    """
    dist.barrier()
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    return seconds


def launched_by_torchrun() -> bool:
    return "MASTER_ADDR" in os.environ and "RANK" in os.environ


def build_mesh(
    device: torch.device, dp_replicate: int, dp_shard: int, tp: int = 1, cp: int = 1, pp: int = 1
) -> DeviceMesh:
    """A 4D mesh (dp_replicate, dp_shard, cp, tp), torchtitan's order. tp is innermost, so with
    torchrun's rank order a tensor-parallel group is consecutive ranks of one node (its
    collectives run in every layer and need the fastest links); cp next (it all-gathers keys
    and values in every layer); then the ranks of one replica are contiguous, so a shard group
    lies inside a node where it can and only the gradient all-reduce crosses nodes: that is
    HSDP's point. Pipeline parallel (pp > 1) is a fifth dimension outside them all: a stage's
    ranks are contiguous, and only its point-to-point sends cross to the next stage's nodes."""
    shape, names = (dp_replicate, dp_shard, cp, tp), ("dp_replicate", "dp_shard", "cp", "tp")
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def pp_size(mesh: DeviceMesh) -> int:
    """The pipeline-parallel degree of a `build_mesh` mesh (1 without a pp dimension)."""
    return mesh["pp"].size() if "pp" in (mesh.mesh_dim_names or ()) else 1


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh handed to fully_shard (`fsdp_and_tp_meshes`)."""
    return fsdp_and_tp_meshes(mesh)[0]


def fsdp_and_tp_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
    """The mesh handed to fully_shard, and the one tensor parallel splits over, from one root
    (FSDP2 joins the two into one mesh for a TP DTensor and refuses meshes of two roots).
    `fsdp_meshes` has both, and their join."""
    dp, tp, _ = fsdp_meshes(mesh)
    return dp, tp


def fsdp_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(fully_shard's mesh, tensor parallel's, and the two joined with tp last: the mesh of a
    weight that both split, as FSDP2 makes it), all from one root.

    fully_shard's mesh is 1D (FSDP) unless there are replicas (HSDP). Context parallel's ranks
    hold the same weights and see different tokens, exactly as data-parallel ranks do: FSDP
    shards over dp_shard x cp (and reduces gradients over both), a dimension made here (new
    process groups: every rank calls this once, at the same point)."""
    replicas, cp = mesh["dp_replicate"].size(), mesh["cp"].size()
    dp_names = ("dp_replicate", "dp_shard") if replicas > 1 else ("dp_shard",)
    if cp > 1:
        # The same ranks as (dp_replicate, dp_shard, cp, tp) with the two middle dims as one
        # (cp is inner to dp_shard, so merging them keeps torchrun's rank order), built as a
        # mesh of its own: public API, where torchtitan flattens with DeviceMesh._flatten. Its
        # tp dim holds the same ranks as the 4D mesh's.
        shape = (replicas, mesh["dp_shard"].size() * cp, mesh["tp"].size())
        names = ("dp_replicate", "dp_shard_cp", "tp")
        if (pp := pp_size(mesh)) > 1:  # the same for each stage's ranks
            shape, names = (pp, *shape), ("pp", *names)
        mesh = init_device_mesh(mesh.device_type, shape, mesh_dim_names=names)
        dp_names = ("dp_replicate", "dp_shard_cp") if replicas > 1 else ("dp_shard_cp",)
    return mesh[dp_names], mesh["tp"], mesh[(*dp_names, "tp")]


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among all data-parallel ranks, replicas included. The cp ranks of one
    dp rank share its index: they split the same sequences (parallel/cp.py)."""
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()
