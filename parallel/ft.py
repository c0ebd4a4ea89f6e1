"""Fault-tolerant replica groups on torchft: the replicate dimension as a quorum.

Under HSDP the replicas are a dimension of the DeviceMesh, so one lost rank stops every rank.
With `ft.enabled` each replica group is a torchrun job of its own (FSDP, tp, cp and pp stay
inside it, on the mesh they use today) and the groups meet through torchft:

- a `Manager` per rank asks torchft's lighthouse, once a step, which groups are alive (the
  quorum) and reconfigures a process group across them (gloo on CPU, NCCL on GPU): rank r of
  each group talks to rank r of the others;
- FSDP2's all-reduce hook sums each reduce-scattered gradient over that process group, where
  native HSDP would all-reduce it over the mesh's replicate dimension;
- the step's token count, loss and model statistics are summed over it too (`Replicas.sum`);
- before the update every group asks the quorum whether the step may commit
  (`Replicas.commit`): a group that failed during the step makes it fail everywhere, and the
  step is read and run again by the groups left, so no update is ever half applied;
- a group that (re)starts behind the others loads their live state, sent by a peer over HTTP
  (torchft's checkpoint transport): the checkpoint's state dict, not a file.

What a step with fewer groups trains on: the global batch shrinks to the groups present. The
data stream is sliced as HSDP slices it (group g reads the g-th part of every step), so a
missing group's part of a step is not trained; each such step is said in the log with the
sequences it skipped, and TensorBoard's ft/groups shows the groups of every logged step. A step
that did not commit is read again, whole: no sequence is trained twice.

Without `ft.enabled` the step talks to a `Replicas` that does nothing: one code path.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from configs import ConfigError
from parallel.ft_config import (
    FaultToleranceConfig,
    lighthouse_address,
    quiet_torchft,
)

logger = logging.getLogger("train")
T = TypeVar("T")


class Replicas:
    """The replicate dimension as the step sees it. Without fault tolerance there is nothing
    to do here: HSDP's replicas are a dimension of the DeviceMesh and FSDP reduces over it."""

    groups = 1
    """The replica groups of the run's plan."""

    def attach(self, parts: list[nn.Module], states: dict[str, Any], resume: Callable[[], T]) -> T:
        """Hook the FSDP modules of `parts`, keep the state a peer would need, and `resume`
        (load the run's checkpoint; returns what it returns)."""
        return resume()

    def data_slice(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """This rank's slice of the training stream: among all groups' data-parallel ranks."""
        return dp_rank, dp_size

    def start_step(self) -> bool:
        """Before the step reads its data: join the quorum. True if this group just loaded its
        state (weights, optimizer, step, data position): read the loader anew."""
        return False

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the replica groups of this step, in place."""
        return tensor

    def commit(self, step: int) -> bool:
        """Whether every group of the step may take its update."""
        return True

    @property
    def present(self) -> int:
        """The groups taking part in this step."""
        return 1

    def scalars(self) -> dict[str, float]:
        """What to log at a log step."""
        return {}

    @property
    def writes_checkpoints(self) -> bool:
        return True

    def close(self, finished: int | None) -> None:
        """At the run's end: `finished`, its last step if it ran to train.steps (every group
        then ends at the same step), else None (a stop: each group stops on its own)."""


# The checkpoint's entries a healed group loads from a peer (not the config and mesh: its own).
HEALED = ("model", "optimizer", "lr_scheduler", "dataloader", "train")
# Seconds between the quorums asked at the start, while groups are missing (`_quorum`).
START_POLL_S = 0.5
# What the groups compare (`compare_interval`): what a step changes, bit for bit.
COMPARED = ("model", "optimizer")


class ReplicasDiverged(RuntimeError):
    """The replica groups' states differ; the message is the one line about it."""


class ReplicaGroups(Replicas):
    """torchft's Manager for this rank: the quorum, the process group across the groups, the
    commit and the heal (module docstring)."""

    def __init__(
        self, cfg: FaultToleranceConfig, rank: int, world: int, device: torch.device,
        settings: dict[str, int],
    ) -> None:  # fmt: skip
        quiet_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.cfg, self.groups, self.settings, self.rank = cfg, cfg.groups, settings, rank
        self.device = device
        self.states: dict[str, Any] = {}
        self.healed = False
        timeout = timedelta(seconds=cfg.timeout_s)
        pg = (
            ProcessGroupNCCL(timeout=timeout)
            if device.type == "cuda"
            else ProcessGroupGloo(timeout=timeout)
        )
        # What the other groups dial: this group's store (their process group meets there when
        # this group is the quorum's first) and its manager. torchrun --standalone says
        # localhost, which only this node reaches: the host's name instead.
        store = os.environ["MASTER_ADDR"]
        if store in ("localhost", "::1") or store.startswith("127."):
            store = socket.gethostname()
        self.manager = Manager(
            pg=pg,
            store_addr=store,
            store_port=int(os.environ["MASTER_PORT"]),
            hostname=store,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=cfg.min_groups,
            # The quorum before the step reads its data: the data a step reads does not depend
            # on it (group g always reads its part), but a healed group must have loaded the
            # peer's data position, and a step retried must know it is one, before reading.
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
            rank=rank,
            world_size=world,
            lighthouse_addr=lighthouse_address(cfg, dict(os.environ)),
            replica_id=f"group{cfg.group}",
            # Every group initializes from train.seed (or the same checkpoint): equal already.
            # A group behind the others (a restart) heals from a peer whatever this says.
            init_sync=False,
        )
        self._checked = False
        self._present = 0
        self._resume: Callable[[], Any] | None = None

    def attach(self, parts: list[nn.Module], states: dict[str, Any], resume: Callable[[], T]) -> T:
        from torch.distributed.fsdp import FSDPModule

        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_all_reduce_hook(self._reduce_gradient)
        self.states = {key: states[key] for key in HEALED}
        # Not yet: at the first quorum a group behind the others (a restart while they train)
        # loads their live state instead, and a checkpoint read first would be time lost. Every
        # group starts at the quorum's step 0, so one that resumes does so in every group.
        self._resume = resume
        return None  # type: ignore[return-value]

    def _reduce_gradient(self, grad: torch.Tensor) -> None:
        # FSDP averaged over this group's ranks; the loss is already a global mean (train.py),
        # so the groups' parts add up. A failure is recorded by the manager: no commit.
        from torch.distributed import ReduceOp

        self.manager.allreduce(grad, reduce_op=ReduceOp.SUM).wait()

    def data_slice(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        return self.cfg.group * dp_size + dp_rank, self.groups * dp_size

    def start_step(self) -> bool:
        self.healed = False
        self._quorum()
        self._checked = False
        if self._resume is not None:  # the first quorum: healed, or resume as any run does
            if not self.healed:
                self._resume()
                step = self.states["train"].step  # the quorum's step is the trainer's from now
                self.manager.load_state_dict({"step": step, "batches_committed": step})
                self.healed = step > 0
            self._resume = None
        # The steps done, as the quorum has them: a group that just healed is at its peers'.
        done, present = self.manager.current_step(), self.present
        if present != self._present and self.rank == 0:
            logger.info("step %d: %d of %d replica groups in the quorum", done + 1, present,
                        self.groups)  # fmt: skip
        self._present = present
        every = self.cfg.compare_interval
        if every and done and done % every == 0:  # after the heal, if there was one
            self.compare(done)
        return self.healed

    def _quorum(self) -> None:
        """This step's quorum. At the run's start it is asked again until every group is in it
        (up to ft.start_wait_s): groups launched together start together. By a count of tries,
        not a clock, so that every rank of a group asks as often as the others."""
        tries = int(self.cfg.start_wait_s / START_POLL_S) if self._resume is not None else 0
        self.manager.start_quorum()
        while tries and self.manager.current_step() == 0 and self.present < self.groups:
            time.sleep(START_POLL_S)
            self.manager.start_quorum()
            tries -= 1

    def compare(self, step: int, keys: tuple[str, ...] = COMPARED) -> None:
        """ReplicasDiverged unless every group of the quorum holds the same weights and
        optimizer state (`keys`) as this one, bit for bit (each rank its shards)."""
        from torch.distributed import ReduceOp, all_reduce

        digests = torch.tensor([_digest(self.states[key].state_dict()) for key in keys],
                               dtype=torch.float64)  # fmt: skip
        both = torch.cat([digests, digests**2]).to(self.device)
        self.manager.allreduce(both, reduce_op=ReduceOp.SUM).wait()
        present = self.present
        differ = self.manager.errored() is None and bool(_unequal(both, present).any())
        # Every rank of the group decides alike, also when only some ranks' shards differ.
        flag = torch.tensor([float(differ)], device=self.device)
        all_reduce(flag, op=ReduceOp.MAX)
        if flag.item():
            raise ReplicasDiverged(
                f"step {step}: the replica groups' {' or '.join(keys)} states differ (a digest "
                "of each rank's shards, compared across the groups): a silent corruption or a "
                "nondeterministic kernel; resume every group from the last checkpoint"
            )
        if self.rank == 0 and self.manager.errored() is None:
            what = "weights and optimizer state" if keys == COMPARED else "weights"
            logger.info("step %d: the %d replica groups hold bitwise-equal %s", step, present,
                        what)  # fmt: skip

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed import ReduceOp

        if self._checked:
            self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
            return tensor
        # The step's first sum carries the settings' check: x and x^2 of each, summed over the
        # groups, are P x and P x^2 exactly when every group has the same x.
        values = torch.tensor(list(self.settings.values()), dtype=torch.float64)
        both = torch.cat([tensor.flatten().double().cpu(), values, values**2]).to(tensor.device)
        self.manager.allreduce(both, reduce_op=ReduceOp.SUM).wait()
        n = tensor.numel()
        if self.manager.errored() is None:
            unequal = _unequal(both[n:], self.present).tolist()
            for name, differs in zip(self.settings, unequal, strict=True):
                if differs:
                    raise ConfigError(
                        f"ft: the replica groups differ in {name}: every group must run the "
                        "same model, data and batch settings (start them with the same "
                        "config and overrides)"
                    )
        tensor.copy_(both[:n].view_as(tensor).to(tensor.dtype))
        self._checked = True
        return tensor

    def commit(self, step: int) -> bool:
        committed = self.manager.should_commit()
        present, said = self.present, self.rank == 0
        if not committed and said:
            why = self.manager.errored() or f"{present} of ft.min_groups={self.cfg.min_groups}"
            logger.warning("step %d: not committed by the replica groups (%s); the groups left "
                           "read and run it again", step, why)  # fmt: skip
        elif present < self.groups and said:
            logger.warning(
                "step %d: %d of %d replica groups; the step trained their %d/%d of the global "
                "batch (the missing groups' part of this step is skipped)",
                step, present, self.groups, present, self.groups,
            )  # fmt: skip
        return committed

    @property
    def present(self) -> int:
        return self.manager.num_participants()

    def scalars(self) -> dict[str, float]:
        return {"ft/groups": float(self.present)}

    @property
    def writes_checkpoints(self) -> bool:
        # One group writes (the first of the quorum: another one after it fails); the others'
        # state is the same, bit for bit.
        return self.manager.participating_rank() == 0

    def close(self, finished: int | None) -> None:
        if self.cfg.compare_interval and finished is not None:
            self.compare(finished)  # every group ends on the same state
        self.manager.shutdown(wait=False)

    # What a peer sends: the checkpoint's state dict with each DTensor as its local shard
    # (rank r of a group heals from rank r of another: the same mesh, the same shards).
    def _state(self) -> dict[str, Any]:
        return {key: _local(state.state_dict()) for key, state in self.states.items()}

    def _load(self, received: dict[str, Any]) -> None:
        for key, state in self.states.items():
            state.load_state_dict(_into(state.state_dict(), received[key]))
        self.healed = True
        logger.info("healed from a live replica group: its weights, optimizer state, step and "
                    "data position")  # fmt: skip


def _unequal(summed: torch.Tensor, present: int) -> torch.Tensor:
    """From [x..., x^2...] summed over `present` groups, which x were not the same in every
    group: the sums are P x and P x^2 exactly when they were (Cauchy-Schwarz otherwise)."""
    sums, squares = summed.cpu().chunk(2)
    return sums * sums != present * squares


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    if isinstance(state, DTensor):
        return [state.to_local()]
    return [state] if isinstance(state, torch.Tensor) else []


def _digest(state: Any) -> int:
    """A 20-bit digest of the bits of every tensor in `state` (`fingerprint`'s range): each
    tensor's elements summed as integers of their width, the sums hashed in order."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [t.detach().contiguous().view(ints[t.element_size()]).sum(dtype=torch.int64)
            for t in _tensors(state) if t.numel()]  # fmt: skip
    if not sums:
        return 0
    return zlib.crc32(torch.stack(sums).cpu().numpy().tobytes()) & 0xFFFFF


def _local(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_local(v) for v in state)
    return state.to_local() if isinstance(state, DTensor) else state


def _into(template: Any, received: Any) -> Any:
    """`received` (local shards) in the form of this rank's own state dict: each DTensor's
    local shard overwritten, the rest taken as sent."""
    if isinstance(template, dict) and isinstance(received, dict):
        return {k: _into(template[k], v) if k in template else v for k, v in received.items()}
    if isinstance(template, list | tuple) and isinstance(received, list | tuple):
        return type(template)(_into(t, r) for t, r in zip(template, received, strict=True))
    if isinstance(template, DTensor):
        template.to_local().copy_(received)
        return template
    if isinstance(template, torch.Tensor) and isinstance(received, torch.Tensor):
        return received.to(template.device)
    return received
