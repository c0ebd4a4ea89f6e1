"""What the training step minimizes, as the step sees it: a sum over a micro-batch, and the
units the step's loss is a mean over.

`train_step` divides each micro-batch's summed loss by the step's units over all ranks (target
tokens for the cross-entropy, pairs for DPO, parallel/dpo.py), so the loss and gradients do not
depend on the mesh or the micro-batching, whatever the objective. An objective runs in two
parts, so that a pipeline can run them on different ranks (parallel/pp.py): `prepare`, before
the policy's forward (DPO's reference log-probs), and `loss`, from the model's output on the
rank that holds the output. Its statistics (DPO's rewards) come back with each loss, are summed
over micro-batches and ranks on the loss all-reduce, and reach `after_step` once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from data.documents import MicroBatch
from data.loader import NO_TARGET

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Forward = Callable[..., Any]
"""What runs the model on a batch: the model, or a `Pipeline` (None on a rank without the last
stage)."""


class Objective(Protocol):
    rows_per_sample: int
    """Sequences in each sample of the stream (a preference pair: 2), for tokens/s."""
    stats_size: int
    """How many statistics `loss` returns (0: none)."""
    hidden_only: bool
    """`loss` takes the final hidden states, not the logits (the chunked loss)."""

    def units(self, batch: MicroBatch) -> torch.Tensor:
        """What the step's loss is a mean over, in this micro-batch (a 0-d tensor)."""

    def prepare(self, forward: Forward, model: nn.Module, batch: MicroBatch) -> Any:
        """What `loss` needs of the batch besides the model's output, before the policy's
        forward (its activations then wait for backward): a tensor of one value per row, or
        None. `forward` runs the model, `model` holds its modules."""

    def loss(
        self, out: torch.Tensor, targets: torch.Tensor, prepared: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's summed loss from the model's output, and its summed statistics
        (`stats_size` values)."""

    def after_step(self, stats: torch.Tensor, log: bool) -> dict[str, float]:
        """After the optimizer step, with the step's statistics summed over micro-batches and
        ranks: the scalars to log when `log`."""

    def scalars(self, stats: torch.Tensor) -> dict[str, float]:
        """The scalars of statistics summed over micro-batches and ranks (an evaluation's)."""


def objective_loss(
    objective: Objective, forward: Forward, batch: MicroBatch
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The micro-batch's summed loss and statistics, forward included (`forward`: the model,
    or a `Pipeline` for evaluation under pp, which gives None on a rank without the last
    stage). At tp > 1 call it under `loss_context`: the loss comes back a plain tensor, its
    backward still running through DTensor."""
    prepared = objective.prepare(forward, getattr(forward, "parts", forward), batch)
    # Only when chunking: a family without `hidden_only` keeps working unchunked.
    chunked = {"hidden_only": True} if objective.hidden_only else {}
    out = forward(batch.inputs, document_ids=batch.document_ids, positions=batch.positions,
                  **chunked)  # fmt: skip
    if out is None:
        return None
    loss, stats = objective.loss(out, batch.targets, prepared)
    return (loss.to_local() if isinstance(loss, DTensor) else loss), stats


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy, in float32 for a stable log-softmax."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def summed_loss(
    model: nn.Module, batch: MicroBatch, loss_fn: LossFn = cross_entropy_sum
) -> torch.Tensor:
    """The model's summed cross-entropy on one micro-batch (`loss_fn`: possibly the compiled
    one; a `ChunkedLoss` takes the final hidden states and projects them itself, a chunk at a
    time): `objective_loss` of the default objective, for a model without pp."""
    result = objective_loss(TokenLoss(loss_fn), model, batch)
    assert result is not None  # noqa: S101 - a model, not a Pipeline, always has the output
    return result[0]


class TokenLoss:
    """The cross-entropy, a mean over the step's target tokens (the default objective)."""

    rows_per_sample, stats_size = 1, 0

    def __init__(self, loss_fn: LossFn) -> None:
        from parallel.loss import ChunkedLoss

        self.loss_fn, self.hidden_only = loss_fn, isinstance(loss_fn, ChunkedLoss)

    def units(self, batch: MicroBatch) -> torch.Tensor:
        return (batch.targets != NO_TARGET).sum()

    def prepare(self, forward: Forward, model: nn.Module, batch: MicroBatch) -> None:
        return None

    def loss(
        self, out: torch.Tensor, targets: torch.Tensor, prepared: None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss_fn(out, targets), torch.zeros(0, device=targets.device)

    def after_step(self, stats: torch.Tensor, log: bool) -> dict[str, float]:
        return {}

    def scalars(self, stats: torch.Tensor) -> dict[str, float]:
        return {}
