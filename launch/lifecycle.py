"""A rank's life around the training loop: its log lines, stop signals (finish the step, save,
exit), dying with the launcher, and one trainer per run folder."""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from parallel.runtime import launched_by_torchrun

logger = logging.getLogger(__name__)


def setup_logging(rank: int) -> None:
    """Every line names its rank; ranks other than 0 log warnings and errors only."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


# SIGTERM: preemption, scancel, Kubernetes, torchrun forwarding its own stop. SIGINT: Ctrl-C.
# SIGUSR1: Slurm's warning ahead of the time limit (--signal=USR1@120), forwarded by the launcher.
# SIGHUP: the terminal closed or the ssh connection dropped. SIGQUIT: Ctrl-\. Every signal a
# launcher forwards (torchrun's default list, plus SIGUSR1: PET_SIGNALS_TO_HANDLE in launch/*.sh
# and hsdp.sbatch) is here: one that is not would kill the ranks mid-step, unsaved.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)


class StopRequest:
    """Turns a stop signal into "finish this step, save a checkpoint, exit 0".

    The handler only records the signal; every rank agrees on the step to stop after because the
    flag rides on the step's loss all-reduce (a rank the signal missed stops with the others).
    The step reads the flag just before that all-reduce (`read`): a signal during a step's
    forward or backward stops the run after that step; one during what follows the all-reduce
    (the update, a log line, an evaluation, a save, the next batch) after the next step. The
    signal's line names that step. One that arrives while the rank waits in the all-reduce, its
    own flag already read, is said once the result is known (`decided`): another rank's flag
    may stop this very step. One event can deliver the signal twice (Slurm signals every
    process of the job, and torchrun forwards its copy), so a repeat is not "hurry up"; the
    third signal exits at once, for a user who really means it.

    A launcher that dies sends more than one SIGTERM: PR_SET_PDEATHSIG fires when the *thread*
    that started the rank exits, and the kernel re-parents the rank to another live thread of
    the launcher, firing again when that one exits (1 to 3 signals for one `kill -9` of a
    threaded process, measured). Once the launcher is lost, a SIGTERM is the kernel's copy: it
    is neither counted nor said (three of them used to end the rank at once, unsaved).

    A SIGTERM because this rank's launcher died (`launcher_lost`) is not a request: its node is
    lost. The ranks still save the step in flight, then exit non-zero (train.py) so that
    torchrun restarts the workers on the nodes that remain (launch/elastic.py).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.step: int | None = None
        """The step a stop requested now ends the run after (None: the first step to run)."""
        self.last_step: int | None = None
        """The run's last step (train.steps), once the loop has started."""
        self._count = 0
        self._launcher = os.getppid() if launched_by_torchrun() else None
        self._deciding = False
        self._unsaid = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGTERM and self.launcher_lost:
            return  # the dead launcher's next thread exiting (see the class docstring)
        self._count += 1
        if self._count >= 3:
            raise SystemExit(128 + signum)
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            # A rank handling an error is ending already (say, waiting for rank 0 to report it
            # when torchrun stops the ranks): "stopping after step N" would be false, and would
            # follow the reason as the run's last line. The request still counts.
            self._unsaid = sys.exc_info()[1] is None
            if not self._deciding:
                self._say()

    def _say(self) -> None:
        if not self._unsaid:
            return
        self._unsaid = False
        why = ": its launcher died" if self.launcher_lost else ""
        if self.step is None:
            after = "the first step"
        else:
            after = f"step {self.step}" + (" (the last)" if self.step == self.last_step else "")
        logger.warning("%s received%s: stopping after %s", self.signal_name, why, after)

    def start(self, first_step: int, last_step: int) -> None:
        """The loop begins at `first_step`: a request stops the run after it (or the last)."""
        self.step, self.last_step = min(first_step, last_step), last_step

    def read(self) -> tuple[bool, bool]:
        """(asked to stop, launcher lost) for the step's all-reduce. Until `decided`, a new
        signal's line waits for the all-reduce's answer."""
        self._deciding = True
        return self.requested, self.launcher_lost

    def decided(self, step: int, stopping: bool) -> None:
        """The all-reduce of `step` is done: the run stops after it, or a request from now on
        stops it after the next step."""
        self.step = step if stopping else min(step + 1, self.last_step or step + 1)
        self._deciding = False
        self._say()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def launcher_lost(self) -> bool:
        """The stop signal came because this rank's torchrun agent died (exit_with_launcher's
        SIGTERM), not from a user or a scheduler: its node is lost, and the run must go on
        without it. Asked again on each read: while the agent's threads are still exiting, the
        signal may arrive before the kernel re-parents this rank."""
        if self.signal_name is None or self._launcher is None or sys.platform != "linux":
            return False  # (PR_SET_PDEATHSIG is Linux's: elsewhere no launcher sends one)
        return os.getppid() != self._launcher or not _running(self._launcher)


def exit_with_launcher() -> None:
    """Under torchrun, have the kernel send this rank SIGTERM when its launcher dies.

    torchrun starts each rank in a session of its own, so a `kill -9` of torchrun (or of its
    process group) would leave the ranks training unsupervised, and a relaunch would run two
    trainers on one run folder. SIGTERM, not SIGKILL: the ranks stop like on preemption,
    saving the step in flight when their peers are alive, else failing at the collective
    timeout. Linux only (prctl); elsewhere a no-op.
    """
    if not launched_by_torchrun() or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def exit_process(status: int) -> NoReturn:
    """End this rank with `status`, its run over, without the interpreter's finalization.

    Why: DTensor's caches (the sharding propagator's, the redistribute planner's, and the
    default arguments `torch.distributed.nn.functional` binds to the default group when DTensor
    first imports it) keep every DeviceMesh, and through it every process group, alive past
    `destroy_process_group`: after a 2-rank run each rank still has its 4 gloo groups' 12
    threads running (tests/test_operations.py counts them). A normal exit then tears the
    interpreter and the C++ runtime down around live threads, the window of the rare abort
    "terminate called without an active exception" (-6 after a clean run). os._exit skips that
    teardown; what a normal exit does first still happens here: the atexit handlers run
    (logging's flush, TensorBoard's, W&B's, a fork's own) and stdout and stderr are flushed.
    No thread of ours is left by then (the trainer joins them), so none is cut short."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


class RunLock:
    """An exclusive lock on a run folder, held by rank 0 for the whole run.

    Two trainers on one run folder overwrite each other's checkpoints mid-save. The lock is a
    `flock` on `<run dir>/.lock`: the kernel releases it when the holder dies, even by
    `kill -9`, so a stale lock never blocks a restart. The file names the holder (host, pid,
    since when) for the error message. Where the file system has no flock, the recorded pid is
    checked instead (on the same host).
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"
        self._file: Any = None

    def acquire(self) -> str | None:
        """Take the lock; returns None, or why not (one line naming the holder)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the whole run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            return self._busy(holder)
        except OSError:  # no flock here (some network file systems): trust a live pid
            f.seek(0)
            holder = f.read().strip()
            host, _, pid = holder.partition(" pid ")
            if host == socket.gethostname() and _pid_alive(int(pid.split()[0] or 0)):
                f.close()
                return self._busy(holder)
        f.seek(0)
        f.truncate()
        f.write(f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%F %T')}\n")
        f.flush()
        self._file = f
        return None

    def _busy(self, holder: str) -> str:
        return (
            f"run folder {self.path.parent} is in use by {holder} (lock {self.path}): stop that "
            "run first, or choose another run.name"
        )

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)
            self._file.close()  # closing drops the flock
            self._file = None


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (Linux: /proc; elsewhere: it exists)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return _pid_alive(pid)
    return state not in ("Z", "X")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def set_aside_earlier_attempt(run_dir: Path) -> None:
    """A fresh start in a run folder that an earlier attempt left without a checkpoint: move
    that attempt's config.toml and TensorBoard logs to previous/<time>/, so its curves do not
    overlap the new run's and nothing is overwritten. Said in the log, never silent."""
    leftovers = [p for p in (run_dir / "config.toml", run_dir / "tensorboard") if p.exists()]
    if not leftovers:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # Two starts within one second (a crash loop, a quick retry) must not collide: -2, -3, ...
    dest, n = run_dir / "previous" / stamp, 1
    (run_dir / "previous").mkdir(exist_ok=True)
    while True:
        try:
            dest.mkdir()
            break
        except FileExistsError:
            n += 1
            dest = run_dir / "previous" / f"{stamp}-{n}"
    for path in leftovers:
        path.rename(dest / path.name)
    logger.warning(
        "run folder %s has no checkpoint to resume: starting at step 0; the earlier attempt's "
        "%s moved to %s", run_dir, " and ".join(p.name for p in leftovers), dest,
    )  # fmt: skip
