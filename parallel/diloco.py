"""Semi-synchronous replica groups for slow links: DiLoCo (arXiv 2311.08105) on torchft.

With `ft.sync_steps = H > 0` the replica groups of parallel/ft.py stop reducing gradients at
every step. Each group trains alone (FSDP, tp, ... inside it as usual; its loss and gradients
are its own part of the global batch), and every H steps torchft's `local_sgd.DiLoCo` syncs
them, from inside the inner optimizer's step: the groups average their pseudo-gradient (the
weights at the last sync minus the weights now) and apply it to the last sync's weights with an
outer SGD with Nesterov momentum (the paper's lr 0.7, momentum 0.9). The link then carries one
all-reduce of the weights every H steps instead of the gradients every step.

What changes against the synchronous groups:
- the quorum is asked at each sync only; a group that fails between syncs is dropped at the
  next one, and a sync that fails is discarded by torchft (each group's weights go back to the
  last sync's), after which the groups train on;
- a (re)started group resumes from the newest checkpoint, trains alone until the next sync and
  heals there from a peer (its weights, optimizer states, step and data position, and DiLoCo's
  last-sync weights and outer momentum), mid-step: the loop reads its data anew;
- the groups' weights are equal right after a sync only: they are compared at the run's end
  when it is one (its inner optimizer states are each group's own), and a checkpoint holds
  the weights and inner optimizer state of the group that wrote it;
  DiLoCo's last-sync weights and outer momentum are not in checkpoints (a resume restarts
  them from the weights it loads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parallel.ft import HEALED, ReplicaGroups, T


class SemiSyncGroups(ReplicaGroups):
    """ReplicaGroups whose groups sync every ft.sync_steps steps through DiLoCo (module
    docstring); the step sees a group of its own between syncs."""

    def attach(self, parts: list[nn.Module], states: dict[str, Any], resume: Callable[[], T]) -> T:
        from torchft.local_sgd import DiLoCo

        self.states = {key: states[key] for key in HEALED}
        resumed = resume()  # no quorum before the first sync: every group resumes as a run does
        # The quorum counts syncs: a group resumed from an older checkpoint is behind and
        # heals at its first sync.
        syncs = self.states["train"].step // self.cfg.sync_steps
        self.manager.load_state_dict({"step": syncs, "batches_committed": syncs * self.groups})
        model, optimizer = states["model"].model, states["optimizer"].optimizer
        outer = torch.optim.SGD(model.parameters(), lr=self.cfg.outer_lr,
                                momentum=self.cfg.outer_momentum, nesterov=True)  # fmt: skip
        # Its hooks on the inner optimizer sync every sync_steps steps (and hold back a heal's
        # read of the state while the optimizer steps).
        self.diloco = DiLoCo(self.manager, [model], optimizer, outer, self.cfg.sync_steps)
        self.diloco.__enter__()
        return resumed

    def start_step(self) -> bool:
        healed, self.healed = self.healed, False  # a heal happens inside the last step
        return healed

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor  # between syncs every number of the step is the group's

    def commit(self, step: int) -> bool:
        return True  # the sync commits or not inside the optimizer's step (torchft)

    @property
    def writes_checkpoints(self) -> bool:
        # The first of the last sync's quorum; before any sync (no quorum: 0 taking part),
        # group 0.
        if self.present == 0:
            return self.cfg.group == 0
        return self.manager.participating_rank() == 0

    def scalars(self) -> dict[str, float]:
        return {"ft/groups": float(self.present)} if self.present else {}

    def close(self, finished: int | None) -> None:
        self.diloco.__exit__(None, None, None)
        # Right after a sync every group holds its weights (each its own inner optimizer).
        if self.cfg.compare_interval and finished is not None and self.present:
            if finished % self.cfg.sync_steps == 0:
                self.compare(finished, keys=("model",))
        self.manager.shutdown(wait=False)
