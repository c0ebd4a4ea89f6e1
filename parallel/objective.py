"""What the training step minimizes, as the step sees it: a sum over a micro-batch, and the
units the step's loss is a mean over.

`train_step` divides each micro-batch's summed loss by the step's units over all ranks (target
tokens for the cross-entropy, pairs for DPO, parallel/dpo.py), so the loss and gradients do not
depend on the mesh or the micro-batching, whatever the objective. An objective's statistics
(DPO's rewards) reach the step as the family's do: `StepTerms`, joined with the family's by
`JoinedTerms`, summed over micro-batches and ranks on the loss all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from data.documents import MicroBatch
from data.loader import NO_TARGET
from model import StepTerms

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Objective(Protocol):
    terms: StepTerms | None
    """Its statistics (None: none)."""
    rows_per_sample: int
    """Sequences in each sample of the stream (a preference pair: 2), for tokens/s."""

    def units(self, batch: MicroBatch) -> torch.Tensor:
        """What the step's loss is a mean over, in this micro-batch (a 0-d tensor)."""

    def __call__(self, model: nn.Module, batch: MicroBatch) -> torch.Tensor:
        """The micro-batch's summed loss (forward included)."""


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy, in float32 for a stable log-softmax."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def summed_loss(
    model: nn.Module, batch: MicroBatch, loss_fn: LossFn = cross_entropy_sum
) -> torch.Tensor | None:
    """The model's summed loss on one micro-batch (`loss_fn`: possibly the compiled one; a
    `ChunkedLoss` takes the final hidden states and projects them itself, a chunk at a time).
    At tp > 1 call it under `loss_context`: the loss is then a DTensor holding the whole value
    on every tp rank, returned as a plain tensor (its backward still runs through DTensor).
    A `Pipeline` (evaluation under pp) returns None on a rank without the last stage."""
    from parallel.loss import ChunkedLoss

    # Only when chunking: a family without `hidden_only` keeps working unchunked.
    chunked = {"hidden_only": True} if isinstance(loss_fn, ChunkedLoss) else {}
    out = model(batch.inputs, document_ids=batch.document_ids, positions=batch.positions,
                **chunked)  # fmt: skip
    if out is None:
        return None
    loss = loss_fn(out, batch.targets)
    return loss.to_local() if isinstance(loss, DTensor) else loss


class TokenLoss:
    """The cross-entropy, a mean over the step's target tokens (the default objective)."""

    terms: StepTerms | None = None
    rows_per_sample = 1

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn

    def units(self, batch: MicroBatch) -> torch.Tensor:
        return (batch.targets != NO_TARGET).sum()

    def __call__(self, model: nn.Module, batch: MicroBatch) -> torch.Tensor:
        loss = summed_loss(model, batch, self.loss_fn)
        assert loss is not None  # the step runs a pipeline through Pipeline.step instead
        return loss


class JoinedTerms:
    """Two `StepTerms` as one: extra losses added, statistics concatenated (and split again
    for each one's `after_step`)."""

    def __init__(self, first: StepTerms, second: StepTerms) -> None:
        self.parts, self.sizes = (first, second), [0, 0]

    def collect(self, sequences: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        losses, stats = [], []
        for i, part in enumerate(self.parts):
            extra, stat = part.collect(sequences)
            self.sizes[i] = stat.numel()
            losses += [] if extra is None else [extra]
            stats.append(stat)
        return (sum(losses) if losses else None), torch.cat(stats)  # type: ignore[return-value]

    def after_step(self, stats: torch.Tensor, log: bool) -> dict[str, float]:
        first, second = stats.split(self.sizes)
        return self.parts[0].after_step(first, log) | self.parts[1].after_step(second, log)


def join_terms(first: StepTerms | None, second: StepTerms | None) -> StepTerms | None:
    if first is None or second is None:
        return first or second
    return JoinedTerms(first, second)
