"""Operating a run: stop signals, the run-folder lock, what a resume may change, early checks.

Each test drives train.py as a user does (a subprocess, real signals, files on disk).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

import train
from launch.lifecycle import RunLock
from tests.test_train import TINY

ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def argv(dataset: str, out: Path, *extra: str) -> list[str]:
    return [
        "configs/debug.toml", f"--data.path={dataset}", f"--run.output_dir={out}", *TINY,
        "--parallel.param_dtype=float32", "--train.micro_batch_size=2", *extra,
    ]  # fmt: skip


def train_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


class Background:
    """A training command in the background, its stderr in a file we can poll."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stderr=out, stdout=out)

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.text()):
                return m
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode}:\n{self.text()[-3000:]}"
            )
            time.sleep(0.1)
        self.proc.kill()
        pytest.fail(f"{pattern!r} not seen in {timeout} s:\n{self.text()[-3000:]}")

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"still running after {timeout} s:\n{self.text()[-3000:]}")


def logged_losses(log: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"step (\d+)/\d+  loss (\S+)", log)}


@pytest.mark.slow
def test_sigterm_saves_the_step_in_flight_and_the_same_command_resumes(
    tiny_dataset: str, tmp_path: Path
) -> None:
    # checkpoint.interval far beyond the run: only the stop can save anything. A constant
    # schedule, so that ending the resumed run early does not change its lr.
    args = argv(
        tiny_dataset, tmp_path, "--train.steps=100000", "--metrics.log_interval=1",
        "--checkpoint.interval=50000", "--optim.decay=constant",
    )  # fmt: skip
    run = Background([sys.executable, "train.py", *args], tmp_path / "first.log")
    run.wait_for(r"step 5/100000  loss")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 0
    log = run.text()
    stopped = re.search(r"stopped by SIGTERM after step (\d+)/100000", log)
    assert stopped, log[-3000:]
    n = int(stopped.group(1))
    assert max(logged_losses(log)) == n  # the last step it finished is the one it saved
    assert (tmp_path / "debug" / "checkpoints" / f"step-{n}" / "COMPLETE").is_file()
    assert "the same command resumes from it" in log

    # The same command (fewer steps, so it ends) continues at n + 1: no finished step is redone.
    again = train_cli([*args, f"--train.steps={n + 3}"])
    assert again.returncode == 0, again.stderr[-3000:]
    saved = tmp_path / "debug" / "checkpoints" / f"step-{n}"
    assert f"resuming {saved} at step {n}" in again.stderr
    resumed = logged_losses(again.stderr)
    assert sorted(resumed) == [n + 1, n + 2, n + 3]
    # ...and matches a run that was never interrupted.
    straight = train_cli([*argv(tiny_dataset, tmp_path / "ref", f"--train.steps={n + 3}",
                                "--metrics.log_interval=1", "--optim.decay=constant")])  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert {s: logged_losses(straight.stderr)[s] for s in resumed} == resumed


def signalled_run(argv: list[str], signame: str, at_step: int, when: str) -> tuple[list, list]:
    """Train in this rank (of tests/distributed.py) with the stop signals installed; rank 1
    sends itself `signame` in step `at_step`: in its forward (`when="compute"`), or once the
    step's all-reduce is done, during its update and save (`"update"`). Returns the losses and
    this rank's stop lines."""
    from configs import parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from launch.lifecycle import StopRequest
    from parallel.dims import LaunchEnv

    env, real_step, lines, armed = LaunchEnv.from_env(), train.train_step, [], []

    def signal_in_forward(module: torch.nn.Module, args: tuple) -> None:
        if armed:  # the first module of the step's forward
            os.kill(os.getpid(), getattr(signal, armed.pop()))

    def step_and_signal(
        run: train.Run, micro_batches: list, log: bool, stop: StopRequest, saved: bool
    ) -> train.StepResult:
        signalled = env.rank == 1 and run.progress.step + 1 == at_step
        if signalled and when == "compute":
            armed.append(signame)
        result = real_step(run, micro_batches, log, stop, saved)
        if signalled and when == "update":
            os.kill(os.getpid(), getattr(signal, signame))
        return result

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("launch.lifecycle").addHandler(Lines(logging.WARNING))
    train.train_step = step_and_signal
    torch.nn.modules.module.register_module_forward_pre_hook(signal_in_forward)
    stop = StopRequest()
    stop.install()
    job = parse_config(JobConfig, argv)
    return train.train(job, check_config(job, env), env, stop), lines


@pytest.mark.parametrize(
    ("signame", "at_step", "when", "line"),
    [
        ("SIGQUIT", 4, "compute", "SIGQUIT received: stopping after step 4"),
        pytest.param(
            "SIGHUP", 4, "update", "SIGHUP received: stopping after step 5", marks=pytest.mark.slow
        ),
        pytest.param(
            "SIGTERM",
            6,
            "update",
            "SIGTERM received: stopping after step 6 (the last)",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_signal_stops_after_the_step_its_line_names(
    tiny_dataset: str, tmp_path: Path, signame: str, at_step: int, when: str, line: str
) -> None:
    """A signal during step 4's forward or backward stops every rank after step 4, saved (the
    flag is read at the step's end, not its start); one after step 4's all-reduce (its update,
    a save, the next batch) after step 5. Either way the line names the step. After the last
    step's all-reduce the run just finishes. Rank 1 alone is signalled; both ranks stop."""
    from tests.distributed import run_distributed

    args = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.steps=6", "--checkpoint.interval=100",
            "--train.micro_batch_size=2"]  # fmt: skip
    (losses, said0), (_, said1) = run_distributed(signalled_run, 2, args, signame, at_step, when)
    assert said0 == [] and said1 == [line]
    stopped_after = int(re.findall(r"\d+", line)[0])
    assert len(losses) == stopped_after
    checkpoints = tmp_path / "debug" / "checkpoints"
    assert [p.parent.name for p in checkpoints.glob("step-*/COMPLETE")] == [f"step-{stopped_after}"]


@pytest.mark.slow
@pytest.mark.drill  # a signal to one rank stops every rank after the same step by default in
# test_a_signal_stops_after_the_step_its_line_names (in-process ranks) and under launchers in
# tests/test_launch.py's test_sighup_to_one_multinode_agent_stops_every_node_in_seconds
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Plain torchrun, SIGUSR1 to rank 1 alone (Slurm's warning, say): rank 0, never signalled,
    stops after the same step and the step is saved."""
    args = argv(
        tiny_dataset, tmp_path, "--train.steps=100000", "--metrics.log_interval=1",
        "--checkpoint.interval=50000",
    )  # fmt: skip
    cmd = [*TORCHRUN, "--nproc-per-node=2", "train.py", *args]
    run = Background(cmd, tmp_path / "run.log")
    run.wait_for(r"step 3/100000  loss")
    children = Path(f"/proc/{run.proc.pid}/task/{run.proc.pid}/children").read_text().split()
    assert len(children) == 2, children
    os.kill(int(children[-1]), signal.SIGUSR1)  # one rank only (Slurm's warning, say)
    assert run.finish() == 0, run.text()[-3000:]
    log = run.text()
    # Rank 0 got no signal, yet stops after the same step: the flag rode on the all-reduce.
    stopped = re.search(r"stopped by a signal to another rank after step (\d+)/", log)
    assert stopped, log[-3000:]
    said = f"[rank1] WARNING SIGUSR1 received: stopping after step {stopped.group(1)}\n"
    assert said in log, log[-3000:]
    assert (tmp_path / "debug" / "checkpoints" / f"step-{stopped.group(1)}" / "COMPLETE").is_file()


@pytest.mark.drill  # under torchrun.sh it runs by default (test_launch.py's second launch)
def test_second_trainer_on_a_run_folder_in_use_gets_one_line(
    tiny_dataset: str, tmp_path: Path
) -> None:
    held = RunLock(tmp_path / "debug")
    assert held.acquire() is None
    try:
        result = train_cli(argv(tiny_dataset, tmp_path, "--train.steps=2"))
        assert result.returncode == 2
        [line] = [ln for ln in result.stderr.splitlines() if "ERROR" in ln]
        assert f"config error: run folder {tmp_path / 'debug'} is in use by" in line
        assert f"pid {os.getpid()}" in line and "Traceback" not in result.stderr
    finally:
        held.release()
    # The holder gone (even by kill -9: the kernel drops a flock), the folder is free again.
    result = train_cli(argv(tiny_dataset, tmp_path, "--train.steps=2"))
    assert result.returncode == 0, result.stderr[-3000:]


def test_lock_of_a_dead_holder_is_stale(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from launch.lifecycle import RunLock; "
         "lock = RunLock(Path(sys.argv[1])); assert lock.acquire() is None; "
         "print('held', flush=True); time.sleep(60)", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    lock = RunLock(tmp_path)
    assert f"pid {holder.pid}" in (lock.acquire() or "")
    holder.kill()
    holder.wait()
    assert lock.acquire() is None
    lock.release()


@pytest.mark.slow
def test_resume_applies_what_may_change_and_rejects_what_may_not(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = train_cli(argv(tiny_dataset, tmp_path, "--train.steps=4", "--checkpoint.interval=4"))
    assert first.returncode == 0, first.stderr[-3000:]

    # A changed lr and schedule length: applied, listed, and what config.toml says.
    args = argv(tiny_dataset, tmp_path, "--train.steps=6", "--checkpoint.interval=4",
                "--optim.lr=0.5", "--optim.decay=constant", "--metrics.log_interval=1")  # fmt: skip
    again = train_cli(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "changed since the checkpoint, applied: optim.lr: 0.003 -> 0.5" in again.stderr
    assert "changed since the checkpoint, applied: train.steps: 4 -> 6" in again.stderr
    assert re.search(r"step 5/6  loss \S+  lr 5\.00e-01", again.stderr), again.stderr[-2000:]
    written = tomllib.loads((tmp_path / "debug" / "config.toml").read_text())
    assert written["optim"]["lr"] == 0.5

    # What would change the model's math or the data stream mid-run: one line, exit 2.
    # (train.main in this process: the refusal comes before any process group, like every
    # config error, and a process per case would only add its start-up.)
    os.environ.pop("WORLD_SIZE", None)  # this process is a 1-rank launch
    for bad, shown in [
        ("--data.seq_len=16", "data.seq_len: 32 -> 16"),
        ("--train.seed=1", "train.seed: 0 -> 1"),
        ("--model.norm_eps=0.001", "model.norm_eps"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="train"):
            assert train.main([*args, "--train.steps=8", bad]) == 2, bad
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert line.startswith("config error: resuming") and shown in line, line


def test_early_checks_before_any_rank_starts(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each a config error of train.main before any process group (in this process)."""
    os.environ.pop("WORLD_SIZE", None)

    def error(*extra: str) -> str:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="train"):
            assert train.main(argv(tiny_dataset, tmp_path, *extra)) == 2
        [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        return line

    # An fp8.skip entry that matches no layer would silently convert the layer meant to stay.
    line = error("--fp8.enabled=true", "--fp8.skip=outptu")
    assert line.startswith("config error: fp8.skip: outptu matches no Linear layer"), line

    # resume=none next to existing checkpoints would prune them: refused.
    (tmp_path / "debug" / "checkpoints" / "step-4").mkdir(parents=True)
    (tmp_path / "debug" / "checkpoints" / "step-4" / "COMPLETE").write_text("step 4\n")
    assert "already has checkpoints" in error("--checkpoint.resume=none")


@pytest.mark.slow
def test_dry_run_needs_no_data(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "train.py", "configs/llama3_8b.toml", "--dry-run",
         f"--data.path={tmp_path / 'not-prepared'}", f"--run.output_dir={tmp_path}"],
        cwd=ROOT, env=ENV | {"WORLD_SIZE": "16", "RANK": "0", "LOCAL_WORLD_SIZE": "8",
                             "GROUP_WORLD_SIZE": "2"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "not found (a dry run does not need it" in result.stdout
    assert "dp_replicate=2 x dp_shard=8" in result.stdout


@pytest.mark.slow
def test_fresh_start_in_a_used_run_folder_sets_the_old_attempt_aside(
    tiny_dataset: str, tmp_path: Path
) -> None:
    args = argv(
        tiny_dataset, tmp_path, "--train.steps=2", "--metrics.tensorboard=true",
        "--checkpoint.interval=0",
    )  # fmt: skip
    assert train_cli(args).returncode == 0
    again = train_cli(args)  # no checkpoint: it starts over, and says where the old logs went
    assert again.returncode == 0, again.stderr[-2000:]
    assert "has no checkpoint to resume: starting at step 0" in again.stderr
    [previous] = (tmp_path / "debug" / "previous").iterdir()
    assert (previous / "tensorboard").is_dir() and (previous / "config.toml").is_file()
    assert len(list((tmp_path / "debug" / "tensorboard").iterdir())) == 1


def test_two_fresh_starts_within_one_second_set_aside_two_attempts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """previous/<time> has a one-second resolution: a quick retry must not collide with it
    (it did, as a FileExistsError on every rank, when three short runs shared a folder)."""
    from launch import lifecycle

    monkeypatch.setattr(lifecycle.time, "strftime", lambda fmt: "20261123-120000")
    for attempt in ("first", "second"):
        (tmp_path / "config.toml").write_text(attempt)
        lifecycle.set_aside_earlier_attempt(tmp_path)
    moved = {p.name: (p / "config.toml").read_text() for p in (tmp_path / "previous").iterdir()}
    assert moved == {"20261123-120000": "first", "20261123-120000-2": "second"}


def test_end_summary_says_which_step_a_stale_val_loss_is_from() -> None:
    """A stop between evaluations leaves the last evaluation's loss: the summary names its
    step, and only then (after the last step's own evaluation it is the run's)."""
    from launch.metrics import RunSummary

    stopped = RunSummary(32, 100, [2.5, 2.4], 2.61, 4096, 12.0, None, val_step=20)
    [line, *_] = stopped.lines("SIGTERM", checkpoint_interval=0)
    assert line.startswith("stopped by SIGTERM after step 32/100, 2 steps in")
    assert "final loss 2.4000, val_loss 2.6100 (step 20), 4,096 tokens seen" in line
    done = RunSummary(100, 100, [2.0], 2.1, 4096, 12.0, None, val_step=100)
    assert "val_loss 2.1000, 4,096" in done.lines(None, checkpoint_interval=0)[0]


def train_then_threads(args: list[str]) -> list[str]:
    """train.main(args) on this rank, then the names of this process's c10d threads."""
    status = train.main(args)
    assert status == 0
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    return [name for name in names if "gloo" in name or "tcpstore" in name]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_process_groups_outlive_a_finished_run(tiny_dataset: str, tmp_path: Path) -> None:
    """Why a rank leaves through exit_process: after a clean 2-rank run (train.main returned,
    destroy_process_group and gc.collect done) DTensor's caches still hold the process groups,
    whose gloo threads would meet the interpreter's teardown. When this fails, torch frees
    them: exit_process's os._exit may go (launch/lifecycle.py)."""
    from tests.distributed import run_distributed

    args = argv(tiny_dataset, tmp_path, "--train.steps=1")[1:]  # without the config file
    for threads in run_distributed(train_then_threads, 2, args):
        assert any("gloo" in name for name in threads), threads


EXITS = """
import atexit, sys
from launch.lifecycle import exit_process

class Finalized:
    def __del__(self):
        print("finalized", flush=True)  # runs in the interpreter's teardown, if there is one

kept = Finalized()
atexit.register(lambda: print("atexit handler ran"))
print("last line, unflushed", end=" ")
sys.stderr.write("stderr, unflushed")
exit_process(3)
"""


def test_exit_process_runs_atexit_flushes_and_skips_the_teardown() -> None:
    """exit_process(status): the status, the atexit handlers (logging, TensorBoard and W&B
    flush there) and the buffered output survive; the interpreter's teardown, where c10d's
    live threads meet a half-destroyed runtime, never runs."""
    done = subprocess.run([sys.executable, "-c", EXITS], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout == "last line, unflushed atexit handler ran\n", done.stdout
    assert done.stderr == "stderr, unflushed"
