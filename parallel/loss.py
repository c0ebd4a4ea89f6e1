"""The loss a chunk of tokens at a time (`train.loss_chunk_tokens`): no whole-sequence logits.

At a 128k vocabulary the logits outgrow everything else a long sequence holds: for Llama 3 8B
at seq 8,192 with full AC they and the loss's float32 temporaries are 13.7 GiB of 35 GiB per
rank (parallel/plan.py), at seq 131,072 219 GiB of 294 GiB. With chunking, the model's forward
stops at the final norm (`forward(..., hidden_only=True)`, the model contract) and `ChunkedLoss`
applies the family's output projection (`model.output_layer`) and the cross-entropy to
`chunk_tokens` tokens at a time, each chunk under `torch.utils.checkpoint` (non-reentrant):
forward keeps only the hidden states, and backward recomputes one chunk's logits, takes their
gradient into the hidden states and the weight, and frees them before the next chunk. The peak
is one chunk's logits (and their float32 temporaries) instead of the sequence's. DPO's
sequence log-probs come the same way (`row_nll`: each token's cross-entropy a chunk at a time,
summed per row).

Why checkpoint per chunk and not a custom autograd.Function that computes each chunk's
gradients in forward (Liger's fused linear cross-entropy): it runs exactly the unchunked ops,
so the loss and gradients match the unchunked ones (fp32, tests/test_loss.py), and it calls the
output layer as a module, so whatever that is works unchanged: FSDP2's unsharded weight
(the root unit's parameters stay gathered from its forward to its backward, and the gradient
accumulates on them to be reduce-scattered with the root's), tied embeddings, a LoRA adapter, a
float8 Linear, the compiled loss (`compile.loss`). The price is one more forward of the output
projection per step, about 2% of Llama 3 8B's FLOPs; Liger's saves that but must reimplement
the projection's backward for a bare weight.

At tp > 1 loss parallel already divides the logits by tp (each rank computes its slice of the
vocabulary for every token, parallel/tp.py `loss_context`), and chunking divides them again:
the final norm's output, split along the sequence over the tp ranks, is all-gathered once (what
the output projection's "output" style would gather anyway, for the whole sequence at once),
and each chunk of it goes through the projection, whose logits come out split over the
vocabulary, and through loss parallel's cross-entropy. Backward runs under the same
`loss_context`, so each chunk's recompute does too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from configs import ConfigError
from model import ModelFamily

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ChunkedLoss:
    """`loss_fn(output(hidden), targets)`, summed over chunks of `chunk_tokens` tokens; takes
    the final hidden states (batch, seq, dim) where the plain loss takes the logits."""

    def __init__(self, output: nn.Module, chunk_tokens: int, loss_fn: LossFn) -> None:
        self.output, self.chunk_tokens, self.loss_fn = output, chunk_tokens, loss_fn

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(hidden, DTensor):  # tp > 1: the sequence's shards, gathered on every rank
            hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
        # Chunks of the flattened (batch x seq) tokens. `split`, not slicing: its backward
        # concatenates the chunks' gradients once, where each slice's would be a zero-padded
        # copy of the whole hidden states.
        hiddens = hidden.flatten(0, 1).split(self.chunk_tokens)
        total = None
        for h, t in zip(hiddens, targets.flatten().split(self.chunk_tokens), strict=True):
            if torch.is_grad_enabled():  # validation runs under no_grad: nothing to recompute
                part = checkpoint(self._chunk, h, t, use_reentrant=False)
            else:
                part = self._chunk(h, t)
            total = part if total is None else total + part
        return total

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # A batch of one sequence, the shapes loss_fn takes: (1, tokens, dim), (1, tokens).
        return self.loss_fn(self.output(hidden.unsqueeze(0)), targets.unsqueeze(0))

    def row_nll(
        self, hidden: torch.Tensor, targets: torch.Tensor, output: nn.Module | None = None
    ) -> torch.Tensor:
        """Each row's summed cross-entropy (batch,), float32, a chunk at a time as `__call__`
        (DPO's sequence log-probs, parallel/dpo.py); `output`: another model's projection (the
        frozen reference copy's) instead of this one's."""
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim)
        output = output if output is not None else self.output
        chunks = zip(hidden.flatten(0, 1).split(self.chunk_tokens),
                     targets.flatten().split(self.chunk_tokens), strict=True)  # fmt: skip
        grad = torch.is_grad_enabled()
        per_token = [checkpoint(_token_nll, h, t, output, use_reentrant=False) if grad
                     else _token_nll(h, t, output) for h, t in chunks]  # fmt: skip
        return torch.cat(per_token).view(targets.shape).sum(dim=1)


def _token_nll(hidden: torch.Tensor, targets: torch.Tensor, output: nn.Module) -> torch.Tensor:
    """Each token's cross-entropy (NO_TARGET: 0), float32, from its final hidden state."""
    logits = output(hidden.unsqueeze(0)).flatten(0, 1).float()
    nll = F.cross_entropy(logits, targets, reduction="none")
    return nll.full_tensor() if isinstance(nll, DTensor) else nll


def check_chunked_loss(
    family: ModelFamily, chunk_tokens: int, reshard_after_forward: str, name: str
) -> None:
    """ConfigError, before any process group, for a chunked loss this run cannot have."""
    if not chunk_tokens:
        return
    if getattr(family, "output_layer", None) is None:
        raise ConfigError(
            f"train.loss_chunk_tokens: model {name} has no output_layer(model) (model/__init__.py)"
        )
    if reshard_after_forward == "always":
        # The chunks call the output projection after the root's forward and again in
        # backward: the root unit must stay gathered in between ('default' and 'never' keep it).
        raise ConfigError(
            "train.loss_chunk_tokens with parallel.reshard_after_forward='always': the chunked "
            "loss uses the output projection after the root unit's forward, which 'always' "
            "frees; use 'default' (it frees every block but the last, never the root)"
        )
