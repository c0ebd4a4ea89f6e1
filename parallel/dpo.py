"""Direct preference optimization (`[dpo]`): TRL's `DPOTrainer` loss, as an objective of the step.

A micro-batch of preference pairs (data/pairs.py) holds each pair's chosen and rejected rows
side by side (rows 2i and 2i + 1). A row's log-probability is the sum of its targets' log-probs
(the completion and its EOS, TRL's `completion_mask`); the reference's comes from one of three
places (`dpo.reference`):

- ``copy``: a frozen copy of the starting weights, built by the same builder as the policy and
  sharded like it (FSDP2; under pp split into the same stages, run by a `Pipeline` of its own),
  with no gradients and no optimizer state; its forward runs under no_grad before the policy's.
- ``lora``: the policy itself with its LoRA adapters switched off (parallel/lora.py
  `adapters_off`): the base model, which LoRA leaves frozen, so no second copy exists.
- ``precomputed``: one pass over the training pairs before the first step
  (parallel/dpo_reference.py) writes every pair's reference log-probs to a file, which the
  loader reads with the batch: the reference costs nothing during training.

The loss per pair (beta = `dpo.beta`, d = (chosen - ref chosen) - (rejected - ref rejected)):

- ``sigmoid``: -(1 - ls) log sigmoid(beta d) - ls log sigmoid(-beta d), ls =
  `dpo.label_smoothing` (conservative DPO; at ls = 0 TRL's "sigmoid" loss exactly);
- ``robust``: TRL's "robust" (ls the probability that a label is flipped);
- ``ipo``: TRL's "ipo": (d' - 1 / (2 beta))^2 with d' from the log-ratios divided by each
  completion's token count.

The step divides the summed loss by the step's pairs over all ranks (`units`), so it is the
mean over the global batch's pairs, as TRL's `per_sequence_loss.mean()`, on any mesh and with
any accumulation. The statistics (TRL's metrics) are sums over pairs, divided by the pairs
counted with them at the log step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from configs import ConfigError
from data.documents import MicroBatch
from parallel.loss import ChunkedLoss
from parallel.objective import Forward

LossType = Literal["sigmoid", "robust", "ipo"]
Reference = Literal["copy", "lora", "precomputed"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip


@dataclass
class DPOConfig:
    """`[dpo]`: train on preference pairs with DPO instead of the cross-entropy."""

    enabled: bool = False
    """Train with DPO (needs a dataset of preference pairs: data.prepare --format preference)."""
    beta: float = 0.1
    """How far the policy may move from the reference (TRL's beta; IPO's tau); > 0."""
    loss_type: LossType = "sigmoid"
    """'sigmoid' (DPO), 'robust' (robust DPO) or 'ipo' (IPO), as TRL computes them."""
    label_smoothing: float = 0.0
    """sigmoid: conservative DPO's label smoothing; robust: the chance a label is flipped;
    in [0, 0.5)."""
    reference: Reference = "copy"
    """Where the reference log-probs come from: 'copy' (a frozen, sharded copy of the starting
    weights), 'lora' (the policy with its adapters off; needs lora.enabled) or 'precomputed' (one
    pass over the pairs before training, read with the batch)."""
    reference_path: str = ""
    """precomputed: the file of reference log-probs (.npy, a .json fingerprint beside it);
    default: reference_logps.npy in the run folder. An existing one is checked, not rewritten."""

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}"
            )
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ConfigError(
                "dpo.label_smoothing applies to loss_type 'sigmoid' and 'robust', not 'ipo'"
            )


def sequence_logps(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its targets (NO_TARGET positions add 0), float32.
    At tp > 1, under loss_context, `out` is the logits split over the vocabulary."""
    nll = F.cross_entropy(out.flatten(0, 1).float(), targets.flatten(), reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.full_tensor()
    return -nll.view(targets.shape).sum(dim=1)


def dpo_losses(
    logps: torch.Tensor,
    reference: torch.Tensor,
    lengths: torch.Tensor,
    cfg: DPOConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair losses and the summed statistics (METRICS, then the pair count) of rows
    (chosen, rejected, chosen, ...) with their reference log-probs and target counts."""
    chosen, rejected = logps[0::2], logps[1::2]
    chosen_ratio = chosen - reference[0::2]
    rejected_ratio = rejected - reference[1::2]
    delta = chosen_ratio - rejected_ratio
    beta, ls = cfg.beta, cfg.label_smoothing
    if cfg.loss_type == "sigmoid":
        losses = -(1 - ls) * F.logsigmoid(beta * delta) - ls * F.logsigmoid(-beta * delta)
    elif cfg.loss_type == "robust":
        clean = -(1 - ls) * F.logsigmoid(beta * delta)
        flipped = -ls * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * ls)
    else:  # ipo: the log-ratios per completion token (TRL's normalization)
        per_token = chosen_ratio / lengths[0::2].clamp(min=1) - rejected_ratio / lengths[
            1::2
        ].clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    with torch.no_grad():
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        stats = torch.stack([
            chosen_rewards.sum(), rejected_rewards.sum(),
            (chosen_rewards > rejected_rewards).float().sum(),
            (chosen_rewards - rejected_rewards).sum(), chosen.sum(), rejected.sum(),
            torch.tensor(float(len(chosen)), device=logps.device),
        ]).float()  # fmt: skip
    return losses, stats


class DPOLoss:
    """The DPO objective (parallel/objective.py `Objective`): summed over a micro-batch's pairs,
    normalized by the step's pairs. `reference_model`: what runs the frozen copy (`dpo.reference
    = 'copy'`: the copy, or its `Pipeline` under pp); with 'lora' the policy runs with its
    adapters off; with 'precomputed' the batch brings the values."""

    rows_per_sample = 2  # chosen, rejected
    stats_size = len(METRICS) + 1  # and the pairs they are sums over

    def __init__(
        self,
        cfg: DPOConfig,
        reference_model: Forward | None = None,
        cp_group: dist.ProcessGroup | None = None,
        chunked: ChunkedLoss | None = None,
        reference_output: nn.Module | None = None,
    ) -> None:
        """`chunked` (train.loss_chunk_tokens): the policy's chunked loss, whose projection
        the log-probs come from a chunk at a time, from the final hidden states; with the copy,
        `reference_output` is the copy's projection."""
        self.cfg, self.reference_model, self.cp_group = cfg, reference_model, cp_group
        self.chunked, self.reference_output = chunked, reference_output
        self.hidden_only = chunked is not None
        self.since_log: torch.Tensor | None = None

    def _logps(
        self, out: torch.Tensor, targets: torch.Tensor, output: nn.Module | None = None
    ) -> torch.Tensor:
        """Each whole row's log-probability, from the logits or (chunked) the hidden states."""
        if self.chunked is None:
            return self._whole_rows(sequence_logps(out, targets))
        return self._whole_rows(-self.chunked.row_nll(out, targets, output))

    def _whole_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """Under context parallel each rank holds part of every row's tokens: the sums over the
        cp ranks (an all-reduce whose backward all-reduces the gradients: each cp rank counted
        the step's pairs into its units, so the step's normalization makes that exact)."""
        if self.cp_group is None:
            return per_row
        return dist_nn.all_reduce(per_row, group=self.cp_group)

    def units(self, batch: MicroBatch) -> torch.Tensor:
        return torch.tensor(batch.inputs.shape[0] // 2, device=batch.inputs.device)

    def prepare(self, forward: Forward, model: nn.Module, batch: MicroBatch) -> torch.Tensor | None:
        """The rows' reference log-probs: the batch's, or from the reference model (None under
        pp on a rank without the last stage)."""
        if batch.reference is not None:
            return batch.reference
        return self.reference_logps(forward, model, batch)

    @torch.no_grad()
    def reference_logps(
        self, forward: Forward, model: nn.Module, batch: MicroBatch
    ) -> torch.Tensor | None:
        """The rows' log-probs under the reference: the copy, or `model` without adapters
        (run by `forward`)."""
        from parallel.lora import adapters_off

        copy = self.cfg.reference == "copy"
        if copy:
            assert self.reference_model is not None
            forward, context = self.reference_model, contextlib.nullcontext()
        else:
            context = adapters_off(model)
        chunked = {"hidden_only": True} if self.hidden_only else {}
        with context:
            out = forward(batch.inputs, document_ids=batch.document_ids, positions=batch.positions,
                          **chunked)  # fmt: skip
            logps = None if out is None else self._logps(out, batch.targets, self.reference_output)
        if copy and self.hidden_only:  # its projection stayed gathered for the chunks: free it
            for part in getattr(forward, "parts", [forward]):
                if isinstance(part, FSDPModule):
                    part.reshard()
        return logps

    def loss(
        self, out: torch.Tensor, targets: torch.Tensor, prepared: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logps = self._logps(out, targets)
        with torch.no_grad():
            lengths = self._whole_rows((targets != -100).sum(dim=1).to(logps.dtype))
        losses, stats = dpo_losses(logps, prepared.to(logps.dtype), lengths, self.cfg)
        return losses.sum(), stats

    def after_step(self, stats: torch.Tensor, log: bool) -> dict[str, float]:
        # Means over the pairs of every step since the last log (TRL averages its logging
        # interval's steps, each a mean over the same number of pairs).
        self.since_log = stats if self.since_log is None else self.since_log + stats
        if not log:
            return {}
        total, self.since_log = self.since_log, None
        return self.scalars(total)

    def scalars(self, stats: torch.Tensor) -> dict[str, float]:
        """TRL's metrics: means over the pairs the statistics were summed over."""
        total = stats.tolist()
        return {name: value / total[-1] for name, value in zip(METRICS, total, strict=False)}
