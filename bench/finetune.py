"""Fine-tuning cost on CPU: full training against half the parameters frozen and LoRA rank 16.

    python bench/finetune.py             # ~4 minutes on an idle 2-core machine
    python bench/finetune.py --rounds 1 --cases full,lora-16

Each run is `python train.py` (one process, FSDP2 on a one-rank mesh, as always; 2 threads) on
the ~100M model of bench/throughput.py (dim 768, 14 layers, fp32, 4 x 256 tokens per step) on
the stdlib corpus (`python -m data.prepare`), in three variants of the same shape:

| case | what trains |
|---|---|
| full | every parameter (99.9M) |
| half-frozen | all but the embedding and blocks 0-6 (`train.freeze`): 49.9M |
| lora-16 | rank-16 adapters on the attention projections (`[lora]`, defaults): 1.4M |

The cases alternate (A B C A B C, `--rounds`) so slow drift of the machine hits all alike.
Prints tokens/s (median of the per-step samples after warm-up) and peak RSS (the trainer's
`rss`, ru_maxrss) per case, with the planner's gradient + optimizer-state bytes and kept
activations for the same run (parallel/plan.py); JSON with every command and sample to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The project first (bench/checkpoint.py would shadow its checkpoint package), then bench/.
sys.path[:0] = [str(REPO), str(REPO / "bench")]
from throughput import M100, Schedule, machine_facts, number, run_once  # noqa: E402

# As the throughput table's 100m case at one rank: ~7 s a step, 8 measured steps.
SCHEDULE = Schedule(steps=10, warmup=2, interval=1)
CASES = {
    "full": [],
    "half-frozen": ["--train.freeze=tok_embeddings.*,layers.[0-6].*"],
    "lora-16": ["--lora.enabled=true", "--lora.rank=16"],
}
RSS_RE = re.compile(r"\brss ([\d.]+)GiB")


def planned_state(args: list[str]) -> dict[str, float]:
    """The planner's per-rank gradient and optimizer-state bytes for this run (one rank)."""
    from configs import parse_config
    from launch.job import JobConfig
    from model import get_family
    from parallel.plan import model_shape, plan_memory

    job = parse_config(JobConfig, args)
    family = get_family(job.model.name)
    shape = model_shape(family, family.build_args(job.model), job.fp8, job.lora, job.train.freeze)
    p = job.parallel
    mem = plan_memory(shape, 1, job.train.micro_batch_size, job.data.seq_len, p.param_dtype)
    return {
        "params": shape.numel(),
        "trainable": shape.numel(trainable_only=True),
        "grads_optimizer_bytes": mem["grads"] + mem["optimizer"],
        "activation_bytes": mem["activations"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="times each case runs, alternating")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of the cases")
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/finetune.json")
    opts = p.parse_args(argv)
    # What throughput.run_once reads from its options.
    opts.out, opts.quick, opts.schedules = opts.out.resolve(), False, {"finetune": SCHEDULE}
    if not (REPO / "outputs/data/stdlib/index.json").exists():
        sys.exit("no stdlib corpus: run `python -m data.prepare` first")
    threads = os.cpu_count() or 1
    names = opts.cases.split(",")
    if unknown := sorted(set(names) - set(CASES)):
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    report: dict = {"machine": machine_facts(), "schedule": vars(SCHEDULE), "results": []}
    for i in range(opts.rounds):
        for name in names:
            label = f"finetune-{name}-{i}"
            program = [sys.executable, "train.py"]
            result = run_once("finetune", label, program, [*M100, *CASES[name]], threads, opts)
            log = (opts.out.parent / "runs" / label / "bench.log").read_text()
            result["peak_rss_gib"] = max(number(x) for x in RSS_RE.findall(log))
            runs[name].append(result)
    for name in names:
        report["results"].append(
            {
                "case": name,
                "tok_s": statistics.median(s for r in runs[name] for s in r["tok_s_samples"]),
                "peak_rss_gib": statistics.median(r["peak_rss_gib"] for r in runs[name]),
                **planned_state([*M100, *CASES[name]]),
                "runs": runs[name],
            }
        )
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    full = next((r for r in report["results"] if r["case"] == "full"), None)
    print("| case | trains | tok/s | vs full | peak RSS GiB | planner GiB: grads + optimizer "
          "| activations |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in report["results"]:
        ratio = f"{r['tok_s'] / full['tok_s']:.2f}x" if full else "-"
        print(
            f"| {r['case']} | {r['trainable']:,} of {r['params']:,} | {r['tok_s']:,.0f} | "
            f"{ratio} | {r['peak_rss_gib']:.2f} | {r['grads_optimizer_bytes'] / 2**30:.2f} | "
            f"{r['activation_bytes'] / 2**30:.2f} |"
        )
    print(f"\nJSON: {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
