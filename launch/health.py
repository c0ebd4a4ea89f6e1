"""Where every rank is, and who holds the others up: heartbeats, hang lines and stragglers.

- `Heartbeat`: each rank's step and phase in `<run dir>/heartbeat/rank_N.json`, rewritten every
  few seconds by a thread of the rank. A frozen or dead rank stops writing; a rank that waits in
  a collective keeps writing. Readable live and after the run died (docs/launch.md).
- `hang_line`: what a rank says when a collective times out: its rank, step and phase, the kind
  of collective it waited in, and the ranks whose heartbeat says they are behind.
- `StragglerMeter`: each rank's step time split into waiting for the others and its own work,
  gathered once per log interval; names the slowest rank.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from configs import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: `python -m launch.hangs` reads a run folder without it
# (seconds sooner, and on a login node with no torch).

logger = logging.getLogger(__name__)


@dataclass
class HealthConfig:
    heartbeat_interval_s: float = 5.0
    """Seconds between rewrites of each rank's <run dir>/heartbeat/rank_N.json (0 = none). A
    heartbeat older than twice this names a frozen or dead rank in a hang's line."""
    stragglers: bool = True
    """Gather every rank's step time, data wait and wait for the others at each log line (one
    all-gather per log interval) and name the slowest rank."""
    straggler_factor: float = 1.5
    """A rank whose own work per step (its step time less its wait for the others) is this
    many times the median of the other ranks' is a straggler."""
    straggler_intervals: int = 3
    """Warn when the same rank is a straggler for this many log intervals in a row."""
    flight_recorder_entries: int = 2000
    """Collectives each rank's flight recorder keeps (0 = off); dumped to <run dir>/
    comm_traces/rank_N when a collective times out (read with `python -m launch.hangs`)."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s < 0 or self.flight_recorder_entries < 0:
            raise ConfigError(
                "health: heartbeat_interval_s and flight_recorder_entries must be >= 0"
            )
        if self.straggler_factor <= 1 or self.straggler_intervals < 1:
            raise ConfigError(
                f"health: straggler_factor must be > 1 (got {self.straggler_factor}) and "
                f"straggler_intervals >= 1 (got {self.straggler_intervals})"
            )


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return run_dir / "heartbeat" / f"rank_{rank}.json"


class Heartbeat:
    """This rank's step and phase, written to its heartbeat file by a daemon thread.

    The loop only sets two attributes (`beat`): no file I/O on the training path. The thread
    keeps writing while the main thread waits inside a collective (torch releases the GIL
    there), so a stale file means the process itself stopped: SIGSTOP, a dead node, a
    swap storm. Times are the writer's wall clock (time.time): ranks on other nodes compare
    them through NTP-synchronized clocks, good to well under a second.
    """

    def __init__(self, run_dir: Path, rank: int, interval_s: float) -> None:
        self.path = heartbeat_path(run_dir, rank)
        self.rank, self.interval_s = rank, interval_s
        self.step, self.phase, self.since = 0, "setup", time.time()
        self.state = "running"
        self.timeout_s = 0
        """The process groups' timeout now: for the hang line (set by train.py)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self.interval_s > 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write()
            self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase, self.since = step, phase, time.time()

    def stop(self, state: str) -> None:
        """The last write: how this rank ended ("finished", "failed: ...")."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.state = state
            self._write()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError as err:  # a full or vanished file system must not kill training
                logger.warning("heartbeat %s not written: %s", self.path, err)

    def _write(self) -> None:
        record = {
            "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "step": self.step, "phase": self.phase, "phase_since": round(self.since, 3),
            "updated": round(time.time(), 3), "state": self.state,
        }  # fmt: skip
        # Write then rename: a reader never sees half a file.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, self.path)


def read_heartbeats(run_dir: Path) -> dict[int, dict]:
    """Every rank's last heartbeat in the run folder, by rank (unreadable files skipped)."""
    beats = {}
    for path in sorted((run_dir / "heartbeat").glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            beats[int(record["rank"])] = record
        except (OSError, ValueError, KeyError):
            continue
    return beats


def describe_beat(beat: dict, now: float) -> str:
    """'rank 1 last reported step 5 (forward) 31 s ago'."""
    ago = max(0.0, now - beat["updated"])
    where = f"step {beat['step']} ({beat['phase']})"
    state = "" if beat.get("state", "running") == "running" else f", {beat['state']}"
    return f"rank {beat['rank']} last reported {where} {ago:.0f} s ago{state}"


def lagging_ranks(
    beats: dict[int, dict], rank: int, step: int, world_size: int, interval_s: float, now: float
) -> list[str]:
    """Who the others wait for: ranks whose heartbeat went stale (the process stopped), is
    at an earlier step, or was never written."""
    stale_after = 2 * interval_s + 1
    found = []
    for other in range(world_size):
        if other == rank:
            continue
        beat = beats.get(other)
        if beat is None:
            found.append(f"rank {other} wrote no heartbeat")
        elif now - beat["updated"] > stale_after or beat["step"] < step:
            found.append(describe_beat(beat, now))
    return found


# Names of torch's collective functions (innermost frame first wins) and what a user calls them.
COLLECTIVE_KINDS = (
    ("reduce_scatter", "reduce-scatter"),
    ("reducescatter", "reduce-scatter"),  # NCCL's recorder spells them without the underscore
    ("all_gather", "all-gather"),
    ("allgather", "all-gather"),
    ("all_reduce", "all-reduce"),
    ("allreduce", "all-reduce"),
    ("all_to_all", "all-to-all"),
    ("alltoall", "all-to-all"),
    ("barrier", "barrier"),
    ("broadcast", "broadcast"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("recv", "receive"),
    ("send", "send"),
)
# How gloo and NCCL say that a peer never came, or went away.
# Only these exact phrases: another error that merely mentions a timeout keeps its traceback.
TIMED_OUT = ("Timed out waiting", "Watchdog caught collective operation timeout")
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def collective_failure(err: BaseException) -> str | None:
    """'timed out' or 'lost a peer' when `err` is a collective that failed so, else None."""
    text = str(err)
    if any(s in text for s in TIMED_OUT):
        return "timed out"
    if any(s in text for s in PEER_GONE):
        return "lost a peer"
    return None


def kind_of(name: str) -> str | None:
    """'all-gather' for 'all_gather_single', 'gloo:all_gather', 'nccl:_allgather_base', ..."""
    return next((kind for key, kind in COLLECTIVE_KINDS if key in name), None)


def collective_kind(err: BaseException, dump: Path | None = None) -> str:
    """The collective `err` was raised in: from the innermost torch.distributed frame, else
    (DTensor's functional collectives wait elsewhere) the last one in this rank's
    flight-recorder `dump`."""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if f"torch{os.sep}distributed" in frame.filename and (kind := kind_of(frame.name)):
            return kind
    try:
        entries = pickle.loads(dump.read_bytes())["entries"] if dump else []
    except (OSError, pickle.UnpicklingError, EOFError, KeyError):
        entries = []
    return (entries and kind_of(entries[-1]["profiling_name"])) or "a collective"


def hang_line(
    err: BaseException,
    heartbeat: Heartbeat,
    world_size: int,
    timeout_s: float,
    dump: Path | None = None,
) -> str:
    """One line: this rank, its step and phase, the collective, who is behind. 'hang:' when
    the collective timed out, 'peer lost:' when a peer's connection closed (it died).
    `dump`: this rank's flight-recorder dump, if any (`collective_kind`)."""
    how, now = collective_failure(err), time.time()
    timed_out = how == "timed out"
    kind, waited = "hang" if timed_out else "peer lost", f" after {timeout_s:.0f} s" * timed_out
    where = f"rank {heartbeat.rank} at step {heartbeat.step} ({heartbeat.phase})"
    head = f"{kind}: {where} {how}{waited} in {collective_kind(err, dump)}"
    if heartbeat.interval_s <= 0:
        return head + "; no heartbeats to name the rank behind (health.heartbeat_interval_s=0)"
    behind = lagging_ranks(
        read_heartbeats(heartbeat.path.parent.parent), heartbeat.rank, heartbeat.step,
        world_size, heartbeat.interval_s, now,
    )  # fmt: skip
    if behind:
        return head + "; behind: " + "; ".join(behind)
    if not timed_out:  # a rank that just died wrote its heartbeat a moment ago
        return head + "; the launcher names the rank that died"
    return head + "; every rank's heartbeat is fresh: a rank is stuck inside a collective or a "
    "kernel (see comm_traces/ and python -m launch.hangs)"


def dump_flight_recorder(run_dir: Path, rank: int, nccl: bool = False) -> Path | None:
    """This rank's flight recorder (its last collectives) to <run dir>/comm_traces/rank_N.

    NCCL dumps by itself on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT, set by init_distributed);
    gloo records but never dumps, so the rank that caught the timeout writes its own. `nccl`:
    the NCCL groups' recorder, else gloo's. The dump calls are private torch API: there is no
    public one (torch 2.11-2.13)."""
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")):
        return None
    import torch

    c10d = torch._C._distributed_c10d
    path = run_dir / "comm_traces" / f"rank_{rank}"
    try:
        dump = c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(dump())
    except (OSError, RuntimeError, AttributeError):
        return None
    return path


def slowest_rank(own: list[float]) -> tuple[int, float]:
    """The rank with the most work per step (of 2 or more), and the median of the others'.

    The others' median, not everyone's: with 2 ranks everyone's is the mean of the two, so a
    rank 3x slower than its peer would read as only 1.5x "the median"."""
    slowest = max(range(len(own)), key=own.__getitem__)
    return slowest, statistics.median(own[:slowest] + own[slowest + 1 :])


@dataclass
class StragglerMeter:
    """Per-rank step time, data wait and wait for the others, summed between log lines.

    In a synchronous step every rank's wall time is the same: the fast ones wait inside the
    collectives for the slow one. What differs is the wait: `wait_s` is the time this rank
    spent in the step's first all-reduce, i.e. how much later than it the last rank arrived.
    A rank's own work is its step time less that wait; the rank with the most is the one the
    others wait for. (Work hidden inside FSDP's collectives, a slow GPU's backward, is not
    split out this way; its optimizer step before the next step's all-reduce is.)
    """

    cfg: HealthConfig
    device: torch.device
    rank: int
    world_size: int
    _sums: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)
    _suspect: int = -1
    _in_a_row: int = 0

    def record(self, step_s: float, data_s: float, wait_s: float) -> None:
        s, d, w, n = self._sums
        self._sums = (s + step_s, d + data_s, w + wait_s, n + 1)

    def gather(self) -> dict[str, float]:
        """Every rank calls it at the same log step: one all-gather of 3 numbers per rank.
        Returns the straggler scalars (the same on every rank) and warns on rank 0."""
        import torch
        import torch.distributed as dist

        s, d, w, n = self._sums
        self._sums = (0.0, 0.0, 0.0, 0)
        mine = torch.tensor([s, d, w], dtype=torch.float64, device=self.device) / max(n, 1)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        step_s, data_s, wait_s = torch.stack(everyone).cpu().T.tolist()
        own = [t - w for t, w in zip(step_s, wait_s, strict=True)]
        slowest, median = slowest_rank(own)
        lag = own[slowest] - median
        self._track(slowest, own[slowest], median)
        return {"straggler/slowest_rank": float(slowest), "straggler/lag_s": lag,
                "straggler/data_wait_max": max(data_s)}  # fmt: skip

    def _track(self, slowest: int, own: float, median: float) -> None:
        if median > 0 and own > self.cfg.straggler_factor * median:
            self._in_a_row = self._in_a_row + 1 if slowest == self._suspect else 1
            self._suspect = slowest
        else:
            self._suspect, self._in_a_row = -1, 0
        if self._in_a_row >= self.cfg.straggler_intervals and self.rank == 0:
            logger.warning(
                "straggler: rank %d works %.3f s per step, %.1fx the others' median %.3f s, "
                "for %d log intervals in a row (health.straggler_factor=%g): the others wait "
                "for it", slowest, own, own / median, median, self._in_a_row,
                self.cfg.straggler_factor,
            )  # fmt: skip
