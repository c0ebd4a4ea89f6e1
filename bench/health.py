"""What hang and straggler diagnostics cost: the trainer with heartbeats, straggler gathering
and the flight recorder on, against all three off, in alternating runs.

    python bench/health.py                 # 2 gloo ranks, debug model, ~4 min on 2 cores
    python bench/health.py --pairs 5 --steps 80

"On" is the worst case: a heartbeat every second (default 5) and the straggler all-gather at
every step (log_interval 1; normally once per log interval). Each run's steady-state tok/s is
the mean of its log lines' `tok/s` after metrics.warmup_steps; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ON = ["--health.heartbeat_interval_s=1", "--health.stragglers=true",
      "--health.flight_recorder_entries=2000"]  # fmt: skip
OFF = ["--health.heartbeat_interval_s=0", "--health.stragglers=false",
       "--health.flight_recorder_entries=0"]  # fmt: skip


def tokens_per_second(data: str, steps: int, nproc: int, extra: list[str], device: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "train.py", "configs/debug.toml",
               f"--data.path={data}", f"--run.output_dir={out}", f"--train.steps={steps}",
               "--metrics.log_interval=1", "--train.eval_interval=0",
               "--checkpoint.interval=0", "--metrics.tensorboard=false",
               f"--parallel.device={device}", *extra]  # fmt: skip
        env = os.environ | {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
        log = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    rates = [float(v.replace(",", "")) for v in re.findall(r" tok/s ([\d,]+)", log.stderr)]
    return statistics.mean(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="outputs/data/stdlib")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(args.pairs):
        for name, extra in (("off", OFF), ("on", ON)) if i % 2 == 0 else (("on", ON), ("off", OFF)):
            results[name].append(
                tokens_per_second(args.data, args.steps, args.nproc, extra, args.device)
            )
            print(f"pair {i + 1} {name}: {results[name][-1]:,.0f} tok/s", flush=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print("\n| diagnostics | tok/s (median) | runs |\n|---|---|---|")
    for name, median in (("off", off), ("on", on)):
        runs = ", ".join(f"{v:,.0f}" for v in results[name])
        print(f"| {name} | {median:,.0f} | {runs} |")
    print(f"\non / off: {on / off:.3f}")


if __name__ == "__main__":
    main()
