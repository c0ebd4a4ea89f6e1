"""Muon for sharded parameters: orthogonalized momentum on the blocks' matrices, AdamW on the rest.

    optimizer = Muon(muon_groups(model, blocks, cfg, adamw), kernel)  # optim.name="muon"

Muon (Keller Jordan, 2024; Moonshot's Moonlight and Kimi K2 at scale) keeps a momentum buffer
per matrix and steps along its orthogonalization: a few Newton-Schulz iterations push every
singular value of the (Nesterov) momentum towards 1. The math here is `torch.optim.Muon`'s, to
the bit on a whole matrix (tests/test_muon.py compares them directly).

Under FSDP2 a rank holds a row shard of each matrix, and Newton-Schulz over a row shard is not
the orthogonalization of the matrix. So the momentum (elementwise) is updated on the shards, as
DTensors shaped like the parameters (DCP saves and reshards them like AdamW's moments), and for
the orthogonalization each matrix is made whole on one rank of its sharding group, its owner
(`orthogonalize`):

- matrices split along one dim over one mesh dim (FSDP, HSDP, tp alone): the same-shaped ones
  of a parameter group (every block's `wq` and `wo`, ...) form a bucket; the matrices go
  round-robin to their owners (continued from bucket to bucket) in one all-to-all for the
  bucket, each owner runs Newton-Schulz on its own, and a second all-to-all returns every
  rank its part of every result;
- an MoE expert stack (experts, out, in) split by expert (FSDP's Shard(0), expert parallel):
  each rank holds whole experts already and orthogonalizes each on its own, with no traffic;
- any other layout (FSDP x tp: split over two mesh dims) is stacked into one DTensor and
  redistributed so that the stack dim carries the sharding, and back.

Replicated mesh dims (HSDP's dp_replicate) stay replicated: each replica repeats its group's
work, which costs no traffic across replicas. The matrices travel in the dtype of Newton-Schulz
(bfloat16, torch's, unless optim.muon.ns_dtype says float32), which torch casts to first: the
same result as sending float32, at half the bytes. docs/parallelism.md explains the choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.adamw import adamw

from configs import ConfigError

# torch.optim.Muon's (Keller Jordan's) quintic coefficients, steps and norm floor.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


@dataclass
class MuonConfig:
    lr: float = 3e-4
    """Muon's peak lr (the schedule of [optim] scales it like AdamW's). With
    adjust_lr_fn='match_rms_adamw' the update has AdamW's RMS, so AdamW's lr and weight decay
    carry over (Moonlight); with 'original', Keller Jordan's runs use about 0.02."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the Muon matrices: p -= lr * weight_decay * p."""
    momentum: float = 0.95
    """Momentum of the buffer: buf = momentum * buf + (1 - momentum) * grad."""
    nesterov: bool = True
    """Orthogonalize grad + momentum * (buf - grad) instead of the buffer itself."""
    ns_steps: int = 5
    """Newton-Schulz iterations (torch.optim.Muon: 5; at most 99)."""
    ns_coefficients: list[float] = field(default_factory=lambda: list(NS_COEFFICIENTS))
    """(a, b, c) of the quintic iteration X <- aX + (bA + cA^2)X, A = XX^T."""
    ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of Newton-Schulz (and of the matrices' trip to their owners). bfloat16 is
    torch.optim.Muon's, bitwise; float32 costs twice the bytes (and, on GPUs, the matmul time)
    and keeps runs on different meshes within 1e-5 of each other in tests/test_muon.py (in
    bfloat16 a gradient that differs in its last float32 bit between meshes can round to a
    neighbouring bfloat16 value)."""
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Update scale per matrix (out, in): 'original' lr * sqrt(max(1, out/in)) (Keller Jordan),
    'match_rms_adamw' lr * 0.2 * sqrt(max(out, in)) (Moonshot)."""

    def __post_init__(self) -> None:
        coeffs = self.ns_coefficients
        rules = (
            ("lr", self.lr > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("momentum", 0 <= self.momentum < 1, "in [0, 1)"),
            ("ns_steps", 1 <= self.ns_steps <= 99, "in [1, 99]"),
            ("ns_coefficients", len(coeffs) == 3 and all(map(math.isfinite, coeffs)),
             "three finite numbers (a, b, c)"),
        )  # fmt: skip
        for name, ok, rule in rules:
            if not ok:
                raise ConfigError(f"optim.muon.{name} must be {rule}, got {getattr(self, name)}")


def check_muon(optimizer: str, cpu_offload: bool) -> None:
    """ConfigError for what Muon cannot run with (launch/check.py, before any collective)."""
    if optimizer == "muon" and cpu_offload:
        raise ConfigError(
            "optim.name='muon' with parallel.cpu_offload is not supported: Muon's all-to-alls "
            "would send the offloaded (CPU) matrices over the GPUs' NCCL group"
        )


def muon_parameters(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """Names of the parameters Muon trains: the trainable matrices (and 3-D expert stacks) of the
    blocks. The embeddings, the output projection, norms and biases are left to AdamW: they are
    not hidden linear maps. So are LoRA's adapters: rank-r factors whose orthogonalization would
    set all r singular values of each factor alike, not those of their product B @ A."""
    inside = {id(p) for block in blocks for p in block.parameters()}
    return [
        name for name, p in model.named_parameters()
        if p.requires_grad and p.ndim >= 2 and id(p) in inside and ".lora_" not in name
    ]  # fmt: skip


def adjusted_lr(lr: float, rule: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's per-matrix lr (its `_adjust_lr`, private there)."""
    if rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def newton_schulz(x: torch.Tensor, steps: int, coefficients: tuple[float, ...]) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of one matrix, op for op (its
    `_zeropower_via_newtonschulz` is private), on the wide orientation, in `x`'s dtype
    (torch's: bfloat16)."""
    a, b, c = coefficients
    ortho = x.clone()
    tall = x.size(0) > x.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=NS_EPS))
    for _ in range(steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho.T if tall else ortho


def orthogonalize(
    updates: list[torch.Tensor], steps: int, coefficients: tuple[float, ...], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Newton-Schulz in `dtype` of each matrix (each expert's of a 3-D stack) of `updates`,
    whole, however they are sharded; returns each one's local part, shaped like its shard.

    Where each rank already holds whole matrices (one process; expert stacks split by expert
    only, as FSDP and expert parallel split them) they are orthogonalized where they are.
    Matrices split along rows or columns over one mesh dim (FSDP, HSDP, tp alone) go to their
    owners in one all-to-all per bucket of same-shaped matrices (`_exchange`). Any other layout
    (FSDP x tp: split over two mesh dims) takes DTensor's redistribute, to the same result."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    buckets: dict[Any, list[int]] = {}
    for i, u in enumerate(updates):
        split = _split_dims(u)
        if not split or (u.ndim == 3 and all(d == 0 for _, d in split)):
            local = (u.to_local() if isinstance(u, DTensor) else u).to(dtype)
            result = _newton_schulz_stack(local if u.ndim == 3 else local[None], steps,
                                          coefficients)  # fmt: skip
            out[i] = result if u.ndim == 3 else result[0]
            continue
        buckets.setdefault((tuple(u.shape), u.device_mesh, tuple(u.placements)), []).append(i)
    first_owner = 0  # round-robin continues across buckets, so no rank owns every first one
    for indices in buckets.values():
        bucket = [updates[i] for i in indices]
        split = _split_dims(bucket[0])
        one_dim = len(split) == 1 and type(bucket[0].placements[split[0][0]]) is Shard
        if bucket[0].ndim == 2 and one_dim:
            parts = _exchange(bucket, split[0], steps, coefficients, dtype, first_owner)
            first_owner += len(bucket)
        else:
            parts = _redistribute(bucket, steps, coefficients, dtype)
        for i, part in zip(indices, parts, strict=True):
            out[i] = part
    return out  # type: ignore[return-value]


def _split_dims(u: torch.Tensor) -> list[tuple[int, int]]:
    """(mesh dim, tensor dim) of each mesh dim of more than one rank that splits `u`."""
    if not isinstance(u, DTensor):
        return []
    mesh = u.device_mesh
    return [
        (i, p.dim) for i, p in enumerate(u.placements)
        if _is_shard(p) and mesh.size(i) > 1
    ]  # fmt: skip


def _is_shard(p: Any) -> bool:
    # FSDP's _StridedShard (dp_shard x tp on one dim) is a Shard in torch 2.11, not in 2.13.
    return isinstance(p, Shard) or hasattr(p, "split_factor")


def _exchange(
    updates: list[DTensor],
    split: tuple[int, int],
    steps: int,
    coefficients: tuple[float, ...],
    dtype: torch.dtype,
    first_owner: int = 0,
) -> list[torch.Tensor]:
    """Matrices split along `dim` over one mesh dim: matrix k goes whole to rank
    (first_owner + k) % N of that group (round-robin), in one all-to-all for the bucket; each
    rank orthogonalizes its own, and a second all-to-all returns to every rank its part of
    every result."""
    mesh_dim, dim = split
    group = updates[0].device_mesh.get_group(mesh_dim)
    n, me = dist.get_world_size(group), dist.get_group_rank(group, dist.get_rank())
    # Each rank's extent along `dim`: FSDP2 and DTensor split as torch.chunk does.
    total, other = updates[0].shape[dim], updates[0].shape[1 - dim]
    sizes = ([len(c) for c in torch.arange(total).chunk(n)] + [0] * n)[:n]
    local = torch.stack([u.to_local().to(dtype) for u in updates])  # (K, my part)
    owned = owned_matrices(len(updates), n, first_owner)
    mine = len(owned[me])
    to_owners = [len(owned[j]) * sizes[me] * other for j in range(n)]  # my parts of theirs
    from_ranks = [mine * sizes[j] * other for j in range(n)]  # their parts of mine
    send = torch.cat([local[owned[j]].flatten() for j in range(n)])
    receive = send.new_empty(sum(from_ranks))
    dist.all_to_all_single(receive, send, from_ranks, to_owners, group=group)

    def part(flat: torch.Tensor, count: int, extent: int) -> torch.Tensor:
        return flat.view(count, extent, other) if dim == 0 else flat.view(count, other, extent)

    pieces = receive.split(from_ranks)
    whole = torch.cat([part(p, mine, sizes[j]) for j, p in enumerate(pieces)], dim=dim + 1)
    result = _newton_schulz_stack(whole, steps, coefficients)
    send = torch.cat([p.flatten() for p in result.split(sizes, dim=dim + 1)])
    back = send.new_empty(sum(to_owners))
    dist.all_to_all_single(back, send, to_owners, from_ranks, group=group)
    ours = torch.empty_like(local)
    for j, piece in enumerate(back.split(to_owners)):
        ours[owned[j]] = part(piece, len(owned[j]), sizes[me])
    return list(ours.unbind(0))


def owned_matrices(count: int, n: int, first_owner: int = 0) -> list[list[int]]:
    """Round-robin owners of a bucket of `count` matrices over `n` ranks, the first one on rank
    `first_owner`: the indices each rank owns."""
    return [list(range((j - first_owner) % n, count, n)) for j in range(n)]


def _redistribute(
    updates: list[DTensor], steps: int, coefficients: tuple[float, ...], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Any layout: the bucket stacked into one DTensor, redistributed so that its sharded mesh
    dims split the stack instead (each rank then holds whole matrices), and back."""
    first = updates[0]
    mesh, placements = first.device_mesh, first.placements
    if first.ndim == 3:  # an expert tensor: its experts are the stack
        local, shape, shift = first.to_local().to(dtype), tuple(first.shape), 0
    else:
        local = torch.stack([u.to_local().to(dtype) for u in updates])
        shape, shift = (len(updates), *first.shape), 1
    stacked = _from_local(local, mesh, _placements(placements, shift), shape)
    owners = [Replicate() if isinstance(p, Replicate) else Shard(0) for p in placements]
    owned = stacked.redistribute(mesh, owners).to_local()
    result = _newton_schulz_stack(owned, steps, coefficients)
    back = _from_local(result, mesh, owners, shape).redistribute(mesh, stacked.placements)
    local = back.to_local()
    return [local] if first.ndim == 3 else list(local.unbind(0))


def _placements(placements: Iterable[Any], shift: int) -> list[Any]:
    """The placements of a stack of tensors: each shard dim moved `shift` dims down."""
    return [_shifted(p, shift) if _is_shard(p) and shift else p for p in placements]


def _shifted(p: Any, shift: int) -> Any:
    if type(p) is Shard:
        return Shard(p.dim + shift)
    # _StridedShard: the same split, one dim down.
    return type(p)(p.dim + shift, split_factor=p.split_factor)


def _from_local(local: torch.Tensor, mesh: Any, placements: list[Any], shape: tuple) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=stride)  # fmt: skip


def _newton_schulz_stack(
    stack: torch.Tensor, steps: int, coefficients: tuple[float, ...]
) -> torch.Tensor:
    if stack.shape[0] == 0:  # this rank owns none of the stack
        return stack
    return torch.stack([newton_schulz(m, steps, coefficients) for m in stack])


class Muon(torch.optim.Optimizer):
    """Muon on the param groups with algorithm='muon', AdamW on those with 'adamw'.

    One optimizer, so that the trainer's step, the schedule (one lr per group) and the
    checkpoint (`get_optimizer_state_dict`, keyed by FQN) stay those of AdamW alone. A Muon
    parameter's state is `momentum_buffer`, shaped and sharded like it; an AdamW parameter's is
    torch.optim.AdamW's (`step`, `exp_avg`, `exp_avg_sq`), stepped by torch's own function.
    """

    def __init__(
        self, groups: list[dict[str, Any]], kernel: Literal["fused", "foreach", "for_loop"]
    ) -> None:
        super().__init__(groups, {})
        self.kernel = kernel  # AdamW's (optim.implementation)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 - no closure: one forward
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == "muon":
                self._muon(group, params)
            else:
                self._adamw(group, params)

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)  # elementwise: on the shards
            updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
        dtype = getattr(torch, group["ns_dtype"])
        ortho = orthogonalize(updates, group["ns_steps"], tuple(group["ns_coefficients"]), dtype)
        for p, update in zip(params, ortho, strict=True):
            local = p.to_local() if isinstance(p, DTensor) else p
            rows, cols = p.shape[-2:]  # each matrix's, also an expert's in a 3-D stack
            local.mul_(1 - lr * decay)
            local.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        device = params[0].device if params else None
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:  # as torch.optim.AdamW: the step count on the device when fused
                step_device = device if self.kernel == "fused" else "cpu"
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=step_device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps,
            foreach=self.kernel == "foreach", fused=self.kernel == "fused", amsgrad=False,
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )  # fmt: skip


def muon_groups(
    model: nn.Module, blocks: list[nn.Module], cfg: MuonConfig, adamw_settings: dict[str, Any]
) -> list[dict[str, Any]]:
    """The param groups of `Muon`: the blocks' matrices, then AdamW's (lr, betas, eps,
    weight_decay) with decay on its matrices (embeddings, output) only, as build_optimizer's."""
    names = set(muon_parameters(model, blocks))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rest = [p for n, p in trainable if n not in names]
    muon = {
        "params": [p for n, p in trainable if n in names], "algorithm": "muon", "lr": cfg.lr,
        "weight_decay": cfg.weight_decay, "momentum": cfg.momentum, "nesterov": cfg.nesterov,
        "ns_steps": cfg.ns_steps, "ns_coefficients": list(cfg.ns_coefficients),
        "adjust_lr_fn": cfg.adjust_lr_fn, "ns_dtype": cfg.ns_dtype,
    }  # fmt: skip
    common = {"algorithm": "adamw"} | {k: adamw_settings[k] for k in ("lr", "betas", "eps")}
    decay = adamw_settings["weight_decay"]
    return [
        muon,
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": decay} | common,
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0} | common,
    ]
