"""The launch layer as operators use it: torchrun agents as nodes, faults, Slurm, preflight.

Every "node" here is a torchrun agent on this machine (or, for Slurm, a slurmd in its own network
namespace), so the multi-node code paths run for real on CPU with gloo.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_train import TINY

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = f"{sys.executable} -m torch.distributed.run"
HSDP_2X2 = "mesh DeviceMesh((dp_replicate=2, dp_shard=2)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_args(dataset: str, out: Path, *extra: str) -> list[str]:
    return [
        f"--data.path={dataset}", f"--run.output_dir={out}", *TINY, "--parallel.mesh=auto",
        "--train.micro_batch_size=2", "--parallel.param_dtype=float32",
        "--parallel.timeout_s=30", *extra,
    ]  # fmt: skip


class Nodes:
    """Two torchrun agents started by launch/multinode.sh, one log file each."""

    def __init__(self, tmp: Path, args: list[str], max_restarts: int = 0, nnodes: int = 2):
        port = free_port()
        self.logs = [tmp / f"node{i}.log" for i in range(nnodes)]
        self.procs: list[subprocess.Popen] = []
        for i, log in enumerate(self.logs):
            env = os.environ | {
                "NNODES": str(nnodes), "NODE_RANK": str(i), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "NPROC": "2", "OMP_NUM_THREADS": "1",
                "MAX_RESTARTS": str(max_restarts), "TORCHRUN": TORCHRUN,
            }  # fmt: skip
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        ["launch/multinode.sh", *args],
                        cwd=ROOT,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                )

    def text(self) -> str:
        return "\n".join(log.read_text() for log in self.logs)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if match := re.search(pattern, self.text()):
                return match
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        pytest.fail(f"{pattern!r} not seen in {timeout} s:\n{self.text()[-4000:]}")

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [p.returncode for p in self.procs]

    def worker_pid(self, rank: int) -> int:
        """PID of the training process with this global RANK (a child of some agent)."""
        agents = {str(p.pid) for p in self.procs}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            if ppid in agents and f"RANK={rank}".encode() in environ:
                return int(stat.parent.name)
        raise AssertionError(f"no worker with RANK={rank} under agents {agents}")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def nodes():
    started: list[Nodes] = []

    def start(*args, **kwargs) -> Nodes:
        started.append(Nodes(*args, **kwargs))
        return started[-1]

    yield start
    for n in started:
        n.kill()


@pytest.mark.slow
def test_two_torchrun_agents_train_hsdp_2x2(tiny_dataset: str, tmp_path: Path, nodes) -> None:
    run = nodes(tmp_path, tiny_args(tiny_dataset, tmp_path, "--train.steps=4"))
    assert run.wait(timeout=120) == [0, 0], run.text()[-4000:]
    log = run.text()
    assert HSDP_2X2 in log, log[-4000:]
    assert "step 4  loss" in log


@pytest.mark.slow
def test_killed_worker_restarts_group_and_resumes(tiny_dataset: str, tmp_path: Path, nodes):
    """SIGKILL one rank mid-run: torchrun restarts every node's workers, which resume from the
    latest complete checkpoint (resume=auto) and reach the last step."""
    args = tiny_args(
        tiny_dataset, tmp_path, "--train.steps=40", "--checkpoint.interval=5",
        "--metrics.log_interval=5",
    )  # fmt: skip
    run = nodes(tmp_path, args, max_restarts=1)
    run.wait_for(r"checkpoint step 10:", timeout=90)
    os.kill(run.worker_pid(rank=3), signal.SIGKILL)
    assert run.wait(timeout=150) == [0, 0], run.text()[-4000:]
    log = run.text()
    resumed = re.search(r"resumed from \S+ \(all state, step (\d+)\)", log)
    assert resumed and int(resumed.group(1)) >= 10, log[-4000:]
    assert HSDP_2X2 in log and re.search(r"step 40  loss", log[resumed.end() :])


@pytest.mark.slow
def test_killed_worker_without_restarts_fails_fast(tiny_dataset: str, tmp_path: Path, nodes):
    """No restarts: every agent exits non-zero, well within the collective timeout, and the log
    names the killed rank."""
    args = tiny_args(tiny_dataset, tmp_path, "--train.steps=400", "--metrics.log_interval=5")
    run = nodes(tmp_path, args, max_restarts=0)
    run.wait_for(r"step 10  loss", timeout=90)
    os.kill(run.worker_pid(rank=3), signal.SIGKILL)
    start = time.monotonic()
    codes = run.wait(timeout=90)
    log = run.text()
    assert all(code != 0 for code in codes), (codes, log[-4000:])
    assert "rank      : 3" in log and "Signal 9 (SIGKILL)" in log, log[-4000:]
    print(f"failed {time.monotonic() - start:.1f} s after the kill")


# ---- Slurm: a real controller and two slurmd "nodes" in network namespaces (tests/slurm) -----

CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    """Bring up the test cluster; yields its bin/ folder (sbatch etc. wrappers)."""
    state = tmp_path_factory.mktemp("slurm")
    env = os.environ | {"SLURM_TEST_DIR": str(state), "SLURM_TEST_NAME": f"fsdp2t{os.getpid()}"}
    try:
        up = subprocess.run(
            [str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=300
        )
        if up.returncode == 3:
            pytest.skip(up.stderr.strip().splitlines()[-1])
        assert up.returncode == 0, up.stderr[-3000:]
        yield state / "bin"
    finally:
        subprocess.run([str(CLUSTER), "down"], env=env, capture_output=True, timeout=60)


def sbatch(bin_dir: Path, out: Path, args: list[str], timeout: float = 150, **env_vars: str) -> str:
    """Submit launch/hsdp.sbatch on 2 CPU nodes x 2 ranks and wait; returns the job's log."""
    env = os.environ | env_vars | {
        "NPROC_PER_NODE": "2", "TORCHRUN": str(Path(sys.executable).with_name("torchrun")),
        "MASTER_PORT": str(free_port()), "MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    cmd = [
        "timeout", str(timeout), str(bin_dir / "sbatch"), "--wait", "--nodes=2",
        "--cpus-per-task=1", "--gpus-per-node=0", f"--output={out}", "launch/hsdp.sbatch", *args,
    ]  # fmt: skip
    # `timeout` first: a job that cannot be scheduled pends forever and --wait with it.
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 30
    )
    log = out.read_text() if out.exists() else ""
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n{log[-4000:]}"
    return log


@pytest.mark.slow
def test_sbatch_hsdp_two_nodes_trains_checkpoints_and_resumes(
    slurm: Path, tiny_dataset: str, tmp_path: Path
) -> None:
    args = tiny_args(tiny_dataset, tmp_path, "--checkpoint.interval=2", "--train.steps=4")
    preflight = {"PREFLIGHT": "1", "PREFLIGHT_ARGS": "--size-mb=1 --iters=2"}
    log = sbatch(slurm, tmp_path / "first.out", args, **preflight)
    assert re.search(r"inter-node \(dp_replicate, 2 ranks, .*busbw", log), log[-4000:]
    assert re.search(r"node 1 \(node[12]\): ranks \[2, 3\]", log), log[-4000:]
    assert HSDP_2X2 in log and "step 4  loss" in log, log[-4000:]
    assert (tmp_path / "debug" / "checkpoints" / "step-4" / "COMPLETE").exists()

    log = sbatch(slurm, tmp_path / "second.out", [*args, "--train.steps=6"])
    assert re.search(r"resumed from \S+step-4 \(all state, step 4\)", log), log[-4000:]
    assert "step 6  loss" in log


# ---- launch/preflight.py ---------------------------------------------------------------------

NCCL_IB = """\
node1:2101:2101 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.1.0.1<0>
node1:2101:2190 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
node1:2101:2190 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
"""
NCCL_SOCKET = """\
node1:2101:2101 [0] NCCL INFO NET/IB : No device found.
node1:2101:2101 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.1<0>
node1:2101:2190 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0
"""


def test_nccl_log_warns_on_sockets_not_infiniband() -> None:
    from launch.preflight import read_nccl_log

    [ib] = read_nccl_log(NCCL_IB)
    assert ib.level == logging.INFO and "InfiniBand (NET/IB)" in ib.message
    [sock] = read_nccl_log(NCCL_SOCKET)
    assert sock.level == logging.WARNING and "sockets (NET/Socket)" in sock.message
    [none] = read_nccl_log("node1:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.1<0>\n")
    assert none.level == logging.WARNING and "NCCL_DEBUG=INFO" in none.message


def test_socket_ifname_must_name_an_interface_of_this_node() -> None:
    from launch.preflight import bus_bandwidth, missing_interfaces

    present = ["lo", "eth0", "ib0"]
    assert missing_interfaces({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth0"}, present)\
        == []  # fmt: skip
    assert missing_interfaces({"NCCL_SOCKET_IFNAME": "^docker,lo"}, present) == []
    [bad] = missing_interfaces({"NCCL_SOCKET_IFNAME": "=ib", "GLOO_SOCKET_IFNAME": "eth0"}, present)
    assert "NCCL_SOCKET_IFNAME==ib: no interface named 'ib'" in bad and "lo, eth0, ib0" in bad
    assert len(missing_interfaces({"GLOO_SOCKET_IFNAME": "bond0"}, present)) == 1
    algbw, busbw = bus_bandwidth(nbytes=4 * 10**9, seconds=2.0, ranks=8)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.5)  # x 2*7/8


@pytest.mark.slow
def test_preflight_on_four_ranks_split_as_two_nodes(tmp_path: Path) -> None:
    log = tmp_path / "nccl.log"
    log.write_text(NCCL_SOCKET)
    cmd = [
        *TORCHRUN.split(), "--standalone", "--nproc-per-node=4", "-m", "launch.preflight",
        "--nodes=2", "--size-mb=1", "--iters=2", f"--nccl-log={log}",
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stderr
    assert "2 node(s) x 2 ranks, gloo" in out and "node 1 (" in out and "ranks [2, 3]" in out
    assert re.search(r"intra-node \(dp_shard, 2 ranks, 1.0 MB\): algbw [\d.]+ GB/s, busbw", out)
    assert re.search(r"inter-node \(dp_replicate, 2 ranks, 1.0 MB\): algbw [\d.]+ GB/s", out)
    assert "sockets (NET/Socket), not InfiniBand" in out

    env["NCCL_SOCKET_IFNAME"] = "=nosuchif0"
    cmd = [*TORCHRUN.split(), "--standalone", "--nproc-per-node=2", "-m", "launch.preflight",
           "--size-mb=0.1", "--iters=1"]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert result.returncode != 0
    assert "NCCL_SOCKET_IFNAME==nosuchif0: no interface named 'nosuchif0'" in result.stderr


@pytest.mark.slow
def test_sbatch_preemption_signal_requeues_and_resumes(
    slurm: Path, tiny_dataset: str, tmp_path: Path
) -> None:
    """SIGUSR1 to the batch shell (what --signal=B:USR1@120 sends) requeues the job; the new run
    resumes from the latest checkpoint and finishes."""
    out = tmp_path / "job.out"
    args = tiny_args(
        tiny_dataset, tmp_path, "--checkpoint.interval=10", "--train.steps=40",
        "--metrics.log_interval=10",
    )  # fmt: skip
    env = os.environ | {
        "NPROC_PER_NODE": "2", "TORCHRUN": str(Path(sys.executable).with_name("torchrun")),
        "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    submit = [
        str(slurm / "sbatch"), "--parsable", "--nodes=2", "--cpus-per-task=1",
        "--gpus-per-node=0", f"--output={out}", "launch/hsdp.sbatch", *args,
    ]  # fmt: skip
    job = subprocess.run(
        submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()

    def slurm_cmd(*cmd: str) -> str:
        return subprocess.run(
            [str(slurm / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=30
        ).stdout.strip()

    def wait_until(check, what: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                log = out.read_text() if out.exists() else ""
                pytest.fail(f"{what} not seen in {timeout} s:\n{log[-4000:]}")
            time.sleep(0.3)

    try:
        log = lambda: out.read_text() if out.exists() else ""  # noqa: E731
        wait_until(lambda: "checkpoint step 20:" in log(), "checkpoint step 20")
        slurm_cmd("scancel", "--batch", "--signal=USR1", job)
        state = lambda: slurm_cmd("squeue", "-h", "-j", job, "-o", "%T")  # noqa: E731
        wait_until(lambda: state() == "PENDING", "the requeued job pending")
        # Slurm holds a requeued job back for two minutes; release it now.
        slurm_cmd("scontrol", "update", f"JobId={job}", "StartTime=now")
        wait_until(lambda: state() == "", "the requeued job's end", timeout=120)
    finally:
        slurm_cmd("scancel", job)
    text = log()
    assert f"SIGUSR1: requeueing job {job}" in text, text[-4000:]
    resumed = re.search(r"resumed from \S+ \(all state, step (\d+)\)", text)
    assert resumed and int(resumed.group(1)) >= 20, text[-4000:]
    assert "step 40  loss" in text[resumed.end() :]
