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
HSDP_2X2 = "mesh DeviceMesh((dp_replicate=2, dp_shard=2, cp=1, tp=1)"
# The environment's bin/ first on PATH, as after `source .venv/bin/activate`: the launchers find
# torchrun and python there.
ENV = os.environ | {
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "OMP_NUM_THREADS": "1",
}
# What the trainer logs: "resuming <run>/checkpoints/step-12 at step 12 of 40", and where it
# stopped on a signal: "stopped by SIGTERM after step 12/400".
RESUMING = re.compile(r"resuming \S+step-(\d+) at step (\d+) of \d+")
STOPPED = re.compile(r"stopped by (SIG\w+) after step (\d+)/\d+")


def step_logged(step: int, log: str) -> bool:
    return re.search(rf"step {step}/\d+  loss", log) is not None


def last_logged_step(log: str) -> int:
    return max((int(s) for s in re.findall(r"step (\d+)/\d+  loss", log)), default=0)


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


class Launched:
    """Launch scripts started in the background, each in a session of its own, one log each."""

    def __init__(self, logs: list[Path], cmds: list[list[str]], envs: list[dict[str, str]]):
        self.logs = logs
        self.procs: list[subprocess.Popen] = []
        for log, cmd, env in zip(logs, cmds, envs, strict=True):
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=ENV | env, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            self.procs.append(proc)

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

    def worker_pids(self) -> dict[int, int]:
        """{global RANK: PID} of the training processes, the children of the agents."""
        agents = {str(p.pid) for p in self.procs}
        found = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            ranks = [v for v in environ if v.startswith(b"RANK=")]
            if ppid in agents and ranks:
                found[int(ranks[0][5:])] = int(stat.parent.name)
        return found

    def worker_pid(self, rank: int) -> int:
        """PID of the training process with this global RANK (a child of some agent)."""
        pids = self.worker_pids()
        assert rank in pids, f"no worker with RANK={rank} under agents {self.procs}"
        return pids[rank]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def end(self) -> None:
        """Kill the agents' sessions, then any worker that outlived them."""
        stragglers = self.worker_pids().values()
        self.kill()
        for pid in stragglers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def launch():
    """launch.nodes(tmp, args, ...): launch/multinode.sh as `nnodes` agents on 127.0.0.1;
    launch.single(log, args, **env): launch/torchrun.sh. Whatever is left is killed after."""
    started: list[Launched] = []

    class Start:
        @staticmethod
        def nodes(tmp: Path, args: list[str], max_restarts: int = 0, nnodes: int = 2,
                  nproc: int = 2, **env: str) -> Launched:  # fmt: skip
            port = free_port()
            envs = [env | {
                "NNODES": str(nnodes), "NODE_RANK": str(i), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "NPROC": str(nproc), "MAX_RESTARTS": str(max_restarts),
                "TORCHRUN": TORCHRUN,
            } for i in range(nnodes)]  # fmt: skip
            logs = [tmp / f"node{i}.log" for i in range(nnodes)]
            started.append(Launched(logs, [["launch/multinode.sh", *args]] * nnodes, envs))
            return started[-1]

        @staticmethod
        def single(log: Path, args: list[str], **env: str) -> Launched:
            started.append(Launched([log], [["launch/torchrun.sh", *args]], [{"NPROC": "2"} | env]))
            return started[-1]

    yield Start
    for run in started:
        run.end()


@pytest.mark.slow
@pytest.mark.drill  # two agents train HSDP 2x2 by default in test_elastic.py and under sbatch
def test_two_torchrun_agents_train_hsdp_2x2(tiny_dataset: str, tmp_path: Path, launch) -> None:
    run = launch.nodes(tmp_path, tiny_args(tiny_dataset, tmp_path, "--train.steps=4"))
    assert run.wait(timeout=120) == [0, 0], run.text()[-4000:]
    log = run.text()
    assert HSDP_2X2 in log, log[-4000:]
    assert step_logged(4, log)


@pytest.mark.drill  # one node's restart runs by default (test_torchrun_sh_restarts_a_killed...)
def test_killed_worker_restarts_group_and_resumes(tiny_dataset: str, tmp_path: Path, launch):
    """SIGKILL one rank mid-run: torchrun restarts every node's workers, which resume from the
    latest complete checkpoint (resume=auto) and reach the last step."""
    args = tiny_args(
        tiny_dataset, tmp_path, "--train.steps=40", "--checkpoint.interval=5",
        "--metrics.log_interval=5",
    )  # fmt: skip
    run = launch.nodes(tmp_path, args, max_restarts=1)
    run.wait_for(r"checkpoint step 10:", timeout=90)
    os.kill(run.worker_pid(rank=3), signal.SIGKILL)
    assert run.wait(timeout=150) == [0, 0], run.text()[-4000:]
    log = run.text()
    resumed = RESUMING.search(log)
    assert resumed and int(resumed.group(2)) >= 10, log[-4000:]
    assert HSDP_2X2 in log and step_logged(40, log[resumed.end() :])


@pytest.mark.slow
def test_killed_worker_without_restarts_fails_fast(tiny_dataset: str, tmp_path: Path, launch):
    """No restarts: every agent exits non-zero, well within the collective timeout, and the log
    names the killed rank. (One rank per node: the other node's agent is what must end.)"""
    args = tiny_args(tiny_dataset, tmp_path, "--train.steps=400", "--metrics.log_interval=5")
    run = launch.nodes(tmp_path, args, max_restarts=0, nproc=1)
    run.wait_for(r"step 10/\d+  loss", timeout=90)
    os.kill(run.worker_pid(rank=1), signal.SIGKILL)
    start = time.monotonic()
    codes = run.wait(timeout=90)
    log = run.text()
    assert all(code != 0 for code in codes), (codes, log[-4000:])
    assert "rank      : 1" in log and "Signal 9 (SIGKILL)" in log, log[-4000:]
    print(f"failed {time.monotonic() - start:.1f} s after the kill")


# ---- Deterministic failures: one line, exit status 2, no rank started, nothing retried ------


def one_line_failure(log: str, code: int, expected: str) -> None:
    """The launcher exited 2 with one line containing `expected`, and nothing from torchrun."""
    assert code == 2, (code, log[-4000:])
    lines = [line for line in log.splitlines() if expected in line]
    assert len(lines) == 1, log[-4000:]
    for noise in ("Traceback", "ChildFailedError", "torch.distributed.elastic"):
        assert noise not in log, log[-4000:]


FAILURES = {
    "mesh": (["--parallel.mesh=manual", "--parallel.dp_replicate=3"], {}, "config error: "),
    "data": (["--data.path=no/such/dataset"], {}, "config error: data.path"),
    "interface": ([], {"GLOO_SOCKET_IFNAME": "nosuchif0"}, "network error: GLOO_SOCKET_IFNAME"),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher, failure",
    # A plain `python train.py` is one process: it has no interface to check. multinode.sh
    # runs torchrun.sh's check on each node: its config and data cases are drills.
    [pytest.param(launcher, failure, marks=[pytest.mark.drill] * (
        launcher == "multinode.sh" and failure != "interface"))
     for launcher in ("python", "torchrun.sh", "multinode.sh")
     for failure in FAILURES if (launcher, failure) != ("python", "interface")],
)  # fmt: skip
def test_deterministic_failure_is_one_line_and_exit_2(
    tiny_dataset: str, tmp_path: Path, launch, launcher: str, failure: str
) -> None:
    """A config error, missing data or a wrong *_SOCKET_IFNAME ends every launcher at once with
    exit status 2 and one line, before any rank starts: MAX_RESTARTS cannot retry it."""
    extra, env, expected = FAILURES[failure]
    args = tiny_args(tiny_dataset, tmp_path, "--train.steps=4", *extra)
    start = time.monotonic()
    if launcher == "python":
        result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=ENV | env,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        runs = [(result.stdout + result.stderr, result.returncode)]
    else:
        if launcher == "torchrun.sh":
            run = launch.single(tmp_path / "run.log", args, MAX_RESTARTS="2", **env)
        else:
            run = launch.nodes(tmp_path, args, max_restarts=2, **env)
        codes = run.wait(timeout=60)
        runs = list(zip([log.read_text() for log in run.logs], codes, strict=True))
    for log, code in runs:
        one_line_failure(log, code, expected)
    print(f"{launcher} {failure}: exit 2 after {time.monotonic() - start:.1f} s")


def test_check_validates_for_the_world_the_launcher_will_start(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """launch.check: the launch options first, then train.py's arguments in any order (the
    config file among them); the world is the one given, not this process's."""
    from launch.check import main

    train = ["configs/debug.toml", *tiny_args(tiny_dataset, tmp_path, "--parallel.mesh=auto")]
    assert main(["--world-size=4", "--nnodes=2", *train]) == 0
    assert main(["--world-size=6", "--nnodes=2", "--local-world-size=3", *train[1:], train[0],
                 "--train.global_batch_size=12"]) == 0  # fmt: skip
    caplog.clear()
    assert main(["--world-size=3", "--nnodes=1", *train]) == 2  # 8 sequences over 3 ranks
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("config error: train.global_batch_size (8)"), line


def test_missing_torchrun_is_one_line(tmp_path: Path) -> None:
    env = ENV | {"TORCHRUN": str(tmp_path / "no-torchrun"), "NNODES": "2",
                 "MASTER_ADDR": "127.0.0.1"}  # fmt: skip
    for script in ("launch/torchrun.sh", "launch/multinode.sh"):
        result = subprocess.run([script, "configs/debug.toml"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "no-torchrun' not found" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [
        "train.py",
        *(pytest.param(s, marks=pytest.mark.drill) for s in ("torchrun.sh", "multinode.sh")),
    ],
)  # the launchers' case runs by default under sbatch (test_sbatch_hsdp_two_nodes_...)
def test_launchers_resolve_relative_paths_from_where_they_are_started(
    tiny_dataset: str, tmp_path: Path, script: str
) -> None:
    """`cd elsewhere && /path/to/launch/SCRIPT my.toml` (or `python /path/to/train.py`): the
    config, data.path and run.output_dir are the user's relative paths, from the user's
    directory, not the repo's. A folder named like the trainer's packages there shadows
    nothing. (hsdp.sbatch: test_sbatch_hsdp_two_nodes_trains_checkpoints_and_resumes submits
    from a folder of its own, with such a folder.)"""
    (tmp_path / "data").symlink_to(tiny_dataset)
    (tmp_path / "launch").mkdir()  # would shadow `-m launch.check` if the cwd came first
    (tmp_path / "launch" / "check.py").write_text("raise SystemExit('shadowed')\n")
    (tmp_path / "my.toml").write_text(
        '[run]\nname = "here"\noutput_dir = "runs"\n[data]\npath = "data"\n'
    )
    args = ["my.toml", *TINY, "--parallel.mesh=auto", "--train.micro_batch_size=2",
            "--train.steps=2", "--train.eval_interval=0",
            "--parallel.param_dtype=float32"]  # fmt: skip
    env = ENV | {"NPROC": "2"}
    if script == "multinode.sh":
        port = str(free_port())
        env |= {"NNODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                "TORCHRUN": TORCHRUN}  # fmt: skip
    cmd = (
        [sys.executable, str(ROOT / script)]
        if script == "train.py"
        else [str(ROOT / "launch" / script)]
    )
    result = subprocess.run([*cmd, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert step_logged(2, log), log[-4000:]
    assert (tmp_path / "runs" / "here" / "config.toml").is_file()
    assert not (ROOT / "runs").exists()


# Each number a launcher reads from the environment, given as a user might get it wrong.
BAD_NUMBERS = [
    ("torchrun.sh", {"MAX_RESTARTS": "abc"}, "MAX_RESTARTS must be a whole number >= 0, got 'abc'"),
    ("torchrun.sh", {"NPROC": "0"}, "NPROC must be a whole number >= 1, got '0'"),
    ("torchrun.sh", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30s"},
     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be a whole number >= 0, got '30s'"),
    ("multinode.sh", {"NNODES": "two"}, "NNODES must be a whole number >= 1, got 'two'"),
    ("multinode.sh", {"NNODES": "1:x"}, "MAX_NNODES must be a whole number >= 1, got 'x'"),
    ("multinode.sh", {"NNODES": "3:2"}, "NNODES=3:2 must be MIN:MAX with MIN <= MAX"),
    ("multinode.sh", {"NPROC": "08"}, "NPROC must be a whole number >= 1, got '08'"),
    ("multinode.sh", {"MASTER_PORT": "70000"}, "MASTER_PORT must be a whole number in 1..65535"),
    ("multinode.sh", {"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be a whole number >= 0, got '-1'"),
    ("multinode.sh", {"RDZV_BACKEND": "static", "NODE_RANK": "2"},
     "NODE_RANK must be a whole number in 0..1, got '2'"),
    ("hsdp.sbatch", {"NPROC_PER_NODE": "eight"}, "NPROC_PER_NODE must be a whole number >= 1"),
    ("hsdp.sbatch", {"MASTER_PORT": "0"}, "MASTER_PORT must be a whole number in 1..65535"),
    ("hsdp.sbatch", {"MAX_RESTARTS": "3 "}, "MAX_RESTARTS must be a whole number >= 0, got '3 '"),
    ("hsdp.sbatch", {"TIMEOUT_S": "10m"}, "TIMEOUT_S must be a whole number >= 1, got '10m'"),
    ("hsdp.sbatch", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1.5"},
     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT must be a whole number >= 0, got '1.5'"),
    ("hsdp.sbatch", {"PREFLIGHT": "yes"}, "PREFLIGHT must be a whole number in 0..1, got 'yes'"),
]  # fmt: skip


@pytest.mark.parametrize(("script", "bad", "message"), BAD_NUMBERS)
def test_a_launcher_variable_that_is_no_number_is_one_line(
    script: str, bad: dict[str, str], message: str
) -> None:
    """`MAX_RESTARTS=abc ./launch/torchrun.sh ...`: the launcher's own line and exit status 2,
    before anything starts; not torchrun's usage text or a bash arithmetic error."""
    env = ENV | {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "SLURM_JOB_ID": "1"} | bad
    cmd = ["bash", "launch/hsdp.sbatch"] if script == "hsdp.sbatch" else [f"launch/{script}"]
    result = subprocess.run([*cmd, "configs/debug.toml"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=30)  # fmt: skip
    assert result.returncode == 2 and not result.stdout, result
    assert result.stderr.startswith(f"{script}: {message}") and result.stderr.count("\n") == 1


def test_the_launchers_check_numbers_with_one_function() -> None:
    """check_number is copied into each script (hsdp.sbatch runs from a spooled copy and cannot
    source a file beside it): the copies stay equal."""
    copies = {
        script: re.search(r"\n(# Numbers from the environment.*?\n\}\n)", text, re.S)
        for script in ("torchrun.sh", "multinode.sh", "hsdp.sbatch")
        if (text := (ROOT / "launch" / script).read_text())
    }
    assert all(copies.values()), copies
    assert len({match[1] for match in copies.values()}) == 1


def test_every_signal_a_launcher_forwards_stops_the_ranks_cleanly() -> None:
    """Each launcher has torchrun forward PET_SIGNALS_TO_HANDLE to the ranks; plain torchrun
    forwards its default list (TORCHELASTIC_SIGNALS_TO_HANDLE). A rank without a handler for
    one of them dies mid-step on it, unsaved: every one is a stop signal of the ranks'."""
    from torch.distributed.run import get_args_parser

    from launch.lifecycle import STOP_SIGNALS

    ours = {sig.name for sig in STOP_SIGNALS}
    for script in ("torchrun.sh", "multinode.sh", "hsdp.sbatch"):
        forwarded = re.search(r"PET_SIGNALS_TO_HANDLE:-([A-Z0-9,]+)\}", (ROOT / "launch" / script)
                              .read_text())  # fmt: skip
        assert forwarded and set(forwarded[1].split(",")) <= ours, (script, forwarded)
    torchrun_default = get_args_parser().get_default("signals_to_handle")
    assert set(torchrun_default.split(",")) <= ours, torchrun_default


def test_hsdp_sbatch_outside_slurm_is_one_line(tmp_path: Path) -> None:
    """`bash launch/hsdp.sbatch` (no sbatch) has no job, no nodes and no srun: say so."""
    env = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")}
    script = str(ROOT / "launch" / "hsdp.sbatch")
    result = subprocess.run(["bash", script, "configs/debug.toml"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "submit it with sbatch" in result.stderr


@pytest.mark.slow
def test_plain_torchrun_with_a_missing_interface_is_one_line_per_node(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Plain torchrun (no launch script checked the interface): train.py checks it before
    init_process_group, instead of every rank failing inside gloo."""
    args = tiny_args(tiny_dataset, tmp_path, "--train.steps=2", "--checkpoint.interval=1")
    result = subprocess.run(
        [*TORCHRUN.split(), "--standalone", "--nproc-per-node=2", "train.py", *args], cwd=ROOT,
        env=ENV | {"GLOO_SOCKET_IFNAME": "nosuchif0"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode != 0
    lines = [line for line in log.splitlines() if "network error: GLOO_SOCKET_IFNAME" in line]
    assert len(lines) == 1 and "nosuchif0" in lines[0], log[-4000:]
    assert "[rank0]" in lines[0] and "gloo" not in log.lower().replace("gloo_socket", ""), log
    assert "received: stopping" not in log, log  # torchrun stops rank 1 as it waits: no line
    assert not (tmp_path / "debug").exists()  # no empty run or checkpoint folder left behind


@pytest.mark.slow
def test_plain_torchrun_restart_on_its_shared_store_stops_with_one_line(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Plain torchrun --max-restarts (without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) restarts
    the workers on the rendezvous store of their first start: its stale keys had gloo dial the
    dead ranks (connectFullMesh failed after 30 s with a traceback; after a lost node, the
    ranks waited out parallel.timeout_s in silence). The first start warns; the restarted
    workers stop within seconds with one line naming the fix."""
    args = tiny_args(tiny_dataset, tmp_path, "--train.steps=400", "--checkpoint.interval=5",
                     "--metrics.log_interval=5")  # fmt: skip
    env = {k: v for k, v in ENV.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    cmd = [*TORCHRUN.split(), "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "train.py", *args]  # fmt: skip
    log_file = tmp_path / "run.log"
    with open(log_file, "w") as out:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "checkpoint step 5:" not in log_file.read_text():
            assert time.monotonic() < deadline and agent.poll() is None, log_file.read_text()
            time.sleep(0.2)
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        os.kill(int(children[-1]), signal.SIGKILL)
        killed = time.monotonic()
        assert agent.wait(timeout=90) != 0
        ended = time.monotonic() - killed
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    log = log_file.read_text()
    warning = "WARNING torchrun --max-restarts=1 shares its rendezvous store with the workers"
    assert log.count(warning) == 1, log[-4000:]
    [line] = [line for line in log.splitlines() if "restart error:" in line]
    assert "[rank0] ERROR restart error: torchrun restarted the workers (restart 1 of 1)" in line
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
    assert "connectFullMesh" not in log and "received: stopping" not in log, log[-4000:]
    print(f"restarted workers stopped: torchrun gone {ended:.1f} s after the kill")


# ---- Stop signals, restarts and a dying launcher under launch/torchrun.sh --------------------

# checkpoint.interval far beyond the run: only a stop can save anything.
LONG_RUN = ["--train.steps=4000", "--checkpoint.interval=1000", "--metrics.log_interval=5"]
# The launcher's last line after a stop (launch/agent.py).
STOP_LINE = "launcher: stopped by {name}, exit status {status} (a stop, not a failure"


def stopped_and_saved(log: str, signame: str, ckpt: Path) -> int:
    """The step all ranks stopped after, on `signame`, and its checkpoint is complete."""
    stopped = STOPPED.search(log)
    assert stopped and stopped.group(1) == signame, log[-4000:]
    step = int(stopped.group(2))
    assert f"checkpoint step {step}:" in log, log[-4000:]
    assert (ckpt / f"step-{step}" / "COMPLETE").exists(), log[-4000:]
    return step


def lines_name(log: str, signame: str, step: int, ranks: int = 2) -> None:
    """Every rank said it would stop after `step`, the step it saved."""
    said = re.findall(rf"\[rank(\d)\] WARNING {signame} received: stopping after step (\d+)", log)
    assert sorted(said) == [(str(r), str(step)) for r in range(ranks)], log[-4000:]


@pytest.mark.slow
@pytest.mark.drill  # SIGHUP takes this path by default (test_second_launch_...), SIGTERM's save
# and resume run by default under plain python (test_operations.py), SIGTERM from a dying
# torchrun in test_kill_9_of_torchrun_ends_its_ranks
def test_torchrun_sh_sigterm_saves_and_the_next_launch_resumes_there(
    tiny_dataset: str, tmp_path: Path, launch
) -> None:
    """SIGTERM to the launcher: the ranks finish their step, save it and exit; the same command
    resumes at exactly that step, so no finished step is redone."""
    run = launch.single(tmp_path / "first.log", tiny_args(tiny_dataset, tmp_path, *LONG_RUN))
    run.wait_for(r"step 10/\d+  loss", timeout=90)
    ranks = run.worker_pids()
    start = time.monotonic()
    os.kill(run.procs[0].pid, signal.SIGTERM)
    # A stop, neither finished (0) nor failed (1): 128 + 15, and one line, no traceback.
    assert run.wait(timeout=60) == [143], run.text()[-4000:]
    gone = time.monotonic() - start
    assert not any(alive(pid) for pid in ranks.values())
    step = stopped_and_saved(run.text(), "SIGTERM", tmp_path / "debug" / "checkpoints")
    lines_name(run.text(), "SIGTERM", step)
    assert STOP_LINE.format(name="SIGTERM", status=143) in run.text()
    assert "Traceback" not in run.text() and "SignalException" not in run.text()

    args = tiny_args(tiny_dataset, tmp_path, f"--train.steps={step + 2}")
    again = launch.single(tmp_path / "second.log", args)
    assert again.wait(timeout=90) == [0], again.text()[-4000:]
    resumed = RESUMING.search(again.text())
    assert resumed and int(resumed.group(2)) == step, again.text()[-4000:]
    print(f"SIGTERM: saved step {step}, torchrun and ranks gone {gone:.1f} s after the "
          f"signal; resumed at step {resumed.group(2)}")  # fmt: skip


FAKE_SRUN = """#!/usr/bin/env bash
# srun on one node: drop srun's options, run the task.
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames LIST -> this machine; scontrol requeue JOB -> noted in $REQUEUED.
if [[ $1 == show ]]; then echo 127.0.0.1; else echo "$*" >> "$REQUEUED"; fi
"""


@pytest.mark.slow
def test_hsdp_sbatch_exits_138_after_sigusr1_saves_and_requeues(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """hsdp.sbatch in a one-node job, with srun and scontrol stand-ins (no Slurm here; the real
    cluster's test is test_sbatch_stop_signals_save_the_step_in_flight_and_usr1_requeues):
    SIGUSR1 to the batch shell, as --signal=B:USR1@120 sends it. The ranks save the step in
    flight, the job requeues itself, and the script exits 138 (128 + SIGUSR1), the status a
    scheduler can tell from a failure's 1."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{ENV['PATH']}", "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1",
        "SLURM_CPUS_ON_NODE": "2", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port()),
        "REQUEUED": str(tmp_path / "requeued"),
        # This checkout's launch.agent, whatever checkout the environment has installed.
        "PYTHONPATH": str(ROOT),
    }  # fmt: skip
    log = tmp_path / "job.out"
    args = ["configs/debug.toml", *tiny_args(tiny_dataset, tmp_path, *LONG_RUN)]
    job = Launched([log], [["bash", "launch/hsdp.sbatch", *args]], [env])
    try:
        job.wait_for(r"step 10/\d+  loss", timeout=90)
        os.kill(job.procs[0].pid, signal.SIGUSR1)
        assert job.wait(timeout=60) == [138], job.text()[-4000:]
    finally:
        job.kill()
    text = job.text()
    stopped_and_saved(text, "SIGUSR1", tmp_path / "debug" / "checkpoints")
    assert STOP_LINE.format(name="SIGUSR1", status=138) in text, text[-4000:]
    assert (tmp_path / "requeued").read_text() == "requeue 4242\n"
    assert "Traceback" not in text, text[-4000:]


@pytest.mark.slow
def test_second_launch_on_a_run_folder_in_use_is_refused_and_sighup_stops_the_first(
    tiny_dataset: str, tmp_path: Path, launch
) -> None:
    """A second launch/torchrun.sh on the same run folder: one line naming the holder, exit 2,
    the first run untouched. Then SIGHUP to the first torchrun (its terminal closed, an ssh
    connection dropped): torchrun forwards it to the ranks, which stop after the step their
    line names, save it and exit 0; the launcher exits 129. (SIGQUIT takes the same path:
    tests/test_operations.py sends it to a rank, and
    test_every_signal_a_launcher_forwards_stops_the_ranks_cleanly holds the lists equal;
    SIGUSR1 through hsdp.sbatch: test_hsdp_sbatch_exits_138_after_sigusr1_saves_and_requeues.)"""
    args = tiny_args(tiny_dataset, tmp_path, *LONG_RUN)
    first = launch.single(tmp_path / "first.log", args)
    first.wait_for(r"step 10/\d+  loss", timeout=90)
    start = time.monotonic()
    second = launch.single(tmp_path / "second.log", args)
    [code] = second.wait(timeout=60)
    one_line_failure(second.text(), code, "is in use by")
    print(f"second launch: exit 2 after {time.monotonic() - start:.1f} s")
    assert first.procs[0].poll() is None, first.text()[-4000:]

    signame, sig = "SIGHUP", signal.SIGHUP
    ranks = first.worker_pids()
    start = time.monotonic()
    os.kill(first.procs[0].pid, sig)
    assert first.wait(timeout=60) == [128 + sig], first.text()[-4000:]
    gone = time.monotonic() - start
    assert not any(alive(pid) for pid in ranks.values())
    log = first.text()
    step = stopped_and_saved(log, signame, tmp_path / "debug" / "checkpoints")
    lines_name(log, signame, step)
    assert STOP_LINE.format(name=signame, status=128 + sig) in log
    assert "Traceback" not in log, log[-4000:]
    print(f"{signame}: saved step {step}, torchrun and ranks gone {gone:.1f} s after the signal")


@pytest.mark.slow
def test_sighup_to_one_multinode_agent_stops_every_node_in_seconds(
    tiny_dataset: str, tmp_path: Path, launch
) -> None:
    """Two multinode.sh agents, one rank each; SIGHUP to node 1's only (that node drained, its
    ssh session closed): both ranks stop after the same step and save it, and both launchers
    exit 129 within seconds, each with one line (node 0's: the signal went to another node),
    no traceback and no wait in torchrun's exit barrier (300 s)."""
    run = launch.nodes(tmp_path, tiny_args(tiny_dataset, tmp_path, *LONG_RUN), nproc=1)
    run.wait_for(r"step 10/\d+  loss", timeout=90)
    ranks = run.worker_pids()
    start = time.monotonic()
    os.kill(run.procs[1].pid, signal.SIGHUP)
    assert run.wait(timeout=90) == [129, 129], run.text()[-4000:]
    gone = time.monotonic() - start
    assert not any(alive(pid) for pid in ranks.values())
    stopped = [log.read_text() for log in run.logs]
    # Rank 1 got the signal from its agent; rank 0 stopped with it, after the same step, saved.
    said = re.search(r"\[rank1\] WARNING SIGHUP received: stopping after step (\d+)", stopped[1])
    assert said, stopped[1][-4000:]
    step = int(said.group(1))
    assert f"stopped by a signal to another rank after step {step}/" in stopped[0], stopped[0]
    assert (tmp_path / "debug" / "checkpoints" / f"step-{step}" / "COMPLETE").exists()
    for log, name in zip(stopped, ["SIGHUP to another node", "SIGHUP"], strict=True):
        last = log.strip().splitlines()[-1]
        assert STOP_LINE.format(name=name, status=129) in last, log[-4000:]
    for log in stopped:
        assert "Traceback" not in log and "DistStoreError" not in log, log[-4000:]
    assert gone < 30, f"launchers gone {gone:.1f} s after the signal"
    print(f"SIGHUP to one of 2 agents: saved step {step}, both launchers gone after {gone:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize(
    "target", [pytest.param("pid", marks=pytest.mark.drill), "process group"]
)  # pid: the same PR_SET_PDEATHSIG path, for the agent alone
def test_kill_9_of_torchrun_ends_its_ranks(
    tiny_dataset: str, tmp_path: Path, launch, target: str
) -> None:
    """kill -9 of the torchrun agent (or of its process group: the ranks have sessions of their
    own) leaves no orphans: the kernel sends each rank SIGTERM (PR_SET_PDEATHSIG), and they
    stop as on preemption, saving the step in flight, every time."""
    run = launch.single(tmp_path / "run.log", tiny_args(tiny_dataset, tmp_path, *LONG_RUN))
    run.wait_for(r"step 10/\d+  loss", timeout=90)
    ranks = run.worker_pids()
    assert len(ranks) == 2, ranks
    start = time.monotonic()
    if target == "pid":
        os.kill(run.procs[0].pid, signal.SIGKILL)
    else:
        os.killpg(run.procs[0].pid, signal.SIGKILL)
    while any(alive(pid) for pid in ranks.values()):
        assert time.monotonic() - start < 30, f"ranks {ranks} outlived torchrun by 30 s"
        time.sleep(0.05)
    gone = time.monotonic() - start
    log = run.text()
    # Always saved: the launcher's death may reach a rank as several SIGTERMs (one per thread
    # of the agent it is re-parented through), which once ended it at once, unsaved, when
    # they were three (launch/lifecycle.py's StopRequest).
    step = stopped_and_saved(log, "SIGTERM", tmp_path / "debug" / "checkpoints")
    print(f"kill -9 of torchrun ({target}): ranks gone after {gone:.1f} s, saved step {step}")


@pytest.mark.slow
def test_torchrun_sh_restarts_a_killed_rank_from_the_checkpoint(
    tiny_dataset: str, tmp_path: Path, launch
) -> None:
    """MAX_RESTARTS=1 under --standalone: the restarted ranks meet in a fresh store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE) and resume from the latest checkpoint."""
    args = tiny_args(
        tiny_dataset, tmp_path, "--train.steps=40", "--checkpoint.interval=5",
        "--metrics.log_interval=5",
    )  # fmt: skip
    run = launch.single(tmp_path / "run.log", args, MAX_RESTARTS="1")
    run.wait_for(r"checkpoint step 10:", timeout=90)
    os.kill(run.worker_pid(rank=1), signal.SIGKILL)
    start = time.monotonic()
    killed_after = last_logged_step(run.text())
    run.wait_for(RESUMING.pattern, timeout=90)
    restarted = time.monotonic() - start
    assert run.wait(timeout=150) == [0], run.text()[-4000:]
    log = run.text()
    resumed = RESUMING.search(log)
    assert resumed and int(resumed.group(2)) >= 10, log[-4000:]
    assert step_logged(40, log[resumed.end() :]) and "connectFullMesh" not in log
    print(f"rank killed after step >= {killed_after}, resumed at step {resumed.group(2)} "
          f"{restarted:.1f} s after the kill")  # fmt: skip


@pytest.mark.slow
def test_torchrun_sh_run_a_rank_stops_ends_with_the_ranks_line(
    tiny_dataset: str, tmp_path: Path, launch
) -> None:
    """A non-finite loss stops the run from inside the ranks: the log ends with rank 0's line,
    not torchrun's ChildFailedError report, and the launcher exits with the rank's status (1)."""
    args = tiny_args(
        tiny_dataset, tmp_path, "--train.steps=4", "--optim.lr=1e30", "--optim.warmup_steps=0",
        "--train.max_grad_norm=0",
    )  # fmt: skip
    run = launch.single(tmp_path / "run.log", args)
    assert run.wait(timeout=120) == [1], run.text()[-4000:]
    log = run.text()
    last = log.strip().splitlines()[-1]
    assert re.search(r"\[rank0\] ERROR step \d+: loss .* grad norm (nan|inf); stopping", last), log
    for noise in ("Traceback", "ChildFailedError", "torch/distributed/elastic"):
        assert noise not in log, log[-4000:]


def test_a_stop_signal_to_a_rank_already_ending_on_an_error_says_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torchrun stops the other ranks while they wait for rank 0 to report an error: a rank
    ending on an error does not announce a stop after its current step (there is none)."""
    from launch.lifecycle import STOP_SIGNALS, StopRequest

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    stop = StopRequest()
    stop.install()
    try:
        with caplog.at_level(logging.WARNING):
            try:
                raise RuntimeError("step 2: loss nan")
            except RuntimeError:
                os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.requested and caplog.text == ""
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal, outside: not said either
            assert "received" not in caplog.text
            fresh = StopRequest()
            fresh.install()
            os.kill(os.getpid(), signal.SIGTERM)
            assert "SIGTERM received: stopping after the first step" in caplog.text
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_signal_while_the_step_decides_is_said_with_the_decision(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A signal that arrives while the rank waits in the step's all-reduce, its own flag read
    as False: another rank's flag may still stop this step, so the line waits for the answer
    and names the step the run really stops after (never one step too late)."""
    from launch.lifecycle import STOP_SIGNALS, StopRequest

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        with caplog.at_level(logging.WARNING):
            for stopping, said in [(True, "step 6"), (False, "step 7")]:
                caplog.clear()
                stop = StopRequest()
                stop.install()
                stop.start(1, 10)
                assert stop.read() == (False, False)
                os.kill(os.getpid(), signal.SIGQUIT)  # inside the all-reduce: not said yet
                assert stop.requested and caplog.text == ""
                stop.decided(6, stopping=stopping)  # another rank's flag, or none
                assert caplog.messages == [f"SIGQUIT received: stopping after {said}"]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_the_agent_keeps_torchruns_report_only_for_a_rank_killed_by_a_signal() -> None:
    """launch/agent.py: a rank that exited with a status printed why (its line, or a traceback);
    one a signal killed printed nothing, and torchrun's report is what names it. The agent's
    lines about the failure wait until that is known, and come in their order otherwise."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from launch.agent import HoldBack, reported_status

    def failed(*codes: int) -> ChildFailedError:
        failures = {r: ProcessFailure(r, 100 + r, code, "<N/A>") for r, code in enumerate(codes)}
        return ChildFailedError("train.py", failures)

    assert reported_status(failed(1, -15)) == 1 and reported_status(failed(2)) == 2
    assert reported_status(failed(-9, -15)) is None

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger, hold = logging.getLogger("torch.distributed.elastic.test_agent"), HoldBack()
    logger.propagate, logger.handlers = False, [handler]
    logger.addFilter(hold)
    logger.warning("Sending process %s closing signal %s", 101, "SIGTERM")
    logger.error("failed (exitcode: %s) local_rank: %s", -9, 0)
    assert seen == [] and len(hold.held) == 2
    logger.warning("Worker group FAILED. 1/1 attempts left; will restart worker group")
    assert seen == [
        "Sending process 101 closing signal SIGTERM",
        "failed (exitcode: -9) local_rank: 0",
        "Worker group FAILED. 1/1 attempts left; will restart worker group",
    ]


# ---- Slurm: a real controller and two slurmd "nodes" in network namespaces (tests/slurm) -----

CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    """Bring up the test cluster; yields its bin/ folder (sbatch etc. wrappers)."""
    state = tmp_path_factory.mktemp("slurm")
    env = os.environ | {"SLURM_TEST_DIR": str(state), "SLURM_TEST_NAME": f"fsdp2t{os.getpid()}"}
    # As exported by many cluster shells: the nodes must still get every core (GNU nproc counts
    # these variables, not cores; cluster.sh and the launchers must not), or each node runs 1
    # rank and the two-node test's "ranks [2, 3]" line never comes.
    env |= {"OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1"}
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


# What a CPU-only cluster adds to the documented command (see launch/hsdp.sbatch's header).
CPU_CLUSTER = ["--gpus-per-node=0"]


def sbatch(
    bin_dir: Path, out: Path, args: list[str], *, cwd: Path = ROOT,
    script: str = "launch/hsdp.sbatch", timeout: float = 150, expect: int = 0, **env: str,
) -> str:  # fmt: skip
    """`sbatch --wait --gpus-per-node=0 launch/hsdp.sbatch ARGS` on the test cluster (2 nodes of
    this machine's cores, so 2 ranks each by default); returns the job's log."""
    cmd = [
        "timeout", str(timeout), str(bin_dir / "sbatch"), "--wait", *CPU_CLUSTER,
        f"--output={out}", script, *args,
    ]  # fmt: skip
    # `timeout` first: a job that cannot be scheduled pends forever and --wait with it.
    result = subprocess.run(
        cmd, cwd=cwd, env=ENV | env, capture_output=True, text=True, timeout=timeout + 30
    )
    log = out.read_text() if out.exists() else ""
    assert result.returncode == expect, f"{result.stdout}{result.stderr}\n{log[-4000:]}"
    return log


@pytest.mark.slow
def test_sbatch_hsdp_two_nodes_trains_checkpoints_and_resumes(
    slurm: Path, tiny_dataset: str, tmp_path: Path
) -> None:
    """The documented command, config file first: 2 nodes x 2 ranks train HSDP 2x2 and save.
    Submitted again from another directory, with paths relative to it (and a `launch/` and a
    `train.py` there, which must shadow nothing) and tensor parallel inside each node
    (`--parallel.tp=2`, as docs/launch.md's 70B example), the job resumes."""
    train = tiny_args(tiny_dataset, tmp_path, "--checkpoint.interval=2", "--train.steps=4")
    preflight = {"PREFLIGHT": "1", "PREFLIGHT_ARGS": "--size-mb=1 --iters=2"}
    log = sbatch(slurm, tmp_path / "first.out", ["configs/debug.toml", *train],
                 GLOO_SOCKET_IFNAME="eth0", **preflight)  # fmt: skip
    assert re.search(r"network: GLOO_SOCKET_IFNAME=eth0 \(eth0 10\.[\d.]+\)", log), log[-4000:]
    assert re.search(r"inter-node \(dp_replicate, 2 ranks, .*busbw", log), log[-4000:]
    assert re.search(r"node 1 \(node[12]\): ranks \[2, 3\]", log), log[-4000:]
    assert HSDP_2X2 in log and step_logged(4, log), log[-4000:]
    assert (tmp_path / "debug" / "checkpoints" / "step-4" / "COMPLETE").exists()

    # Slurm runs a spooled copy of the script: it must not look for the repo next to itself.
    # Modules named like the trainer's in the submission directory shadow nothing.
    (tmp_path / "my.toml").write_text((ROOT / "configs" / "debug.toml").read_text())
    (tmp_path / "launch").mkdir()
    for shadow in ("launch/__init__.py", "launch/check.py", "train.py"):
        (tmp_path / shadow).write_text(f"raise SystemExit('shadowed: {shadow}')\n")
    train = tiny_args(tiny_dataset, Path("."), "--checkpoint.interval=2", "--train.steps=6")
    log = sbatch(slurm, tmp_path / "second.out", ["my.toml", *train, "--parallel.tp=2"],
                 cwd=tmp_path, script=str(ROOT / "launch" / "hsdp.sbatch"))  # fmt: skip
    resumed = RESUMING.search(log)
    assert resumed and resumed.group(2) == "4", log[-4000:]
    assert "mesh DeviceMesh((dp_replicate=2, dp_shard=1, cp=1, tp=2)" in log, log[-4000:]
    assert step_logged(6, log) and (tmp_path / "debug" / "checkpoints" / "step-6").exists()


@pytest.mark.slow
@pytest.mark.drill  # the groups' launch runs by default with multinode.sh (tests/test_ft.py)
def test_sbatch_ft_runs_a_replica_group_per_node(
    slurm: Path, tiny_dataset: str, tmp_path: Path
) -> None:
    """FT=1 (docs/launch.md, "Replica groups that survive a lost node"): each node a replica
    group on torchft, the lighthouse on the first node; both groups train every step and end
    bitwise equal."""
    train = tiny_args(tiny_dataset, tmp_path, "--train.steps=6", "--ft.compare_interval=3")
    log = sbatch(slurm, tmp_path / "ft.out", ["configs/debug.toml", *train], FT="1")
    assert log.count("2 of 2 replica groups in the quorum") == 2, log[-4000:]
    for step in (3, 6):
        assert log.count(f"step {step}: the 2 replica groups hold bitwise-equal") == 2, log
    assert "1 of 2 replica groups" not in log and step_logged(6, log), log[-4000:]
    groups = {p.name for p in (tmp_path / "debug").glob("group*")}
    assert groups == {"group0", "group1"}
    assert (tmp_path / "debug" / "checkpoints" / "step-6" / "COMPLETE").exists()


@pytest.mark.slow
def test_sbatch_deterministic_failures_end_the_job_at_once(
    slurm: Path, tiny_dataset: str, tmp_path: Path
) -> None:
    """Missing data, a GLOO_SOCKET_IFNAME the nodes lack, no torchrun: the job ends with exit
    status 2 and one line, before any job step (the default MAX_RESTARTS=3 retries nothing)."""
    cases = {
        "data": (["--data.path=no/such/dataset"], {}, "config error: data.path"),
        "interface": ([], {"GLOO_SOCKET_IFNAME": "nosuchif0"}, "network error: GLOO_SOCKET"),
        "torchrun": ([], {"TORCHRUN": str(tmp_path / "no-torchrun")}, "torchrun not found"),
    }
    for name, (extra, env, expected) in cases.items():
        train = tiny_args(tiny_dataset, tmp_path, "--train.steps=4", *extra)
        start = time.monotonic()
        log = sbatch(slurm, tmp_path / f"{name}.out", ["configs/debug.toml", *train],
                     expect=2, **env)  # fmt: skip
        one_line_failure(log, 2, expected)
        assert "srun" not in log, log[-4000:]
        print(f"sbatch {name}: job exit 2 after {time.monotonic() - start:.1f} s")


@pytest.mark.slow
@pytest.mark.drill
def test_sbatch_stop_signals_save_the_step_in_flight_and_usr1_requeues(
    slurm: Path, tiny_dataset: str, tmp_path: Path
) -> None:
    """SIGUSR1 to the batch shell (what --signal=B:USR1@120 sends) reaches every rank: they
    finish their step, save it (checkpoint.interval=1000: nothing else would) and exit; the job
    requeues itself, and the new run resumes at exactly that step: no finished step is redone.
    Then scancel (SIGTERM to every process of the job, as at the time limit or on preemption):
    the ranks save the step in flight again."""
    out = tmp_path / "job.out"
    train = tiny_args(tiny_dataset, tmp_path, *LONG_RUN)
    submit = [str(slurm / "sbatch"), "--parsable", *CPU_CLUSTER, f"--output={out}",
              "launch/hsdp.sbatch", "configs/debug.toml", *train]  # fmt: skip
    job = subprocess.run(
        submit, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()

    def slurm_cmd(*cmd: str) -> str:
        return subprocess.run(
            [str(slurm / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=30
        ).stdout.strip()

    def log() -> str:
        return out.read_text() if out.exists() else ""

    def wait_until(check, what: str, timeout: float = 90, diagnose=lambda: "") -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                pytest.fail(f"{what} not seen in {timeout} s ({diagnose()}):\n{log()[-4000:]}")
            time.sleep(0.3)

    def state() -> str:
        return slurm_cmd("squeue", "-h", "-j", job, "-o", "%T")

    try:
        wait_until(lambda: re.search(r"step 10/\d+  loss", log()), "step 10")
        start = time.monotonic()
        slurm_cmd("scancel", "--batch", "--signal=USR1", job)
        wait_until(lambda: state() == "PENDING", "the requeued job pending")
        requeued_after = time.monotonic() - start
        # Slurm holds a requeued job back for cred_expire + 1 s (the test cluster sets 15 s; the
        # default is 120). Not overridden with StartTime=now: a launch in the second its old
        # credential was revoked is refused by slurmd, and the job is then held for good.
        why = lambda: slurm_cmd("squeue", "-h", "-j", job, "-o", "%T %r %S")  # noqa: E731
        wait_until(lambda: RESUMING.search(log()), "the requeued job resuming", 90, why)
        resumed_after = time.monotonic() - start
        first_stop = STOPPED.search(log())
        assert first_stop, log()[-4000:]
        resumed_at = int(RESUMING.search(log()).group(2))
        wait_until(lambda: last_logged_step(log()) > resumed_at + 5, "steps after the resume")
        slurm_cmd("scancel", job)
        wait_until(lambda: state() == "", "the cancelled job's end")
    finally:
        slurm_cmd("scancel", job)
    text = log()
    assert "SIGUSR1: the ranks finish their step" in text, text[-4000:]
    assert STOP_LINE.format(name="SIGUSR1", status=138) in text, text[-4000:]
    assert f"requeueing job {job}" in text, text[-4000:]
    ckpt = tmp_path / "debug" / "checkpoints"
    saved = stopped_and_saved(text, "SIGUSR1", ckpt)
    assert resumed_at == saved, text[-4000:]
    cancelled = stopped_and_saved(text[first_stop.end() :], "SIGTERM", ckpt)
    assert cancelled > saved
    print(
        f"USR1: saved step {saved}, requeued {requeued_after:.1f} s after the signal, resumed "
        f"at step {resumed_at} {resumed_after:.1f} s after it; scancel: saved step {cancelled}"
    )


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
    from launch.preflight import bus_bandwidth, describe_interfaces, missing_interfaces

    present = ["lo", "eth0", "ib0"]
    assert missing_interfaces({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth0"}, present)\
        == []  # fmt: skip
    assert missing_interfaces({"NCCL_SOCKET_IFNAME": "^docker,lo"}, present) == []
    [bad] = missing_interfaces({"NCCL_SOCKET_IFNAME": "=ib", "GLOO_SOCKET_IFNAME": "eth0"}, present)
    assert "NCCL_SOCKET_IFNAME==ib: no interface named 'ib'" in bad and "lo, eth0, ib0" in bad
    assert len(missing_interfaces({"GLOO_SOCKET_IFNAME": "bond0"}, present)) == 1
    # The log names the interface in use and its address.
    used = describe_interfaces({"GLOO_SOCKET_IFNAME": "lo"})
    assert used == "GLOO_SOCKET_IFNAME=lo (lo 127.0.0.1)"
    assert "gloo binds to" in describe_interfaces({})
    algbw, busbw = bus_bandwidth(nbytes=4 * 10**9, seconds=2.0, ranks=8)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.5)  # x 2*7/8


@pytest.mark.slow
@pytest.mark.drill  # the sbatch test runs the preflight across two nodes by default
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
