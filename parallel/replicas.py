"""The replicate dimension the step talks to (`Replicas`): none beyond the mesh, replica groups
on torchft every step (parallel/ft.py), or DiLoCo's groups meeting every ft.sync_steps steps
(parallel/diloco.py); chosen here from the `[ft]` section."""

from __future__ import annotations

from typing import Any

import torch

from parallel.diloco import SemiSyncGroups
from parallel.ft import ReplicaGroups, Replicas
from parallel.ft_config import FaultToleranceConfig, fingerprint


def build_replicas(
    cfg: FaultToleranceConfig, rank: int, world: int, device: torch.device,
    settings: dict[str, Any],
) -> Replicas:  # fmt: skip
    """This rank's view of the replica groups; `settings`: what every group must agree on."""
    if not cfg.enabled:
        return Replicas()
    groups = SemiSyncGroups if cfg.sync_steps else ReplicaGroups
    return groups(cfg, rank, world, device, fingerprint(settings))
