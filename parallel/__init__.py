"""Parallelism and its companions, each applied from outside the model by one `apply_*`
function. They find the model's blocks through the model contract (`family.fsdp_units`), never by
attribute names of one family."""

from __future__ import annotations

from torch import nn


def replace_submodule(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put `new` where `old` sits inside `root` (its parent's attribute, or a ModuleDict or
    ModuleList entry), so the parent's forward calls the wrapper from now on."""
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise ValueError(f"{type(old).__name__} is not a submodule of {type(root).__name__}")
