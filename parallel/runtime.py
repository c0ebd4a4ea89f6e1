"""Process group, device and the 2D data-parallel DeviceMesh; and the process's life around
them: stop signals, dying with the launcher, one trainer per run folder."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

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


def init_distributed(device: torch.device, env: LaunchEnv, timeout_s: int) -> None:
    """Join the default process group: NCCL on GPUs, gloo on CPU.

    A plain `python train.py` (no torchrun) gets a one-rank group on an in-memory store, so the
    same FSDP code path runs everywhere and no port is needed.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.world_size == 1 and not _launched_by_torchrun():
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        # device_id binds NCCL to this GPU eagerly, so a wrong mapping fails here, not mid-step.
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)


def _launched_by_torchrun() -> bool:
    return "MASTER_ADDR" in os.environ and "RANK" in os.environ


def build_mesh(device: torch.device, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    """A 2D mesh (dp_replicate, dp_shard). Ranks of one replica are contiguous, so with
    torchrun's rank order a shard group lies inside a node and only the gradient all-reduce
    crosses nodes: that is HSDP's point."""
    return init_device_mesh(
        device.type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh handed to fully_shard: 1D (FSDP) unless there are replicas (HSDP)."""
    return mesh if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among all data-parallel ranks, replicas included."""
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()


# ---- the process's life: stop signals, the launcher's death, one trainer per run folder ------

# SIGTERM: preemption, scancel, Kubernetes, torchrun forwarding its own stop. SIGINT: Ctrl-C.
# SIGUSR1: Slurm's warning ahead of the time limit (--signal=USR1@120), forwarded by the launcher.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Turns a stop signal into "finish this step, save a checkpoint, exit 0".

    The handler only records the signal; the training loop reads it after its step, and every
    rank agrees on the same step because the flag rides on the step's loss all-reduce (a rank
    the signal missed stops with the others). One event can deliver the signal twice (Slurm
    signals every process of the job, and torchrun forwards its copy), so a repeat is not
    "hurry up"; the third signal exits at once, for a user who really means it.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._count = 0

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self._count += 1
        name = signal.Signals(signum).name
        if self._count >= 3:
            raise SystemExit(128 + signum)
        if self.signal_name is None:
            self.signal_name = name
            logger.warning("%s received: stopping after the current step", name)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


def exit_with_launcher() -> None:
    """Under torchrun, have the kernel send this rank SIGTERM when its launcher dies.

    torchrun starts each rank in a session of its own, so a `kill -9` of torchrun (or of its
    process group) would leave the ranks training unsupervised, and a relaunch would run two
    trainers on one run folder. SIGTERM, not SIGKILL: the ranks stop like on preemption,
    saving the step in flight when their peers are alive, else failing at the collective
    timeout. Linux only (prctl); elsewhere a no-op.
    """
    if not _launched_by_torchrun() or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class RunLock:
    """An exclusive lock on a run folder, held by rank 0 for the whole run.

    Two trainers on one run folder overwrite each other's checkpoints mid-save. The lock is a
    `flock` on `<run dir>/.lock`: the kernel releases it when the holder dies, even by
    `kill -9`, so a stale lock never blocks a restart. The file names the holder (host, pid,
    since when) for the error message. Where the file system has no flock, the recorded pid is
    checked instead (on the same host).
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"
        self._file: Any = None

    def acquire(self) -> str | None:
        """Take the lock; returns None, or why not (one line naming the holder)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the whole run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return self._busy(holder)
        except OSError:  # no flock here (some network file systems): trust a live pid
            f.seek(0)
            holder = f.read().strip()
            host, _, pid = holder.partition(" pid ")
            if host == socket.gethostname() and _pid_alive(int(pid.split()[0] or 0)):
                f.close()
                return self._busy(holder)
        f.seek(0)
        f.truncate()
        f.write(f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%F %T')}\n")
        f.flush()
        self._file = f
        return None

    def _busy(self, holder: str) -> str:
        return (
            f"run folder {self.path.parent} is in use by {holder} (lock {self.path}): stop that "
            "run first, or choose another run.name"
        )

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)
            self._file.close()  # closing drops the flock
            self._file = None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
