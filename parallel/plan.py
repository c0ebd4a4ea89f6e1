"""The planner's formulas: memory per rank and bytes sent per step on each mesh dimension, for
any (dp_replicate, dp_shard, cp, tp) mesh, read from the model built on meta. `python -m
launch.plan` (before renting the cluster) and `train.py --dry-run` print them.

Counting follows this trainer exactly (tests/test_plan.py checks it against the collectives of a
real run within 1%):
- Parameters are sharded per FSDP unit (each block, then the root: embeddings, final norm,
  output), dim 0 padded to a multiple of dp_shard, as FSDP2 does.
- Each micro-batch all-gathers every unit in forward, and again in backward if the unit was
  resharded after forward (`parallel.fsdp.reshard_plan` decides, for FSDP, the loop
  and this planner alike). When no unit is resharded ('never', or 'default' at dp_shard = 1),
  units stay gathered from the first micro-batch's forward to the last one's backward: one
  all-gather per unit and step. AC recompute happens while the unit is gathered: no extra
  all-gather.
- Only the last micro-batch of a step reduces gradients: a reduce-scatter in `reduce_dtype`
  inside the shard group, then (HSDP) an all-reduce of the shard across replicas.
- Fine-tuning (`train.freeze`, LoRA: parallel/freeze.py, parallel/lora.py): gradients, their
  reduction and optimizer state exist for trainable parameters only. Backward skips a block
  whose parameters are all frozen when nothing before it trains (not the embedding, not an
  earlier block): no activations kept for it, and no second all-gather, except for the last
  such block, which FSDP2's implicit backward prefetch (of the block before, in forward order)
  gathers all the same (measured by tests/test_plan.py). Tensor parallel's
  backward traffic is still counted for every block, and LoRA adapters whole on each tp rank
  (one of each pair is split: a slight overestimate).
- fp8 (tensorwise) all-gathers the Linear weights that `parallel.float8.float8_policy` converts
  as 1 byte per element.
- Bytes sent per rank by a ring: all-gather (S-1)·shard, reduce-scatter (S-1)/S·input,
  all-reduce 2(R-1)/R·buffer. The trainer's few scalar all-reduces (token count, loss, grad
  norm) are left out.
- Tensor parallel (tp > 1, parallel/tp.py): the weights its plan splits (every Linear and the
  embedding) hold 1/tp per rank before FSDP shards them; norm gains are replicated. Per block
  and micro-batch, the attention and FFN inputs are all-gathered along the sequence and their
  outputs reduce-scattered back (2 + 2 of a (tokens, dim) tensor in forward, the same in
  backward, and a checkpointed block's recompute 2 + 1); the embedding output and the final
  norm's output add one each. The logits stay split over the vocabulary (loss parallel: three
  all-reduces of a float32 per token). The all-reduces of the replicated norm gains' gradients
  (dim elements each) are left out. Activations divide by tp except the two gathered
  (tokens, dim) block inputs that the split Linears keep.
- Mixture of experts (a family with `expert_modules`, model/__init__.py; `Unit.expert` marks
  the stacked expert weights): without expert parallel they are block parameters like the
  others, sharded over dp_shard along dim 0 (the experts) and all-gathered whole with their
  block. Activations count the routed copies: top_k per token. Expert parallel (ep > 1,
  parallel/ep.py) splits them over ep by expert, then FSDP-shards each rank's experts over
  expert_shard = dp_shard x cp x tp / ep in a unit of their own: gathered and reduce-scattered
  there (n_experts / ep experts when gathered), all-reduced over dp_replicate with the rest,
  and four all-to-alls of the routed rows per MoE layer and micro-batch, each tp rank sending
  its 1/tp of them, plus two all-gathers of the routed rows over tp at tp > 1
  (`_ep_communication`, `_ep_tp_gathers`).
- Context parallel (cp > 1, parallel/cp.py): each rank holds micro-batch x seq_len / cp
  tokens, so activations and logits divide by cp, except the whole sequence's keys and values
  that attention gathers and keeps for backward (2·cp·kv_dim per local token and block in
  place of 2·kv_dim). FSDP shards and reduces over dp_shard x cp (reported as dp_shard). Per
  layer and micro-batch, forward all-gathers K and V over cp in param_dtype, backward
  reduce-scatters their gradients, and a checkpointed block's recompute gathers them again
  (full, selective and op AC alike: the gathered K/V are not among op AC's saved outputs)
  (`_cp_communication`). The all-gather of the document ids under document masking (8 bytes
  a token per forward) is left out.
- Muon (optim.name="muon", parallel/muon.py): a momentum buffer (float32) per Muon matrix in
  place of AdamW's two moments and step. Each bucket of same-shaped block matrices split over
  one mesh dim (dp_shard x cp at tp = 1, tp at dp_shard x cp = 1) crosses two all-to-alls in
  the Newton-Schulz dtype: each of K matrices of M elements goes to its owner and comes back,
  2 (N-1)/N^2 K M per rank on average (every rank but the owner sends its 1/N, the owner sends
  back N-1 of N parts). Expert stacks are split by expert, whole where they are: no traffic.
  Under FSDP x tp (a matrix split over two mesh dims) DTensor's redistribute moves them
  instead: not counted. The owner holds its ceil(K/N) whole matrices of the largest bucket
  twice (received, orthogonalized): `muon_owner`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from configs import ConfigError
from model import ModelFamily, moe_family
from parallel.float8 import Float8Config
from parallel.fsdp import Reshard, reshard_plan
from parallel.lora import LoRAConfig
from parallel.muon import muon_parameters

BYTES = {"bfloat16": 2, "float32": 4}
AcMode = Literal["none", "full", "selective", "op"]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its parameter shapes and which of them are all-gathered in float8."""

    shapes: tuple[tuple[int, ...], ...]
    float8_gathered: tuple[bool, ...]
    tp_split: tuple[bool, ...] = ()
    """Which parameters tensor parallel splits (the family's TP_PLAN); empty: none."""
    trainable: tuple[bool, ...] = ()
    """Which parameters train (train.freeze, LoRA); empty: all of them."""
    backward: bool = True
    """Whether backward runs through this unit (not: frozen, and nothing before it trains)."""
    expert: tuple[bool, ...] = ()
    """Which parameters are stacked expert weights (dim 0 = expert); empty: none."""
    muon: tuple[bool, ...] = ()
    """Which parameters Muon trains under optim.name="muon" (parallel/muon.py); empty: none."""

    def numel(self, trainable_only: bool = False) -> int:
        return sum(math.prod(s) for s, t in zip(self.shapes, self._trains(), strict=True)
                   if t or not trainable_only)  # fmt: skip

    def expert_numel(self) -> int:
        experts = self.expert or (False,) * len(self.shapes)
        return sum(math.prod(s) for s, e in zip(self.shapes, experts, strict=True) if e)

    def _trains(self) -> tuple[bool, ...]:
        return self.trainable or (True,) * len(self.shapes)

    def shard_numel(
        self,
        shard: int,
        fp8_only: bool | None = None,
        tp: int = 1,
        trainable_only: bool = False,
        ep: int = 1,
        experts: bool | None = None,
        muon: bool | None = None,
    ) -> int:
        """Elements of this rank's (padded) shard: FSDP2 pads dim 0 to a multiple of shard;
        a weight tensor parallel splits holds 1/tp of them (tp divides those dims).
        `trainable_only`: of the parameters that train (gradients, optimizer state). Expert
        weights under expert parallel: split over ep by expert first, then FSDP pads each
        rank's experts to a multiple of shard x tp / ep (expert_shard: the tp ranks compute
        other rows, parallel/ep.py; tp splits no expert). `experts`: True for the
        expert weights only, False for the others only; `muon` likewise for Muon's."""
        split = self.tp_split or (False,) * len(self.shapes)
        expert = self.expert or (False,) * len(self.shapes)
        muons = self.muon or (False,) * len(self.shapes)
        params = zip(self.shapes, self.float8_gathered, split, self._trains(), expert, muons,
                     strict=True)  # fmt: skip
        total = 0
        for s, f, t, trains, e, m in params:
            if (fp8_only is not None and f != fp8_only) or (trainable_only and not trains):
                continue
            if (experts is not None and e != experts) or (muon is not None and m != muon):
                continue
            # Under EP the experts' FSDP group is the ranks EP leaves, tp ranks included.
            group = shard * tp // ep if ep > 1 else shard
            rows = math.ceil(s[0] // ep / group) if e else math.ceil(s[0] / shard)
            total += rows * math.prod(s[1:]) // (tp if t else 1)
        return total

    def tp_numel(self, tp: int, ep: int = 1) -> int:
        """Elements of the unit on one tensor-parallel rank, gathered (before FSDP); its
        expert weights hold the rank's n_experts / ep experts."""
        return self.shard_numel(1, tp=tp, experts=False) + self.shard_numel(ep, ep=ep, experts=True)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model, read from the model itself built on meta."""

    units: list[Unit]
    """The blocks' FSDP units in order, then the root's."""
    dim: int
    kv_dim: int
    ffn_hidden: int
    n_layers: int
    vocab_size: int
    top_k: int = 0
    """Mixture of experts: experts per token (0: a dense model)."""
    n_experts: int = 0

    def numel(self, trainable_only: bool = False) -> int:
        return sum(u.numel(trainable_only) for u in self.units)

    def n_backward_blocks(self) -> int:
        """Blocks that backward runs through (all of them unless the first ones are frozen)."""
        return sum(u.backward for u in self.units[:-1])

    def active_numel(self) -> int:
        """Parameters one token uses: top_k / n_experts of each expert weight, all the rest."""
        experts = sum(u.expert_numel() for u in self.units)
        return self.numel() - experts + (experts * self.top_k // self.n_experts if experts else 0)


def model_shape(
    family: ModelFamily,
    args: object,
    fp8: Float8Config | None = None,
    lora: LoRAConfig | None = None,
    freeze: list[str] | tuple[str, ...] = (),
) -> ModelShape:
    """Build the model on meta (no memory) and read its FSDP units' parameter shapes. With fp8
    on and tensorwise, the weights of the Linear layers the FP8 policy converts are all-gathered
    in float8 (rowwise gathers in the compute dtype). `lora` (when enabled) and `freeze`: what
    trains, as train.py sets it (LoRA's adapters are parameters of their blocks' units)."""
    from launch.job import JobConfig, TrainConfig  # the job tree imports this module's peers
    from parallel.build import build_model

    job = JobConfig(train=TrainConfig(freeze=list(freeze)))
    job.fp8, job.lora = fp8 or job.fp8, lora or job.lora
    built = build_model(family, args, job)  # on meta, as train.py builds it, without a mesh
    model = built.model
    float8 = set()
    if job.fp8.enabled and job.fp8.recipe == "tensorwise":
        modules = dict(model.named_modules())
        float8 = {id(modules[d.fqn].weight) for d in built.float8 if d.converted}
    # The TP plan names the base layers; their own weights (not LoRA's adapters) are split.
    split = _tp_split_params(model, getattr(family, "TP_PLAN", None))
    units = family.fsdp_units(model)
    in_unit = {id(p) for u in units for p in u.parameters()}
    # Backward reaches a block once anything before it trains: the embedding or a block.
    reached = any(
        p.requires_grad for m in model.modules() if isinstance(m, nn.Embedding)
        for p in m.parameters()
    )  # fmt: skip

    moe = moe_family(family)
    experts = set()
    if moe is not None:
        experts = {id(p) for m in moe.expert_modules(model) for p in m.parameters()}
    names = set(muon_parameters(model, units))
    muon = {id(p) for n, p in model.named_parameters() if n in names}

    def unit(params: list[nn.Parameter], backward: bool = True) -> Unit:
        shapes = tuple(tuple(p.shape) for p in params)
        return Unit(shapes, tuple(id(p) in float8 for p in params),
                    tuple(id(p) in split for p in params),
                    tuple(p.requires_grad for p in params), backward,
                    tuple(id(p) in experts for p in params),
                    tuple(id(p) in muon for p in params))  # fmt: skip

    blocks = []
    for u in units:
        reached = reached or any(p.requires_grad for p in u.parameters())
        blocks.append(unit(list(u.parameters()), reached))
    root = [p for p in model.parameters() if id(p) not in in_unit]
    ffn_hidden = block_ffn_hidden(units, args, moe is not None)
    top_k, n_experts = (args.top_k, args.n_experts) if moe is not None else (0, 0)
    return ModelShape(
        [*blocks, unit(root)],
        dim=args.dim,
        kv_dim=args.n_kv_heads * args.head_dim,
        ffn_hidden=ffn_hidden,
        n_layers=len(units),
        vocab_size=args.vocab_size,
        top_k=top_k,
        n_experts=n_experts,
    )


def block_ffn_hidden(units: list[nn.Module], args: Any, moe: bool) -> int:
    """The FFN hidden size every block shares (an expert's, for a mixture of experts), after
    checking that each block is the one kind the formulas here count: attention (q, k, v, o
    projections) and a SwiGLU FFN (3 matrices) or an MoE layer (a router and n_experts SwiGLU
    experts), plus norm gains. A block with anything else (shared experts, dense layers among
    MoE ones, another attention, biases, FFNs of different widths) is refused by name rather
    than miscounted: its matrices are compared with what the formulas assume."""
    d, heads = args.dim, args.n_heads * args.head_dim
    attention = 2 * d * heads + 2 * d * args.n_kv_heads * args.head_dim
    widths = set()
    for i, block in enumerate(units):
        # LoRA's adapters are counted from the parameters themselves (Unit); not a shape here.
        linears = [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]
        base = [m for n, m in linears if ".lora_" not in f".{n}"]
        adapters = {id(p) for n, m in linears if ".lora_" in f".{n}" for p in m.parameters()}
        matrices = sum(
            p.numel() for p in block.parameters() if p.ndim >= 2 and id(p) not in adapters
        )
        if moe:
            hidden = args.moe_ffn_dim
            ffn = d * args.n_experts + 3 * args.n_experts * d * hidden
            kind = f"attention and {args.n_experts} experts of hidden {hidden} with their router"
        else:
            hidden = max(m.out_features for m in base)  # SwiGLU's up projections are the widest
            ffn = 3 * d * hidden
            kind = f"attention and a SwiGLU FFN of hidden {hidden}"
        if matrices != attention + ffn:
            raise ConfigError(
                f"planner: block {i} has {matrices:,} weights in matrices, not the "
                f"{attention + ffn:,} of {kind}: parallel/plan.py counts only such blocks, so "
                "its memory and traffic figures would be wrong for this model"
            )
        widths.add(hidden)
    if len(widths) > 1:
        raise ConfigError(
            f"planner: the blocks' FFN hidden sizes differ ({sorted(widths)}); parallel/plan.py "
            "counts blocks of one width"
        )
    return widths.pop()


def _tp_split_params(model: nn.Module, tp_plan: dict[str, str] | None) -> set[int]:
    """ids of the parameters that the TP plan splits (not the replicated norm gains)."""
    from parallel.tp import SPLIT_STYLES, _matches

    split: set[int] = set()
    for name, module in model.named_modules():
        for pattern, kind in (tp_plan or {}).items():
            if kind in SPLIT_STYLES and _matches(name, pattern):
                split |= {id(p) for p in module.parameters(recurse=False)}
    return split


def plan_communication(
    shape: ModelShape,
    dp_replicate: int,
    dp_shard: int,
    param_dtype: str = "bfloat16",
    reduce_dtype: str = "float32",
    reshard_after_forward: Reshard = "default",
    grad_accum_steps: int = 1,
    cpu_offload: bool = False,
    tp: int = 1,
    tokens: int = 0,
    ac_mode: AcMode = "none",
    ac_every: int = 1,
    ep: int = 1,
    cp: int = 1,
    muon_dtype: str | None = None,
) -> dict[str, dict[str, float]]:
    """Bytes each rank sends per optimizer step: {mesh dim: {collective: bytes}}. With tp, ep
    or cp > 1, `tokens` (micro-batch x seq_len, whole sequences) sizes the activations they
    move. Under expert parallel the expert weights are gathered and reduced over expert_shard
    (dp_shard / ep). Under context parallel FSDP's group is dp_shard x cp ("dp_shard").
    `muon_dtype`: optim.muon.ns_dtype under optim.name="muon" (None: AdamW)."""
    units = shape.units
    tokens //= cp  # each cp rank holds 1/cp of every sequence
    s, r = dp_shard * cp, dp_replicate
    e = s * tp // ep if ep > 1 else s  # the experts' FSDP group (expert_shard under EP)
    pbytes, rbytes = BYTES[param_dtype], BYTES[reduce_dtype]
    resharded = reshard_plan(len(units) - 1, reshard_after_forward, s, cpu_offload)
    # With no unit resharded, the loop keeps them gathered across micro-batches too.
    kept_all_step = not any(resharded)
    gather = reduce_scatter = all_reduce = expert_gather = expert_reduce = 0.0
    n_blocks = len(units) - 1
    for i, (u, freed) in enumerate(zip(units, resharded, strict=True)):
        # float8-gathered weights cross as 1 byte; norms, embeddings, output in param_dtype
        dense = u.shard_numel(s, True, tp, experts=False)
        dense += u.shard_numel(s, False, tp, experts=False) * pbytes
        experts = u.shard_numel(s, tp=tp, ep=ep, experts=True) * pbytes
        # Gathered again in backward: a unit backward runs through, and the block just before
        # the first one it runs through (prefetched by that one; see the module docstring).
        # Under EP the experts' own unit frees and gathers with its block.
        in_backward = u.backward or (i + 1 < n_blocks and units[i + 1].backward)
        passes = 2 if freed and in_backward else 1
        if not kept_all_step:
            passes *= grad_accum_steps
        gather += passes * (s - 1) * dense
        expert_gather += passes * (e - 1) * experts
        # Frozen parameters have no gradient to reduce.
        dense_grad = u.shard_numel(s, tp=tp, trainable_only=True, experts=False) * rbytes
        expert_grad = u.shard_numel(s, tp=tp, trainable_only=True, ep=ep, experts=True) * rbytes
        reduce_scatter += (s - 1) * dense_grad  # (S-1)/S of the padded full gradient
        expert_reduce += (e - 1) * expert_grad
        all_reduce += 2 * (r - 1) / r * (dense_grad + expert_grad)
    comm = {
        "dp_shard": {"all_gather": gather, "reduce_scatter": reduce_scatter},
        "dp_replicate": {"all_reduce": all_reduce},
        "tp": _tp_communication(
            shape, tp, tokens, param_dtype, ac_mode, ac_every, grad_accum_steps
        ),
    }
    if ep == 1:  # the experts are part of their block's unit
        comm["dp_shard"]["all_gather"] += expert_gather
        comm["dp_shard"]["reduce_scatter"] += expert_reduce
    else:
        comm["expert_shard"] = {"all_gather": expert_gather, "reduce_scatter": expert_reduce}
        comm["ep"] = _ep_communication(
            shape, ep, tokens // tp, param_dtype, ac_mode, ac_every, grad_accum_steps
        )
        if tp > 1:
            comm["tp"]["all_gather"] += _ep_tp_gathers(
                shape, tp, tokens, param_dtype, ac_mode, ac_every, grad_accum_steps
            )
    if cp > 1:
        comm["cp"] = _cp_communication(
            shape, cp, tokens, param_dtype, ac_mode, ac_every, grad_accum_steps, tp
        )
    if muon_dtype is not None and (s == 1 or tp == 1):  # split over one mesh dim at most
        dim, n = ("tp", tp) if tp > 1 else ("dp_shard", s)
        comm[dim]["all_to_all"] = sum(
            2 * (n - 1) / n**2 * len(matrices) * math.prod(shape_) * BYTES[muon_dtype]
            for shape_, matrices in muon_buckets(shape).items()
        )
    return comm


def muon_buckets(shape: ModelShape) -> dict[tuple[int, ...], list[int]]:
    """Muon's dense matrices that train, by shape (the buckets of parallel/muon.py), as the
    indices of their blocks."""
    buckets: dict[tuple[int, ...], list[int]] = {}
    for i, u in enumerate(shape.units[:-1]):
        for s, m, t, e in zip(u.shapes, u.muon or (False,) * len(u.shapes), u._trains(),
                              u.expert or (False,) * len(u.shapes), strict=True):  # fmt: skip
            if m and t and not e:
                buckets.setdefault(s, []).append(i)
    return buckets


def _cp_communication(
    shape: ModelShape,
    cp: int,
    tokens: int,
    param_dtype: str,
    ac_mode: AcMode,
    ac_every: int,
    micro_batches: int,
    tp: int = 1,
) -> dict[str, float]:
    """Bytes context parallel's K/V collectives send per rank and step (parallel/cp.py), for
    `tokens` per rank and micro-batch. Every layer all-gathers its keys and values (each
    (batch, kv_heads, seq/cp, head_dim) per rank) in forward: (cp-1) x that each; a layer
    backward runs through reduce-scatters their gradients (cp x that in, (cp-1)/cp of it out:
    the same bytes); a checkpointed block's recompute runs the gathers again. At tp > 1 a
    rank holds kv_heads / tp of them (tensor parallel splits the heads)."""
    n, n_backward = shape.n_layers, shape.n_backward_blocks()
    recomputed = {"full": n_backward, "op": n_backward}.get(ac_mode, 0)
    if ac_mode == "selective":  # blocks 0, every, 2 x every, ... that backward runs through
        recomputed = sum(u.backward for u in shape.units[:-1][::ac_every])
    kv = (cp - 1) * tokens * shape.kv_dim // tp * BYTES[param_dtype]
    return {
        "all_gather": micro_batches * 2 * (n + recomputed) * kv,
        "reduce_scatter": micro_batches * 2 * n_backward * kv,
    }


def _ep_communication(
    shape: ModelShape,
    ep: int,
    tokens: int,
    param_dtype: str,
    ac_mode: AcMode,
    ac_every: int,
    micro_batches: int,
) -> dict[str, float]:
    """Bytes expert parallel's all-to-alls send per rank and step (parallel/ep.py). Per MoE
    layer and micro-batch: the tokens x top_k routed rows of dim elements go out (dispatch)
    and come back (combine), and their gradients the same ways in backward; a checkpointed
    block's recompute (full or selective AC) dispatches and combines again. Each forward also
    exchanges the int64 row counts per expert. A rank keeps the rows for its own experts:
    (ep - 1) / ep of each buffer leaves it when the routing is balanced, which is also the
    mean over the ranks in any case (every row sent is a row received); one rank's own share
    follows its routing."""
    n = sum(any(u.expert) for u in shape.units)  # MoE layers
    recomputed = {"full": n, "selective": math.ceil(n / ac_every)}.get(ac_mode, 0)
    rows = tokens * shape.top_k * shape.dim * BYTES[param_dtype]
    counts = shape.n_experts * 8
    leaving = (ep - 1) / ep
    per_step = (4 * n + 2 * recomputed) * rows + (n + recomputed) * counts
    return {"all_to_all": micro_batches * leaving * per_step}


def _ep_tp_gathers(
    shape: ModelShape,
    tp: int,
    tokens: int,
    param_dtype: str,
    ac_mode: AcMode,
    ac_every: int,
    micro_batches: int,
) -> float:
    """Bytes of expert parallel's all-gathers over tp per rank and step (parallel/ep.py): each
    tp rank computes 1/tp of the tokens x top_k routed rows; per MoE layer and micro-batch the
    results are all-gathered in forward and the rows' gradients in backward, and a
    checkpointed block's recompute gathers again."""
    n = sum(any(u.expert) for u in shape.units)  # MoE layers
    recomputed = {"full": n, "selective": math.ceil(n / ac_every)}.get(ac_mode, 0)
    rows = tokens * shape.top_k * shape.dim * BYTES[param_dtype]
    return micro_batches * (2 * n + recomputed) * (tp - 1) / tp * rows


def _tp_communication(
    shape: ModelShape,
    tp: int,
    tokens: int,
    param_dtype: str,
    ac_mode: AcMode,
    ac_every: int,
    micro_batches: int,
) -> dict[str, float]:
    """Activation bytes tensor parallel sends per rank and step (see the module docstring)."""
    if tp == 1:
        return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0}
    n = shape.n_layers
    recomputed = {"full": n, "selective": math.ceil(n / ac_every)}.get(ac_mode, 0)
    # Per block: 2 gathers + 2 reduce-scatters forward, 2 + 2 backward; a recompute redoes
    # both gathers but only attention's reduce-scatter (torch's checkpoint stops once it has
    # every saved tensor, before the FFN's output). The root: the embedding's reduce-scatter
    # and the final norm's gather (and their backward twins). The logits stay split: loss
    # parallel all-reduces three float32 values per token (max, sum of exp, target logit).
    hidden = (tp - 1) / tp * tokens * shape.dim * BYTES[param_dtype]
    # An MoE layer runs whole on every tp rank ("replicate"): its output is split back by
    # slicing, so it has no reduce-scatter, forward or backward, where a SwiGLU FFN has w2's.
    moe = sum(any(u.expert) for u in shape.units)
    return {
        "all_gather": micro_batches * (4 * n + 2 * recomputed + 2) * hidden,
        "reduce_scatter": micro_batches * (4 * n - 2 * moe + recomputed + 2) * hidden,
        "all_reduce": micro_batches * 3 * 2 * (tp - 1) / tp * tokens * 4,
    }


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    param_dtype: str,
    ac_mode: AcMode = "none",
    ac_every: int = 1,
    recompute: bool = True,
    tp: int = 1,
    cp: int = 1,
) -> float:
    """Activations kept for backward per rank, from what this model's ops save; with
    `recompute`, plus the block being recomputed in backward (the peak under AC).

    Per token and block, no AC keeps ~10·dim + 4·kv_dim + 4·ffn_hidden elements (norm inputs
    and outputs, q/k/v, attention output, SwiGLU's three hidden tensors); a checkpointed block
    keeps its input (dim), plus one block's worth alive while it is recomputed; op-level AC keeps
    the matmul and attention outputs (~5·dim + 2·kv_dim + 2·ffn_hidden) and the block input.
    SDPA never materializes the attention matrix. Tensor parallel divides all of it by tp but
    the two block inputs gathered whole for the split Linears (2·dim).
    A mixture of experts replaces the FFN's part by its routed copies, top_k per token, each
    with its input and output (2·dim) and the expert's hidden tensors (4·ffn_hidden; op-level
    AC: 2·ffn_hidden + dim, the grouped GEMM outputs), and the router's ~3·n_experts; every tp
    rank runs the whole MoE layer, so that part does not divide by tp.
    Context parallel (`tokens` are this rank's): attention keeps the keys and values of the
    whole sequence, gathered (2·cp·kv_dim per local token in place of 2·kv_dim); op-level AC
    does not keep them (a concatenation's output), it gathers them again.
    """
    d, kv, h, k = shape.dim, shape.kv_dim, shape.ffn_hidden, shape.top_k
    gathered = 2 * d * (1 - 1 / tp)
    ffn, routed = (0, k * (2 * d + 4 * h) + 3 * shape.n_experts) if k else (4 * h, 0)
    kv_kept = 2 * kv + 2 * cp * kv  # K and V projected, then attention's (whole-sequence) K, V
    full_block = tokens * ((10 * d + kv_kept + ffn) / tp + routed + gathered) * BYTES[param_dtype]
    block_input = tokens * d / tp * BYTES[param_dtype]
    n = shape.n_backward_blocks()  # a block backward skips keeps nothing
    if n == 0:
        return 0.0
    if ac_mode == "none":
        return n * full_block
    recomputed = full_block if recompute else 0
    if ac_mode == "op":
        ffn, routed = (0, k * (2 * h + d) + shape.n_experts) if k else (2 * h, 0)
        kept = (5 * d + 2 * kv + ffn) / tp + routed + gathered
        return n * tokens * kept * BYTES[param_dtype] + recomputed
    checkpointed = n if ac_mode == "full" else math.ceil(n / ac_every)
    return checkpointed * block_input + (n - checkpointed) * full_block + recomputed


def plan_memory(
    shape: ModelShape,
    dp_shard: int,
    micro_batch: int,
    seq_len: int,
    param_dtype: str = "bfloat16",
    ac_mode: AcMode = "none",
    ac_every: int = 1,
    reshard_after_forward: Reshard = "default",
    cpu_offload: bool = False,
    compiled_loss: bool = False,
    tp: int = 1,
    ep: int = 1,
    cp: int = 1,
    loss_chunk_tokens: int = 0,
    muon_dtype: str | None = None,
) -> dict[str, float]:
    """Bytes per rank: the sharded fp32 training state, gathered parameters and activations.
    `seq_len` is the whole sequence; under context parallel a rank holds 1/cp of it and the
    state shards over dp_shard x cp.

    Master weights, gradients and AdamW's two moments (plus a 4-byte step per tensor) are
    float32, sharded over dp_shard (HSDP replicas each hold their shard group's state) and,
    for the weights tensor parallel splits, over tp; expert weights under expert parallel
    over ep x expert_shard, the same ranks. Gradients and moments exist only for the
    parameters that train. A gathered block holds its n_experts / ep experts. `muon_dtype`
    (optim.name="muon"): Muon's matrices hold one float32 momentum buffer instead, and the
    owners their whole matrices (`muon_owner`, module docstring).
    """
    units = shape.units
    dp_shard *= cp  # FSDP's group: dp_shard x cp (parallel/runtime.py dp_mesh)
    shard = sum(u.shard_numel(dp_shard, tp=tp, ep=ep) for u in units)
    trained = sum(u.shard_numel(dp_shard, tp=tp, trainable_only=True, ep=ep) for u in units)
    n_tensors = sum(sum(u._trains()) for u in units)
    pbytes = BYTES[param_dtype]
    tokens = micro_batch * seq_len // cp
    root, block = units[-1].tp_numel(tp), units[0].tp_numel(tp, ep)
    # The root stays gathered all step; one block computes while the next is prefetched
    # (a block not resharded after forward stays gathered until its backward).
    n_blocks = len(units) - 1
    kept = n_blocks - sum(reshard_plan(n_blocks, reshard_after_forward, dp_shard, cpu_offload)[:-1])
    gathered_blocks = max(kept, min(2, n_blocks))
    # A chunked loss (train.loss_chunk_tokens, parallel/loss.py) holds one chunk's logits.
    logits = min(tokens, loss_chunk_tokens or tokens) * shape.vocab_size / tp
    optimizer = 8 * trained + 4 * n_tensors
    owner = 0.0
    if muon_dtype is not None:
        muon = sum(u.shard_numel(dp_shard, tp=tp, trainable_only=True, ep=ep, muon=True)
                   for u in units)  # fmt: skip
        n_muon = sum(sum(m and t for m, t in zip(u.muon, u._trains(), strict=True))
                     for u in units if u.muon)  # fmt: skip
        optimizer -= 4 * muon + 4 * n_muon  # one buffer, no second moment and no step
        # Unsplit (one rank per group), each matrix is orthogonalized on its own.
        n = tp if tp > 1 else dp_shard
        held = [(math.ceil(len(m) / n) if n > 1 else 1) * math.prod(s)
                for s, m in muon_buckets(shape).items()]  # fmt: skip
        owner = 2 * max(held, default=0) * BYTES[muon_dtype]
    mem = {
        "params": 4 * shard,
        "grads": 4 * trained,
        "optimizer": optimizer,
        "gathered_params": (root + gathered_blocks * block) * pbytes,
        "activations": activation_bytes(
            shape, tokens, param_dtype, ac_mode, ac_every, tp=tp, cp=cp
        ),
        # Logits in compute dtype and, at the loss's peak, their gradient: in compute dtype when
        # the loss is compiled (compile.loss); eager adds a float32 copy, the float32
        # log-softmax kept for backward and a float32 gradient (measured: bench/loss.py). With
        # tp each rank holds its vocabulary slice only (loss parallel, never compiled).
        "logits": logits * (2 * pbytes if compiled_loss else pbytes + 12),
    }
    return mem | ({"muon_owner": owner} if muon_dtype is not None else {})
