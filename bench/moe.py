"""CPU throughput of the debug mixture of experts without and with expert parallel.

    python bench/moe.py            # ~2 minutes on an idle 2-core machine
    python bench/moe.py --quick    # smoke run: proves the harness works, numbers mean nothing

The qwen3_moe debug flavor (dim 256, 4 layers, 8 experts of hidden 128, top 2; vocab 512 for
the byte tokenizer, fp32) on 2 gloo ranks, FSDP 1x2, 8 x 256 tokens per step: EP 1 (each rank
all-gathers all 8 experts of a block, twice per step) against EP 2 (each rank holds 4 experts
whole; the routed tokens travel by all-to-all, 4 per layer and micro-batch). Runs alternate
A B A B (`--pairs`) so slow drift of the machine hits both alike; every number is the median of
the trainer's own tok/s samples after warm-up (bench/throughput.py's harness). Prints a Markdown
table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from argparse import Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from throughput import QUICK, Schedule, machine_facts, run_once, torchrun  # noqa: E402

MOE = [
    "configs/debug.toml", "--model.name=qwen3_moe", "--model.flavor=debug",
    "--data.seq_len=256", "--train.global_batch_size=8", "--train.micro_batch_size=4",
]  # fmt: skip
CASES = {
    "EP 1 (FSDP 1x2)": [],
    "EP 2 (FSDP 1x2, experts split over both ranks)": ["--parallel.ep=2"],
}
SCHEDULE = Schedule(steps=24, warmup=4, interval=2)  # ~0.4 s per step: ~14 s per run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="EP 1 / EP 2 run pairs")
    p.add_argument("--quick", action="store_true", help="1 pair of 2-step runs: harness check")
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/moe.json")
    a = p.parse_args(argv)
    pairs = 1 if a.quick else a.pairs
    opts = Namespace(quick=a.quick, schedules={"moe": SCHEDULE}, out=a.out)
    if not (REPO / "outputs/data/stdlib").exists():
        import subprocess

        subprocess.run([sys.executable, "-m", "data.prepare"], cwd=REPO, check=True)
    threads = max(1, (os.cpu_count() or 2) // 2)  # as launch/torchrun.sh: cores / ranks
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    for i in range(pairs):
        for name, extra in CASES.items():
            label = f"moe-{'ep2' if extra else 'ep1'}-{i}"
            runs[name].append(run_once("moe", label, torchrun(2), [*MOE, *extra], threads, opts))
    facts = machine_facts() | {"load_avg_1m_end": os.getloadavg()[0]}
    sched = QUICK if a.quick else SCHEDULE
    report = {"machine": facts, "quick": a.quick, "schedule": sched.__dict__, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    base = statistics.median(r["tok_s"] for r in runs[next(iter(CASES))])
    quick = "  (--quick: not a measurement)" if a.quick else ""
    print(f"{facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, commit "
          f"{facts['commit']}, load avg {facts['load_avg_1m_start']:.2f} -> "
          f"{facts['load_avg_1m_end']:.2f}{quick}")  # fmt: skip
    print("\n| case | tok/s (median of runs) | per run | vs EP 1 |\n|---|---|---|---|")
    for name, results in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in results)
        each = ", ".join(f"{r['tok_s']:,.0f}" for r in results)
        print(f"| {name} | {tok_s:,.0f} | {each} | {tok_s / base:.2f}x |")
    print(f"\nJSON: {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
