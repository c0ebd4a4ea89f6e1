"""Tensor parallel with sequence parallel: a family's TP_PLAN, turned into ParallelStyles.

Inside each block (Megatron-style, as in torchtitan): the norms run on activations split along
the sequence (Shard(1)), so their memory and work divide by tp; the attention and FFN inputs are
all-gathered along the sequence, q/k/v and w1/w3 split their output features (each rank holds
whole heads: n_heads / tp of them), and wo/w2 split their input features, their partial sums
reduce-scattered back into sequence shards. Per layer that is one all-gather and one
reduce-scatter of the (batch, seq, dim) activations in forward and again in backward: cheap
over NVLink, slow anywhere else, which is why tp must divide the ranks per node.

The plan is plain data beside the model (`TP_PLAN`: module name -> style name, see
`model.TPStyle`); this module owns what each name means. Applied before FSDP, which then shards
the TP DTensors over the data-parallel dims of the same mesh.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from configs import ConfigError
from model import ModelFamily, TPStyle

# Styles whose module's weights are split over tp (the others replicate theirs): the planner.
SPLIT_STYLES = ("colwise", "rowwise", "embedding", "output")


def check_tp(family: ModelFamily, args: Any, tp: int, name: str) -> None:
    """ConfigError, before any collective, for a model that cannot be split tp ways: each
    rank must hold whole attention heads and an equal slice of the vocabulary."""
    if tp == 1:
        return
    if getattr(family, "TP_PLAN", None) is None:
        raise ConfigError(f"parallel.tp={tp}: model {name} declares no TP_PLAN (model/)")
    heads = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads}
    if bad := [f"{k}={v}" for k, v in heads.items() if v % tp != 0]:
        # Heads are the model's shape: only another tp helps (padding the vocabulary does not).
        fits = [d for d in range(2, args.n_kv_heads + 1) if args.n_kv_heads % d == 0
                and args.n_heads % d == 0]  # fmt: skip
        choose = f"choose tp in {fits}" if fits else "this model cannot use tensor parallel"
        raise ConfigError(
            f"parallel.tp={tp} must divide the attention heads (n_heads={args.n_heads}, "
            f"n_kv_heads={args.n_kv_heads}; not: {', '.join(bad)}): {choose}"
        )
    if args.vocab_size % tp != 0:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.vocab_size ({args.vocab_size}): set "
            f"model.vocab_size to a multiple of {tp} (padding rows are never a target) or "
            "choose another tp"
        )


def _style(kind: TPStyle, module: nn.Module, float8: bool) -> ParallelStyle:
    """The ParallelStyle of one plan entry. `float8`: the module is a torchao Float8Linear
    with tensorwise scaling, whose styles all-gather its input in float8 (half the bytes)."""
    if float8 and kind in ("colwise", "rowwise"):
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
        )

        if kind == "colwise":
            return Float8ColwiseParallel()
        return Float8RowwiseParallel(output_layouts=Shard(1))
    if kind == "colwise":  # input replicated (gathered by "gather_input"), output features split
        return ColwiseParallel()
    if kind == "rowwise":  # partial sums reduce-scattered into sequence shards
        return RowwiseParallel(output_layouts=Shard(1))
    if kind == "sequence":  # a norm over dim, on this rank's slice of the sequence
        return SequenceParallel()
    if kind == "per_head":  # a norm over head_dim, on this rank's heads (dim 2 of b, s, h, d)
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if kind == "gather_input":  # first input: sequence shards -> whole; the rest untouched
        # PrepareModuleInput wants one entry per positional input (attention also takes rope).
        # The gathered input stays a DTensor: the gradients of q, k, v (w1, w3) then add up as
        # one Partial and go back as one reduce-scatter. A plain tensor would cost an
        # all-reduce per Linear in backward (measured: tests/test_tp.py, planner test).
        rest = (None,) * (len(inspect.signature(module.forward).parameters) - 1)
        return PrepareModuleInput(
            input_layouts=(Shard(1), *rest),
            desired_input_layouts=(Replicate(), *rest),
            use_local_output=False,
        )
    if kind == "replicate":  # the whole module on every rank, on the whole sequence
        return _Replicated()
    if kind == "embedding":  # vocabulary rows split; output reduce-scattered along the sequence
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if kind == "output":  # vocabulary columns split; the logits stay split (loss_context)
        return ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
    raise ValueError(f"unknown TP style {kind!r}")


class _Replicated(ParallelStyle):
    """A module run whole on every tp rank, for layers that must see whole tokens and all their
    weights at once (an MoE layer: each token's routing picks among all experts; splitting the
    experts is expert parallel's job). Its parameters become replicated DTensors, so FSDP and
    the gradient norm treat them like every other parameter; the module computes with their
    local tensors (the model contract: `model.moe.local`). Its first input is all-gathered from
    sequence shards into a plain tensor, its first output split back along the sequence (a
    local slice, a plain tensor like "rowwise"'s); further outputs (an MoE layer's aux loss and
    expert counts) pass through, the same on every tp rank. Backward: one all-gather of the
    output's gradient; every rank then holds the same full gradients, so the replicated
    weights' gradients need no reduction.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, self._gather, self._split)

    @staticmethod
    def _gather(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        first = inputs[0]
        if not isinstance(first, DTensor):  # a plain tensor here is this rank's sequence shard
            first = DTensor.from_local(first, mesh, [Shard(1)], run_check=False)
        return (first.redistribute(mesh, [Replicate()]).to_local(), *inputs[1:])

    @staticmethod
    def _split(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        whole = outputs[0] if isinstance(outputs, tuple) else outputs
        split = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
        # A local tensor, as "rowwise" returns: the residual stream between blocks is this
        # rank's sequence shard as a plain tensor.
        split = split.redistribute(mesh, [Shard(1)]).to_local()
        return (split, *outputs[1:]) if isinstance(outputs, tuple) else split


def apply_tp(
    model: nn.Module, family: ModelFamily, tp_mesh: DeviceMesh, float8_collectives: bool = False
) -> dict[str, ParallelStyle]:
    """Parallelize `model` in place over `tp_mesh` by the family's TP_PLAN.

    Every parameter must end up a DTensor on `tp_mesh` (split or replicated): a plain one
    would get no gradient reduction over tp, and FSDP would shard it on another mesh.
    `float8_collectives` (fp8 tensorwise on NCCL): Float8Linear layers get torchao's float8 TP
    styles, which cast the gathered input to float8 before the all-gather. gloo has no float8
    collectives ("Invalid scalar type"), so on CPU a Float8Linear gets the plain styles: its
    matmuls still run in float8, its activations travel in high precision. The "gather_input"
    of attention and FFN stays in high precision: torchao's PrepareFloat8ModuleInput needs
    every consumer to be a Float8Linear, which fp8.skip and fp8.filter do not promise.
    Returns the applied styles by module name.
    """
    float8_linear: type | tuple = ()
    if float8_collectives:
        from torchao.float8.float8_linear import Float8Linear

        float8_linear = Float8Linear
    tied = _tied_names(model)
    modules = dict(model.named_modules())
    plan: dict[str, ParallelStyle] = {}
    for pattern, kind in family.TP_PLAN.items():
        # One style per concrete module: float8 or not is decided per layer (fp8.skip, filter).
        names = [n for n in modules if _matches(n, pattern)]
        if not names:
            raise ValueError(f"TP_PLAN entry {pattern!r} matches no module")
        for name in names:
            plan[name] = _style(kind, modules[name], isinstance(modules[name], float8_linear))
    parallelize_module(model, tp_mesh, plan)
    # The root's output (the logits DTensor) is a view of the output Linear's result; torch >=
    # 2.13's FSDP then warns once per rank that an in-place op on it would skip its backward
    # hook. The loss reads the logits out of place only.
    warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(.*\) returned a view tensor")
    # The grad norm of gradients split over (dp_shard, tp) is reduced by two scalar
    # all-reduces; DTensor logs that flattening the two mesh dims would make it one. Not worth
    # a private API for one float per step.
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_not_norm_hint)
    for first, others in tied.items():  # the styles replaced each module's copy: share again
        # The split copy: a pipeline stage's stand-in for the other module is not in the plan.
        copies = [model.get_parameter(n) for n in (first, *others)]
        shared = next((p for p in copies if isinstance(p, DTensor)), copies[0])
        for name in (first, *others):
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    if plain := [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]:
        raise ValueError(f"TP_PLAN leaves parameters unsplit and unreplicated: {plain}")
    return plan


def _not_norm_hint(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ("_NormPartial" in message and "sequential all_reduce" in message)


def loss_context(tp: int) -> contextlib.AbstractContextManager:
    """Where the loss's forward and backward run. At tp > 1 the logits stay split over the
    vocabulary (the "output" style) and torch's `loss_parallel` computes the cross-entropy
    from the slices: three all-reduces of one float per token, instead of all-gathering
    tokens x vocab logits onto every rank; each rank stores 1/tp of the logits."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def _matches(name: str, pattern: str) -> bool:
    """`layers.*.attention.wq` matches `layers.3.attention.wq` (`*` = one name segment)."""
    parts, wanted = name.split("."), pattern.split(".")
    if len(parts) != len(wanted):
        return False
    return all(w in ("*", p) for p, w in zip(parts, wanted, strict=True))


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """First name of each shared parameter -> its other names (tied embeddings)."""
    seen: dict[int, str] = {}
    tied: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.setdefault(seen[id(param)], []).append(name)
        else:
            seen[id(param)] = name
    return tied
