"""What fault-tolerant replica groups (ft.enabled, parallel/ft.py) cost and save, on one machine.

    python bench/ft.py                    # ~3 min on 2 idle cores
    python bench/ft.py --repeats 3 --nproc 2

1. Throughput: HSDP over 2 "nodes" (one torchrun job, dp_replicate 2) against 2 replica groups
   (`multinode.sh FT=1`, one per node) on the same ranks: what the quorum, the commit and the
   all-reduce through torchft's process group cost per step.
2. A lost group: every process of group 1 killed with SIGKILL after step 20. Times from the kill
   to group 0's first step without it (its log line `step N: 1 of 2 replica groups`), and from
   group 1's restart (the same command) to its heal and its first step back.

Each group is launched as users launch it (launch/multinode.sh, FT=1, node 0 starting the
lighthouse), ranks of one thread each. The slow-link cluster's numbers (tokens/s against HSDP
with 1 Gbit/s between nodes) come from `bench/scaling.py --modes hsdp ft`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.vocab_size=512", "--data.seq_len=32", "--train.global_batch_size=8",
        "--optim.warmup_steps=2", "--train.eval_interval=0", "--metrics.tensorboard=false",
        "--parallel.param_dtype=float32", "--checkpoint.interval=0"]  # fmt: skip
TOK_S = re.compile(r"step (\d+)/\d+  loss \S+  lr \S+  grad_norm \S+  tok/s ([\d,]+)")
ENV = os.environ | {
    "OMP_NUM_THREADS": "1",
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=ENV | env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def wait_for(log: Path, pattern: str, timeout: float) -> tuple[re.Match, float]:
    """The first match of `pattern` in `log`, and when it was seen (monotonic)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if match := re.search(pattern, log.read_text()):
            return match, time.monotonic()
        time.sleep(0.05)
    sys.exit(f"ft bench: {pattern!r} not in {log} after {timeout} s:\n{log.read_text()[-3000:]}")


def group(n: int, nproc: int, port: int) -> dict[str, str]:
    return {"FT": "1", "NNODES": "2", "NODE_RANK": str(n), "MASTER_ADDR": "127.0.0.1",
            "NPROC": str(nproc), "LIGHTHOUSE_PORT": str(port),
            "LIGHTHOUSE_ARGS": "--heartbeat_timeout_ms 1000"}  # fmt: skip


def descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def median_tok_s(log: Path, warmup: int) -> float:
    samples = [float(t.replace(",", "")) for s, t in TOK_S.findall(log.read_text())
               if int(s) > warmup]  # fmt: skip
    return statistics.median(samples)


def throughput(data: str, out: Path, nproc: int, steps: int) -> dict[str, float]:
    args = ["configs/debug.toml", f"--data.path={data}", *TINY, f"--train.steps={steps}",
            "--metrics.log_interval=1", "--metrics.warmup_steps=5"]  # fmt: skip
    hsdp_log = out / "hsdp.log"
    proc = launch(["launch/torchrun.sh", *args, f"--run.output_dir={out / 'hsdp'}",
                   "--parallel.dp_replicate=2"], {"NPROC": str(2 * nproc)}, hsdp_log)  # fmt: skip
    proc.wait(timeout=600)
    port, logs = free_port(), [out / "ft0.log", out / "ft1.log"]
    procs = [launch(["launch/multinode.sh", *args, f"--run.output_dir={out / 'ft'}",
                     "--ft.compare_interval=0"], group(g, nproc, port), logs[g])
             for g in (0, 1)]  # fmt: skip
    for p in procs:
        p.wait(timeout=600)
    return {"hsdp_tok_s": median_tok_s(hsdp_log, 5), "ft_tok_s": median_tok_s(logs[0], 5)}


def lost_group(data: str, out: Path, nproc: int) -> dict[str, float]:
    args = ["launch/multinode.sh", "configs/debug.toml", f"--data.path={data}", *TINY,
            f"--run.output_dir={out}", "--train.steps=100000", "--metrics.log_interval=1",
            "--ft.compare_interval=0"]  # fmt: skip
    port, logs = free_port(), [out / "g0.log", out / "g1.log", out / "g1-again.log"]
    first = launch(args, group(0, nproc, port), logs[0])
    second = launch(args, group(1, nproc, port), logs[1])
    again = None
    try:
        wait_for(logs[1], r"step 20/\d+  loss", 300)
        for pid in [second.pid, *descendants(second.pid)]:  # the agent and its ranks at once
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, degraded = wait_for(logs[0], r"step \d+: 1 of 2 replica groups; the step", 120)
        started = time.monotonic()
        again = launch(args, group(1, nproc, port), logs[2])
        _, healed = wait_for(logs[2], r"healed from a live replica group", 300)
        step = int(wait_for(logs[2], r"step (\d+)/\d+  loss", 60)[0].group(1))
        _, stepped = wait_for(logs[2], rf"step {step}/\d+  loss", 60)
        return {"kill_to_next_step_s": degraded - killed, "start_to_heal_s": healed - started,
                "start_to_first_step_s": stepped - started}  # fmt: skip
    finally:
        for proc in (first, second, again):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a prepared dataset (default: a small one made here)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per group (node)")
    p.add_argument("--steps", type=int, default=80, help="steps of the throughput runs")
    p.add_argument("--repeats", type=int, default=2, help="lost-group trials")
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/ft.json")
    opts = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft-bench-"))
    data = opts.data
    if data is None:
        sys.path.insert(0, str(REPO))
        from data.prepare import prepare
        from tests.conftest import write_corpus

        data = str(prepare([str(write_corpus(work / "text"))], work / "tokens", val_fraction=0.1))
    report: dict = {"nproc": opts.nproc, "throughput": throughput(data, work, opts.nproc,
                                                                  opts.steps)}  # fmt: skip
    trials = []
    for i in range(opts.repeats):
        (work / f"lost{i}").mkdir()
        trials.append(lost_group(data, work / f"lost{i}", opts.nproc))
    report["lost_group"] = trials
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2))
    t = report["throughput"]
    print(f"tok/s: HSDP 2x{opts.nproc} {t['hsdp_tok_s']:,.0f}, 2 ft groups of {opts.nproc} "
          f"{t['ft_tok_s']:,.0f} ({t['ft_tok_s'] / t['hsdp_tok_s']:.2f}x)")  # fmt: skip
    for name in trials[0]:
        print(f"{name}: " + ", ".join(f"{trial[name]:.1f}" for trial in trials))
    return 0


if __name__ == "__main__":
    sys.exit(main())
