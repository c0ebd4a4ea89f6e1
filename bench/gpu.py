"""The GPU benchmarks the issues ask for, on one GPU, in one command.

    python bench/gpu.py                 # both suites, ~15 min on one H100
    python bench/gpu.py --suite 1b      # 1B: bf16 eager, compile, compile + AC, compile + fp8
    python bench/gpu.py --suite fp8     # 8B-shaped layers: fp8 vs bf16, eager and compiled
    python bench/gpu.py --smoke         # the debug model on any device: checks the harness only

Every case is `python train.py` on one process (FSDP2 on a one-rank mesh, as always) with the
trainer's own metrics; this script parses rank 0's `step N ... tok/s X ... tflops/dev Y ...
mem Z` lines after warm-up (compilation included in warm-up) and takes medians. MFU is
reported against the device's dense **bf16** peak for every case, fp8 included, so the
columns compare (the trainer's own log line uses the fp8 peak for fp8 runs).

On the project's GPU machine (torch 2.11, no torchdata or torchao), carry the two wheels
(see bench/README.md) and start the command with the pip line given there.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from throughput import machine_facts, number  # noqa: E402  (bench/ is sys.path[0])

COMMON = [
    "--data.path=outputs/data/stdlib", "--parallel.param_dtype=bfloat16",
    "--parallel.reduce_dtype=float32", "--train.eval_interval=0",
    "--metrics.tensorboard=false", "--checkpoint.interval=0", "--checkpoint.resume=none",
]  # fmt: skip
# torchtitan's Llama 3 benchmarks use 8k-token sequences, one per GPU and step.
SEQ = ["--data.seq_len=8192", "--train.micro_batch_size=1", "--train.global_batch_size=1"]
COMPILE = ["--compile.enabled=true"]
FP8 = ["--fp8.enabled=true"]
SUITES = {
    # Issue "scale and speed": target >= 45% MFU for bf16 + compile.
    "1b": {
        "model": ["--model.flavor=1B", *SEQ],
        "cases": {
            "bf16 eager": [],
            "bf16 compile": COMPILE,
            "bf16 compile + selective AC (every 2nd block)": [*COMPILE, "--ac.mode=selective"],
            "bf16 compile + op-level AC": [*COMPILE, "--ac.mode=op"],
            "fp8 compile": [*COMPILE, *FP8],
        },
    },
    # Issue "FP8": 8B-shaped layers, fewer of them so one GPU holds the model and its states.
    # Target >= 1.30x for fp8 + compile over bf16 + compile.
    "fp8": {
        "model": ["--model.flavor=8B", "--model.n_layers=4", *SEQ],
        "cases": {
            "bf16 eager": [],
            "fp8 eager": FP8,
            "bf16 compile": COMPILE,
            "fp8 compile": [*COMPILE, *FP8],
        },
    },
}
SMOKE_MODEL = ["--model.flavor=debug", "--data.seq_len=128", "--train.micro_batch_size=2"]
SMOKE_MODEL += ["--train.global_batch_size=2"]
FIELDS = {  # log-line field -> key; the trainer prints e.g. `tok/s 1,234  tflops/dev 412.30`
    "tok/s": "tok_s",
    "tflops/dev": "tflops",
    "mem": "mem_gib",
    "rss": "mem_gib",
}
STEP_LINE = re.compile(r"\bstep (\d+)\s+loss\s.*\btok/s\s")


def parse_steps(log: str, warmup: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    for line in log.splitlines():
        m = STEP_LINE.search(line)
        if not m or int(m.group(1)) <= warmup:
            continue
        for field, key in FIELDS.items():
            if f := re.search(rf"(?:^|\s){re.escape(field)} ([\d,.]+)", line):
                samples.setdefault(key, []).append(number(f.group(1)))
    return samples


def bf16_peak() -> float | None:
    import torch

    from parallel.metrics import peak_tflops

    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.device("cuda", 0), "bf16", None)


def run_case(suite: str, name: str, args: list[str], opts: argparse.Namespace) -> dict:
    label = re.sub(r"[^a-z0-9]+", "-", f"{suite} {name}".lower()).strip("-")
    cmd = [sys.executable, "train.py", *COMMON, *args, f"--train.steps={opts.steps}"]
    cmd += [f"--metrics.warmup_steps={opts.warmup}", f"--metrics.log_interval={opts.interval}"]
    cmd += [f"--run.output_dir={opts.out.parent / 'runs'}", f"--run.name={label}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    (opts.out.parent / f"{label}.log").write_text(log)
    result = {"suite": suite, "case": name, "command": shlex.join(cmd[1:]), "ok": False}
    result["wall_s"] = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        # One case failing (fp8 on an old GPU, compile on an odd toolchain) must not cost
        # the others: record the error line and go on.
        result["error"] = next(
            (ln for ln in reversed(log.splitlines()) if "Error" in ln), log[-300:]
        )
        print(f"  {label}: FAILED ({result['error']})", file=sys.stderr)
        return result
    samples = parse_steps(log, opts.warmup)
    if "tok_s" not in samples:
        result["error"] = "no step line after warm-up: add --steps"
        return result
    result |= {k: statistics.median(v) for k, v in samples.items()} | {"ok": True}
    result["samples"] = len(samples["tok_s"])
    if opts.peak and "tflops" in result:
        result["mfu_bf16_pct"] = 100 * result["tflops"] / opts.peak
    print(f"  {label}: {result['tok_s']:,.0f} tok/s", file=sys.stderr)
    return result


def markdown(report: dict) -> str:
    lines = [f"device: {report['device']}, bf16 peak {report['peak_tflops']} TFLOP/s"]
    for suite in dict.fromkeys(r["suite"] for r in report["results"]):
        rows = [r for r in report["results"] if r["suite"] == suite]
        lines += ["", f"### {suite}", "", "| case | tok/s | TFLOP/s | MFU (bf16 peak) | "
                  "peak memory GiB | vs bf16 same mode |", "|---|---|---|---|---|---|"]  # fmt: skip
        by_name = {r["case"]: r for r in rows if r["ok"]}
        for r in rows:
            if not r["ok"]:
                lines.append(f"| {r['case']} | failed: {r['error'][:80]} | | | | |")
                continue
            base = by_name.get(r["case"].replace("fp8", "bf16", 1))
            ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base and base is not r else ""
            mfu = f"{r['mfu_bf16_pct']:.1f}%" if "mfu_bf16_pct" in r else "-"
            lines.append(
                f"| {r['case']} | {r['tok_s']:,.0f} | {r.get('tflops', 0):.1f} | {mfu} | "
                f"{r.get('mem_gib', 0):.1f} | {ratio} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=15, help="steps left out (compile included)")
    p.add_argument("--interval", type=int, default=5, help="steps per logged sample")
    p.add_argument("--smoke", action="store_true", help="debug model, 4 steps: harness check")
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/gpu/gpu.json")
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.steps, opts.warmup, opts.interval = 4, 2, 1
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    if not (REPO / "outputs/data/stdlib").exists():
        subprocess.run([sys.executable, "-m", "data.prepare"], cwd=REPO, check=True)
    import torch

    opts.peak = bf16_peak()
    report = {
        "machine": machine_facts(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "peak_tflops": opts.peak,
        "smoke": opts.smoke,
        "results": [],
    }
    for suite in SUITES if opts.suite == "all" else [opts.suite]:
        model = SMOKE_MODEL if opts.smoke else SUITES[suite]["model"]
        for name, args in SUITES[suite]["cases"].items():
            report["results"].append(run_case(suite, name, [*model, *args], opts))
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    return 0 if all(r["ok"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
