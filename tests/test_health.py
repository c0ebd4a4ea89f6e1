"""Hangs and stragglers (launch/health.py, launch/hangs.py): a frozen rank and a slow rank are
named by the run itself, on real gloo ranks."""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from launch.hangs import report
from launch.health import (
    HealthConfig,
    Heartbeat,
    StragglerMeter,
    collective_failure,
    collective_kind,
    hang_line,
    lagging_ranks,
    read_heartbeats,
    slowest_rank,
)
from tests.distributed import run_distributed
from tests.test_launch import ROOT, alive, launch, tiny_args  # noqa: F401 - launch: fixture
from tests.test_train import TINY


def raised_in(filename: str, function: str, message: str) -> RuntimeError:
    """An error raised from `function` defined in `filename` (as torch's frames would be)."""
    code = compile(f"def {function}():\n    raise RuntimeError({message!r})\n", filename, "exec")
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - a two-line function of ours
    try:
        namespace[function]()
    except RuntimeError as err:
        return err
    raise AssertionError("not raised")


def test_heartbeats_advance_and_name_the_rank_behind(tmp_path: Path) -> None:
    ours = Heartbeat(tmp_path, 0, interval_s=0.05).start()
    frozen = Heartbeat(tmp_path, 1, interval_s=0.05).start()
    frozen.beat(5, "forward")
    ours.beat(5, "forward")
    time.sleep(0.2)
    frozen.stop("running")  # its thread stops writing, as a SIGSTOP would stop it
    first = read_heartbeats(tmp_path)[0]["updated"]
    time.sleep(0.2)
    beats = read_heartbeats(tmp_path)
    assert beats[0]["updated"] > first  # advancing while the loop is in one phase
    assert (beats[1]["step"], beats[1]["phase"]) == (5, "forward")
    gloo = "Timed out waiting 30000ms for recv operation to complete"
    err = raised_in(f"/x/torch{os.sep}distributed/distributed_c10d.py", "all_gather_single", gloo)
    line = hang_line(err, ours, world_size=3, timeout_s=30)
    assert line.startswith(
        "hang: rank 0 at step 5 (forward) timed out after 30 s in all-gather; behind: "
    ) and line.endswith("rank 2 wrote no heartbeat"), line
    # Rank 1's file is fresh and at our step: not named; rank 2 never wrote one. (The line
    # above reads the clock: a test machine stalled for a second would find rank 1 stale.)
    written = beats[1]["updated"]  # rank 1 writes no more
    assert lagging_ranks(read_heartbeats(tmp_path), 0, 5, 3, 0.05, written + 0.2) == [
        "rank 2 wrote no heartbeat"
    ]
    # A stale file (older than 2 x interval + 1 s) or an earlier step names the rank. The
    # times are given, not read from the clock: a stalled test machine must not change them.
    assert lagging_ranks(read_heartbeats(tmp_path), 0, 5, 2, 1.0, written + 31) == [
        "rank 1 last reported step 5 (forward) 31 s ago"
    ]
    assert lagging_ranks(read_heartbeats(tmp_path), 0, 5, 2, 1.0, written + 2.9) == []
    assert lagging_ranks(read_heartbeats(tmp_path), 0, 6, 2, 1.0, written + 0.2) == [
        "rank 1 last reported step 5 (forward) 0 s ago"
    ]
    ours.beat(6, "forward")
    assert re.search(r"behind: rank 1 last reported step 5 \(forward\) \d+ s ago$",
                     hang_line(err, ours, 2, 30))  # fmt: skip
    ours.stop("finished")
    assert read_heartbeats(tmp_path)[0]["state"] == "finished"


def test_the_collective_and_the_failure_are_read_from_the_error(tmp_path: Path) -> None:
    fsdp = f"/x/torch{os.sep}distributed/fsdp/_fully_shard/_fsdp_collectives.py"
    assert collective_kind(raised_in(fsdp, "foreach_reduce_scatter", "x")) == "reduce-scatter"
    assert collective_kind(raised_in("/x/train.py", "all_reduce", "x")) == "a collective"
    assert (
        collective_failure(RuntimeError("Connection closed by peer [127.0.0.1]")) == "lost a peer"
    )
    assert collective_failure(RuntimeError("shapes do not match")) is None
    # DTensor's collectives wait outside torch.distributed's frames: the recorder's last one.
    dump = tmp_path / "rank_0"
    dump.write_bytes(pickle.dumps({"entries": [{"profiling_name": "nccl:_allgather_base"}]}))
    assert collective_kind(raised_in("/x/train.py", "step", "x"), dump) == "all-gather"
    closed = raised_in(
        "/x/torch/distributed/distributed_c10d.py", "barrier", "Connection closed by peer"
    )
    line = hang_line(closed, Heartbeat(Path(), 2, 0), 4, 30)
    assert line.startswith("peer lost: rank 2 at step 0 (setup) lost a peer in barrier; no heart")


def test_a_straggler_is_judged_against_the_other_ranks(caplog: pytest.LogCaptureFixture) -> None:
    """With 2 ranks, a rank doing 3x its peer's work is 3x the others' median (everyone's
    median, the mean of the two, would make it 1.5x: the factor's edge). Equal ranks are not
    stragglers; the warning comes at the intervals-th interval in a row, from rank 0 only."""
    assert slowest_rank([0.1, 0.3]) == (1, 0.1)
    assert slowest_rank([0.1] * 7 + [0.2]) == (7, pytest.approx(0.1))
    assert slowest_rank([0.25, 0.1, 0.3, 0.1]) == (2, 0.1)
    cfg = HealthConfig()  # factor 1.5, 3 intervals
    meters = [StragglerMeter(cfg, torch.device("cpu"), rank, 2) for rank in (0, 1)]
    with caplog.at_level(logging.WARNING, logger="launch.health"):
        for own in ([0.2, 0.2], [0.1, 0.3], [0.1, 0.3], [0.1, 0.3]):
            slowest, median = slowest_rank(own)
            for meter in meters:
                meter._track(slowest, own[slowest], median)
    warned = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(
        "straggler: rank 1 works 0.300 s per step, 3.0x the others' median 0.100 s, for 3 log"
    ), warned


def test_bad_health_settings_are_config_errors() -> None:
    from configs import ConfigError

    with pytest.raises(ConfigError, match="straggler_factor must be > 1"):
        HealthConfig(straggler_factor=1.0)
    with pytest.raises(ConfigError, match="step_timeout_s must be in 1..timeout_s"):
        from parallel.dims import ParallelConfig

        ParallelConfig(timeout_s=30, step_timeout_s=60)


@pytest.mark.slow
def test_a_frozen_rank_is_named_and_the_run_exits_without_orphans(
    tiny_dataset: str,
    tmp_path: Path,
    launch,  # noqa: F811
) -> None:
    """SIGSTOP one of 2 ranks: the other ends with one line naming it, within the steady-state
    timeout + 15 s; the launcher exits 1, no traceback, and the frozen rank is gone (SIGKILLed
    1 s after the failure: FAILURE_GRACE_S, 5 by default)."""
    args = tiny_args(tiny_dataset, tmp_path, "--train.steps=4000", "--metrics.log_interval=1",
                     "--parallel.step_timeout_s=6", "--health.heartbeat_interval_s=1",
                     "--parallel.device=cpu")  # fmt: skip
    run = launch.single(tmp_path / "run.log", args, FAILURE_GRACE_S="1")
    run.wait_for(r"step 3/\d+  loss", timeout=120)
    frozen = run.worker_pid(rank=1)
    os.kill(frozen, signal.SIGSTOP)
    stopped = time.monotonic()
    codes = run.wait(timeout=60)
    elapsed = time.monotonic() - stopped
    log = run.text()
    assert codes == [1], (codes, log[-3000:])
    # torch 2.11's agent keeps torchrun's 30 s before SIGKILL (launch/agent.py).
    grace = 15 if "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters else 35
    assert elapsed < 6 + grace, elapsed
    assert not alive(frozen)
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "hang:" in line]
    # The step's phases, or "log": at log_interval=1 rank 0 may wait in the straggler all-gather.
    pattern = (r"\[rank0\] ERROR hang: rank 0 at step (\d+) \((forward|backward|optimizer|log)\) "
               r"timed out after 6 s in (all-gather|reduce-scatter|all-reduce); behind: "
               r"rank 1 last reported step (\d+) \(\w+\) (\d+) s ago$")  # fmt: skip
    assert len(lines) == 1 and (m := re.search(pattern, lines[0])), log[-3000:]
    # Named because its file is stale (older than 2 x 1 s + 1 s); not the full 6 s: rank 0 may
    # have started waiting for rank 1 a moment before the SIGSTOP.
    assert int(m[4]) <= int(m[1]) and int(m[5]) > 3, lines[0]
    # Afterwards, the run folder says it too.
    summary = "\n".join(report(tmp_path / "debug"))
    assert "rank 1 last reported step" in summary and "no dump from rank(s) 1" in summary
    assert json.loads((tmp_path / "debug/heartbeat/rank_0.json").read_text())["state"].startswith(
        "failed: hang: rank 0"
    )
    print(f"frozen rank named, launcher exited {elapsed:.1f} s after SIGSTOP")


SLOW_RANK, SLOW_STEPS = 1, range(3, 11)


def train_with_a_slow_rank(argv: list[str]) -> list[str]:
    """train.main on this rank, rank 1 sleeping 0.15 s in each step's data phase; returns the
    warnings logged (a handler of ours: tests/distributed.py captures no output)."""
    import train
    from data import documents

    rank = int(os.environ["RANK"])
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("launch.health").addHandler(handler)
    calls = iter(range(10**6))

    def slow_batch(*args, **kwargs):
        # Two micro-batches per step (global 8 = 2 ranks x 2 x 2 accumulation).
        if rank == SLOW_RANK and next(calls) // 2 + 1 in SLOW_STEPS:
            time.sleep(0.15)
        return documents.batch_on_device(*args, **kwargs)

    train.batch_on_device = slow_batch
    assert train.main(argv) == 0
    assert "wandb" not in sys.modules  # metrics.wandb=false: never imported
    return seen


@pytest.mark.slow
def test_a_rank_slowed_by_a_sleep_is_named_as_the_straggler(
    tiny_dataset: str, tmp_path: Path
) -> None:
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.steps=12", "--metrics.log_interval=2", "--metrics.tensorboard=true",
            "--health.straggler_intervals=2", "--train.micro_batch_size=2",
            "--parallel.device=cpu"]  # fmt: skip
    warnings = run_distributed(train_with_a_slow_rank, 2, argv)
    assert any(re.match(r"straggler: rank 1 works .* for [2-4] log intervals in a row", w)
               for w in warnings[0]), warnings  # fmt: skip
    assert not any("straggler" in w for w in warnings[1])  # rank 0 says it, once
    scalars = tensorboard_scalars(tmp_path / "debug" / "tensorboard")
    slowest = dict(scalars["straggler/slowest_rank"])
    assert all(slowest[step] == SLOW_RANK for step in (4, 6, 8, 10)), slowest
    lag = dict(scalars["straggler/lag_s"])
    # 0.3 s of sleep per step against the other rank's work; none after step 10, where what
    # is left is the two ranks' noise (a stall of the loaded test machine included).
    slept = min(lag[step] for step in (4, 6, 8, 10))
    assert slept > 0.1 and lag[12] < 0.5 * slept, lag
    assert "straggler/data_wait_max" in scalars


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


@pytest.mark.slow
def test_hangs_cli_names_the_rank_behind_in_the_dumps(tmp_path: Path) -> None:
    """Recorded dumps (2 gloo ranks, rank 1 one collective short) read by the CLI."""
    run_distributed(record_and_dump, 2, str(tmp_path), env={"TORCH_FR_BUFFER_SIZE": "64"})
    out = subprocess.run([sys.executable, "-m", "launch.hangs", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"rank 1 is behind at #2 all_reduce \[\[3\]\]; others reached #3 barrier", out.stdout
    )


def record_and_dump(run_dir: str) -> None:
    """Two collectives on both ranks, a third that rank 1 never joins: rank 0 times out in it
    and dumps, as train.py does; rank 1 dumps what it has."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from launch.health import dump_flight_recorder

    # The 1 s timeout on a group of its own: on the default group it would also bound the
    # ranks' rendezvous, which a loaded machine can delay past it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    dist.all_reduce(torch.ones(2), group=group)
    dist.all_reduce(torch.ones(3), group=group)
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="Timed out"):
            dist.barrier(group=group)
    dump_flight_recorder(Path(run_dir), dist.get_rank())
    # Rank 1 holds the group (and stays alive) until rank 0 has timed out and dumped: were it
    # to close the group's connections first, rank 0 would fail on a reset, not time out.
    dist.barrier()
