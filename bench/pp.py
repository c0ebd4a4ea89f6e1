"""Pipeline parallel on CPU: pp 2 against dp 2 at the same global batch, and the bubble of each
schedule against the number of micro-batches.

    python bench/pp.py            # ~10 minutes on 2 quiet cores
    python bench/pp.py --quick    # smoke run: proves the harness works, numbers mean nothing

Every run trains the debug model of configs/debug.toml with 8 layers (dim 256, fp32, vocab
512) on sequences of 128 tokens, one thread per rank (two single-thread ranks on 2 cores, one
core each), with the trainer's own tok/s after warm-up (bench/throughput.py's harness).

**pp 2 against dp 2**: 16 sequences per step in micro-batches of 1, as FSDP 1x2 (8
micro-batches per rank, the whole model on each) and as pp 2 with 1F1B (16 micro-batches
through 2 stages of 4 blocks).

**The bubble**: for m = 2, 4 and 8 micro-batches of one sequence per step, each schedule at
pp 2 (1F1B, interleaved 1F1B and ZBV with 2 stages per rank) and one rank alone on
the same batch. Two ranks that pipelined perfectly would take half the lone rank's time per
step; the measured bubble is the share of the pp step beyond that: 1 - (T1 / 2) / Tpp. It
includes the point-to-point sends and the schedules' own overhead, which the planner's
`bubble_fraction` (F = I = W, no communication) leaves out: its column stands beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from throughput import Schedule, machine_facts, run_once, torchrun  # noqa: E402

from parallel.pp_plan import bubble_fraction  # noqa: E402

MODEL = ["configs/debug.toml", "--model.n_layers=8", "--data.seq_len=128"]
MODEL += ["--parallel.param_dtype=float32", "--train.micro_batch_size=1"]
SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}
MICROBATCHES = (2, 4, 8)


def measure(label: str, world: int, args: list[str], opts: Namespace) -> dict:
    program = torchrun(world) if world > 1 else [sys.executable, "train.py"]
    return run_once("pp", label, program, args, 1, opts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path("outputs/bench/pp.json"))
    opts = p.parse_args(argv)
    opts.schedules = {"pp": Schedule(7, 2, 1)}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[1]
    if not (repo / "outputs/data/stdlib").exists():  # configs/debug.toml's data
        subprocess.run([sys.executable, "-m", "data.prepare"], cwd=repo, check=True)
    report: dict = {"machine": machine_facts(), "quick": opts.quick, "versus": {}, "bubble": []}
    # pp 2 against dp 2: 16 sequences per step either way.
    dp = measure("dp2", 2, [*MODEL, "--train.global_batch_size=16"], opts)
    pp = measure("pp2", 2, [*MODEL, "--train.global_batch_size=16", "--parallel.pp=2"], opts)
    report["versus"] = {"dp2": dp, "pp2": pp}
    for m in MICROBATCHES[:2] if opts.quick else MICROBATCHES:
        batch = [*MODEL, f"--train.global_batch_size={m}"]
        alone = measure(f"one-m{m}", 1, batch, opts)
        for schedule, v in SCHEDULES.items():
            if schedule == "zbv" and m < 4:  # ZBV needs 2 x pp micro-batches
                continue
            run = measure(f"{schedule}-m{m}", 2, [*batch, "--parallel.pp=2",
                          f"--parallel.pipeline.schedule={schedule}"], opts)  # fmt: skip
            measured = 1 - (alone["step_s"] / 2) / run["step_s"]
            report["bubble"].append({
                "schedule": schedule, "microbatches": m, "step_s": run["step_s"],
                "one_rank_step_s": alone["step_s"], "measured_bubble": measured,
                "planned_bubble": bubble_fraction(schedule, 2, m, v),  # type: ignore[arg-type]
                "same_losses": run["losses"] == alone["losses"],
            })  # fmt: skip
    opts.out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    m, v = report["machine"], report["versus"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}, commit {m['commit']}"
        + ("  **(--quick: not a measurement)**" if report["quick"] else ""),
        "",
        "| 16 x 128 tokens per step | tok/s | s/step |",
        "|---|---|---|",
        *(f"| {k} | {r['tok_s']:,.0f} | {r['step_s']:.2f} |" for k, r in v.items()),
        "",
        "| schedule | micro-batches | s/step (pp 2) | s/step (1 rank) | measured bubble "
        "| planned bubble |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["bubble"]:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['step_s']:.2f} | "
            f"{r['one_rank_step_s']:.2f} | {r['measured_bubble']:.1%} | "
            f"{r['planned_bubble']:.1%} |"
        )
    medians = statistics.median(r["measured_bubble"] for r in report["bubble"])
    lines.append(f"\nmedian measured bubble over all cases: {medians:.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
