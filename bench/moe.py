"""CPU throughput of the debug mixture of experts under expert parallel, and composed with
tensor parallel and with compiled blocks.

    python bench/moe.py                  # suite ep: EP 1 vs EP 2, ~2 minutes on 2 idle cores
    python bench/moe.py --suite tp       # 4 ranks: EP 2 x dp_shard 2 vs EP 2 x tp 2
    python bench/moe.py --suite compile  # 2 ranks: EP 2 eager vs compiled, graphs, recompiles
    python bench/moe.py --quick          # smoke run: proves the harness works, numbers mean nothing

The qwen3_moe debug flavor (dim 256, 4 layers, 8 experts of hidden 128, top 2; vocab 512 for
the byte tokenizer, fp32), 8 x 256 tokens per step, gloo ranks with cores / ranks threads each:

- ep: 2 ranks, FSDP 1x2: EP 1 (each rank all-gathers all 8 experts of a block, twice per step)
  against EP 2 (each rank holds 4 experts whole; the routed tokens travel by all-to-all, 4 per
  layer and micro-batch).
- tp: 4 ranks, EP 2 with the other factor of 2 as dp_shard (4 data-parallel ranks, one
  micro-batch of 2 each) or as tp (2 data-parallel ranks of micro-batches of 4; each tp rank
  computes half of the routed rows, parallel/ep.py).
- compile: 2 ranks, EP 2 eager against compiled blocks (regions around the dispatch), run
  with TORCH_LOGS=recompiles,graph_breaks: the graphs each rank compiled (Dynamo's "done
  tracing" lines) and the recompiles ("Recompiling function" lines) over the run's steps
  (`--steps`, 24 by default, while the expert loads change), and the step time after warm-up
  (the compile is in warm-up).

Runs alternate A B A B (`--pairs`) so slow drift of the machine hits both alike; every number
is the median of the trainer's own tok/s samples after warm-up (bench/throughput.py's harness).
Prints a Markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
SUITES: dict[str, dict] = {
    "ep": {
        "ranks": 2,
        "cases": {
            "EP 1 (FSDP 1x2)": [],
            "EP 2 (FSDP 1x2, experts split over both ranks)": ["--parallel.ep=2"],
        },
    },
    "tp": {
        "ranks": 4,
        "cases": {
            "EP 2 x dp_shard 2 (FSDP 1x4)": ["--parallel.ep=2", "--train.micro_batch_size=2"],
            "EP 2 x tp 2 (FSDP 1x2, tp 2)": ["--parallel.ep=2", "--parallel.tp=2"],
        },
    },
    "compile": {
        "ranks": 2,
        "cases": {
            "EP 2 eager": ["--parallel.ep=2"],
            "EP 2 compiled": ["--parallel.ep=2", "--compile.enabled=true"],
        },
    },
}
SCHEDULE = Schedule(steps=24, warmup=4, interval=2)  # ~0.4 s per step: ~14 s per EP run
GRAPH = re.compile(r"torchdynamo done tracing")
RECOMPILE = re.compile(r"Recompiling function")


def dynamo_counts(label: str, opts: Namespace) -> dict[str, float]:
    """Graphs compiled and recompiles per rank, from the run's log (TORCH_LOGS)."""
    log = (opts.out.parent / "runs" / label / "bench.log").read_text()
    ranks = opts.ranks
    return {
        "graphs_per_rank": len(GRAPH.findall(log)) / ranks,
        "recompiles_per_rank": len(RECOMPILE.findall(log)) / ranks,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=list(SUITES), default="ep")
    p.add_argument("--pairs", type=int, default=3, help="A / B run pairs")
    p.add_argument("--steps", type=int, default=SCHEDULE.steps, help="steps per run")
    p.add_argument("--quick", action="store_true", help="1 pair of 2-step runs: harness check")
    p.add_argument("--out", type=Path, default=None, help="default outputs/bench/moe-SUITE.json")
    a = p.parse_args(argv)
    suite = SUITES[a.suite]
    out = a.out or REPO / f"outputs/bench/moe-{a.suite}.json"
    pairs = 1 if a.quick else a.pairs
    schedule = Schedule(a.steps, SCHEDULE.warmup, SCHEDULE.interval)
    opts = Namespace(quick=a.quick, schedules={"moe": schedule}, out=out, ranks=suite["ranks"])
    if not (REPO / "outputs/data/stdlib").exists():
        import subprocess

        subprocess.run([sys.executable, "-m", "data.prepare"], cwd=REPO, check=True)
    if a.suite == "compile":  # read back by dynamo_counts; harmless for the eager runs
        os.environ["TORCH_LOGS"] = "recompiles,graph_breaks,dynamo"
    threads = max(1, (os.cpu_count() or 2) // suite["ranks"])  # as launch/torchrun.sh
    runs: dict[str, list[dict]] = {name: [] for name in suite["cases"]}
    for i in range(pairs):
        for j, (name, extra) in enumerate(suite["cases"].items()):
            label = f"moe-{a.suite}-{j}-{i}"
            result = run_once("moe", label, torchrun(suite["ranks"]), [*MOE, *extra], threads, opts)
            if a.suite == "compile":
                result |= dynamo_counts(label, opts)
            runs[name].append(result)
    facts = machine_facts() | {"load_avg_1m_end": os.getloadavg()[0]}
    sched = QUICK if a.quick else schedule
    report = {"machine": facts, "quick": a.quick, "schedule": sched.__dict__, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    base_name = next(iter(suite["cases"]))
    base = statistics.median(r["tok_s"] for r in runs[base_name])
    quick = "  (--quick: not a measurement)" if a.quick else ""
    print(f"{facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}, commit "
          f"{facts['commit']}, load avg {facts['load_avg_1m_start']:.2f} -> "
          f"{facts['load_avg_1m_end']:.2f}{quick}")  # fmt: skip
    extra = " graphs / recompiles per rank |" if a.suite == "compile" else ""
    print(f"\n| case | tok/s (median of runs) | per run | vs {base_name} |{extra}")
    print("|---|---|---|---|" + "---|" * bool(extra))
    for name, results in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in results)
        each = ", ".join(f"{r['tok_s']:,.0f}" for r in results)
        counts = ""
        if extra:
            counts = " " + ", ".join(
                f"{r['graphs_per_rank']:g} / {r['recompiles_per_rank']:g}" for r in results
            ) + " |"  # fmt: skip
        print(f"| {name} | {tok_s:,.0f} | {each} | {tok_s / base:.2f}x |{counts}")
    print(f"\nJSON: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
