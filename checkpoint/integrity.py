"""Checkpoint integrity: per-file sizes and CRC32s recorded at save, checked at resume.

The COMPLETE marker holds a manifest, JSON:
`{"format": ..., "checksum": "crc32", "files": {"__0_0.distcp": {"bytes": N, "crc32": C}, ...,
".metadata": {...}}}`: the size and CRC32 of every file of the checkpoint. Each rank sums the
files it wrote right after writing them (inside DCP's write step: in the background for async
saves) into a sidecar file; rank 0, after writing `.metadata`, merges the sidecars and the sum
of `.metadata` into `COMPLETE.tmp`, which becomes `COMPLETE` by a rename once the save returned
(`Checkpointer`, `checkpoint/checkpointer.py`). So no rank reads the whole checkpoint, and a
full disk fails the save itself, on every rank.

Verified twice: the checks that read no tensor data (`check_files`) in `check_resume`
(`checkpoint/resume.py`, every rank, before the process group), the content (`verify_files`,
each rank its share of the files) in `Checkpointer.load`. Every checkpoint has a manifest, and
it must list every data file DCP wrote (`.metadata` and each `*.distcp`): a marker that is
empty, not JSON, of another shape or that leaves a file out is damage like a flipped bit, since
the files it fails to vouch for could hold anything.

This module has the pieces: the writer that records checksums, the cheap checks that read no
tensor data, and the content check of a share of the files.

CRC32 (zlib) rather than a cryptographic hash: it guards against truncation and flipped bits,
not against tampering, and it is the fastest here: ~2.9 GB/s on one core of the 2-core CPU
machine against ~1.3 GB/s for sha1, ~1.2 for sha256, ~0.5 for md5 (`python bench/checkpoint.py`
prints these; see BENCHMARKS.md).
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

COMPLETE = "COMPLETE"
PENDING = "COMPLETE.tmp"  # the manifest until the Checkpointer renames it to COMPLETE
METADATA = ".metadata"  # DCP's index, written by rank 0
_DATA = ".distcp"  # the suffix of DCP's data files, __<rank>_<i>.distcp
_SIDECAR = "__{rank}_checksums.json"  # one rank's checksums, until rank 0 merges them
_FORMAT = "fsdp2-trainer manifest 1"
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
_CHUNK = 8 << 20  # bytes read at a time: large enough for full speed, small in memory


class CorruptCheckpoint(Exception):
    """One file of a checkpoint is missing, truncated or changed; `str` names it and why."""

    def __init__(self, file: Path, why: str) -> None:
        super().__init__(f"{file} {why}")
        self.file = file


def crc32(path: Path) -> tuple[int, int]:
    """(size, CRC32) of a file, read in chunks (zlib releases the GIL while it sums)."""
    crc, size = 0, 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, plus: each rank sums the files it wrote, and rank 0 merges the sums.

    Both happen inside DCP's save steps, so no rank reads another's files, an async save does
    the summing in its background thread, and an error (a full disk) reaches every rank the way
    DCP reports errors: as the save's exception.
    """

    def prepare_local_plan(self, plan: Any) -> Any:
        # Saving over an existing step directory is deliberate (the step after a fallback from
        # a damaged checkpoint, a restart that redoes a step), and Checkpointer.save removed its
        # COMPLETE first, so it never looks complete while it is rewritten. torch (2.11-2.13)
        # warns about it on every rank, even with overwrite=True set explicitly: drop just that
        # warning. In an async save this runs in DCP's thread, and catch_warnings swaps the
        # process's filter list: the only warning it can hide elsewhere is this same one.
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="Detected an existing checkpoint in ", category=UserWarning
            )
            return super().prepare_local_plan(plan)

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        start = time.perf_counter()
        folder = Path(self.path)
        names = sorted({result.storage_data.relative_path for result in future.wait()})
        files = {name: _entry(*crc32(folder / name)) for name in names}
        rank = plan.storage_data.prefix.strip("_")  # DCP names this rank's files __<rank>_<i>
        sums = {"files": files, "seconds": time.perf_counter() - start}
        (folder / _SIDECAR.format(rank=rank)).write_text(json.dumps(sums))
        return future

    def finish(self, metadata: Metadata, results: list) -> None:
        """On rank 0, after every rank wrote its data: write .metadata, then the manifest."""
        super().finish(metadata, results)
        start = time.perf_counter()
        folder = Path(self.path)
        files: dict[str, dict[str, int]] = {}
        seconds = 0.0  # ranks sum in parallel: the slowest one is what the save waited for
        sidecars = [folder / _SIDECAR.format(rank=rank) for rank in range(len(results))]
        for sidecar in sidecars:
            sums = json.loads(sidecar.read_text())
            files |= sums["files"]
            seconds = max(seconds, sums["seconds"])
        files[METADATA] = _entry(*crc32(folder / METADATA))
        # One line per file, for people who read it: {"format", "checksum", "files": {...}}.
        header = json.dumps({"format": _FORMAT, "checksum": "crc32"})[:-1]
        entries = [f" {json.dumps(name)}: {json.dumps(files[name])}" for name in sorted(files)]
        with open(folder / PENDING, "w") as f:
            f.write(header + ', "files": {\n' + ",\n".join(entries) + "\n}}\n")
            f.flush()
            os.fsync(f.fileno())
        for sidecar in sidecars:
            sidecar.unlink()
        self.checksum_seconds = seconds + time.perf_counter() - start


def _entry(size: int, crc: int) -> dict[str, int]:
    return {"bytes": size, "crc32": crc}


def read_manifest(directory: Path) -> dict[str, dict[str, int]]:
    """File name -> {"bytes", "crc32"} from the COMPLETE marker, which must list every data
    file of `directory`. Raises CorruptCheckpoint naming COMPLETE and what is wrong with it."""
    path = directory / COMPLETE
    try:
        files = _manifest_files(path.read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "is missing") from None
    except ValueError as err:
        raise CorruptCheckpoint(path, f"is not a valid manifest ({err})") from None
    # A file left out would never be summed, so its damage would load unseen. Other files in
    # the folder (a note someone left) are not DCP's and not read.
    data = (p.name for p in directory.iterdir() if p.name == METADATA or p.suffix == _DATA)
    if unlisted := sorted(name for name in data if name not in files):
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        why = f"lists no size and checksum for {unlisted[0]}{more}, a data file of the checkpoint"
        raise CorruptCheckpoint(path, why)
    return files


def _manifest_files(text: bytes) -> dict[str, dict[str, int]]:
    """The "files" of a manifest, checked for shape; ValueError saying what is wrong."""
    if not text.strip():
        raise ValueError("the file is empty")
    try:
        manifest = json.loads(text)
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError for binary bytes
        raise ValueError(f"not JSON: {str(err)[:200]}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"a JSON {_JSON_TYPES.get(type(manifest), 'null')}, not an object")
    form, checksum = manifest.get("format"), manifest.get("checksum")
    if (form, checksum) != (_FORMAT, "crc32"):
        want = f"{_FORMAT!r} with 'crc32'"
        raise ValueError(f"format {form!r} with checksum {checksum!r}, not {want}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError('no "files" object')
    for name, entry in files.items():
        if not isinstance(entry, dict) or any(
            type(entry.get(key)) is not int or entry[key] < 0 for key in ("bytes", "crc32")
        ):
            shown = json.dumps(entry)[:100]
            raise ValueError(f'the entry of {name} is {shown}, not {{"bytes": N, "crc32": C}}')
    return files


def check_files(directory: Path) -> Metadata:
    """The checks that read no tensor data: the manifest reads and lists every data file,
    each is there with its size, .metadata can be read, and every file it points into is long
    enough. Raises CorruptCheckpoint naming the first bad file; returns the metadata."""
    manifest = read_manifest(directory)
    for name, entry in manifest.items():
        _check_size(directory / name, entry["bytes"], "recorded in the manifest", exact=True)
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except FileNotFoundError:
        raise CorruptCheckpoint(directory / METADATA, "is missing") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged file
        why = f"cannot be read ({_one_line(err)})"
        raise CorruptCheckpoint(directory / METADATA, why) from None
    # .metadata and the manifest must agree: this finds a file it points into that is gone
    # together with its manifest entry, or that the manifest records too short.
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        _check_size(directory / name, end, "that its entries in .metadata end at", exact=False)
    return metadata


def _check_size(path: Path, expected: int, what: str, exact: bool) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "is missing") from None
    if size < expected or (exact and size != expected):
        raise CorruptCheckpoint(path, f"has {size:,} bytes, not the {expected:,} {what}")


def verify_files(directory: Path, names: list[str]) -> list[str]:
    """Sum the named files and compare with the manifest: one 'file why' per bad file."""
    manifest = read_manifest(directory)
    bad = []
    for name in names:
        try:
            size, crc = crc32(directory / name)
        except FileNotFoundError:
            bad.append(f"{directory / name} is missing")
            continue
        entry = manifest[name]
        if (size, crc) != (entry["bytes"], entry["crc32"]):
            bad.append(
                f"{directory / name} does not match its checksum (CRC32 {crc:#010x} of "
                f"{size:,} bytes, recorded {entry['crc32']:#010x} of {entry['bytes']:,}): "
                "its content changed after the save"
            )
    return bad


def split_by_size(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """Deal files out to `parts` ranks, largest first to the least loaded: about equal bytes
    each. Deterministic, so every rank computes the same split on its own."""
    shares: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = loads.index(min(loads))
        shares[least].append(name)
        loads[least] += sizes[name]
    return shares


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__
