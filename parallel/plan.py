"""The planner's formulas: memory per rank and bytes sent per step on each mesh dimension, for
any (dp_replicate, dp_shard, cp, tp) mesh, read from the model built on meta. `python -m
launch.plan` (before renting the cluster) and `train.py --dry-run` print them.

Parameters, gradients, optimizer state and FSDP's and tensor parallel's traffic follow from the
model's own parameters (parallel/shape.py); activations, FLOPs and the traffic of context and
expert parallel from what each block computes, as its family describes it (`block_shapes`,
model/blocks.py), so any mix of blocks is planned: a dense first block and MoE blocks after it,
FFNs of other widths or matrix counts, shared experts. Where a family gives no description
(or one its blocks contradict), those terms are nan ("n/a" in the tables), and the rest is
planned all the same (`ModelShape.missing` says why, in one line).

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
  block. Activations count the routed copies: top_k per token, in the MoE blocks. Expert
  parallel (ep > 1, parallel/ep.py) splits them over ep by expert, then FSDP-shards each rank's
  experts over
  expert_shard = dp_shard x cp x tp / ep in a unit of their own: gathered and reduce-scattered
  there (n_experts / ep experts when gathered), all-reduced over dp_replicate with the rest,
  and four all-to-alls of the routed rows per MoE block and micro-batch, each tp rank sending
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
from typing import Literal

from model.blocks import BlockShape
from parallel.fsdp import Reshard, reshard_plan
from parallel.shape import ModelShape, Unit, model_shape

__all__ = [
    "ModelShape",
    "Unit",
    "model_shape",
    "plan_communication",
    "plan_memory",
    "reference_gathers",
]

BYTES = {"bfloat16": 2, "float32": 4}
AcMode = Literal["none", "full", "selective", "op"]


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
    graph_fsdp: bool = False,
    pipelined: bool = False,
) -> dict[str, dict[str, float]]:
    """Bytes each rank sends per optimizer step: {mesh dim: {collective: bytes}}. With tp, ep
    or cp > 1, `tokens` (micro-batch x seq_len, whole sequences) sizes the activations they
    move. Under expert parallel the expert weights are gathered and reduced over expert_shard
    (dp_shard / ep). Under context parallel FSDP's group is dp_shard x cp ("dp_shard").
    `muon_dtype`: optim.muon.ns_dtype under optim.name="muon" (None: AdamW). `graph_fsdp`
    (compile.fsdp="graph", `graph_buckets`): every unit resharded unless 'never', nothing kept
    gathered between micro-batches, gradients reduced after every micro-batch. `pipelined`:
    `shape` is one pipeline rank's stages (parallel/pp_plan.py `plan_pipeline`)."""
    tokens //= cp  # each cp rank holds 1/cp of every sequence
    s, r = dp_shard * cp, dp_replicate
    e = s * tp // ep if ep > 1 else s  # the experts' FSDP group (expert_shard under EP)
    gather, reduce_scatter, all_reduce, expert_gather, expert_reduce = _fsdp_traffic(
        shape, s, r, e, param_dtype, reduce_dtype, reshard_after_forward, grad_accum_steps,
        cpu_offload, tp, ep, graph_fsdp, pipelined,
    )  # fmt: skip
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


def _fsdp_traffic(
    shape: ModelShape,
    s: int,
    r: int,
    e: int,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: Reshard,
    grad_accum_steps: int,
    cpu_offload: bool,
    tp: int,
    ep: int,
    graph_fsdp: bool,
    pipelined: bool,
) -> tuple[float, float, float, float, float]:
    """`plan_communication`'s FSDP bytes per rank and step, summed over the units: the dense
    all-gathers and reduce-scatters over the shard group of `s` ranks, the all-reduce over `r`
    replicas, and the experts' all-gathers and reduce-scatters over their group of `e`."""
    units = shape.units
    pbytes, rbytes = BYTES[param_dtype], BYTES[reduce_dtype]
    resharded = reshard_plan(len(units) - 1, reshard_after_forward, s, cpu_offload, pipelined)
    if graph_fsdp:  # the partitioner regathers every weight for backward, the root's too
        resharded = [reshard_after_forward != "never"] * len(units)
    # With no unit resharded, the loop keeps them gathered across micro-batches too.
    kept_all_step = not any(resharded) and not graph_fsdp
    reductions = grad_accum_steps if graph_fsdp else 1  # no skipped sync inside the graph
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
        reduce_scatter += reductions * (s - 1) * dense_grad  # (S-1)/S of the padded gradient
        expert_reduce += (e - 1) * expert_grad
        all_reduce += reductions * 2 * (r - 1) / r * (dense_grad + expert_grad)
    return gather, reduce_scatter, all_reduce, expert_gather, expert_reduce


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


def _checkpointed(shape: ModelShape, ac_mode: AcMode, ac_every: int) -> list[bool]:
    """Per block: whether AC recomputes it in backward ('full' every block, 'selective' blocks
    0, every, 2 x every, ...: parallel/ac.py; 'op' keeps the matmul and attention outputs and
    recomputes the rest, every collective in the block included: measured, op-level AC sends
    what full AC sends, tests/test_tp.py and tests/test_moe_compose.py)."""
    n = shape.n_layers
    if ac_mode in ("full", "op"):
        return [True] * n
    return [ac_mode == "selective" and i % ac_every == 0 for i in range(n)]


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
    `tokens` per rank and micro-batch. Every block all-gathers its keys and values (each
    (batch, kv_heads, seq/cp, head_dim) per rank) in forward: (cp-1) x that each; a block
    backward runs through reduce-scatters their gradients (cp x that in, (cp-1)/cp of it out:
    the same bytes); a checkpointed block's recompute (op-level AC too) runs the gathers again.
    At tp > 1 a rank holds kv_heads / tp of them (tensor parallel splits the heads)."""
    if shape.blocks is None:  # kv_dim per block unknown
        return {"all_gather": math.nan, "reduce_scatter": math.nan}
    kv = [b.attention.kv_dim for b in shape.blocks]
    backward = [u.backward for u in shape.units[:-1]]
    recomputed = [c and w for c, w in zip(_checkpointed(shape, ac_mode, ac_every), backward,
                                          strict=True)]  # fmt: skip
    gathered = sum(kv) + sum(d for d, r in zip(kv, recomputed, strict=True) if r)
    reduced = sum(d for d, w in zip(kv, backward, strict=True) if w)
    per_kv = (cp - 1) * tokens  # elements per unit of kv_dim, per rank

    def sent(kv_sum: int) -> float:
        return micro_batches * 2 * (per_kv * kv_sum // tp * BYTES[param_dtype])

    return {"all_gather": sent(gathered), "reduce_scatter": sent(reduced)}


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
    block and micro-batch: the tokens x top_k routed rows of dim elements go out (dispatch)
    and come back (combine), and their gradients the same ways in backward; a checkpointed
    block's recompute (any AC mode: op-level AC keeps no collective's output) dispatches and
    combines again. Each forward also
    exchanges the int64 row counts per expert. A rank keeps the rows for its own experts:
    (ep - 1) / ep of each buffer leaves it when the routing is balanced, which is also the
    mean over the ranks in any case (every row sent is a row received); one rank's own share
    follows its routing."""
    if shape.blocks is None:  # top_k unknown
        return {"all_to_all": math.nan}
    recomputes = _checkpointed(shape, ac_mode, ac_every)
    per_step = 0.0
    for i, block in enumerate(shape.blocks):
        if (experts := block.experts) is None:
            continue
        rows = tokens * experts.top_k * shape.dim * BYTES[param_dtype]
        counts = experts.n_experts * 8
        per_step += 4 * rows + counts
        if i < len(recomputes) and recomputes[i]:
            per_step += 2 * rows + counts
    return {"all_to_all": micro_batches * (ep - 1) / ep * per_step}


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
    tp rank computes 1/tp of the tokens x top_k routed rows; per MoE block and micro-batch the
    results are all-gathered in forward and the rows' gradients in backward, and a
    checkpointed block's recompute gathers again."""
    if shape.blocks is None:  # top_k unknown
        return math.nan
    recomputes = _checkpointed(shape, ac_mode, ac_every)
    total = 0.0
    for i, block in enumerate(shape.blocks):
        if (experts := block.experts) is None:
            continue
        rows = tokens * experts.top_k * shape.dim * BYTES[param_dtype]
        total += (3 if i < len(recomputes) and recomputes[i] else 2) * rows
    return micro_batches * (tp - 1) / tp * total


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
    recomputed = sum(_checkpointed(shape, ac_mode, ac_every))  # op-level AC's too
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
    `recompute`, plus the largest block being recomputed in backward (the peak under AC); nan
    when the blocks are not described (`ModelShape.missing`).

    Per token and block, no AC keeps ~10·dim + 4·kv_dim elements for the norms and attention
    (norm inputs and outputs, q/k/v, attention output) and the FFN's hidden tensors
    (`FFNShape.kept`: 4·hidden for SwiGLU's three, 2·hidden for a GeLU MLP's); a checkpointed
    block keeps its input (dim), plus one block's worth alive while it is recomputed; op-level
    AC keeps the matmul and attention outputs (~5·dim + 2·kv_dim + the FFN's up projections)
    and the block input. SDPA never materializes the attention matrix. Tensor parallel divides
    all of it by tp but the two block inputs gathered whole for the split Linears (2·dim).
    A mixture of experts adds its routed copies, top_k per token, each with its input and
    output (2·dim) and the expert's hidden tensors (op-level AC: the grouped GEMM outputs and
    dim), the router's ~3·n_experts, and a shared expert's hidden tensors; every tp rank runs
    the whole MoE layer, so that part does not divide by tp.
    Context parallel (`tokens` are this rank's): attention keeps the keys and values of the
    whole sequence, gathered (2·cp·kv_dim per local token in place of 2·kv_dim); op-level AC
    does not keep them (a concatenation's output), it gathers them again.
    """
    backward = [u.backward for u in shape.units[:-1]]  # a block backward skips keeps nothing
    if not any(backward):
        return 0.0
    if shape.blocks is None:
        return math.nan
    d, nbytes = shape.dim, BYTES[param_dtype]
    gathered = 2 * d * (1 - 1 / tp)
    block_input = tokens * d / tp * nbytes

    def full(b: BlockShape) -> float:  # everything autograd saves
        kv = b.attention.kv_dim
        kv_kept = 2 * kv + 2 * cp * kv  # K and V projected, then attention's (whole-seq) K, V
        split = 10 * d + kv_kept + (b.ffn.kept() if b.ffn else 0)
        return tokens * (split / tp + _moe_kept(b, d, op=False) + gathered) * nbytes

    def op(b: BlockShape) -> float:  # op-level AC: the matmul and attention outputs
        split = 5 * d + 2 * b.attention.kv_dim + (b.ffn.matmul_outputs() if b.ffn else 0)
        return tokens * (split / tp + _moe_kept(b, d, op=True) + gathered) * nbytes

    blocks = [b for b, w in zip(shape.blocks, backward, strict=True) if w]
    peak = max(full(b) for b in blocks) if recompute and ac_mode != "none" else 0
    if ac_mode == "none":
        return sum(full(b) for b in blocks)
    if ac_mode == "op":
        return sum(op(b) for b in blocks) + peak
    checkpointed = [c for c, w in zip(_checkpointed(shape, ac_mode, ac_every), backward,
                                      strict=True) if w]  # fmt: skip
    kept = [block_input if c else full(b) for b, c in zip(blocks, checkpointed, strict=True)]
    return sum(kept) + peak


def _moe_kept(block: BlockShape, dim: int, op: bool) -> float:
    """Elements per token a block's mixture of experts keeps, whole on every tp rank: the
    top_k routed copies (input and output, or with `op` the GEMM outputs and the input), the
    router's probabilities and choices, a shared expert's hidden tensors."""
    if (experts := block.experts) is None:
        return 0
    e = experts.expert
    if op:
        routed = experts.top_k * (e.matmul_outputs() + dim) + experts.n_experts
        return routed + (experts.shared.matmul_outputs() if experts.shared else 0)
    routed = experts.top_k * (2 * dim + e.kept()) + 3 * experts.n_experts
    return routed + (experts.shared.kept() if experts.shared else 0)


def _muon_memory(
    shape: ModelShape, dp_shard: int, tp: int, ep: int, muon_dtype: str | None
) -> tuple[float, float]:
    """`plan_memory`'s Muon terms: the optimizer bytes Muon's matrices save against AdamW's
    (one float32 buffer, no second moment and no step), and an owner's whole matrices."""
    if muon_dtype is None:
        return 0.0, 0.0
    units = shape.units
    muon = sum(u.shard_numel(dp_shard, tp=tp, trainable_only=True, ep=ep, muon=True)
               for u in units)  # fmt: skip
    n_muon = sum(sum(m and t for m, t in zip(u.muon, u._trains(), strict=True))
                 for u in units if u.muon)  # fmt: skip
    # Unsplit (one rank per group), each matrix is orthogonalized on its own.
    n = tp if tp > 1 else dp_shard
    held = [(math.ceil(len(m) / n) if n > 1 else 1) * math.prod(s)
            for s, m in muon_buckets(shape).items()]  # fmt: skip
    return 4 * muon + 4 * n_muon, 2 * max(held, default=0) * BYTES[muon_dtype]


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
    graph_bucket_bytes: float | None = None,
    pipelined: bool = False,
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
    owners their whole matrices (`muon_owner`, module docstring). `graph_bucket_bytes`
    (compile.fsdp="graph"): the largest all-gather bucket (`graph_buckets`); two are gathered
    at a time (one in use, the next in flight), or every weight with 'never'.
    """
    units = shape.units
    dp_shard *= cp  # FSDP's group: dp_shard x cp (parallel/runtime.py dp_mesh)
    shard = sum(u.shard_numel(dp_shard, tp=tp, ep=ep) for u in units)
    trained = sum(u.shard_numel(dp_shard, tp=tp, trainable_only=True, ep=ep) for u in units)
    n_tensors = sum(sum(u._trains()) for u in units)
    pbytes = BYTES[param_dtype]
    tokens = micro_batch * seq_len // cp
    root = units[-1].tp_numel(tp)
    # The root stays gathered all step; one block computes while the next is prefetched
    # (a block not resharded after forward stays gathered until its backward): at the peak,
    # that many of the largest blocks (blocks may differ: a dense one and MoE ones).
    n_blocks = len(units) - 1
    resharded = reshard_plan(n_blocks, reshard_after_forward, dp_shard, cpu_offload, pipelined)
    kept = n_blocks - sum(resharded[:-1])
    largest = sorted((u.tp_numel(tp, ep) for u in units[:-1]), reverse=True)
    gathered_blocks = sum(largest[: max(kept, min(2, n_blocks))])
    gathered = (root + gathered_blocks) * pbytes
    if graph_bucket_bytes is not None:  # float8-gathered weights held as 1 byte per element
        whole = sum(u.shard_numel(1, True, tp) + u.shard_numel(1, False, tp) * pbytes
                    for u in units)  # fmt: skip
        never = reshard_after_forward == "never"
        gathered = whole if never else min(whole, 2 * graph_bucket_bytes)
    # A chunked loss (train.loss_chunk_tokens, parallel/loss.py) holds one chunk's logits.
    logits = min(tokens, loss_chunk_tokens or tokens) * shape.vocab_size / tp
    optimizer = 8 * trained + 4 * n_tensors
    saved, owner = _muon_memory(shape, dp_shard, tp, ep, muon_dtype)
    optimizer -= saved
    mem = {
        "params": 4 * shard,
        "grads": 4 * trained,
        "optimizer": optimizer,
        "gathered_params": gathered,
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


def reference_gathers(
    shape: ModelShape,
    dp_shard: int,
    param_dtype: str,
    grad_accum_steps: int,
    resharded: list[bool],
    tp: int = 1,
    ep: int = 1,
) -> float:
    """DPO's reference (parallel/dpo.py), one more forward per micro-batch: the bytes each rank
    sends per step in the all-gathers of the units it gathers anew (`resharded`, one entry per
    unit): every unit of the frozen copy (train.py builds it resharding them all), or the units
    of the policy (the LoRA reference) that its forward frees."""
    pbytes = BYTES[param_dtype]
    per_pass = sum(u.shard_numel(dp_shard, True, tp, ep=ep)
                   + u.shard_numel(dp_shard, False, tp, ep=ep) * pbytes
                   for u, freed in zip(shape.units, resharded, strict=True) if freed)  # fmt: skip
    return grad_accum_steps * (dp_shard - 1) * per_pass


@dataclass(frozen=True)
class GraphBuckets:
    """compile.fsdp="graph": the collectives of one micro-batch after Inductor's bucketing, each
    as the bytes of its buffer (parallel/graph_fsdp.py)."""

    all_gather: list[int]
    """Forward's all-gathers: gathered bytes per bucket. Backward gathers the same buckets
    again unless parallel.reshard_after_forward='never' (the embedding's weight, which its
    backward does not need, is counted there too: one parameter over)."""
    reduce_scatter: list[int]
    """The gradients' reduce-scatters: input bytes (the whole padded gradient) per bucket."""


def graph_buckets(
    shape: ModelShape,
    dp_shard: int,
    param_dtype: str = "bfloat16",
    reduce_dtype: str = "float32",
    bucket_mb: float = 500.0,
    tp: int = 1,
) -> GraphBuckets:
    """Inductor's FSDP bucketing as torch.fx_passes.bucketing does it: collectives in graph
    order (the units' parameters, in order), each added to the open bucket while the bucket
    stays within `bucket_mb` MiB (its gathered, padded size), else opening the next; 0 MiB: one
    per parameter. The gradients come in the reverse order, in `reduce_dtype`, trainable only.
    A tied weight is gathered twice in forward (once per use) but counted once here. At tp > 1
    a split weight gathers its tp part; a float8-gathered weight crosses as 1 byte per element
    (its gradient in `reduce_dtype`)."""
    cap = bucket_mb * 2**20
    sizes = []  # (gathered elements, bytes per gathered element, trains)
    for u in shape.units:
        split = u.tp_split or (False,) * len(u.shapes)
        for s, trains, f8, t in zip(u.shapes, u._trains(), u.float8_gathered, split, strict=True):
            n = math.ceil(s[0] / dp_shard) * dp_shard * math.prod(s[1:]) // (tp if t else 1)
            sizes.append((n, 1 if f8 else BYTES[param_dtype], trains))

    def pack(nbytes: list[int]) -> list[int]:
        buckets: list[int] = []
        for n in nbytes:
            if buckets and buckets[-1] + n <= cap:
                buckets[-1] += n
            else:
                buckets.append(n)
        return buckets

    gathered = pack([n * nbytes for n, nbytes, _ in sizes])
    grads = pack([n * BYTES[reduce_dtype] for n, _, trains in reversed(sizes) if trains])
    return GraphBuckets(gathered, grads)
