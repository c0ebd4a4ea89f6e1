"""CPU throughput of the trainer: tokens/s, the FSDP2-vs-plain-loop step-time ratio, and the
torchtitan-comparison shape. Every number comes from running `train.py` (or
`bench/plain_loop.py`) as a subprocess and parsing its rank-0 `step N ... tok/s X` lines.

    python bench/throughput.py           # all cases, ~20 min on 2 cores: keep the machine idle
    python bench/throughput.py --cases ratio --pairs 5
    python bench/throughput.py --quick   # smoke run: proves the harness works, numbers mean nothing

Prints Markdown tables and writes JSON to --out; each run's log goes to <out dir>/runs/<label>/.
See bench/README.md for what each case measures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from argparse import Namespace
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("debug", "100m", "ratio", "titan")
# No evaluation pauses and no TensorBoard writes in any timed run.
COMMON = [
    "--train.eval_interval=0", "--metrics.tensorboard=false",
    "--checkpoint.interval=0", "--checkpoint.resume=none",
]  # fmt: skip
# The debug model of configs/debug.toml (fp32, vocab 512), with the batch pinned here so the
# numbers stay comparable when that file's training settings change: 16 x 256 tokens per step,
# micro-batches of 4 (accumulation 4 on one rank, none on four).
DEBUG = [
    "configs/debug.toml",
    "--data.seq_len=256",
    "--train.global_batch_size=16",
    "--train.micro_batch_size=4",
]
# The debug model widened to 768 x 14 layers: 99,899,136 parameters (12 layers, the GPT-2-small
# shape, would be 85.7M). Global batch 4 (1,024 tokens, the least 4 ranks can split) keeps a
# step near 7 s on 2 cores, so a case still gets 8 measured steps in about 2 minutes.
M100 = [*DEBUG, "--model.dim=768", "--model.n_layers=14", "--model.n_heads=12"]
M100 += ["--model.n_kv_heads=12", "--train.global_batch_size=4", "--train.micro_batch_size=1"]
# torchtitan's debug model on CPU: dim 256, 6 layers, 16 heads, vocab 2048 (the flavor's),
# seq 512, 8 sequences per rank on 2 gloo ranks, bf16 params / fp32 reduce, no AC.
TITAN = ["--model.flavor=debug", "--data.seq_len=512", "--train.micro_batch_size=8"]
TITAN += ["--train.global_batch_size=16", "--parallel.param_dtype=bfloat16"]
TITAN += ["--parallel.reduce_dtype=float32"]
TITAN_REFERENCE = (2300.0, 2550.0)  # torchtitan tokens/s per rank on this kind of machine
TITAN_TARGET = 1.10
RATIO_TARGET = 1.05


@dataclass(frozen=True)
class Schedule:
    steps: int  # train.steps, warm-up included
    warmup: int  # metrics.warmup_steps: left out of every average (allocator, lazy init)
    interval: int  # metrics.log_interval: steps per tok/s sample; we take the median of samples


# Sized from short runs on this 2-core machine (s/step: debug 1.6 at 1 rank, 100m ~7 at 1 rank
# and ~12 at 4, titan ~3.6) so a run stays near 2 minutes with 8+ samples. 100m and ratio
# sample every step: 100m steps are long, ratio runs are short and repeated, and a per-step
# median shrugs off the spikes of a noisy machine. Expect ~20 minutes for everything.
SCHEDULES = {
    "debug": Schedule(44, 4, 4),
    "100m": Schedule(10, 2, 1),
    "ratio": Schedule(24, 4, 1),
    "titan": Schedule(28, 4, 2),
}
# --quick: one measured step per run, on 64-token sequences, so all cases finish in minutes.
QUICK = Schedule(2, 1, 1)
QUICK_ARGS = ["--data.seq_len=64"]
# The trainer logs "step 8/16  loss ...", bench/plain_loop.py "step 8  loss ...": no total.
STEP_RE = re.compile(r"\bstep (\d+)(?:/\d+)?\s.*?\btok/s ([\d,.]+)\s+tok/s/dev ([\d,.]+)")
LOSS_RE = re.compile(r"\bstep (\d+)(?:/\d+)?\s+loss (\S+)")
PARAMS_RE = re.compile(r"\bmodel \S+: ([\d,]+) parameters")


def number(text: str) -> float:
    return float(text.replace(",", ""))


def tokens_per_step(args: list[str]) -> int:
    """Global batch x sequence length from the overrides (the last wins, as in train.py)."""
    values = dict(a[2:].split("=", 1) for a in args if a.startswith("--"))
    return int(values["train.global_batch_size"]) * int(values["data.seq_len"])


def run_once(
    case: str, label: str, program: list[str], args: list[str], threads: int, opts: Namespace
) -> dict:
    """Run one training process (or torchrun group); return its parsed measurements."""
    sched = QUICK if opts.quick else opts.schedules[case]
    run_dir = opts.out.parent / "runs" / label
    # A fresh directory each time: a checkpoint left by an earlier run would be resumed.
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    args = [*args, *(QUICK_ARGS if opts.quick else [])]
    cmd = [*program, *args, *COMMON, f"--train.steps={sched.steps}"]
    cmd += [f"--metrics.warmup_steps={sched.warmup}", f"--metrics.log_interval={sched.interval}"]
    cmd += [f"--run.output_dir={run_dir.parent}", f"--run.name={label}"]
    # The same thread count for every rank and both sides of a comparison, never inherited.
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    (run_dir / "bench.log").write_text(log)
    if proc.returncode != 0:
        tail = "\n".join(log.splitlines()[-20:])
        sys.exit(f"{label} failed (exit {proc.returncode}):\n{shlex.join(cmd)}\n{tail}")
    # Full windows only: a window is the `interval` steps before its log line, so one that
    # starts inside warm-up, or a last one cut short by the end of the run, is left out.
    samples = [
        (number(tps), number(dev))
        for step, tps, dev in STEP_RE.findall(log)
        if int(step) % sched.interval == 0 and int(step) - sched.interval >= sched.warmup
    ]
    if not samples:
        sys.exit(f"{label}: no full measured interval in {run_dir / 'bench.log'}; add steps")
    params = PARAMS_RE.search(log)
    tok_s = [s[0] for s in samples]
    tokens = tokens_per_step(args)
    result = {
        "label": label,
        "command": f"OMP_NUM_THREADS={threads} {shlex.join(cmd)}",
        "threads_per_rank": threads,
        "params": int(number(params.group(1))) if params else None,
        "tokens_per_step": tokens,
        "schedule": asdict(sched),
        "tok_s_samples": tok_s,
        "tok_s": statistics.median(tok_s),
        "tok_s_per_rank": statistics.median(s[1] for s in samples),
        "step_s": tokens / statistics.median(tok_s),
        "losses": [float(loss) for _, loss in LOSS_RE.findall(log)],
        "wall_s": round(wall, 1),
    }
    print(
        f"  {label}: {result['tok_s']:,.0f} tok/s (median of {len(tok_s)}, "
        f"{min(tok_s):,.0f}-{max(tok_s):,.0f}), {wall:.0f} s",
        file=sys.stderr,
    )
    return result


def torchrun(nproc: int) -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", f"--nproc-per-node={nproc}", "train.py"]


def throughput_case(case: str, world: int, opts: Namespace) -> dict:
    args = [*{"debug": DEBUG, "100m": M100, "titan": TITAN}[case], *opts.train_args]
    # As launch/torchrun.sh: share the cores between the ranks, at least one thread each.
    threads = opts.threads or max(1, (os.cpu_count() or 1) // world)
    result = run_once(case, f"{case}-ws{world}", torchrun(world), args, threads, opts)
    return {"case": case, "world_size": world} | result


def ratio_case(dtype: str, opts: Namespace) -> dict:
    """Interleave FSDP2 (world size 1) and plain-loop runs, A B A B, so slow drift of the
    machine hits both sides alike; the ratio of each adjacent pair is one sample."""
    args = [*DEBUG, f"--parallel.param_dtype={dtype}"]
    threads = opts.threads or os.cpu_count() or 1
    # `python train.py` without torchrun is a one-rank process group with FSDP2 applied as
    # always: one process, like the plain loop.
    fsdp_cmd = [sys.executable, "train.py"]
    plain_cmd = [sys.executable, "bench/plain_loop.py", f"--bf16={opts.bf16_baseline}"]
    pairs = []
    for i in range(opts.pairs):
        fsdp_args = [*args, *opts.train_args]  # the plain loop has no FSDP options
        fsdp = run_once("ratio", f"ratio-{dtype}-fsdp2-{i}", fsdp_cmd, fsdp_args, threads, opts)
        plain = run_once("ratio", f"ratio-{dtype}-plain-{i}", plain_cmd, args, threads, opts)
        # Same tokens per step, so step-time ratio = inverse throughput ratio.
        pairs.append({"fsdp2": fsdp, "plain": plain, "ratio": plain["tok_s"] / fsdp["tok_s"]})
    ratios = [p["ratio"] for p in pairs]
    # Both programs must train the same thing, or the ratio compares different work.
    loss_diff = max(
        abs(a - b)
        for p in pairs
        for a, b in zip(p["fsdp2"]["losses"], p["plain"]["losses"], strict=True)
    )
    return {
        "dtype": dtype,
        "plain_baseline": "fp32" if dtype == "float32" else f"bf16 {opts.bf16_baseline}",
        "threads": threads,
        "fsdp2_tok_s": statistics.median(p["fsdp2"]["tok_s"] for p in pairs),
        "plain_tok_s": statistics.median(p["plain"]["tok_s"] for p in pairs),
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "max_loss_diff": loss_diff,
        "pairs": pairs,
    }


def machine_facts() -> dict:
    import torch  # only for its version: the measurements run in subprocesses

    def sh(*cmd: str) -> str:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True).stdout.strip()

    cpu = re.search(r"Model name:\s*(.+)", sh("lscpu"))
    dirty = " (dirty)" if sh("git", "status", "--porcelain") else ""
    return {
        "cpu": cpu.group(1) if cpu else "unknown",
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": sh("git", "rev-parse", "--short", "HEAD") + dirty,
        # Other work on the machine skews every number: the load average shows it.
        "load_avg_1m_start": os.getloadavg()[0],
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    quick = "  **(--quick smoke run: not a measurement)**" if report["quick"] else ""
    lines = [
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}, {m['date']}, "
        f"commit {m['commit']}, load avg {m['load_avg_1m_start']:.2f} -> "
        f"{m['load_avg_1m_end']:.2f}{quick}"
    ]
    if report["throughput"]:
        lines += [
            "",
            "| case | ranks | threads/rank | params | tokens/step | tok/s | tok/s/rank | step s "
            "| samples min-max tok/s | samples |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in report["throughput"]:
        s = r["tok_s_samples"]
        lines.append(
            f"| {r['case']} | {r['world_size']} | {r['threads_per_rank']} | {r['params'] or 0:,} | "
            f"{r['tokens_per_step']:,} | {r['tok_s']:,.0f} | {r['tok_s_per_rank']:,.0f} | "
            f"{r['step_s']:.2f} | {min(s):,.0f}-{max(s):,.0f} | {len(s)} |"
        )
    for r in report["throughput"]:
        if r["case"] == "titan":
            lo, hi = (r["tok_s_per_rank"] / ref for ref in reversed(TITAN_REFERENCE))
            lines += [
                "",
                f"titan shape: {r['tok_s_per_rank']:,.0f} tok/s per rank = {lo:.2f}-{hi:.2f}x "
                f"torchtitan's {TITAN_REFERENCE[0]:,.0f}-{TITAN_REFERENCE[1]:,.0f} "
                f"(target >= {TITAN_TARGET:.2f}x)",
            ]
    if report["ratio"]:
        lines += [
            "",
            "| dtype | plain loop | threads | FSDP2 ws1 tok/s | plain tok/s | step-time ratio "
            f"FSDP2/plain, median (target <= {RATIO_TARGET}x) | per pair | max loss diff |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for r in report["ratio"]:
        lines.append(
            f"| {r['dtype']} | {r['plain_baseline']} | {r['threads']} | {r['fsdp2_tok_s']:,.0f} "
            f"| {r['plain_tok_s']:,.0f} | **{r['ratio_median']:.3f}x** | "
            f"{', '.join(f'{x:.3f}' for x in r['ratios'])} | {r['max_loss_diff']:.1e} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--world-sizes", default="1,4", help="ranks for the debug and 100m cases")
    p.add_argument("--steps", type=int, help="train.steps of every run (default: per case)")
    p.add_argument("--warmup", type=int, help="metrics.warmup_steps (default: per case)")
    p.add_argument("--log-interval", type=int, help="steps per tok/s sample (default: per case)")
    p.add_argument("--pairs", type=int, default=3, help="FSDP2/plain run pairs per dtype")
    p.add_argument("--ratio-dtypes", default="float32,bfloat16", help="param dtypes for ratio")
    p.add_argument(
        "--bf16-baseline",
        choices=["copy", "autocast"],
        default="copy",
        help="how plain_loop.py runs bf16",
    )
    p.add_argument("--threads", type=int, help="OMP threads per rank (default: cores // ranks)")
    p.add_argument("--quick", action="store_true", help="2 short steps, 1 pair: harness check")
    p.add_argument(
        "--train-args",
        default="",
        help="extra train.py overrides for every trainer run, e.g. "
        "'--compile.enabled=true --parallel.reshard_after_forward=never'",
    )
    p.add_argument("--out", type=Path, default=Path("outputs/bench/throughput.json"))
    opts = p.parse_args(argv)
    opts.out = opts.out.resolve()
    opts.cases = opts.cases.split(",")
    opts.train_args = shlex.split(opts.train_args)
    if unknown := set(opts.cases) - set(CASES):
        p.error(f"unknown cases {sorted(unknown)}; choose from {CASES}")
    opts.pairs = 1 if opts.quick else opts.pairs
    opts.schedules = {
        case: Schedule(
            opts.steps or s.steps,
            s.warmup if opts.warmup is None else opts.warmup,
            opts.log_interval or s.interval,
        )
        for case, s in SCHEDULES.items()
    }
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    report: dict = {"machine": machine_facts(), "quick": opts.quick, "throughput": [], "ratio": []}
    for case in ("debug", "100m"):
        if case in opts.cases:
            for world in map(int, opts.world_sizes.split(",")):
                report["throughput"].append(throughput_case(case, world, opts))
    if "ratio" in opts.cases:
        report["ratio"] = [ratio_case(dtype, opts) for dtype in opts.ratio_dtypes.split(",")]
    if "titan" in opts.cases:
        report["throughput"].append(throughput_case("titan", 2, opts))
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    pairs = [p for r in report["ratio"] for p in r["pairs"]]
    runs = report["throughput"] + [p[side] for p in pairs for side in ("fsdp2", "plain")]
    report["commands"] = [r["command"] for r in runs]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nJSON: {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
