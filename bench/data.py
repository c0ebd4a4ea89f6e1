"""The data loader at corpus scale: the per-index shuffle at 10^9 windows, and a rank's RSS for a
corpus of 100M windows against a small one.

    python bench/data.py                                  # both, about a minute
    python bench/data.py permutation --n 1000000000
    python bench/data.py loader --windows 100000000 10000 --seq-len 2048
    python bench/data.py randperm --n 10000000            # what the previous shuffle held

`permutation` times data/shuffle.py's `permute` per index, vectorized over a million indices and
per call at micro-batch sizes (and a three-source mixture's whole lookup per micro-batch), and
measures what one call allocates (tracemalloc peak) at several n.
`loader` writes synthetic datasets whose shard files are sparse (no data is written, the
tokens read back as zeros) with default-sized shards of 2^28 tokens, then in a fresh process per
corpus builds a rank's training loader (dp 8, micro-batch 4) and draws batches, reporting
VmRSS and its anonymous and file-backed parts (/proc/self/status) before and after, and the
sampler's time per batch. (Reading holes of a sparse file through mmap is slow on some
filesystems, milliseconds per window, so batch times here say nothing about real shards.)
`randperm` measures `torch.randperm(n).tolist()`, what each rank held per epoch before.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.shuffle import derive_key, permute  # noqa: E402
from data.stream import GlobalStream  # noqa: E402

SHARD_TOKENS = 2**28  # data.prepare's default --shard-tokens


def rss_mib() -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}


def bench_permutation(n: int) -> None:
    key = derive_key(0, "source", "bench", 0)
    chunk, chunks = 1_000_000, 20
    start = time.perf_counter()
    for c in range(chunks):
        permute(np.arange(c * chunk, (c + 1) * chunk) % n, n, key)
    per_index = (time.perf_counter() - start) / (chunk * chunks)
    print(f"n = {n:,}: {per_index * 1e9:.0f} ns per index over {chunks} x {chunk:,} indices")
    for batch in (1, 8, 64):
        calls = 2000
        start = time.perf_counter()
        for c in range(calls):
            permute(np.arange(c * batch, (c + 1) * batch) % n, n, key)
        per_call = (time.perf_counter() - start) / calls
        print(f"  micro-batch of {batch}: {per_call * 1e6:.0f} us per call")
    stream = GlobalStream({"a": n, "b": n // 10, "c": n // 100}, {"a": 6, "b": 3, "c": 1}, 0, True)
    start = time.perf_counter()
    for c in range(2000):
        stream.locate(np.arange(c * 8, (c + 1) * 8))
    per_call = (time.perf_counter() - start) / 2000
    print(f"  a mixture of 3 sources, micro-batch of 8: {per_call * 1e6:.0f} us per call")
    print("  tracemalloc peak of one call (bytes), by n:")
    for size in (10**3, 10**6, n, 10**12):
        for batch in (8, chunk):
            tracemalloc.start()
            permute(np.arange(batch) % size, size, key)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            print(f"    n = {size:.0e}, {batch:>9,} indices: {peak:>12,}")


def write_sparse_dataset(root: Path, windows: int, seq_len: int) -> Path:
    """index.json and sparse shards holding exactly `windows` training windows."""
    per_shard = (SHARD_TOKENS - 1) // seq_len
    shards = []
    for i in range(math.ceil(windows / per_shard)):
        n = min(per_shard, windows - i * per_shard)
        tokens = SHARD_TOKENS if n == per_shard else n * seq_len + 1
        path = root / f"train-{i:05d}.bin"
        with open(path, "wb") as f:
            f.truncate(2 * tokens)  # sparse: no blocks written
        shards.append({"file": path.name, "num_tokens": tokens})
    (root / "val-00000.bin").write_bytes(b"\0" * 2 * (seq_len + 1))
    byte = {"kind": "byte", "path": None, "vocab_size": 258, "eos_id": 257, "bos_id": 256}
    index = {"version": 1, "dtype": "uint16", "vocab_size": 258, "eos_id": 257, "bos_id": 256,
             "tokenizer": byte, "splits": {"train": shards, "val": [
                 {"file": "val-00000.bin", "num_tokens": seq_len + 1}]}}  # fmt: skip
    (root / "index.json").write_text(json.dumps(index))
    return root


def measure_loader(path: str, seq_len: int, batches: int) -> dict:
    """In this process: a rank's loader over `path`, RSS before, after building, after drawing
    `batches` batches; and the time the sampler takes per batch (the index arithmetic alone)."""
    import torch  # noqa: F401 - imported before the baseline, as the trainer has it

    from data.loader import DataConfig, build_dataloader

    before = rss_mib()
    loader = build_dataloader(DataConfig(path=path, seq_len=seq_len), "train", dp_rank=0,
                              dp_size=8, micro_batch_size=4, seed=0)  # fmt: skip
    built = rss_mib()
    it = iter(loader)
    for _ in range(batches):
        next(it)
    drawn = rss_mib()
    indices = iter(loader.batch_sampler)
    start = time.perf_counter()
    for _ in range(batches):
        next(indices)
    sampler_ms = (time.perf_counter() - start) / batches * 1e3
    windows = len(loader.dataset.sources[0])
    return {"windows": windows, "before": before, "built": built, "drawn": drawn,
            "sampler_ms": sampler_ms, "batches": batches}  # fmt: skip


def bench_loader(windows: list[int], seq_len: int, batches: int) -> None:
    print(f"| windows | shards | VmRSS before (anon / file) | after build | after {batches} "
          "batches (anon / file) | sampler ms per batch |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for w in windows:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_sparse_dataset(Path(tmp), w, seq_len)
            shards = len(json.loads((path / "index.json").read_text())["splits"]["train"])
            out = subprocess.run(
                [sys.executable, __file__, "_measure", str(path), str(seq_len), str(batches)],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            r = json.loads(out.splitlines()[-1])
        b, d = r["before"], r["drawn"]
        print(f"| {r['windows']:,} | {shards} | {b['VmRSS']:.0f} MiB ({b['RssAnon']:.0f} / "
              f"{b['RssFile']:.0f}) | {r['built']['VmRSS']:.0f} MiB | {d['VmRSS']:.0f} MiB "
              f"({d['RssAnon']:.0f} / {d['RssFile']:.0f}) | {r['sampler_ms']:.3f} |")  # fmt: skip


def bench_randperm(n: int) -> None:
    import torch

    before = rss_mib()["VmRSS"]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    print(f"torch.randperm({n:,}).tolist(): +{rss_mib()['VmRSS'] - before:,.0f} MiB RSS")
    del perm


def main() -> int:
    if sys.argv[1:2] == ["_measure"]:  # the child of `loader`
        path, seq_len, batches = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(measure_loader(path, seq_len, batches)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what")
    perm = sub.add_parser("permutation")
    perm.add_argument("--n", type=int, default=10**9)
    loader = sub.add_parser("loader")
    loader.add_argument("--windows", type=int, nargs="+", default=[100_000_000, 10_000])
    loader.add_argument("--seq-len", type=int, default=2048)
    loader.add_argument("--batches", type=int, default=500)
    randperm = sub.add_parser("randperm")
    randperm.add_argument("--n", type=int, default=10_000_000)
    a = p.parse_args()
    if a.what in (None, "permutation"):
        bench_permutation(getattr(a, "n", 10**9))
    if a.what in (None, "loader"):
        bench_loader(getattr(a, "windows", [100_000_000, 10_000]), getattr(a, "seq_len", 2048),
                     getattr(a, "batches", 500))  # fmt: skip
    if a.what == "randperm":
        bench_randperm(a.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
