"""compile.fsdp='graph' against eager FSDP2 on CPU: step time, peak RSS, compile time and the
collectives of one compiled step, on 4 gloo ranks.

    python bench/graph_fsdp.py --data outputs/data/stdlib          # ~15 min on 2 cores
    python bench/graph_fsdp.py --data DIR --steps 6 --cases eager graph
    python bench/graph_fsdp.py --data DIR --cases blocks-tp2 graph-tp2 blocks-fp8 graph-fp8 \
        blocks-pp2 graph-pp2 --buckets          # the compositions, ~20 min on 2 cores

Each case trains configs/debug.toml's model (fp32, dim 256, 6 blocks, vocab 512; 8 x 256
tokens a step, 2 per rank) in the trainer itself, on 4 ranks spawned as tests/distributed.py
spawns them, with `train_step` timed on every rank: the first step holds the compile, the
median of the others is the step time (the slowest rank's, which is the step's). Peak RSS is
each rank's ru_maxrss at the end (the kernel keeps no later-reset peak), reported as the
largest rank's. Then one forward and backward of the same model is compiled at each bucket
size and its collectives counted in Inductor's output code. Prints a Markdown table; writes JSON
to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEBUG = ["configs/debug.toml", "--train.eval_interval=0", "--metrics.tensorboard=false",
         "--checkpoint.interval=0", "--metrics.log_interval=100"]  # fmt: skip
GRAPH = ["--compile.enabled=true", "--compile.fsdp=graph"]
CASES = {
    "eager": [],
    "blocks": ["--compile.enabled=true"],  # per-block compile, FSDP2's hooks
    "graph": GRAPH,  # compile.bucket_mb's default
    "graph-unbucketed": [*GRAPH, "--compile.bucket_mb=0"],
    # About one block of this model in float32 (3.4 MB): FSDP2's unit, as a byte budget.
    "graph-4mb": [*GRAPH, "--compile.bucket_mb=4"],
}
# The compositions (issue 56), each against per-block compile with FSDP2's hooks on the same
# 4 ranks, at one block's bucket: FSDP 2 x tp 2, float8 (emulated: CPU has no float8 matmul,
# so its step time says nothing of a GPU's), pp 2 x FSDP 2 (1F1B, 8 micro-batches of 1).
FP8 = ["--fp8.enabled=true", "--fp8.emulate=true", "--fp8.filter=none"]
PP = ["--parallel.pp=2", "--train.micro_batch_size=1"]
for name, flags in {"tp2": ["--parallel.tp=2"], "fp8": FP8, "pp2": PP}.items():
    CASES[f"blocks-{name}"] = [*CASES["blocks"], *flags]
    CASES[f"graph-{name}"] = [*CASES["graph-4mb"], *flags]


def timed_training(argv: list[str]) -> dict[str, Any]:
    """On one rank: train with `train_step` timed; its step times and peak RSS."""
    import train
    from configs import parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    times: list[float] = []
    step = train.train_step

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = step(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return result

    train.train_step = timed
    env = LaunchEnv.from_env()
    job = parse_config(JobConfig, argv)
    train.train(job, check_config(job, env), env)
    return {
        "step_s": times,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def compiled_collectives(argv: list[str]) -> dict[str, int]:
    """On one rank: the all-gathers and reduce-scatters in the output code of one compiled
    forward and backward of the model `argv` builds."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from configs import parse_config
    from launch.job import JobConfig
    from model import get_family
    from parallel.build import build_model
    from parallel.dims import LaunchEnv
    from parallel.fsdp import assign_local_shard
    from parallel.runtime import build_mesh, init_distributed

    env = LaunchEnv.from_env()
    init_distributed(torch.device("cpu"), env, 1800)
    job = parse_config(JobConfig, argv)
    family = get_family(job.model.name)
    mesh = build_mesh(torch.device("cpu"), 1, env.world_size)
    model = build_model(family, family.build_args(job.model), job.build_settings(), mesh).model
    model.to_empty(device="cpu")
    model.init_weights(seed=0, rope_len=job.data.seq_len, assign=assign_local_shard)
    tokens = torch.randint(0, job.model.vocab_size or 512, (2, job.data.seq_len))

    def step() -> None:
        model(tokens).float().logsumexp(-1).mean().backward()

    _, code = run_and_get_code(step)
    text = "\n".join(code)
    torch.distributed.destroy_process_group()
    return {
        kind: len(re.findall(rf"_c10d_functional\.{kind}(?:_tensor)?(?:_out)?\.default\(", text))
        for kind in ("all_gather_into_tensor", "reduce_scatter_tensor")
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a prepared dataset (python -m data.prepare)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--buckets", nargs="*", type=float, default=[0.0, 4.0, 500.0])
    p.add_argument("--out", type=Path, default=Path("outputs/bench/graph_fsdp.json"))
    args = p.parse_args()
    from tests.distributed import run_distributed

    os.chdir(REPO)
    out_dir = args.out.parent / "graph_fsdp_runs"
    base = [*DEBUG, f"--data.path={args.data}", f"--train.steps={args.steps}",
            f"--run.output_dir={out_dir}", "--checkpoint.resume=none"]  # fmt: skip
    report: dict[str, Any] = {"load_before": os.getloadavg(), "cases": {}, "collectives": {}}
    for case in args.cases:
        start = time.perf_counter()
        ranks = run_distributed(timed_training, 4, [*base, f"--run.name={case}",
                                *CASES[case]], timeout=3600)  # fmt: skip
        step = [max(r["step_s"][i] for r in ranks) for i in range(args.steps)]
        report["cases"][case] = {
            "first_step_s": step[0],
            "step_s": statistics.median(step[1:]),
            "steps_s": step,
            "max_rss_mib": max(r["max_rss_mib"] for r in ranks),
            "wall_s": time.perf_counter() - start,
            "load": os.getloadavg(),
        }
        print(case, json.dumps(report["cases"][case]), file=sys.stderr)
    for mb in args.buckets:
        argv = [*base, *GRAPH, f"--compile.bucket_mb={mb}"]
        report["collectives"][mb] = run_distributed(compiled_collectives, 4, argv,
                                                    timeout=3600)[0]  # fmt: skip
        print(mb, report["collectives"][mb], file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print("| case | first step (compile) s | step s | peak RSS MiB (largest rank) |")
    print("|---|---|---|---|")
    for case, r in report["cases"].items():
        print(f"| {case} | {r['first_step_s']:.1f} | {r['step_s']:.3f} | {r['max_rss_mib']:.0f} |")
    print("\n| bucket_mb | all-gathers (fwd + bwd) | reduce-scatters |\n|---|---|---|")
    for mb, c in report["collectives"].items():
        print(f"| {mb:g} | {c['all_gather_into_tensor']} | {c['reduce_scatter_tensor']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
