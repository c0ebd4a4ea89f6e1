"""Pipeline parallel's arithmetic: its settings, where each stage lives, how the blocks are split,
and what the planner counts for it (the bubble, activations in flight, point-to-point bytes).

Pure arithmetic, no process group: `launch.check` rejects a bad pipeline with one line before
any collective, and the planner (`python -m launch.plan --pp`) prints the same numbers as
`train.py --dry-run`. The runtime (the split model, torch's schedules) is parallel/pp.py.

Units: a *stage* is a contiguous range of blocks; a rank holds `stages_per_rank` of them. The
formulas count time in forward passes of one micro-batch through one stage (F), with a
backward of 2 F split evenly into input gradients (I) and weight gradients (W), the ratio the
zero-bubble papers assume for transformer blocks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from configs import ConfigError
from parallel.pp_config import SCHEDULES, ZERO_BUBBLE, PipelineConfig, Schedule, stage_ranks

if TYPE_CHECKING:
    from collections.abc import Callable

    from parallel.plan import ModelShape


def check_pipeline(
    cfg: PipelineConfig, pp: int, n_blocks: int, microbatches: int, compiled: bool
) -> None:
    """ConfigError, before any collective, for a pipeline that cannot run; one line each,
    saying what would."""
    if pp == 1:
        return
    fixed, _ = SCHEDULES[cfg.schedule]
    v = cfg.local_stages()
    if fixed is not None and v != fixed:
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.schedule!r} runs {fixed} stage(s) per rank, not "
            f"stages_per_rank={cfg.stages_per_rank}: set stages_per_rank={fixed} (or 0), or "
            "schedule='interleaved_1f1b' for other numbers"
        )
    if fixed is None and v < 2:
        raise ConfigError(
            "parallel.pipeline.schedule='interleaved_1f1b' needs stages_per_rank >= 2 "
            "(with 1, use schedule='1f1b')"
        )
    stages = pp * v
    if n_blocks < stages:
        raise ConfigError(
            f"parallel.pp={pp} x {v} stage(s) per rank = {stages} stages, but the model has "
            f"{n_blocks} blocks: each stage needs at least one (fewer stages, or more layers)"
        )
    if cfg.split and (len(cfg.split) != stages or sum(cfg.split) != n_blocks):
        raise ConfigError(
            f"parallel.pipeline.split={cfg.split} must have {stages} entries (pp x stages per "
            f"rank) that sum to the model's {n_blocks} blocks"
        )
    if cfg.microbatches and cfg.microbatches != microbatches:
        raise ConfigError(
            f"parallel.pipeline.microbatches={cfg.microbatches}, but the step has {microbatches} "
            "micro-batches (train.global_batch_size / (train.micro_batch_size x data-parallel "
            "ranks)): they are the same micro-batches; change train.micro_batch_size instead"
        )
    need = {"1f1b": pp, "gpipe": 1, "zbv": stages, "dualpipev": stages}.get(cfg.schedule, pp)
    multiple = cfg.schedule == "interleaved_1f1b"
    if microbatches < need or (multiple and microbatches % pp != 0):
        rule = f"a multiple of pp ({pp})" if multiple else f"at least {need}"
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.schedule!r} needs {rule} micro-batches per step; "
            f"this step has {microbatches} (train.global_batch_size / (train.micro_batch_size x "
            "data-parallel ranks)): lower train.micro_batch_size"
        )
    if compiled and cfg.schedule in ZERO_BUBBLE:
        raise ConfigError(
            f"compile.enabled with parallel.pipeline.schedule={cfg.schedule!r}: torch's "
            "zero-bubble schedules split backward into input and weight gradients through the "
            "autograd graph, which compiled blocks hide; use '1f1b' or 'interleaved_1f1b' with "
            "compile"
        )


# ---- the split ------------------------------------------------------------------------------


def block_costs(shape: ModelShape, seq_len: int) -> tuple[list[float], float]:
    """Training FLOPs per token of each block, and of the output projection and loss (on the
    last stage), read from the planner's model shape: 6 per active weight (top_k of n_experts
    of a described MoE block's experts), plus attention's 12 x its width x seq_len. A family
    that does not describe its blocks (model/blocks.py) gets every weight and the model's dim.
    The one place the split reads the planner (`balanced_split`)."""
    blocks = shape.blocks or (None,) * shape.n_layers
    costs = []
    for unit, block in zip(shape.units[:-1], blocks, strict=True):
        active, experts = float(unit.numel()), unit.expert_numel()
        if experts and block is not None and block.experts is not None:
            active -= experts * (1 - block.experts.top_k / block.experts.n_experts)
        width = block.attention.q_dim if block is not None else shape.dim
        costs.append(6 * active + 12 * width * seq_len)
    return costs, 6.0 * shape.vocab_size * shape.dim


def balanced_split(costs: list[float], last_extra: float, stages: int) -> list[int]:
    """Blocks per stage: contiguous ranges whose largest cost (the last stage's plus
    `last_extra`) is the smallest possible and, among those, the most even (least sum of
    squares). Exact, by dynamic programming over (stages, blocks): instant for 126 blocks."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    worst = (math.inf, math.inf)
    # best[s][j]: (largest stage cost, sum of squares) of j blocks in s stages; came[s][j]: i.
    best = [[worst] * (n + 1) for _ in range(stages + 1)]
    came = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        extra = last_extra if s == stages else 0.0
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == worst:
                    continue
                cost = prefix[j] - prefix[i] + extra
                top, squares = best[s - 1][i]
                candidate = (max(top, cost), squares + cost * cost)
                if candidate < best[s][j]:
                    best[s][j], came[s][j] = candidate, i
    sizes, j = [], n
    for s in range(stages, 0, -1):
        sizes.append(j - came[s][j])
        j = came[s][j]
    return sizes[::-1]


# ---- the planner's terms --------------------------------------------------------------------


def bubble_fraction(schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Idle share of a rank's step time, F = I = W per stage (the module docstring):
    (p-1)/(m+p-1) for 1F1B and GPipe; (p-1)/(v m+p-1) interleaved over v stages per rank;
    0 for ZBV, whose weight gradients fill the warm-up and cool-down (Qi et al. 2024, with
    m >= 2p); DualPipeV's (p-1)(F&B + B - 3W) per its authors, (p-1)/(6m+p-1) here."""
    p, m, v = pp, microbatches, stages_per_rank
    if p == 1:
        return 0.0
    if schedule == "zbv":
        return 0.0
    if schedule == "dualpipev":
        return (p - 1) / (6 * m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def in_flight(schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int) -> float:
    """Micro-batches whose activations the busiest rank (rank 0) holds at its peak, in units of
    one micro-batch through all of the rank's blocks: GPipe all m; 1F1B p; interleaved, torch's
    warm-up of (v-1) p + 2 (p-1) chunks plus one, each 1/v of the rank's blocks; ZBV p (its
    paper: 1F1B's memory); DualPipeV (2p+1) chunks of 1/2."""
    p, m, v = pp, microbatches, stages_per_rank
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        return min(v * m, (v - 1) * p + 2 * (p - 1) + 1) / v
    if schedule == "dualpipev":
        return min(2 * m, 2 * p + 1) / 2
    return float(min(m, p))


def p2p_bytes(
    schedule: Schedule,
    pp: int,
    microbatches: int,
    stages_per_rank: int,
    activation_bytes: float,
    rank: int | None = None,
) -> float:
    """Bytes one rank sends to other pp ranks per step: each of its stages sends its output to
    the next stage and the gradient of its input to the previous one, once per micro-batch,
    unless that stage is on the same rank (the V's turn). `activation_bytes`: one
    micro-batch's hidden state (micro-batch x seq_len / (cp tp) x dim in param_dtype).
    `rank`: the pp rank (None: the largest over ranks)."""
    if pp == 1:
        return 0.0
    owner = stage_ranks(pp, stages_per_rank, schedule)
    sent = [0] * pp
    for s in range(len(owner) - 1):  # the boundary between stage s and s + 1
        if owner[s] != owner[s + 1]:
            sent[owner[s]] += 1  # activations forward
            sent[owner[s + 1]] += 1  # their gradients back
    per_rank = [n * microbatches * activation_bytes for n in sent]
    return max(per_rank) if rank is None else per_rank[rank]


def stage_of_blocks(split: list[int]) -> list[int]:
    """The stage of each block, for a split of blocks per stage."""
    return [s for s, n in enumerate(split) for _ in range(n)]


# ---- one pp rank's memory and traffic ---------------------------------------------------------


def rank_in_flight(
    schedule: Schedule, pp: int, microbatches: int, stages_per_rank: int, rank: int
) -> float:
    """`in_flight` for pp rank `rank`: 1F1B's rank r holds p - r micro-batches, interleaved
    1F1B's (v-1) p + 2 (p-1-r) + 1 chunks (torch's warm-up); the others as rank 0."""
    p, m, v = pp, microbatches, stages_per_rank
    if schedule == "1f1b":
        return float(min(m, p - rank))
    if schedule == "interleaved_1f1b":
        return min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1) / v
    return in_flight(schedule, pp, microbatches, stages_per_rank)


def rank_shape(
    shape: ModelShape, blocks: list[int], first: bool, last: bool, tie_trains: bool = True
) -> ModelShape:
    """One pp rank's part of the model: its blocks, and of the root unit the first parameter
    (the embeddings) on the first stage's rank, the others (final norm, output projection)
    on the last stage's. With tied embeddings the last stage's rank also holds a replica of
    the first (parallel/pp_split.py), with a gradient. `tie_trains=False`: the replica (on the
    first stage's rank only: the tied weight) as if frozen, for the planner's differences."""
    from dataclasses import replace

    def pick(unit: Any, keep: list[int]) -> Any:
        fields = ("shapes", "float8_gathered", "tp_split", "trainable", "expert", "muon")
        chosen = {f: tuple(getattr(unit, f)[i] for i in keep) if getattr(unit, f) else ()
                  for f in fields}  # fmt: skip
        return replace(unit, **chosen)

    root = shape.units[-1]
    replica = last and shape.tied_embedding
    keep = [0] * (first + replica) + [i for i in range(1, len(root.shapes)) if last]
    picked = pick(root, keep)
    if shape.tied_embedding and (first or last) and not tie_trains:
        trains = list(picked._trains())
        trains[int(first and replica)] = False
        picked = replace(picked, trainable=tuple(trains))
    units = [shape.units[b] for b in blocks] + [picked]
    described = tuple(shape.blocks[b] for b in blocks) if shape.blocks is not None else None
    return replace(shape, units=units, blocks=described,
                   embedding_numel=shape.embedding_numel if first else 0)  # fmt: skip


def plan_pipeline(
    shape: ModelShape,
    cfg: PipelineConfig,
    pp: int,
    microbatches: int,
    micro_batch: int,
    seq_len: int,
    memory: Callable[[ModelShape, bool], dict[str, float]],
    communication: Callable[[ModelShape], dict[str, dict[str, float]]],
    param_dtype: str = "bfloat16",
    tp: int = 1,
    cp: int = 1,
) -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, Any]]:
    """Memory and bytes sent per step of the pp rank that needs the most memory, and the
    pipeline's own terms (schedule, split, bubble, micro-batches in flight). `memory(shape,
    last)` and `communication(shape)`: the planner's plan_memory and plan_communication for
    a rank's part (parallel/plan.py, with pipelined=True): this module adds the schedule's
    activations in flight and the point-to-point sends."""
    from parallel.plan import BYTES

    v = cfg.local_stages()
    split = list(cfg.split) or balanced_split(*block_costs(shape, seq_len), pp * v)
    stage_of = stage_of_blocks(split)
    owners = stage_ranks(pp, v, cfg.schedule)
    hidden = micro_batch * seq_len // (cp * tp) * shape.dim * BYTES[param_dtype]
    worst: tuple[float, dict, dict, int] | None = None
    for rank in range(pp):
        blocks = [b for b, s in enumerate(stage_of) if owners[s] == rank]
        first, last = owners[0] == rank, owners[-1] == rank
        part = rank_shape(shape, blocks, first, last)
        mem = dict(memory(part, last))
        tie = 0.0
        if shape.tied_embedding and (first or last):
            # The last stage's replica of a tied weight has a gradient, no optimizer state. Per
            # step the first stage's rank sends the weight's shard, the last's its gradient
            # (fp32 both: the gradient's bytes; none frozen), unless one rank holds both.
            frozen = memory(rank_shape(shape, blocks, first, last, tie_trains=False), last)
            tie = mem["grads"] - frozen["grads"] if first != last else 0.0
            mem["optimizer"] = frozen["optimizer"] if last else mem["optimizer"]
        mem["activations"] *= rank_in_flight(cfg.schedule, pp, microbatches, v, rank)
        comm = communication(part)
        sends = p2p_bytes(cfg.schedule, pp, microbatches, v, hidden, rank)
        comm["pp"] = {"send_recv": sends + tie}
        total = sum(mem.values())
        if worst is None or total > worst[0]:
            worst = (total, mem, comm, rank)
    assert worst is not None  # noqa: S101 - pp >= 1 ranks
    terms = {
        "schedule": cfg.schedule, "split": split, "rank": worst[3],
        "bubble": bubble_fraction(cfg.schedule, pp, microbatches, v),
        "in_flight": rank_in_flight(cfg.schedule, pp, microbatches, v, worst[3]),
    }  # fmt: skip
    return worst[1], worst[2], terms


def describe(terms: dict[str, Any], pp: int, microbatches: int) -> str:
    """One line for the dry run and the planner: the schedule, the split, the bubble."""
    return (
        f"pipeline: pp={pp} {terms['schedule']} over {microbatches} micro-batches, blocks per "
        f"stage {terms['split']}; bubble {terms['bubble']:.1%} of the step (F = I = W); rank "
        f"{terms['rank']} (most memory) holds {terms['in_flight']:g} micro-batches of "
        "activations in flight"
    )
