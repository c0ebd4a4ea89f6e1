"""Where every rank of a run is, or was when it stopped: heartbeats and flight-recorder dumps.

    python -m launch.hangs outputs/debug            # a live run, or one that died
    python -m launch.hangs outputs/debug --torch    # then torch's own analyzer (NCCL dumps)

Prints each rank's last heartbeat (step, phase, how long ago), then, when a collective timed out
with the flight recorder on (health.flight_recorder_entries), each rank's last collective per
process group from <run dir>/comm_traces/rank_N, and which ranks are behind: a lower sequence
number in a group than its peers, or no dump at all (frozen or dead ranks never dump).

The full cross-rank matching (sizes, mismatched collectives) is torch's analyzer,
`torchfrtrace <run dir>/comm_traces --prefix rank_` (`--torch` runs it). On gloo, torch
2.13's dumps lack their process groups' ranks and that analyzer stops with a KeyError; the
summary here needs only the sequence numbers, and reads both.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

from launch.health import describe_beat, read_heartbeats


def read_dumps(trace_dir: Path) -> dict[int, dict]:
    """{rank: the unpickled flight-recorder dump} for every comm_traces/rank_N."""
    dumps = {}
    for path in sorted(trace_dir.glob("rank_*")):
        suffix = path.name.removeprefix("rank_")
        if not suffix.isdigit():
            continue
        try:
            dumps[int(suffix)] = pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError):
            continue
    return dumps


def last_collectives(dump: dict) -> dict[str, dict]:
    """{process group: its last collective entry} in one rank's dump."""
    last: dict[str, dict] = {}
    for entry in dump.get("entries", []):
        if entry.get("is_p2p"):
            continue
        group = "{} ({})".format(*entry["process_group"])
        if group not in last or entry["collective_seq_id"] > last[group]["collective_seq_id"]:
            last[group] = entry
    return last


def describe_entry(entry: dict) -> str:
    """'#99 all_gather [[30784]]': sequence number in its group, kind, input sizes. (No state:
    gloo marks a timed-out collective retired like a finished one.)"""
    kind = entry["profiling_name"].split(":", 1)[-1]
    return f"#{entry['collective_seq_id']} {kind} {entry['input_sizes']}"


def diverged(dumps: dict[int, dict], world_size: int) -> list[str]:
    """Lines naming the ranks behind: fewer collectives in a group than its most advanced
    rank, or no dump at all."""
    lines = []
    missing = sorted(set(range(world_size)) - set(dumps))
    if missing:
        lines.append(f"no dump from rank(s) {', '.join(map(str, missing))}: frozen, killed or "
                     "dead before the others timed out")  # fmt: skip
    by_group: dict[str, dict[int, dict]] = {}
    for rank, dump in dumps.items():
        for group, entry in last_collectives(dump).items():
            by_group.setdefault(group, {})[rank] = entry
    for group, entries in sorted(by_group.items()):
        ahead = max(entries.values(), key=lambda e: e["collective_seq_id"])
        for rank, entry in sorted(entries.items()):
            if entry["collective_seq_id"] < ahead["collective_seq_id"]:
                lines.append(f"group {group}: rank {rank} is behind at {describe_entry(entry)}; "
                             f"others reached {describe_entry(ahead)}")  # fmt: skip
    return lines


def report(run_dir: Path, now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    beats = read_heartbeats(run_dir)
    lines = [f"heartbeats in {run_dir / 'heartbeat'}:" if beats else "no heartbeats"]
    lines += ["  " + describe_beat(beat, now) + f" (host {beat['host']}, pid {beat['pid']})"
              for _, beat in sorted(beats.items())]  # fmt: skip
    dumps = read_dumps(run_dir / "comm_traces")
    if not dumps:
        return [*lines, "no flight-recorder dumps (nothing timed out, or the recorder was off)"]
    lines.append(f"flight recorder, last collective per process group ({run_dir / 'comm_traces'}):")
    for rank, dump in sorted(dumps.items()):
        for group, entry in sorted(last_collectives(dump).items()):
            lines.append(f"  rank {rank} group {group}: {describe_entry(entry)}")
    world_size = max([*dumps, *beats]) + 1
    lines += diverged(dumps, world_size) or ["every rank with a dump reached the same collective"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.hangs", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("run_dir", type=Path, help="the run folder (run.output_dir/run.name)")
    parser.add_argument("--torch", action="store_true", help="then run torch's analyzer")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"launch.hangs: {args.run_dir} is not a folder", file=sys.stderr)
        return 2
    for line in report(args.run_dir):
        print(line)
    if args.torch and (args.run_dir / "comm_traces").is_dir():
        from torch.distributed.flight_recorder.fr_trace import main as fr_trace

        fr_trace([str(args.run_dir / "comm_traces"), "--prefix", "rank_"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
