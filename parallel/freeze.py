"""Frozen parameters: `train.freeze`, glob patterns over parameter names, as OLMo-core's
`freeze_params`.

    apply_freeze(model, ["tok_embeddings.*", "layers.[0-2].*"])   # before fully_shard

A frozen parameter keeps its place in its block's FSDP unit: FSDP2 shards each parameter on its
own, so frozen and trainable ones share a unit at no extra memory. It is still all-gathered for
forward, but gets no gradient, hence no reduce-scatter, no optimizer state (train.py's optimizer
takes trainable parameters only) and no part in the gradient norm. A block whose parameters are
all frozen and whose input needs no gradient (everything before it is frozen too) is left out
of backward altogether: no all-gather, no activations kept for it.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from configs import ConfigError
from model import canonical_name


def apply_freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set requires_grad=False on every parameter whose canonical name matches a pattern (`*`
    matches dots too: 'layers.1.*' is all of block 1); returns the frozen names. ConfigError for
    a pattern that matches nothing, and for freezing everything (nothing would train)."""
    # Tied weights under each of their names: 'output.weight' freezes a tied embedding too.
    params = [(canonical_name(n), p) for n, p in model.named_parameters(remove_duplicate=False)]
    if unmatched := [pat for pat in patterns if not any(fnmatchcase(n, pat) for n, _ in params)]:
        raise ConfigError(
            f"train.freeze: {', '.join(map(repr, unmatched))} matches no parameter of this "
            f"model (globs over names such as {params[0][0]!r})"
        )
    frozen = [n for n, p in params if any(fnmatchcase(n, pat) for pat in patterns)]
    for name, param in params:
        if any(fnmatchcase(name, pat) for pat in patterns):
            param.requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"train.freeze ({', '.join(patterns)}) freezes every parameter: nothing would train"
        )
    return frozen
