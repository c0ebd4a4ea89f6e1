"""Elastic restarts (launch/elastic.py): a lost node, and the run going on with the nodes left.

The quick test checks the mesh choice and the refusal in this process; the slow one is the
operator's case for real: two torchrun agents on this machine, each a "node" of 2 gloo ranks,
rendezvousing with --nnodes=1:2, and one of them killed with kill -9 mid-run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpoint.state import read_progress
from configs import ConfigError, parse_config
from launch import elastic
from launch.elastic import Mesh, choose_mesh, mesh_for_world, restart_line, unfit_node_counts
from launch.job import JobConfig
from model import get_family
from parallel.dims import LaunchEnv
from tests.distributed import run_distributed
from tests.test_families import scalars
from tests.test_launch import (
    HSDP_2X2,
    TORCHRUN,
    Launched,
    alive,
    free_port,
    last_logged_step,
    tiny_args,
)
from tests.test_train import TINY, assert_close, train_losses


def env(nodes: int, per_node: int = 2) -> LaunchEnv:
    return LaunchEnv(0, 0, nodes * per_node, per_node, nodes)


def test_the_mesh_follows_the_nodes_left_with_the_same_global_batch(monkeypatch) -> None:
    """mesh=auto on 2 nodes x 2 ranks, then 1 node: dp_replicate 2 -> 1, dp_shard stays in the
    node, grad accumulation 1 -> 2. Three nodes of 2 cannot hold a global batch of 16 in
    micro-batches of 2: one line names the nodes left and what would fit."""
    job = parse_config(JobConfig, [*TINY, "--parallel.mesh=auto", "--train.micro_batch_size=2"])
    family = get_family(job.model.name)
    args = family.build_args(job.model)
    four, two = choose_mesh(job, family, args, env(2)), choose_mesh(job, family, args, env(1))
    assert four == Mesh(4, 2, 2, 2, 1) and two == Mesh(2, 1, 1, 2, 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_line(four, two, 12) == (
        "world 4 -> 2 after a restart: dp_replicate 2 -> 1, grad accumulation 1 -> 2, "
        "resumed from step 12"
    )
    assert restart_line(four, four, 12) is None
    # The checkpoint's world was 4 nodes; 3 are left.
    monkeypatch.setattr(elastic, "saved_mesh", lambda job: Mesh(8, 4, 4, 2, 1))
    job.train.global_batch_size = 16
    with pytest.raises(ConfigError) as refused:
        mesh_for_world(job, family, args, env(3))
    assert str(refused.value) == (
        "world 8 -> 6 after a restart (3 node(s) left of 4, 2 ranks each; the run fits on 1, 2 "
        "or 4 node(s)): train.global_batch_size (16) must be a multiple of "
        "train.micro_batch_size (2) x data-parallel ranks (6)"
    )
    # At launch with NNODES=1:4, the node counts a restart could not go on with: a warning.
    assert unfit_node_counts(job, family, args, env(4), min_nodes=1) == (
        "nodes 1:4: a restart on 3 node(s) would stop instead of training with another batch "
        "(on 3: train.global_batch_size (16) must be a multiple of train.micro_batch_size (2) x "
        "data-parallel ranks (6))"
    )
    assert unfit_node_counts(job, family, args, env(2), min_nodes=1) is None
    job.train.global_batch_size = 18  # 6 ranks hold it in micro-batches of 1
    with pytest.raises(ConfigError, match=r"or here with train.micro_batch_size=1\)"):
        mesh_for_world(job, family, args, env(3))
    # A fixed mesh does not follow the world: the line says what would.
    fixed = parse_config(JobConfig, [*TINY, "--parallel.dp_replicate=2", "--parallel.dp_shard=2"])
    with pytest.raises(ConfigError, match=r"world 8 -> 2 .* fits on no number of such nodes"):
        mesh_for_world(fixed, family, args, env(1))


def test_a_stop_signal_is_a_lost_node_only_when_the_launcher_is_gone(monkeypatch) -> None:
    """SIGTERM from a live launcher is a requested stop (exit 0 after saving); the same signal
    once the launcher is gone (PR_SET_PDEATHSIG) is a lost node (exit 3, a restart), and its
    repeats are the kernel's, never the third signal that exits at once."""
    from launch.lifecycle import STOP_SIGNALS, StopRequest

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    launcher = subprocess.Popen(["sleep", "60"])
    try:
        # As if that process had started this rank: the kernel re-parents a rank whose
        # launcher died (getppid changes); until then the launcher is a zombie or gone.
        monkeypatch.setattr(os, "getppid", lambda: launcher.pid)
        stop = StopRequest()
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and not stop.launcher_lost
        launcher.kill()
        launcher.wait()
        assert stop.launcher_lost
        # More SIGTERMs from the same death (PR_SET_PDEATHSIG fires once per launcher thread
        # the rank is re-parented through): not a third signal that exits at once.
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.launcher_lost
        os.kill(os.getpid(), signal.SIGINT)  # a user's second signal still counts
        with pytest.raises(SystemExit, match="130"):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        launcher.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def store_host(port: int, agents: list[int], timeout: float) -> int:
    """Which of the `agents` (PIDs) hosts the rendezvous store: the one listening on `port`.
    The first agent to bind it hosts it; the others are its clients."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in Path(table).read_text().splitlines()[1:]:
                cols = row.split()
                if cols[1].endswith(f":{port:04X}") and cols[3] == "0A":  # 0A: LISTEN
                    listening.add(f"socket:[{cols[9]}]")
        for pid in agents:
            try:
                fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
            except OSError:
                continue
            if listening & set(fds):
                return pid
        time.sleep(0.2)
    pytest.fail(f"no agent of {agents} listens on port {port} after {timeout} s")


RESTART_LINE = re.compile(
    r"world 4 -> 2 after a restart: dp_replicate 2 -> 1, grad accumulation 1 -> 2, "
    r"resumed from step (\d+)"
)


def children(agent: int, launched: Launched) -> dict[int, int]:
    """{RANK: PID} of the workers of one agent."""

    def parent(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]

    return {rank: pid for rank, pid in launched.worker_pids().items() if parent(pid) == str(agent)}


def node_env(port: int) -> dict[str, str]:
    return {
        "NNODES": "1:2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NPROC": "2",
        "MAX_RESTARTS": "1", "TORCHRUN": TORCHRUN,
        # A restart waits for the dead agent's heartbeat to expire (keep_alive_interval x
        # keep_alive_max_attempt, default 5 x 3 s), then last_call_timeout (default 30 s) for
        # nodes beyond the minimum (docs/launch.md).
        "RDZV_CONF": "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
    }  # fmt: skip


@pytest.mark.slow
def test_kill_9_of_an_agent_goes_on_as_world_2_with_the_same_global_batch(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Two agents of 2 ranks (--nnodes=1:2); B's torchrun is killed (kill -9) after the step-10
    checkpoint. Its ranks, and A's with them, finish the step in flight and save it, then exit
    non-zero; A restarts its workers as a world of 2 (mesh 1 x 2, accumulation 2), resumes that
    step and finishes; no rank outlives its run. After the restart, the losses are those of a
    2-rank run resumed from the same checkpoint, and the data position ends where it must."""
    steps = 30
    args = tiny_args(
        tiny_dataset, tmp_path, f"--train.steps={steps}", "--checkpoint.interval=5",
        "--checkpoint.keep_last=0", "--metrics.log_interval=1", "--metrics.tensorboard=true",
    )  # fmt: skip
    port = free_port()
    cmd = ["launch/multinode.sh", *args]
    both = Launched([tmp_path / "node0.log", tmp_path / "node1.log"], [cmd] * 2,
                    [node_env(port)] * 2)  # fmt: skip
    try:
        # The node that hosts the rendezvous store must outlive the others (docs/launch.md):
        # B is the other one.
        host = store_host(port, [p.pid for p in both.procs], timeout=60)
        a, b = sorted(both.procs, key=lambda p: p.pid != host)
        both.wait_for(r"checkpoint step 10:", timeout=120)
        assert HSDP_2X2 in both.text(), both.text()[-3000:]
        b_ranks = children(b.pid, both)
        assert len(b_ranks) == 2, b_ranks
        killed = time.monotonic()
        os.kill(b.pid, signal.SIGKILL)
        resumed = both.wait_for(RESTART_LINE.pattern, timeout=120)
        restart_s = time.monotonic() - killed
        assert a.wait(timeout=120) == 0, both.text()[-4000:]
        # B's ranks saved with the others, then exited: none is left behind.
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in b_ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in b_ranks.values()), b_ranks
    finally:
        both.end()
    log = both.text()
    step = int(resumed.group(1))
    assert f"a node's launcher died: step {step} saved" in log, log[-3000:]
    assert step >= 10 and re.search(rf"step {steps}/{steps}  loss", log[resumed.end() :])
    print(f"agent lost: step {step} saved, resumed there as world 2 {restart_s:.1f} s after "
          "the kill")  # fmt: skip
    # The same run: after the restart, the losses of a 2-rank run resumed from that checkpoint.
    ckpt = tmp_path / "debug" / "checkpoints" / f"step-{step}"
    ref_args = [*args, "--run.name=reference", f"--checkpoint.resume={ckpt}",
                "--metrics.tensorboard=false"]  # fmt: skip
    reference = run_distributed(train_losses, 2, ref_args)[0]
    logged = scalars(tmp_path / "debug")["loss/train"]
    assert len(logged) == steps
    assert_close(logged[step:], reference, rtol=1e-6)
    # Its data position: every sample of the global stream once, 8 per step on either world.
    assert read_progress(tmp_path / "debug" / "checkpoints" / f"step-{steps}") == (steps, steps * 8)


GREW = re.compile(
    r"world 2 -> 4 since the checkpoint: dp_replicate 1 -> 2, grad accumulation 2 -> 1, "
    r"resumed from step (\d+)"
)


@pytest.mark.slow
@pytest.mark.drill
def test_a_node_that_joins_then_dies_whole(tiny_dataset: str, tmp_path: Path) -> None:
    """Growing back, then a node lost whole. A starts alone (world 2); B joins: torchrun
    restarts A's workers to admit it (they save the step in flight) and the run goes on as
    world 4. Then B's agent and ranks are killed at once: A's ranks fail their next collective,
    and A goes on as world 2 from the newest periodic checkpoint, redoing at most
    checkpoint.interval steps. A stop signal ends the (long) run."""
    args = tiny_args(
        tiny_dataset, tmp_path, "--train.steps=100000", "--checkpoint.interval=5",
        "--checkpoint.keep_last=2", "--metrics.log_interval=1",
    )  # fmt: skip
    port, cmd = free_port(), ["launch/multinode.sh", *args]
    a = Launched([tmp_path / "nodeA.log"], [cmd], [node_env(port)])
    b = None
    try:
        a.wait_for(r"step 3/\d+  loss", timeout=120)  # alone: B is not even started
        b = Launched([tmp_path / "nodeB.log"], [cmd], [node_env(port)])
        # Rank 0 of world 4 may be on either node: both logs.
        deadline = time.monotonic() + 120
        while not (grew := GREW.search(a.text() + b.text())):
            assert time.monotonic() < deadline, (a.text() + b.text())[-3000:]
            time.sleep(0.2)
        # A checkpoint of world 4 first, so that the loss is of a node of a running world 4.
        while max(map(int, re.findall(r"checkpoint step (\d+):", a.text() + b.text()))) <= int(
            grew.group(1)
        ):
            assert time.monotonic() < deadline, (a.text() + b.text())[-3000:]
            time.sleep(0.1)
        b_ranks = children(b.procs[0].pid, b)
        assert len(b_ranks) == 2, (b_ranks, (a.text() + b.text())[-3000:])
        for pid in [b.procs[0].pid, *b_ranks.values()]:
            os.kill(pid, signal.SIGKILL)
        last_before = last_logged_step(a.text() + b.text())
        resumed = a.wait_for(RESTART_LINE.pattern, timeout=120)
        a.wait_for(rf"step {int(resumed.group(1)) + 2}/\d+  loss", timeout=60)
        os.kill(a.procs[0].pid, signal.SIGTERM)  # a requested stop: the ranks save and exit 0
        a.wait(timeout=60)
        stopped = re.search(r"stopped by SIGTERM after step (\d+)", a.text()[resumed.end() :])
        assert stopped, a.text()[-3000:]
        assert not any(alive(pid) for pid in b_ranks.values()), b_ranks
    finally:
        a.end()
        if b:
            b.end()
    step = int(resumed.group(1))
    assert step % 5 == 0 and 0 <= last_before - step <= 5, (step, last_before)
    assert "a node's launcher died" not in a.text() + b.text()
    assert (tmp_path / "debug" / "checkpoints" / f"step-{stopped.group(1)}" / "COMPLETE").exists()
    print(f"grew to world 4 at step {grew.group(1)}; node lost after step {last_before}, "
          f"resumed as world 2 from step {step}")  # fmt: skip


def test_a_restart_on_the_shared_store_is_said_and_a_fresh_store_is_not() -> None:
    """torchrun's defaults (TORCHELASTIC_USE_AGENT_STORE=True): a warning at the first start
    when restarts are allowed, and one line for a restarted worker; with a fresh store per
    restart (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: USE_AGENT_STORE=False) or no restarts,
    nothing."""
    from launch.elastic import shared_store_problem, shared_store_warning

    first = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
             "TORCHELASTIC_MAX_RESTARTS": "3"}  # fmt: skip
    again = first | {"TORCHELASTIC_RESTART_COUNT": "2"}
    assert shared_store_problem(first) is None
    assert "--max-restarts=3 shares its rendezvous store" in shared_store_warning(first)
    problem = shared_store_problem(again)
    assert problem.startswith("torchrun restarted the workers (restart 2 of 3) on the rendezvous")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem
    for fresh in ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, {"TORCHELASTIC_MAX_RESTARTS": "0"}):
        assert shared_store_warning(first | fresh) is None
    assert shared_store_problem(again | {"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert shared_store_warning(again) is None  # the restarted workers say the problem
    assert shared_store_problem({}) is None and shared_store_warning({}) is None
