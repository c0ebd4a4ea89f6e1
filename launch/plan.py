"""Memory and communication per GPU for FSDP, HSDP, FSDP + TP, FSDP + CP and FSDP + TP + CP,
before renting the cluster.

    python -m launch.plan --model 8B --nodes 16 --gpus-per-node 8 --seq-len 8192 --ac full
    python -m launch.plan --model 70B --nodes 2 --lora-rank 16      # a LoRA fine-tune
    python -m launch.plan --family qwen3_moe --model 30B-A3B --nodes 2 --ep 8 --ac full
    python -m launch.plan --model 8B --seq-len 131072 --tp --cp 2 4 8 --ac full  # long context
    python -m launch.plan --model 70B --nodes 8 --seq-len 131072 --tp 2 4 --cp 2 4 --ac full

Prints, for FSDP (dp_shard = all GPUs), HSDP (dp_shard = GPUs per node), FSDP with tensor
parallel inside each node, FSDP over dp_shard x cp with context parallel inside each node (cp
splits every sequence), both (each tp x cp that fits in a node) and (a mixture of experts) FSDP
with expert parallel inside each node side by side, the per-GPU memory and the bytes each GPU
sends per optimizer step on each mesh dimension, which plan fits in `--gpu-mem` and which
communicates faster with the given bandwidths. `train.py --dry-run` prints the same table for
the configured run. The formulas, and how they follow this trainer, are in parallel/plan.py.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable
from typing import NoReturn

from configs import ConfigError
from model import FAMILIES, ModelConfig, get_family
from parallel.float8 import Float8Config
from parallel.lora import LoRAConfig
from parallel.plan import BYTES, ModelShape, model_shape, plan_communication, plan_memory
from parallel.pp_plan import SCHEDULES, PipelineConfig, plan_pipeline


def known(values: Iterable[float]) -> float:
    """The sum of the terms the planner could derive (a nan one is not known: `missing`)."""
    return sum(v for v in values if not math.isnan(v))


def comm_seconds(
    comm: dict[str, dict[str, float]], shard_bw: float, replicate_bw: float, tp_bw: float = 1.0
) -> float:
    """Communication time if nothing overlaps, bandwidths in bytes/s per GPU (tp_bw: inside
    a node, where tensor parallel, context parallel's K/V collectives and expert parallel's
    all-to-alls stay; the experts' expert_shard group spans the nodes like dp_shard; pipeline
    parallel's sends cross nodes like dp_replicate). Terms the planner could not derive count
    as 0."""
    shard = known(comm["dp_shard"].values()) / shard_bw
    shard += known(comm.get("expert_shard", {}).values()) / shard_bw
    inside = sum(known(comm.get(dim, {}).values()) for dim in ("tp", "cp", "ep"))
    across = known(comm["dp_replicate"].values()) + known(comm.get("pp", {}).values())  # nodes
    return shard + across / replicate_bw + inside / tp_bw


def _size(nbytes: float) -> str:
    if math.isnan(nbytes):
        return f"{'n/a':>22}"
    unit, scale = ("GiB", 2**30) if nbytes >= 2**30 else ("MiB", 2**20)
    return f"{nbytes / scale:>18.2f} {unit}"


def format_plan(
    columns: dict[str, tuple[dict[str, float], dict[str, dict[str, float]]]],
) -> list[str]:
    """Rows of a table with one column per mesh: memory per GPU, then bytes sent per step."""
    # Expert parallel's rows have the longest names: the label column widens when they show.
    width = 38 if any("ep" in comm for _, comm in columns.values()) else 33
    lines = [f"{'per GPU':<{width + 2}}" + "".join(f"{name:>22}" for name in columns)]
    memories = [mem for mem, _ in columns.values()]
    for key in memories[0]:
        lines.append(f"  {'memory: ' + key:<{width}}" + "".join(_size(m[key]) for m in memories))
    totals = "".join(_size(known(m.values())) for m in memories)
    lines.append(f"  {'estimated memory per rank':<{width}}" + totals)
    for dim, coll in (
        ("dp_shard", "all_gather"),
        ("dp_shard", "reduce_scatter"),
        ("dp_replicate", "all_reduce"),
        ("tp", "all_gather"),
        ("tp", "reduce_scatter"),
        ("tp", "all_reduce"),
        ("cp", "all_gather"),
        ("cp", "reduce_scatter"),
        ("expert_shard", "all_gather"),
        ("expert_shard", "reduce_scatter"),
        ("ep", "all_to_all"),
        ("dp_shard", "all_to_all"),  # Muon's owners (optim.name="muon")
        ("tp", "all_to_all"),
        ("pp", "send_recv"),  # pipeline parallel's activations and their gradients
    ):
        if not any(coll in comm.get(dim, {}) for _, comm in columns.values()):
            continue  # cp's, expert parallel's and Muon's rows, for a column that has them
        row = "".join(_size(comm.get(dim, {}).get(coll, 0)) for _, comm in columns.values())
        lines.append(f"  {f'sent/step: {dim} {coll}':<{width}}" + row)
    return lines


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one ConfigError line (its own prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (python -m launch.plan --help lists the options)")


def _positive(kind: type) -> type:
    def parse(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # what argparse names in "invalid int value"
    return parse  # type: ignore[return-value]


def _parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="8B", help="the family's flavor (default 8B)")
    p.add_argument("--family", default=ModelConfig().name, choices=list(FAMILIES),
                   help="the trainer's --model.name: one of the registered families, "
                   f"{', '.join(FAMILIES)}")  # fmt: skip
    count, size = _positive(int), _positive(float)
    p.add_argument("--nodes", type=count, default=1)
    p.add_argument("--gpus-per-node", type=count, default=8)
    p.add_argument("--seq-len", type=count, default=8192)
    p.add_argument("--batch", type=count, default=1, help="micro-batch per GPU (sequences)")
    p.add_argument("--grad-accum", type=count, default=1)
    p.add_argument("--fp8", action="store_true", help="fp8 tensorwise (fp8.filter=auto)")
    p.add_argument("--ac", default="none", choices=["none", "full", "selective", "op"])
    p.add_argument("--ac-every", type=count, default=2)
    p.add_argument("--param-dtype", default="bfloat16", choices=list(BYTES))
    p.add_argument("--reduce-dtype", default="float32", choices=list(BYTES))
    p.add_argument("--reshard", default="default", choices=["default", "always", "never"])
    p.add_argument("--intra-bw", type=size, default=900, help="GB/s per GPU inside a node")
    p.add_argument("--inter-bw", type=size, default=50, help="GB/s per GPU across nodes")
    p.add_argument("--gpu-mem", type=size, default=80, help="GB per GPU")
    p.add_argument("--tp", type=count, nargs="*", default=[8], help="TP degrees to compare")
    p.add_argument("--cp", type=count, nargs="*", default=[], help="context-parallel degrees "
                   "to compare (FSDP over dp_shard x cp, cp inside a node)")  # fmt: skip
    p.add_argument("--ep", type=count, nargs="*", default=[], help="EP degrees to compare "
                   "(mixture of experts: FSDP over all GPUs, EP inside a node)")  # fmt: skip
    p.add_argument(
        "--pp",
        type=int,
        nargs="*",
        default=[],
        help="pipeline-parallel degrees to "
        "compare (stages across nodes; FSDP, and TP inside a node, per stage)",
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=list(SCHEDULES),
        help="parallel.pipeline.schedule (with --pp)",
    )
    p.add_argument("--tflops", type=float, default=400, help="achieved TFLOP/s per GPU: "
                   "what a pipeline bubble costs in seconds (with --pp)")  # fmt: skip
    p.add_argument("--freeze", nargs="*", default=[], help="train.freeze patterns")
    p.add_argument("--loss-chunk-tokens", type=int, default=0, help="train.loss_chunk_tokens "
                   "(0: the whole sequence's logits at once; not with TP)")  # fmt: skip
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on lora.targets' "
                   "default layers (0: no LoRA)")  # fmt: skip
    return p


def _meshes(a: argparse.Namespace, shape: ModelShape) -> dict[str, tuple[int, int, int, int, int]]:
    """The meshes to compare: name -> (dp_replicate, dp_shard, tp, ep, cp)."""
    world = a.nodes * a.gpus_per_node
    meshes = {  # name: (dp_replicate, dp_shard, tp, ep, cp)
        f"FSDP 1x{world}": (1, world, 1, 1, 1),
        f"HSDP {a.nodes}x{a.gpus_per_node}": (a.nodes, a.gpus_per_node, 1, 1, 1),
    }
    # Tensor parallel inside a node, FSDP over the rest (one shard group per node's tp slice
    # spans all nodes: the model state shards over nodes x gpus / tp).
    for tp in a.tp:
        if tp > 1 and a.gpus_per_node % tp == 0:
            meshes[f"FSDP 1x{world // tp} TP{tp}"] = (1, world // tp, tp, 1, 1)
    # Expert parallel: groups of ep GPUs of one node inside FSDP over all of them.
    for ep in a.ep if shape.n_experts else []:
        if ep > 1 and a.gpus_per_node % ep == 0 and shape.n_experts % ep == 0:
            meshes[f"FSDP 1x{world} EP{ep}"] = (1, world, 1, ep, 1)
    # Both: tp splits attention inside a node, EP groups of ep consecutive GPUs (the tp ranks
    # first) split the experts, each tp rank computing 1/tp of the routed rows (parallel/ep.py).
    for tp in a.tp:
        for ep in a.ep if shape.n_experts else []:
            fits = tp > 1 and ep > 1 and a.gpus_per_node % tp == 0
            if fits and a.gpus_per_node % ep == 0 and shape.n_experts % ep == 0:
                meshes[f"FSDP 1x{world // tp} TP{tp} EP{ep}"] = (1, world // tp, tp, ep, 1)
    # Context parallel: groups of cp GPUs of one node split each sequence (2 x cp chunks);
    # FSDP shards over all GPUs (dp_shard x cp), as train.py's dp_mesh does.
    for cp in a.cp:
        if cp > 1 and a.gpus_per_node % cp == 0 and a.seq_len % (2 * cp) == 0:
            meshes[f"FSDP 1x{world // cp} CP{cp}"] = (1, world // cp, 1, 1, cp)
    # Both inside a node: tp splits each token's heads, cp the sequence (parallel/runtime.py).
    for tp in a.tp:
        for cp in a.cp:
            fits = tp > 1 and cp > 1 and a.gpus_per_node % (tp * cp) == 0
            if fits and a.seq_len % (2 * cp) == 0:
                meshes[f"FSDP 1x{world // (tp * cp)} TP{tp} CP{cp}"] = (
                    1,
                    world // tp // cp,
                    tp,
                    1,
                    cp,
                )
    return meshes


def _pipeline_columns(
    a: argparse.Namespace,
    shape: ModelShape,
    columns: dict[str, tuple[dict, dict]],
    seconds: dict[str, float],
) -> dict[str, str]:
    """Add a column per --pp degree (FSDP over each stage's GPUs, and with each --tp inside a
    node, and each --ep of a mixture of experts: EP groups inside a stage's GPUs): the pp rank
    with the most memory (parallel/pp_plan.py). Its seconds add the bubble,
    the idle share of a step whose compute takes 6 x active parameters x tokens / --tflops.
    Returns each column's bubble, as text."""
    world, bubbles = a.nodes * a.gpus_per_node, {}
    compute = 6 * shape.active_numel() * a.batch * a.seq_len * a.grad_accum / (a.tflops * 1e12)
    eps = [1, *(e for e in a.ep if e > 1 and shape.n_experts and shape.n_experts % e == 0)]
    for pp in a.pp:
        tps = [1, *(t for t in a.tp if t > 1 and a.gpus_per_node % t == 0)]
        for tp, ep in ((t, e) for t in tps for e in eps):
            if pp < 2 or world % (pp * tp) or shape.n_layers < pp:
                continue
            shard, micro = world // (pp * tp), a.grad_accum * tp * pp  # the same global batch
            # An EP group: ep consecutive GPUs of one node, inside a stage's shard x tp ranks.
            if ep > 1 and (a.gpus_per_node % ep or (shard * tp) % ep):
                continue
            name = f"PP{pp} FSDP 1x{shard}" + (f" TP{tp}" if tp > 1 else "")
            name += f" EP{ep}" if ep > 1 else ""

            def memory(
                part: ModelShape, last: bool, tp: int = tp, shard: int = shard, ep: int = ep
            ) -> dict:
                mem = plan_memory(part, shard, a.batch, a.seq_len, a.param_dtype, a.ac,
                                  a.ac_every, a.reshard, tp=tp, ep=ep, pipelined=True,
                                  loss_chunk_tokens=a.loss_chunk_tokens)  # fmt: skip
                return mem if last else mem | {"logits": 0.0}

            def communication(part: ModelShape, tp: int = tp, shard: int = shard,
                              micro: int = micro, ep: int = ep) -> dict:  # fmt: skip
                return plan_communication(
                    part, 1, shard, a.param_dtype, a.reduce_dtype, a.reshard, micro, tp=tp,
                    tokens=a.batch * a.seq_len, ac_mode=a.ac, ac_every=a.ac_every, ep=ep,
                    pipelined=True,
                )  # fmt: skip

            cfg = PipelineConfig(schedule=a.schedule)
            mem, comm, terms = plan_pipeline(shape, cfg, pp, micro, a.batch, a.seq_len, memory,
                                             communication, a.param_dtype, tp)  # fmt: skip
            columns[name] = (mem, comm)
            shard_bw = a.intra_bw if shard * tp <= a.gpus_per_node else a.inter_bw
            idle = compute * terms["bubble"] / (1 - terms["bubble"])
            seconds[name] = idle + comm_seconds(comm, shard_bw * 1e9, a.inter_bw * 1e9,
                                                a.intra_bw * 1e9)  # fmt: skip
            bubbles[name] = f"{terms['bubble']:.1%} ({idle:.2f} s)"
    return bubbles


def main(argv: list[str] | None = None) -> int:
    """Print the plans; a bad option or model is one `config error:` line and status 2."""
    try:
        return _plan(_parser().parse_args(argv))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2


def _plan(a: argparse.Namespace) -> int:
    if a.loss_chunk_tokens < 0:
        raise ConfigError(f"--loss-chunk-tokens must be >= 0, got {a.loss_chunk_tokens}")
    family = get_family(a.family)
    args = family.build_args(ModelConfig(name=a.family, flavor=a.model))
    lora = LoRAConfig(enabled=True, rank=a.lora_rank) if a.lora_rank > 0 else None
    shape = model_shape(family, args, Float8Config(enabled=a.fp8), lora, a.freeze)
    meshes = _meshes(a, shape)
    columns, seconds = {}, {}
    for name, (rep, shard, tp, ep, cp) in meshes.items():
        mem = plan_memory(
            shape, shard, a.batch, a.seq_len, a.param_dtype, a.ac, a.ac_every, a.reshard, tp=tp,
            ep=ep, cp=cp, loss_chunk_tokens=a.loss_chunk_tokens,
        )  # fmt: skip
        # The same global batch: tp (cp) ranks share their sequences, so tp (cp) x the
        # accumulation.
        comm = plan_communication(
            shape, rep, shard, a.param_dtype, a.reduce_dtype, a.reshard, a.grad_accum * tp * cp,
            tp=tp, tokens=a.batch * a.seq_len, ac_mode=a.ac, ac_every=a.ac_every, ep=ep, cp=cp,
        )  # fmt: skip
        columns[name] = (mem, comm)
        # A shard group within one node talks over NVLink; spanning nodes, the slow link rules.
        shard_bw = a.intra_bw if shard * tp * cp <= a.gpus_per_node else a.inter_bw
        seconds[name] = comm_seconds(comm, shard_bw * 1e9, a.inter_bw * 1e9, a.intra_bw * 1e9)
    bubbles = _pipeline_columns(a, shape, columns, seconds)
    n_params, n_trained = shape.numel(), shape.numel(trainable_only=True)
    trains = f", {n_trained / 1e9:.3f}B trainable" if n_trained < n_params else ""
    if shape.n_experts and shape.blocks is not None:
        trains += f", {shape.active_numel() / 1e9:.2f}B active per token"
    print(f"{a.family} {a.model} ({n_params / 1e9:.2f}B parameters{trains}) on {a.nodes} x "
          f"{a.gpus_per_node}")  # fmt: skip
    if shape.missing:  # one line: what this family's description leaves the planner without
        print(f"planner: {a.family}: {shape.missing}")
    else:
        flops = shape.flops_per_token(a.seq_len)
        print(f"training FLOPs per token at seq {a.seq_len}: {flops / 1e9:.2f} GFLOP")
    print("\n".join(format_plan(columns)))
    partly = " (without the n/a terms)" if shape.missing else ""
    for name, (mem, _) in columns.items():
        total = known(mem.values())
        fits = "fits" if total <= a.gpu_mem * 1e9 else "does NOT fit"
        bubble = f" + bubble {bubbles[name]}" if name in bubbles else ""
        print(f"{name}: {total / 1e9:.1f} GB{partly} {fits} in {a.gpu_mem:g} GB; "
              f"communication{bubble} {seconds[name]:.2f} s/step if not overlapped")  # fmt: skip
    best = min(seconds, key=seconds.__getitem__)
    print(f"faster communication: {best}")
    fitting = [n for n, (mem, _) in columns.items() if known(mem.values()) <= a.gpu_mem * 1e9]
    if fitting:
        print(f"recommended: {min(fitting, key=seconds.__getitem__)} (the faster one that fits)")
    else:
        print("recommended: none fits; try --ac full, more nodes, or a smaller --batch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
