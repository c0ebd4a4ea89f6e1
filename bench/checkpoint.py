"""Checkpoint cost on CPU: save time, load time, and how long a save blocks the training loop,
synchronous (`checkpoint.async_mode=off`) vs `async`, at world size 2.

    python bench/checkpoint.py            # debug and ~100M models, ~4 min on 2 cores: keep it idle
    python bench/checkpoint.py --models debug
    python bench/checkpoint.py --quick    # smoke run: the harness works, the numbers mean nothing

Every number comes from running `train.py` under torchrun and parsing rank 0's log lines
`checkpoint step N: blocked X s, total Y s, checksums C s` (blocked: time the loop spent in the
save call; total: from the call until every rank finished writing; checksums: the part of it
spent summing the files, ranks in parallel), `... match their checksums, verified in V s` and
`resumed from ... in Z s` (the load after verification). Also the speed of zlib.crc32 against
hashlib's digests on this CPU, which is why the manifest holds CRC32s.
For each model: one run per mode that saves every `--interval` steps, then one run that
resumes (loads) the sync run's last checkpoint. The last save of a run is left out of the
medians: the end of training waits for it in either mode (unless the run saves only once).
Prints a Markdown table and writes JSON to --out; each run's log goes to <out dir>/runs/<label>/.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
COMMON = ["--train.eval_interval=0", "--metrics.tensorboard=false", "--metrics.log_interval=1"]
MODELS = {
    # configs/debug.toml's model (fp32, vocab 512) with a pinned batch, as in bench/throughput.py.
    "debug": ["configs/debug.toml", "--data.seq_len=256", "--train.global_batch_size=8"]
    + ["--train.micro_batch_size=4"],
    # ~100M parameters (12 x 768, GPT-2-small's shape; vocab 512): ~1.2 GB of model + AdamW.
    "100m": ["configs/debug.toml", "--model.dim=768", "--model.n_layers=12"]
    + ["--model.n_heads=12", "--model.n_kv_heads=12", "--model.vocab_size=512"]
    + ["--data.seq_len=256", "--train.global_batch_size=2", "--train.micro_batch_size=1"],
}
QUICK_ARGS = ["--data.seq_len=64"]
SAVE_RE = re.compile(
    r"checkpoint step (\d+): blocked ([\d.]+) s, total ([\d.]+) s, checksums ([\d.]+) s \((.+)\)"
)
LOAD_RE = re.compile(r"resumed from \S+ \(all state, step (\d+)\) in ([\d.]+) s")
VERIFY_RE = re.compile(r"match their checksums, verified in ([\d.]+) s")
PARAMS_RE = re.compile(r"\bmodel \S+: ([\d,]+) parameters")


def run_train(label: str, args: list[str], opts: Namespace) -> tuple[str, str]:
    """Run train.py on WORLD gloo ranks; return (log, command)."""
    run_dir = opts.out.parent / "runs" / label
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [*launcher, "--standalone", f"--nproc-per-node={WORLD}", "train.py", *args, *COMMON]
    cmd += [f"--run.output_dir={run_dir.parent}", f"--run.name={label}"]
    env = os.environ | {"OMP_NUM_THREADS": str(opts.threads)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "bench.log").write_text(log)
    if proc.returncode != 0:
        tail = "\n".join(log.splitlines()[-20:])
        sys.exit(f"{label} failed (exit {proc.returncode}):\n{shlex.join(cmd)}\n{tail}")
    return log, f"OMP_NUM_THREADS={opts.threads} {shlex.join(cmd)}"


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_case(model: str, mode: str, opts: Namespace) -> dict:
    label = f"ckpt-{model}-{mode}"
    shutil.rmtree(opts.out.parent / "runs" / label, ignore_errors=True)  # no stale resume
    args = [*MODELS[model], *(QUICK_ARGS if opts.quick else []), f"--train.steps={opts.steps}"]
    args += [f"--checkpoint.interval={opts.interval}", f"--checkpoint.async_mode={mode}"]
    args.append("--checkpoint.keep_last=1")  # a 100M checkpoint is ~1.2 GB
    start = time.perf_counter()
    log, command = run_train(label, args, opts)
    wall = time.perf_counter() - start
    found = SAVE_RE.findall(log)
    saves = [(int(s), float(b), float(t), Path(p)) for s, b, t, _, p in found]
    checksums = [float(c) for _, _, _, c, _ in found]
    if not saves:
        sys.exit(f"{label}: no 'checkpoint step' lines in {opts.out.parent / 'runs' / label}")
    params = PARAMS_RE.search(log)
    mid = saves[:-1] or saves  # the last save is always waited for at the end
    result = {
        "model": model,
        "mode": mode,
        "params": int(params.group(1).replace(",", "")) if params else None,
        "saves": [{"step": s, "blocked_s": b, "total_s": t} for s, b, t, _ in saves],
        "blocked_s": statistics.median(b for _, b, _, _ in mid),
        "total_s": statistics.median(t for _, _, t, _ in mid),
        "checksum_s": statistics.median(checksums[: len(mid)]),
        "bytes": du(saves[-1][3]),
        "last_checkpoint": str(saves[-1][3]),
        "wall_s": round(wall, 1),
        "command": command,
    }
    print(f"  {label}: {result['saves']}", file=sys.stderr)
    return result


def load_case(saved: dict, opts: Namespace) -> dict:
    """Resume the sync run's last checkpoint and train one step (saving nothing)."""
    label = f"ckpt-{saved['model']}-{saved['mode']}"
    args = [*MODELS[saved["model"]], *(QUICK_ARGS if opts.quick else [])]
    args += [f"--train.steps={opts.steps + 1}", "--checkpoint.interval=0"]
    log, command = run_train(label, args, opts)  # same run name: resume=auto finds it
    found, verified = LOAD_RE.search(log), VERIFY_RE.search(log)
    if not found or not verified:
        sys.exit(f"{label}: no 'resumed from' or 'verified in' line in the resume run")
    return {
        "load_s": float(found.group(2)),
        "verify_s": float(verified.group(1)),
        "step": int(found.group(1)),
        "command": command,
    }


def hash_speeds(mib: int = 256) -> dict[str, float]:
    """GB/s of zlib.crc32 and hashlib digests over `mib` MiB in memory, in 8 MiB chunks (as
    checkpoint/integrity.py reads files): the best of two passes each."""
    import hashlib
    import zlib

    data = memoryview(os.urandom(mib << 20))
    chunks = [data[i : i + (8 << 20)] for i in range(0, len(data), 8 << 20)]

    def crc32() -> None:
        crc = 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)

    def digest(name: str):
        def run() -> None:
            h = hashlib.new(name)
            for chunk in chunks:
                h.update(chunk)

        return run

    speeds = {}
    for name, fn in [("crc32", crc32)] + [(n, digest(n)) for n in ("sha1", "sha256", "md5")]:
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        speeds[name] = round(len(data) / best / 1e9, 2)
    return speeds


def markdown(report: dict) -> str:
    m = report["machine"]
    quick = "  **(--quick smoke run: not a measurement)**" if report["quick"] else ""
    lines = [
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, world size {WORLD}, "
        f"{m['threads']} threads/rank, {m['date']}, load avg {m['load_avg_1m_start']:.2f} -> "
        f"{m['load_avg_1m_end']:.2f}{quick}",
        "",
        "| model | params | checkpoint | mode | save total s | of which checksums s "
        "| loop blocked s | verify s | load s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        load = f"{r['load']['load_s']:.2f}" if "load" in r else "-"
        verify = f"{r['load']['verify_s']:.2f}" if "load" in r else "-"
        lines.append(
            f"| {r['model']} | {r['params'] or 0:,} | {r['bytes'] / 2**20:,.0f} MiB | {r['mode']} "
            f"| {r['total_s']:.2f} | {r['checksum_s']:.2f} | {r['blocked_s']:.3f} | {verify} "
            f"| {load} |"
        )
    speeds = ", ".join(f"{name} {gbps} GB/s" for name, gbps in report["hash_gbps"].items())
    lines += ["", f"Checksum speed, one thread, 256 MiB in memory: {speeds}"]
    return "\n".join(lines)


def machine_facts(threads: int) -> dict:
    import torch  # only for its version: the measurements run in subprocesses

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = re.search(r"Model name:\s*(.+)", lscpu)
    return {
        "cpu": cpu.group(1) if cpu else "unknown",
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_avg_1m_start": os.getloadavg()[0],
    }


def parse_args(argv: list[str] | None) -> Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {list(MODELS)}")
    p.add_argument("--steps", type=int, default=8, help="train.steps of each save run")
    p.add_argument("--interval", type=int, default=2, help="checkpoint.interval of each save run")
    p.add_argument("--threads", type=int, help="OMP threads per rank (default: cores // 2)")
    p.add_argument("--quick", action="store_true", help="debug model, 4 short steps")
    p.add_argument("--out", type=Path, default=Path("outputs/bench/checkpoint.json"))
    opts = p.parse_args(argv)
    opts.out = opts.out.resolve()
    opts.models = opts.models.split(",")
    if unknown := set(opts.models) - set(MODELS):
        p.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    if opts.quick:
        opts.models, opts.steps = ["debug"], 4
    opts.threads = opts.threads or max(1, (os.cpu_count() or 1) // WORLD)
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    report: dict = {"machine": machine_facts(opts.threads), "quick": opts.quick, "runs": []}
    report["hash_gbps"] = hash_speeds()
    for model in opts.models:
        sync = save_case(model, "off", opts)
        report["runs"] += [sync, save_case(model, "async", opts)]
        sync["load"] = load_case(sync, opts)
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nJSON: {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
