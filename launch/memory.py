"""What the CUDA caching allocator holds after one step (`metrics.memory_snapshot_step`): which
stream and pool hold the memory that is reserved but not allocated, and how it is cut.

`reserved - allocated` is the allocator's cache: segments it got from cudaMalloc and keeps
for reuse. When it is large, the question is where: a pool of another stream (FSDP's
all-gather and reduce-scatter streams allocate in their own), small blocks (< 1 MiB) or large
ones, and whether the free memory is one block or splinters too small to reuse
(fragmentation, which `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` avoids). At the chosen
step every rank records the allocator's history (each allocation and free, with its stack) for
that step, then writes `<run dir>/memory/step{N}_rank{r}.pickle` (`torch.cuda.memory._snapshot`:
open it at pytorch.org/memory_viz) and `step{N}_rank{r}.txt`, the summary; rank 0 also logs it.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
GIB = 2**30


def summarize(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The snapshot's segments grouped by (stream, pool, size class), the group with the most
    memory reserved but not allocated first: segments, reserved, allocated and in-use-or-
    awaiting-free bytes, and the largest free ('inactive') block."""
    groups: dict[tuple, dict[str, Any]] = {}
    for seg in snapshot["segments"]:
        key = (seg["stream"], tuple(seg.get("segment_pool_id", (0, 0))), seg["segment_type"])
        group = groups.setdefault(key, {"stream": key[0], "pool": key[1], "kind": key[2],
                                        "segments": 0, "reserved": 0, "allocated": 0,
                                        "active": 0, "largest_free": 0})  # fmt: skip
        group["segments"] += 1
        group["reserved"] += seg["total_size"]
        group["allocated"] += seg["allocated_size"]
        group["active"] += seg.get("active_size", seg["allocated_size"])
        free = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        group["largest_free"] = max([group["largest_free"], *free])
    return sorted(groups.values(), key=lambda g: g["allocated"] - g["reserved"])


def summary_lines(step: int, groups: list[dict[str, Any]]) -> list[str]:
    reserved = sum(g["reserved"] for g in groups)
    allocated = sum(g["allocated"] for g in groups)
    cached = (reserved - allocated) / GIB
    lines = [f"memory after step {step}: reserved {reserved / GIB:.2f} GiB, allocated "
             f"{allocated / GIB:.2f} GiB, cached {cached:.2f} GiB"]  # fmt: skip
    for g in groups:
        lines.append(
            f"  stream {g['stream']} pool {g['pool']} {g['kind']}: {g['segments']} segments, "
            f"reserved {g['reserved'] / GIB:.2f} GiB, allocated {g['allocated'] / GIB:.2f} GiB, "
            f"cached {(g['reserved'] - g['allocated']) / GIB:.2f} GiB (largest free block "
            f"{g['largest_free'] / 2**20:.1f} MiB)"
        )
    return lines


@contextlib.contextmanager
def memory_snapshot(snapshot_step: int, step: int, run_dir: Path, rank: int) -> Iterator[None]:
    """Run the body (step `step`) with the allocator's history recorded when it is
    `snapshot_step`, then write the snapshot and its summary (see the module docstring)."""
    if step != snapshot_step:
        yield
        return
    if not torch.cuda.is_available():
        if rank == 0:
            logger.warning("metrics.memory_snapshot_step=%d: no CUDA device, no allocator to "
                           "snapshot", step)  # fmt: skip
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        yield
    finally:
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    out = run_dir / "memory"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step{step}_rank{rank}.pickle").write_bytes(pickle.dumps(snapshot))
    lines = summary_lines(step, summarize(snapshot))
    (out / f"step{step}_rank{rank}.txt").write_text("\n".join(lines) + "\n")
    if rank == 0:
        for line in lines:
            logger.info("%s", line)
        logger.info("memory snapshots of step %d written to %s", step, out)
