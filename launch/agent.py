"""torchrun as launch/torchrun.sh runs it: torch's own agent (`torch.distributed.run`), in this
process, with one difference at the end.

    python launch/agent.py --standalone --nproc-per-node=2 train.py ...   # torchrun's options
    python -m launch.agent --keep-failure-report --nnodes=2 ...           # several nodes

A rank that stops the run itself (a non-finite loss, a full disk) logs why in one line and
exits with a status: 1, or 2 for a config error only the ranks can find. torchrun would then
print two lines about the failed rank and the peers it stops, its ChildFailedError traceback
and a report, after the rank's line, and exit 1 whatever the cause. Here the run ends with the
rank's own line (or its traceback, for a crash) and the launcher exits with the rank's status.

A rank killed by a signal (the OOM killer, a segfault, `kill -9`) printed nothing: torchrun's
report, which names it and the signal, is kept. So is every report with
`--keep-failure-report` (hsdp.sbatch): on several nodes only rank 0 logs why the run stopped,
and another node's agent would end with nothing said. Restarts (`--max-restarts`)
are torchrun's, unchanged.

A stop signal to the agent (SIGTERM, SIGINT, SIGUSR1, ...) is torchrun's too: it passes the
signal to the ranks, which finish their step, save and exit 0, and waits for them. torchrun
would then raise its SignalException: a traceback and exit status 1, as for a failure. Here the
run ends with one line and exit status 128 + the signal's number (143 for SIGTERM, 138 for
SIGUSR1, 130 for SIGINT), what a shell reports for a process a signal ended: a stopped run is
neither finished (0: `launcher && export` must not go on) nor failed (1), and a scheduler can
tell it apart (Slurm's RequeueExit, say). What the ranks saved is in their own lines above it.

On several nodes a stop signal may reach one agent only (one node drained or preempted). Its
ranks pass the stop on to every other rank, so all stop after the same step and save; the
other agents then see their ranks succeed and wait in torchrun's exit barrier (300 s) for the
signaled one, which torchrun lets exit without joining it: they end with a DistStoreError. Here
the signaled agent, once its ranks saved, writes the stop to the rendezvous store and joins the
barrier; every other agent reads it there and ends the same way, with a line that names the
signal sent to another node and 128 + its number: a stop is the same status on every node.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import (
    _TERMINAL_STATE_SYNC_ID,
    DEFAULT_ROLE,
    RunResult,
    SimpleElasticAgent,
)
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# What torchrun's agent logs when a rank has failed: which one, and each peer it then stops
# (and kills, when the peer does not exit in time).
FAILURE_LINES = ("failed (exitcode", "Sending process", "Unable to shutdown process")
# Seconds the other ranks get to exit after one failed, before SIGKILL (FAILURE_GRACE_S).
FAILURE_GRACE_S = 5


def shorten_failure_grace(seconds: int) -> None:
    """After a rank fails, torchrun SIGTERMs the others and waits 30 s before SIGKILL, a time
    neither --shutdown-timeout nor TORCH_ELASTIC_SHUTDOWN_TIMEOUT changes (those are for a
    stop signal to the agent, when the ranks save: that path passes its own timeout and is
    unchanged). A rank hung in a collective or frozen never acts on SIGTERM; a healthy one
    ends in a second (its peer's sockets close): so wait `seconds`. Both places that wait
    are private (the process context's `close` when it sees a failure, the agent's
    `_stop_workers` before a restart); no public setting exists (torch 2.11-2.13)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    # torch 2.11's agent closes the ranks with close's default timeout on a stop signal too,
    # where they save: shortening it there would cut their save to `seconds`. So 2.11 keeps
    # torchrun's 30 s after a failure; 2.12+ passes the stop signal's own timeout explicitly.
    if "timeout" not in inspect.signature(LocalElasticAgent._shutdown).parameters:
        return
    close = PContext.close

    def close_soon(context: PContext, death_sig: object = None, timeout: int = seconds) -> None:
        close(context, death_sig, timeout)  # type: ignore[arg-type]

    def stop_workers(agent: LocalElasticAgent, worker_group: object) -> None:
        agent._shutdown(timeout=seconds)

    PContext.close = close_soon  # type: ignore[method-assign]
    LocalElasticAgent._stop_workers = stop_workers  # type: ignore[method-assign]


# Keys of the agents' rendezvous store: the signal that stopped an agent, and the barrier after
# which each agent has read it (the store lives in one agent: it must not exit before).
STOP_KEY = "fsdp2/stopped_by"
READ_BARRIER = "fsdp2/stop_read"


class PeerStopped(SignalException):
    """Raised by an agent whose ranks stopped because another node's agent got a stop signal."""


def _barrier(agent: SimpleElasticAgent, key_prefix: str, timeout_s: float) -> None:
    from torch.distributed.elastic.utils import store as store_util

    world = agent._worker_group.group_world_size
    store_util.barrier(agent._store, world, key_prefix, barrier_timeout=timeout_s)


def share_stops(timeout_s: float) -> None:
    """Let one node's stop signal end every node's agent at once, with 128 + the signal (the
    module's docstring says why). Patches torchrun's agent (torch 2.11-2.13): its `run` and its
    exit barrier are the only places that know, and neither has a hook."""
    run, exit_barrier = SimpleElasticAgent.run, SimpleElasticAgent._exit_barrier

    def joined_exit_barrier(agent: SimpleElasticAgent) -> None:
        agent._fsdp2_joined_exit_barrier = True  # a second join would count this agent twice
        exit_barrier(agent)

    def run_sharing_stops(agent: SimpleElasticAgent, role: str = DEFAULT_ROLE) -> RunResult | None:
        try:
            result = run(agent, role)  # on a signal: raises once the ranks have saved
        except SignalException as stop:
            if agent._store is not None and agent._worker_group.group_world_size > 1:
                _tell_the_others(agent, stop, timeout_s)
            raise
        if result is not None and not result.is_failed() and agent._store is not None:
            _raise_a_peers_stop(agent, timeout_s)
        return result

    SimpleElasticAgent._exit_barrier = joined_exit_barrier  # type: ignore[method-assign]
    SimpleElasticAgent.run = run_sharing_stops  # type: ignore[method-assign]


def _tell_the_others(agent: SimpleElasticAgent, stop: SignalException, timeout_s: float) -> None:
    """Signaled: the stop into the store, then the exit barrier the others wait in, then wait
    until they have read it. A node that is gone or failed costs at most `timeout_s` each."""
    try:
        agent._store.set(STOP_KEY, stop.sigval.name)
        if not getattr(agent, "_fsdp2_joined_exit_barrier", False):
            _barrier(agent, _TERMINAL_STATE_SYNC_ID, timeout_s)
        _barrier(agent, READ_BARRIER, timeout_s)
    except Exception:  # noqa: BLE001 - the stop itself is done: this only informs the others
        logging.getLogger(__name__).debug("stop not shared", exc_info=True)


def _raise_a_peers_stop(agent: SimpleElasticAgent, timeout_s: float) -> None:
    """After the exit barrier (every agent's ranks are done): another agent's stop, if any."""
    try:
        if not agent._store.check([STOP_KEY]):
            return
        name = agent._store.get(STOP_KEY).decode()
    except Exception:  # noqa: BLE001 - the store's host exited: no agent was stopped
        return
    try:
        _barrier(agent, READ_BARRIER, timeout_s)  # read: the store's host may now exit
    except Exception:  # noqa: BLE001 - it exited already, after everyone read
        pass
    raise PeerStopped(f"{name} to another node's agent", signal.Signals[name])


class HoldBack(logging.Filter):
    """Holds the agent's lines about a failed rank until the end says whether they add anything.
    Any other line of the agent (a restart, say) lets them through first, in their order."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []
        self.passing = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.passing:
            return True
        if isinstance(record.msg, str) and record.msg.startswith(FAILURE_LINES):
            self.held.append(record)
            return False
        self.release()
        return True

    def release(self) -> None:
        held, self.held, self.passing = self.held, [], True
        try:
            for record in held:
                logging.getLogger(record.name).handle(record)
        finally:
            self.passing = False


def reported_status(error: ChildFailedError) -> int | None:
    """The exit status of the first rank to fail, if it exited with one (it ran to its own
    end and printed why); None if a signal killed it."""
    _, failure = error.get_first_failure()
    return failure.exitcode if failure.exitcode > 0 else None


KEEP_REPORT = "--keep-failure-report"


def main(argv: list[str]) -> int:
    keep_report = argv[:1] == [KEEP_REPORT]
    argv = argv[1:] if keep_report else argv
    hold = HoldBack()
    # Every logger of the agent gets the filter: a line from any of them releases what is held.
    agent_loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith("torch.distributed.elastic")
    ]
    for logger in agent_loggers:
        logger.addFilter(hold)
    shorten_failure_grace(int(os.environ.get("FAILURE_GRACE_S", FAILURE_GRACE_S)))
    # The other nodes' ranks stopped after the same step and saved as these did: they need no
    # longer than the ranks' own save (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) to report in.
    share_stops(float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)))
    try:
        torchrun.main(argv)
    except ChildFailedError as error:
        if keep_report or (status := reported_status(error)) is None:
            hold.release()
            raise
        hold.held.clear()  # the rank's own line stays the last
        return status
    except SignalException as stop:
        # The agent's "Sending process ... closing signal" lines are the stop itself, not news.
        hold.held.clear()
        status = 128 + stop.sigval
        reason = "a stop, not a failure; the ranks' lines above say the step they saved"
        by = stop.sigval.name + (" to another node" if isinstance(stop, PeerStopped) else "")
        print(f"launcher: stopped by {by}, exit status {status} ({reason})", file=sys.stderr)
        return status
    finally:
        hold.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
