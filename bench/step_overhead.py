"""What each training step pays at world size 1 besides the model: the trainer's per-step pieces
timed alone, in one process, on the debug model of configs/debug.toml (fp32, CPU).

    python bench/step_overhead.py            # ~1 minute; keep the machine idle
    python bench/step_overhead.py --fr 0     # the collectives without torch's flight recorder

Each piece: the best of 5 repeats of a timed loop, in microseconds per call, and how often a
step calls it. bench/throughput.py's ratio case measures the whole step against the plain loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def best_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(max(1, calls // 10)):  # warm up
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fr", type=int, default=2000, help="health.flight_recorder_entries")
    opts = parser.parse_args()
    if opts.fr:  # read when the process group is created (parallel/runtime.py does the same)
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(opts.fr))
    import torch
    import torch.distributed as dist

    from configs import parse_config
    from launch.health import HealthConfig, Heartbeat, StragglerMeter
    from launch.job import JobConfig
    from launch.metrics import ThroughputMeter
    from model import get_family
    from parallel.build import build_model
    from parallel.fsdp import assign_local_shard
    from parallel.runtime import build_mesh
    from train import clip_grad_norm

    torch.set_num_threads(1)
    # As a plain `python train.py` starts (parallel/runtime.py): one rank, an in-memory store.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cpu = torch.device("cpu")
    job = parse_config(JobConfig, [str(REPO / "configs" / "debug.toml")])
    family = get_family(job.model.name)
    mesh = build_mesh(cpu, 1, 1)
    model = build_model(family, family.build_args(job.model), job.build_settings(), mesh).model
    model.to_empty(device=cpu)
    model.init_weights(seed=0, rope_len=job.data.seq_len, assign=assign_local_shard)
    tokens = torch.randint(0, job.model.vocab_size, (2, job.data.seq_len))
    model(tokens).float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]

    flags = torch.zeros(3)
    beat = Heartbeat(Path("/nonexistent"), 0, 0)  # beats only: its writer thread is off
    stragglers = StragglerMeter(HealthConfig(), cpu, 0, 1)
    meter = ThroughputMeter(0, 1, 1, None)
    rows = [
        ("all_reduce of the step's loss and flags", 2,
         best_us(lambda: dist.all_reduce(flags), 2000)),
        ("Heartbeat.beat", 7, best_us(lambda: beat.beat(1, "forward"), 100_000)),
        ("StragglerMeter.record", 1, best_us(lambda: stragglers.record(1.0, 0.1, 0.0), 100_000)),
        ("ThroughputMeter.record", 1, best_us(lambda: meter.record(9, 1.0, 0.1, 4096), 100_000)),
        (f"clip_grad_norm, float64 ({len(grads)} DTensor gradients)", 1,
         best_us(lambda: clip_grad_norm(model, 0.0), 20)),
        ("get_total_norm, float32 (the plain loop's)", 1,
         best_us(lambda: torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor(), 20)),
    ]  # fmt: skip
    dist.destroy_process_group()
    fr = f"flight recorder {opts.fr} entries" if opts.fr else "flight recorder off"
    print(f"| per-step piece (world size 1, {fr}) | calls per step | us per call |")
    print("|---|---|---|")
    for name, per_step, us in rows:
        print(f"| {name} | {per_step} | {us:.2f} |")


if __name__ == "__main__":
    main()
