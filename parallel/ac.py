"""Activation checkpointing (AC): trade recomputation in backward for activation memory.

Each transformer block (the family's `fsdp_units`) is wrapped in place, so parameter names only
gain a
`_checkpoint_wrapped_module.` segment: `torch.distributed.checkpoint.state_dict` and
`model.canonical_name` drop it, so checkpoints and initial weights are the same with AC
on or off.

Modes (`[ac] mode`):

| mode | what backward keeps per block | recompute |
|---|---|---|
| `none` | every activation autograd saves | nothing |
| `full` | the block's input only | the whole block forward |
| `selective` | as `full` for every `every`-th block, everything for the others | those blocks |
| `op` | matmul and attention outputs (the expensive ops) | norms, RoPE, SiLU, products |

Blocks are wrapped with torch's `checkpoint_wrapper`, as torchtitan does: it runs the public
`torch.utils.checkpoint.checkpoint` (non-reentrant: works with FSDP2's hooks, torch.compile and
keyword arguments), and it is the wrapper DCP's state-dict helpers and its own `state_dict()`
hooks know how to strip from names. A home-made wrapper would have to copy those hooks (it lives
in a `_checkpoint` module, but has been stable and in the FSDP tutorials since torch 2.0).
`op` is torchtitan's "selective op" AC without its "recompute every other matmul" refinement:
it keeps all matmul outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from configs import ConfigError
from parallel import replace_submodule
from parallel.workarounds import sac_ignores_profiler_ranges


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective", "op"] = "none"
    """'full' recomputes every block in backward; 'selective' every `every`-th block; 'op'
    keeps matmul/attention outputs and recomputes the cheap ops of every block."""
    every: int = 1
    """With mode='selective': checkpoint blocks 0, every, 2*every, ... (1 = all, as 'full')."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError(f"ac.every must be >= 1, got {self.every}")


def _saved_ops() -> set[Any]:
    """Ops whose outputs op-level AC keeps: the matmuls (grouped ones included), every SDPA
    kernel (CPU, CUDA) and FlexAttention."""
    aten = torch.ops.aten
    names = [
        "mm",
        "addmm",
        "_grouped_mm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ]
    # getattr: not every kernel exists in every build (torch 2.11-2.13, CPU or CUDA).
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    # FlexAttention (document masking on GPUs) is a higher-order op, not an aten one.
    if hasattr(torch.ops.higher_order, "flex_attention"):
        ops.add(torch.ops.higher_order.flex_attention)
    # The MoE experts' grouped GEMM, a custom op of model/moe.py (registered with `model`).
    if hasattr(torch.ops.fsdp2_trainer, "grouped_linear"):
        ops.add(torch.ops.fsdp2_trainer.grouped_linear.default)
    return ops


def _op_policy(saved: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _attention_ops() -> set[Any]:
    """The attention kernels among `_saved_ops`: their outputs, not the matmuls'."""
    return {op for op in _saved_ops() if "attention" in str(op)}


def _whole_block_policy(
    attention: set[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in attention else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: ActivationCheckpointConfig,
    in_graph: bool = False,
) -> list[int]:
    """Wrap `blocks` (the family's `fsdp_units(model)`) in place inside `model`; returns the
    indices of the wrapped ones.

    Call it before `apply_compile` (compile traces the checkpointed block, recompute included)
    and before `apply_fsdp` (FSDP's hooks then sit on the wrapper, outside the recomputed
    region, so a recompute does not all-gather twice).
    `in_graph`: the blocks will be compiled inside one whole-model graph with FSDP's
    collectives (compile.fsdp="graph"): 'full' and 'selective' then keep the attention output
    of each checkpointed block (see below).
    """
    if cfg.mode == "none":
        return []
    wrapped = []
    for i, block in enumerate(blocks):
        if cfg.mode == "selective" and i % cfg.every != 0:
            continue
        kwargs = {}
        if cfg.mode == "op":
            sac_ignores_profiler_ranges()  # for nested FSDP units (parallel/workarounds.py, 4)
            policy = partial(_op_policy, _saved_ops())
            kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, policy)
        elif in_graph:
            # Inside a whole-model graph (compile.fsdp="graph") a recomputed attention kernel
            # saves its RNG state (the kernels take a dropout), which torch 2.13's AOTAutograd
            # then misplaces among the saved DeviceMesh of the sharded weights and fails
            # ("expected all tensors_saved_with_vc_check to be Tensors"). So its output is
            # kept, as torchtitan's SimpleFSDP keeps it: everything else is recomputed.
            policy = partial(_whole_block_policy, _attention_ops())
            kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, policy)
        # preserve_rng_state=False: the blocks have no dropout, so the recompute needs no RNG
        # replay (saving and restoring the CUDA RNG state around every block costs time).
        wrapper = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)
        replace_submodule(model, block, wrapper)
        wrapped.append(i)
    return wrapped
