"""Context parallel on CPU: tokens/s and peak memory per rank at cp 1, 2 and 4.

    python bench/cp.py            # SDPA, 4k and 8k tokens, cp 1, 2, 4: 9 minutes on 2 cores
    python bench/cp.py --attention chunked --seq-lens 8192 --out outputs/bench/cp-chunked.json
    python bench/cp.py --quick    # smoke run: proves the harness works, numbers mean nothing

**Only the split changes.** Every run is 4 gloo ranks (torchrun; cores / 4 threads each, at
least one: 4 single-thread ranks on 2 cores here, oversubscribed 2x alike in every run) training
the model of configs/debug.toml with 4 layers (dim 256, 16 heads, fp32, vocab 512, no AC) on 4
sequences per step in micro-batches of one sequence. cp 1 is FSDP 1x4 (each rank one whole
sequence per step); cp 2 is dp_shard 2 x cp 2 (each rank half of each of 2 sequences, one
after the other); cp 4 is dp_shard 1 x cp 4 (a quarter of each of 4). FSDP shards over
dp_shard x cp = 4 in every run, so weights, gradients and optimizer state per rank do not
change, and every rank runs seq_len tokens and the same causal attention work per step (head
and tail chunks, parallel/cp.py). What changes is one micro-batch's activations, seq_len / cp
tokens (plus the whole sequence's keys and values that attention gathers), and the
collectives: cp all-gathers K and V every layer and micro-batch, and accumulates cp
micro-batches, each with FSDP's gathers.

**The CPU kernels** (`--attention`: SDPA by default; chunked at 8k, ~7 minutes more): at cp
1 SDPA runs `is_causal`, but under cp it takes a mask of (local rows x whole sequence)
(model/attention.py `split_mask`): since 4c588db one additive float mask per forward, shared
by the layers (before, a boolean one that CPU SDPA copied to float32 and saved in every
layer); the planner does not count it. The chunked kernel takes the split's spans instead:
nothing of size rows x sequence is built, and the keys after a chunk are never touched.

**Memory is VmHWM**, the kernel's peak resident set of each rank process, read from
/proc/<pid>/status every 0.5 s while the run lasts (it only grows, so the last reading before
exit is the peak, short of growth in the last half second, when the trainer is shutting down).
It counts everything the process touched: torch's libraries, the allocator's cached blocks and
glibc's, not only live tensors. glibc keeps freed blocks below its (growing) mmap threshold in
its heap for reuse, so without care the peak also holds whatever the heap kept: the ranks of
one run, doing the same work, differed by up to 0.3 GiB. The ranks therefore run with
`MALLOC_MMAP_THRESHOLD_=65536` (unless set already): every tensor over 64 KiB is its own
mapping, returned to the kernel when freed, and the peak follows live memory. The trainer's
own `rss` (rank 0's ru_maxrss, the same quantity) is kept as a check. Set against it: the
planner's per-rank activations + logits for the same run (parallel/plan.py `plan_memory`, what
`train.py --dry-run` prints), whose fall from cp 1 is the fall the planner predicts; the rest
of the planner's figure is the same at every cp here.

tok/s is the median of the trainer's samples after warm-up (bench/throughput.py's harness); the
losses of every run are compared with cp 1's (same seed and global batch: equal to the 4
decimals the log prints, else the runs trained different things). Prints a Markdown table,
writes JSON to --out, and each run's log to <out dir>/runs/<label>/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
from argparse import Namespace
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
# The project first (bench/checkpoint.py would shadow its checkpoint package), then bench/.
sys.path[:0] = [str(REPO), str(REPO / "bench")]
from throughput import Schedule, machine_facts, number, run_once, torchrun  # noqa: E402

WORLD = 4
MODEL = [
    "configs/debug.toml", "--model.n_layers=4",
    f"--train.global_batch_size={WORLD}", "--train.micro_batch_size=1",
]  # fmt: skip
# Every rank runs seq_len tokens a step: on this 2-core machine (SDPA) 7 s at 4k and 24 s at
# 8k at cp 1, 13 and 45 s at cp 2 and 4. One warm-up step (allocator, lazy init), then a
# sample per step: 2 samples keep the default sweep at 9 minutes.
SCHEDULE = Schedule(steps=3, warmup=1, interval=1)
RSS_RE = re.compile(r"\brss ([\d.]+)GiB")
GIB = 2**30


class RankPeaks:
    """VmHWM of each rank process of one torchrun group, polled from /proc on a thread.

    The ranks are found by an environment variable set for this run only (torchrun passes the
    environment on to its workers) and told apart by their RANK; the torchrun agent, which has
    the tag but no RANK, is left out."""

    def __init__(self, tag: str, interval_s: float = 0.5) -> None:
        self.tag, self.interval_s = tag, interval_s
        self.pids: dict[int, int] = {}  # pid -> rank
        self.peaks: dict[int, int] = {}  # rank -> bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RankPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if len(self.pids) < WORLD:  # every rank found: stop scanning /proc
                self._find_ranks()
            for pid, rank in list(self.pids.items()):
                if (hwm := _vm_hwm(pid)) is not None:
                    self.peaks[rank] = max(self.peaks.get(rank, 0), hwm)

    def _find_ranks(self) -> None:
        tag = f"CP_BENCH_RUN={self.tag}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in self.pids:
                continue
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:  # gone, or another user's
                continue
            rank = next((v[5:] for v in env if v.startswith(b"RANK=")), None)
            if tag in env and rank is not None:
                self.pids[int(entry)] = int(rank)


def _vm_hwm(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


class Case(NamedTuple):
    attention: str  # model.attention: the CPU kernel
    seq: int
    cp: int


def case_args(case: Case) -> list[str]:
    return [
        *MODEL,
        f"--model.attention={case.attention}",
        f"--data.seq_len={case.seq}",
        f"--parallel.dp_shard={WORLD // case.cp}",
        f"--parallel.cp={case.cp}",
    ]


def planned(args: list[str], cp: int) -> dict[str, float]:
    """The planner's per-rank bytes for this run, as `train.py --dry-run` computes them."""
    from configs import parse_config
    from launch.job import JobConfig
    from model import get_family
    from parallel.plan import model_shape, plan_memory

    job = parse_config(JobConfig, args)
    family = get_family(job.model.name)
    shape = model_shape(family, family.build_args(job.model), job.fp8, job.lora, job.train.freeze)
    p, t = job.parallel, job.train
    mem = plan_memory(shape, WORLD // cp, t.micro_batch_size, job.data.seq_len, p.param_dtype,
                      job.ac.mode, job.ac.every, p.reshard_after_forward, p.cpu_offload, cp=cp,
                      loss_chunk_tokens=t.loss_chunk_tokens)  # fmt: skip
    return mem | {
        "total": sum(mem.values()),
        "activations_and_logits": mem["activations"] + mem["logits"],
    }


def run_case(case: Case, i: int, opts: Namespace) -> dict:
    label = f"cp-{case.attention}-seq{case.seq}-cp{case.cp}-{i}"
    # The tag the poller finds the ranks by; run_once hands os.environ to torchrun.
    os.environ["CP_BENCH_RUN"] = label
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # see the module docstring
    try:
        with RankPeaks(label) as peaks:
            result = run_once("cp", label, torchrun(WORLD), case_args(case), opts.threads, opts)
    finally:
        del os.environ["CP_BENCH_RUN"]
    if sorted(peaks.peaks) != list(range(WORLD)):
        sys.exit(f"{label}: found the peak memory of ranks {sorted(peaks.peaks)} only")
    log = (opts.out.parent / "runs" / label / "bench.log").read_text()
    rss = [number(x) for x in RSS_RE.findall(log)]
    return result | {
        "peak_rss_bytes_by_rank": [peaks.peaks[r] for r in range(WORLD)],
        "rank0_ru_maxrss_gib": max(rss) if rss else None,
    }


def summarize(case: Case, runs: list[dict]) -> dict:
    per_rank = [
        statistics.median(r["peak_rss_bytes_by_rank"][k] for r in runs) for k in range(WORLD)
    ]
    cp = case.cp
    return case._asdict() | {
        "mesh": f"dp_shard {WORLD // cp} x cp {cp}" if cp > 1 else f"FSDP 1x{WORLD}",
        "tok_s": statistics.median(s for r in runs for s in r["tok_s_samples"]),
        "tok_s_per_rank": statistics.median(r["tok_s_per_rank"] for r in runs),
        "peak_rss_bytes_by_rank": per_rank,
        "peak_rss_bytes_max": max(per_rank),
        "planned_bytes": planned(case_args(case), cp),
        "runs": runs,
    }


def markdown(report: dict) -> str:
    m = report["machine"]
    quick = "  **(--quick smoke run: not a measurement)**" if report["quick"] else ""
    lines = [
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}, commit {m['commit']}, "
        f"load avg {m['load_avg_1m_start']:.2f} -> {m['load_avg_1m_end']:.2f}{quick}",
        "",
        "| attention | seq | cp | mesh | tok/s | tok/s/rank "
        "| peak RSS per rank GiB (max; ranks 0-3) | fall vs cp 1 "
        "| planner: activations + logits GiB | planned fall | max loss diff vs cp 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        base = next(
            b
            for b in report["results"]
            if (b["attention"], b["seq"], b["cp"]) == (r["attention"], r["seq"], 1)
        )
        plan = r["planned_bytes"]["activations_and_logits"]
        base_plan = base["planned_bytes"]["activations_and_logits"]
        fall = (base["peak_rss_bytes_max"] - r["peak_rss_bytes_max"]) / GIB
        ranks = ", ".join(f"{b / GIB:.2f}" for b in r["peak_rss_bytes_by_rank"])
        cols = [f"{fall:.2f}", f"{(base_plan - plan) / GIB:.2f}"] if r is not base else ["", ""]
        diffs = [
            abs(a - b)
            for run, ref in zip(r["runs"], base["runs"], strict=False)
            for a, b in zip(run["losses"], ref["losses"], strict=True)
        ]
        diff = max(diffs, default=float("nan"))
        lines.append(
            f"| {r['attention']} | {r['seq']:,} | {r['cp']} | {r['mesh']} | {r['tok_s']:,.0f} | "
            f"{r['tok_s_per_rank']:,.0f} | {r['peak_rss_bytes_max'] / GIB:.2f} ({ranks}) | "
            f"{cols[0]} | {plan / GIB:.2f} | {cols[1]} | {diff:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-lens", default="4096,8192", help="comma-separated data.seq_len values")
    p.add_argument("--cps", default="1,2,4", help="comma-separated cp degrees (1 first: the base)")
    p.add_argument("--attention", default="sdpa", help="comma-separated model.attention kernels")
    p.add_argument("--rounds", type=int, default=1, help="runs per case, the cases alternating")
    p.add_argument("--quick", action="store_true", help="2 steps of 64 tokens: harness check")
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/cp.json")
    opts = p.parse_args(argv)
    opts.out = opts.out.resolve()
    opts.schedules = {"cp": SCHEDULE}  # what run_once reads
    # As launch/torchrun.sh: the cores shared between the ranks, at least one thread each.
    opts.threads = max(1, (os.cpu_count() or 1) // WORLD)
    # The configs' relative paths (configs/debug.toml, data.path) are the repository's, for
    # the planner here as for the runs.
    os.chdir(REPO)
    if not (REPO / "outputs/data/stdlib/index.json").exists():
        sys.exit("no stdlib corpus: run `python -m data.prepare` first")
    cps = [int(c) for c in opts.cps.split(",")]
    if cps[0] != 1 or any(WORLD % c for c in cps):
        p.error(f"--cps must start with 1 (the base) and divide the world size {WORLD}")
    # --quick runs 64-token sequences (run_once's QUICK_ARGS) whatever --seq-lens says.
    seqs = [64] if opts.quick else [int(s) for s in opts.seq_lens.split(",")]
    kernels = opts.attention.split(",")
    runs = {Case(a, s, c): [] for a in kernels for s in seqs for c in cps}
    report: dict = {"machine": machine_facts(), "quick": opts.quick, "world_size": WORLD}
    report["threads_per_rank"] = opts.threads
    report["schedule"] = vars(SCHEDULE)
    for i in range(1 if opts.quick else opts.rounds):
        for case in runs:
            runs[case].append(run_case(case, i, opts))
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    report["results"] = [summarize(case, r) for case, r in runs.items()]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nJSON: {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
