"""Document masking: the tokens of a packed window attend only within their own document.

`python -m data.prepare` writes documents back to back, each followed by the dataset's EOS id,
and the loader cuts fixed windows across them. With `data.attention_mask = "causal"` a token
attends to every earlier token of its window, the end of the previous document included. With
"document" it attends only to earlier tokens of its own document, so a packed window computes
for each document what that document alone would give (tests/test_documents.py). The rules
(docs/data.md has the reasoning):

- A document runs up to and including its EOS: a token's document id is the number of EOS
  strictly before it in the window, so an EOS belongs to the document it ends. The window's
  first tokens, the rest of a document that began before the window, are a document too.
- The first token of a document is not a target: the only context a model would have to
  predict it from is the document before, which it may not see. So the target at each EOS
  position (the next document's first token) becomes -100. The train loop divides the loss by
  the global count of targets that remain, so it stays the same on any mesh.
- `data.document_positions`: RoPE positions counted from the first token of each document (the
  window start, for the cut one) instead of from the window start.

Everything here is a function of one micro-batch, computed where it is used: on the device,
by the train loop and `evaluate` (train.py), for the model's `document_ids` and `positions`
(model/__init__.py). Nothing of it is stored or checkpointed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from configs import ConfigError
from data.loader import NO_TARGET, DataConfig, DatasetIndex


class MicroBatch(NamedTuple):
    """One micro-batch as the model and the loss take it."""

    inputs: torch.Tensor
    """(batch, seq) int64 token ids."""
    targets: torch.Tensor
    """(batch, seq) int64: the next token of each position, NO_TARGET where there is none."""
    document_ids: torch.Tensor | None = None
    """(batch, seq) int32: the document of each token (None: causal over the whole window)."""
    positions: torch.Tensor | None = None
    """(batch, seq) int64: each token's RoPE position (None: 0..seq-1)."""
    reference: torch.Tensor | None = None
    """(batch,) float64: each row's precomputed reference log-probability (DPO with
    dpo.reference = 'precomputed', parallel/dpo.py); None otherwise."""


def micro_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    cfg: DataConfig,
    eos_id: int | None,
    device: torch.device,
    reference: torch.Tensor | None = None,
) -> MicroBatch:
    """A loader's (inputs, targets) on `device`, with what `cfg.attention_mask` derives.
    Preference pairs (batch, 2, seq) become rows chosen, rejected, chosen, ... (batch x 2, seq),
    their precomputed reference log-probs (batch, 2), if any, rows likewise."""
    if inputs.dim() == 3:
        inputs, targets = inputs.flatten(0, 1), targets.flatten(0, 1)
        reference = None if reference is None else reference.flatten().to(device)
    inputs, targets = inputs.to(device), targets.to(device)
    if cfg.attention_mask == "causal":
        return MicroBatch(inputs, targets, reference=reference)
    if eos_id is None:  # check_documents rejects this at startup
        raise ValueError("document masking needs the dataset's EOS id")
    ids = document_ids(inputs, eos_id)
    targets = targets.masked_fill(inputs == eos_id, NO_TARGET)  # each document's first token
    positions = document_positions(ids) if cfg.document_positions else None
    return MicroBatch(inputs, targets, ids, positions, reference)


def batch_on_device(
    *batch: torch.Tensor, cfg: DataConfig, eos_id: int | None, device: torch.device
) -> MicroBatch:
    """`micro_batch` of what a loader yields: (inputs, targets), and for DPO with precomputed
    reference log-probs (parallel/dpo.py) those too."""
    return micro_batch(*batch[:2], cfg, eos_id, device, *batch[2:])


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(batch, seq) -> the number of EOS strictly before each position: 0 for the window's
    first document, and an EOS gets the id of the document it ends."""
    is_eos = (inputs == eos_id).int()
    return torch.cumsum(is_eos, dim=-1, dtype=torch.int32) - is_eos


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Each token's distance from the first token of its document (or from the window start,
    for the document the window cuts), from nondecreasing document ids."""
    index = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    # The start of each token's document: the latest start at or before it.
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


def check_documents(cfg: DataConfig, index: DatasetIndex, key: str = "data.path") -> None:
    """ConfigError, at startup, for fine-tuning examples (`key` names the setting) without
    document masking, whose packed examples would attend to each other; and for document
    masking on a dataset without a usable EOS id: none recorded (index.json `eos_id` null) or
    one outside the tokenizer's vocabulary, which no token can equal, so every window would
    silently be one document."""
    if index.examples is not None and not index.preference and cfg.attention_mask != "document":
        raise ConfigError(
            f"{key}: '{index.path}' holds fine-tuning examples ({index.examples['format']}), "
            f"packed several to a window; with data.attention_mask='{cfg.attention_mask}' each "
            "would attend to the examples before it: set data.attention_mask='document'"
        )
    if cfg.attention_mask != "document":
        return
    eos = index.eos_id
    if eos is None or not 0 <= eos < index.vocab_size:
        raise ConfigError(
            f"data.attention_mask='document' needs documents that end with an EOS id, but "
            f"'{index.path / 'index.json'}' has eos_id {'null' if eos is None else eos} "
            f"(vocab_size {index.vocab_size}): prepare the data with python -m data.prepare, "
            "which ends every document with the tokenizer's EOS, or set "
            "data.attention_mask='causal'"
        )
