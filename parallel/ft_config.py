"""The `[ft]` section (fault-tolerant replica groups, parallel/ft.py) and what is checked of it
before any process group exists: a module of its own, so that the config tree and the checks
need neither torch.distributed nor torchft."""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from configs import ConfigError

# torchft's own variable for the lighthouse's address (its Manager reads it too).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


@dataclass
class FaultToleranceConfig:
    enabled: bool = False
    """Fault-tolerant replica groups on torchft (docs/launch.md): each group a torchrun job of
    its own, the groups a quorum; a failed group stops no other one and heals from a live
    peer. Needs `pip install -e ".[ft]"` and a running `torchft_lighthouse`."""
    group: int = 0
    """This process's replica group, 0 .. groups-1 (the launchers pass it)."""
    groups: int = 2
    """Replica groups the run is planned for: the global batch is split over them as HSDP
    splits it over dp_replicate."""
    min_groups: int = 1
    """Fewest groups a step commits with; with fewer the step waits and is retried."""
    lighthouse: str = ""
    """The lighthouse's address (http://host:port); '' = the TORCHFT_LIGHTHOUSE variable."""
    timeout_s: float = 60.0
    """Seconds a cross-group collective, commit or heal may take before the step fails over."""
    quorum_timeout_s: float = 600.0
    """Seconds a group waits for a quorum (the first one: for the other groups to start)."""
    connect_timeout_s: float = 10.0
    """Seconds to reach the lighthouse, checked before any process group exists."""
    sync_steps: int = 0
    """0: every step is synchronous (HSDP across the groups). N > 0: DiLoCo, for slow links
    (parallel/diloco.py): each group trains alone and every N steps the groups average the
    change of their weights since the last sync, applied by an outer optimizer."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (SGD with Nesterov momentum; the paper's 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9)."""
    start_wait_s: float = 60.0
    """At the run's start (every group at step 0), seconds to wait for all the groups before
    training with fewer (a late group then heals from the others)."""
    compare_interval: int = 100
    """Every N steps (and at the end) the groups compare a digest of their weights and
    optimizer state, bit for bit, and stop with one line if they differ. 0 = never."""

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ConfigError(f"ft.groups must be >= 1, got {self.groups}")
        if not 0 <= self.group < self.groups:
            raise ConfigError(
                f"ft.group={self.group} is out of range for ft.groups={self.groups} "
                f"(0..{self.groups - 1})"
            )
        if not 1 <= self.min_groups <= self.groups:
            raise ConfigError(
                f"ft.min_groups={self.min_groups} must be between 1 and ft.groups={self.groups}"
            )
        if self.sync_steps < 0 or self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                f"ft: sync_steps must be >= 0 ({self.sync_steps}), outer_lr > 0 "
                f"({self.outer_lr}) and outer_momentum in [0, 1) ({self.outer_momentum})"
            )
        if self.compare_interval < 0:
            raise ConfigError(f"ft.compare_interval must be >= 0, got {self.compare_interval}")
        if self.start_wait_s < 0:
            raise ConfigError(f"ft.start_wait_s must be >= 0, got {self.start_wait_s}")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ft.{name} must be > 0, got {getattr(self, name)}")


def lighthouse_address(cfg: FaultToleranceConfig, environ: dict[str, str]) -> str:
    return cfg.lighthouse or environ.get(LIGHTHOUSE_ENV, "")


def check_ft(cfg: FaultToleranceConfig, environ: dict[str, str], under_torchrun: bool) -> None:
    """ConfigError, before any process group exists, for a fault-tolerant run that cannot
    start: torchft missing, no lighthouse or one that does not answer; with `under_torchrun`
    False (a plain `python train.py`), no torchrun."""
    if not cfg.enabled:
        return
    try:
        quiet_torchft()
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(
            'ft.enabled needs torchft, an optional extra: pip install -e ".[ft]"'
        ) from None
    if not under_torchrun:
        raise ConfigError(
            "ft.enabled: start each replica group with torchrun (launch/torchrun.sh, "
            "launch/multinode.sh, launch/hsdp.sbatch): torchft's manager needs its store"
        )
    address = lighthouse_address(cfg, environ)
    if not address:
        raise ConfigError(
            f"ft.enabled needs the lighthouse's address: set ft.lighthouse or {LIGHTHOUSE_ENV} "
            "(start it with torchft_lighthouse; docs/launch.md)"
        )
    parts = urlsplit(address if "//" in address else f"http://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ConfigError(f"ft.lighthouse {address!r} is not http://host:port")
    # Retried until the timeout: the node that starts the lighthouse may come up last.
    deadline = time.monotonic() + cfg.connect_timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=cfg.connect_timeout_s).close()
            return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"ft.lighthouse {address} cannot be reached within "
                    f"{cfg.connect_timeout_s:g} s ({err.strerror or err}): start "
                    "torchft_lighthouse there first (docs/launch.md)"
                ) from None
            time.sleep(0.2)


def quiet_torchft() -> None:
    """torchft logs every quorum and commit of every rank (Python's logging and its Rust
    core's): errors only (Rust: warnings, unless the user set RUST_LOG). This module says what
    changes."""
    os.environ.setdefault("RUST_LOG", "warn")  # read once, when torchft's core loads
    # Its warnings too: that NCCL's flight recorder cannot be reset (on gloo, at every new
    # quorum). Errors still show.
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # A healing group reads the peer's tensors from a read-only buffer, which torch warns of.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def group_folder(run_dir: Path, cfg: FaultToleranceConfig) -> Path:
    """Where this group's logs, TensorBoard, heartbeats and lock go: each group is a run of
    its own beside the others (checkpoints stay in the run's folder, shared)."""
    return run_dir / f"group{cfg.group}" if cfg.enabled else run_dir


def fingerprint(settings: dict[str, Any]) -> dict[str, int]:
    """Each setting the groups must agree on as a 20-bit number: its square and the sum of
    the squares stay exact in float64 when summed over the groups (`Replicas.sum`)."""
    return {name: zlib.crc32(repr(value).encode()) & 0xFFFFF for name, value in settings.items()}
