"""Run a function on N real gloo ranks on CPU, the way torchrun would start them.

    results = run_distributed(my_check, world_size=4, nodes=2)  # HSDP-shaped: 2 "nodes" x 2

Ranks are separate processes with torchrun's environment variables, so the code under test
(train.py, parallel/) takes its normal env:// path. A rank that raises fails the test with its
traceback; a hang fails it after `timeout` seconds instead of blocking CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("forkserver")
# The fork server imports torch once; each rank forks from it instead of re-importing (~2 s).
# Dynamo and Inductor too: train.py does not import them, but every training step does (FSDP2
# and the compile checks reach them), ~1 s a rank. Then tests.forkserver_preload freezes the
# heap those imports made, which no rank's garbage collections need to walk.
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch._inductor",
                             "train", "tests.forkserver_preload"])  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    nodes: int,
    port: int,
    queue: Any,
    all_reported: Any,
    args: tuple,
    env: dict[str, str],
) -> None:
    local_world = world // nodes
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
        GROUP_WORLD_SIZE=str(nodes),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        # Plain pickle copies tensors by value; the queue's own pickler would pass shared
        # memory handles that vanish when this process exits.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - report anything, including SystemExit
        queue.put((rank, False, traceback.format_exc()))
    if rank == 0:
        # Rank 0 hosts the TCPStore. A function that ends without a last collective (e.g. one
        # that only builds a mesh) would otherwise let rank 0 exit, and take the store with it,
        # while another rank still waits on it: "Broken pipe" there.
        all_reported.wait(timeout=600)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    nodes: int = 1,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; returns each rank's result, by rank.

    `fn` must be importable (module level) and its result picklable.
    """
    port = _free_port()
    queue, all_reported = _CTX.Queue(), _CTX.Event()
    procs = [
        _CTX.Process(
            target=_worker,
            args=(fn, r, world_size, nodes, port, queue, all_reported, args, env or {}),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break  # the others may now wait forever on a collective
    except Exception as exc:  # queue.Empty: a rank hung or died without reporting
        errors.append(
            f"ranks {sorted(set(range(world_size)) - set(results))} did not finish "
            f"within {timeout:.0f}s ({type(exc).__name__})"
        )
    finally:
        all_reported.set()
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
