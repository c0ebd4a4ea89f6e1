"""Distributed checkpoints: save every N steps, resume from the latest complete one, on any mesh.

Layout: the checkpoint of step N is the DCP directory `<run dir>/checkpoints/step-<N>/` (see
`checkpoint/state.py` for its keys). It counts only once the marker file `COMPLETE` exists:
rank 0 writes it after DCP finished on every rank, so a crash or `kill -9` mid-save leaves a
directory without the marker, which resuming skips, and the previous checkpoint intact.

Two halves:
- `check_resume` runs in `check_config`, on every rank, before the process group exists: it
  finds the checkpoint to resume and rejects one that cannot work (wrong model shapes, a data
  position the new mesh cannot continue, a missing path, an unwritable folder) as ConfigError.
- `Checkpointer` runs in the training loop: loads the resume point, saves when due (in the
  background with `async_mode = "async"`), writes the marker, deletes old checkpoints.

Integrity (`checkpoint/integrity.py`). The COMPLETE marker holds a manifest, JSON:
`{"format": ..., "checksum": "crc32", "files": {"__0_0.distcp": {"bytes": N, "crc32": C}, ...,
".metadata": {...}}}`: the size and CRC32 of every file of the checkpoint. Each rank sums the
files it wrote right after writing them (inside DCP's write step: in the background for async
saves) into a sidecar file; rank 0, after writing `.metadata`, merges the sidecars and the sum
of `.metadata` into `COMPLETE.tmp`, which becomes `COMPLETE` by a rename once the save returned.
So no rank reads the whole checkpoint, and a full disk fails the save itself, on every rank.
Verified:
- in `check_resume` (every rank, before the process group; no tensor data read): every file of
  the manifest is there with its size, `.metadata` unpickles, every file it points into is long
  enough, the step and data position read back;
- in `Checkpointer.load` (after): the content. The files are dealt out to the ranks by size,
  each rank sums its share, and all ranks learn every mismatch (one all_gather).
A damaged checkpoint is skipped, with one warning naming the file, for the next older complete
one when `resume=auto` chose it; a damaged `checkpoint.resume=<path>` is one ConfigError naming
the file. Checkpoints saved before manifests existed (marker "step N") load with a warning
that they are not verified; the size checks against `.metadata` still apply to them.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.integrity import (
    COMPLETE,
    PENDING,
    ChecksummingWriter,
    CorruptCheckpoint,
    check_files,
    read_manifest,
    split_by_size,
    verify_files,
)
from checkpoint.state import CONFIG, MODEL, TRAIN, read_progress
from configs import ConfigError

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d+)")
_DAMAGED_HINT = "the checkpoint is damaged: resume another one (an older step-N of its run)"


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps, and at the last step (0 = never save)."""
    keep_last: int = 3
    """Keep this many newest complete checkpoints; older ones are deleted only after a newer one
    is complete (0 = keep all)."""
    async_mode: Literal["off", "async"] = "off"
    """'async': dcp.async_save writes in the background while training continues (one save in
    flight at most, CPU memory for a copy of the state); 'off': training waits for the save."""
    resume: str = "auto"
    """'auto' = the latest complete checkpoint of this run, or a fresh start if there is none;
    a path to a step-N directory; 'none' = always start fresh."""
    load_model_only: bool = False
    """Start a new run from the weights of checkpoint.resume (a path): step 0, a fresh optimizer
    and schedule, data from the start of the stream. Once the run has saved a checkpoint of its
    own, a restart resumes that one instead."""
    export_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the weights written by the Hugging Face export tool."""
    folder: str = "checkpoints"
    """Where step-N directories go: relative to the run directory, or an absolute path."""
    init_from_hf: str | None = None
    """Initialize a new run from a local Hugging Face safetensors directory (instead of
    random weights). Like load_model_only, only when the run has no checkpoint of its own."""

    def __post_init__(self) -> None:
        if self.interval < 0 or self.keep_last < 0:
            raise ConfigError(
                f"checkpoint: interval ({self.interval}) and keep_last ({self.keep_last}) "
                "must be >= 0"
            )
        if self.load_model_only and self.resume in ("auto", "none"):
            raise ConfigError(
                f"checkpoint.load_model_only needs checkpoint.resume=<path to a step-N "
                f"directory>, got resume='{self.resume}'"
            )


# ---- layout ---------------------------------------------------------------------------------


def checkpoint_folder(cfg: CheckpointConfig, run_dir: Path) -> Path:
    return run_dir / cfg.folder  # an absolute cfg.folder replaces run_dir


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def list_step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step-N directory, complete or not, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def complete_checkpoints(folder: Path, warn: bool = False) -> list[Path]:
    """Step directories with the COMPLETE marker, newest first; `warn` logs each partial one
    newer than all of them (a save that did not finish)."""
    complete = []
    for _, path in reversed(list_step_dirs(folder)):
        if is_complete(path):
            complete.append(path)
        elif warn and not complete:
            logger.warning(
                "checkpoint: skipping %s: no %s marker (a save that did not finish)", path, COMPLETE
            )
    return complete


def latest_complete(folder: Path, warn: bool = False) -> Path | None:
    """The newest step directory with the COMPLETE marker; `warn` logs each newer partial one."""
    return next(iter(complete_checkpoints(folder, warn)), None)


# ---- checks before the process group exists ------------------------------------------------


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int
    """Optimizer steps done in the checkpoint (0 with load_model_only: the run starts over)."""
    model_only: bool
    fallback: Callable[[str], ResumePoint] | None = field(default=None, compare=False, repr=False)
    """Only when resume=auto chose this one among the run's own checkpoints: called with what
    is wrong with it, picks the next older one the same way (or raises ConfigError when none
    is left). `Checkpointer.load` calls it when the content check fails. None for an explicit
    checkpoint.resume path: a damaged one is an error, never silently replaced."""


def check_resume(
    cfg: CheckpointConfig,
    run_dir: Path,
    model_shapes: dict[str, tuple[int, ...]],
    positions_per_micro_step: int,
    *,
    is_rank0: bool,
    create_folder: bool,
) -> ResumePoint | None:
    """Find the checkpoint to resume from and check it fits this run; ConfigError if not.

    Only reads files (and, with create_folder and saving on, creates the checkpoint folder):
    every rank runs it on the same inputs before any collective, so all fail alike.
    `model_shapes`: parameter FQN -> shape of this run's model (built on meta).
    `positions_per_micro_step`: dp_size * micro_batch_size, which must divide the checkpoint's
    data position for the loader to continue the global stream exactly.
    """
    folder = checkpoint_folder(cfg, run_dir)
    if cfg.interval > 0 and create_folder:
        _check_writable(folder)
    if cfg.resume == "none":
        return None
    own = complete_checkpoints(folder, warn=is_rank0)
    if own and (cfg.resume == "auto" or cfg.load_model_only):
        # The run's own checkpoints win over an initial load (load_model_only): a run restarted
        # with the same command after a preemption must continue, not start over.
        if cfg.load_model_only and is_rank0:
            logger.info(
                "%s: resuming this run's own checkpoint; the initial weights (%s) were used "
                "for its first start only", own[0], cfg.resume
            )  # fmt: skip
        return _newest_undamaged(tuple(own), model_shapes, positions_per_micro_step, is_rank0)
    if cfg.resume == "auto":
        return None
    path = _check_resume_path(Path(cfg.resume))
    try:
        return _resume_point(path, model_shapes, positions_per_micro_step, cfg.load_model_only)
    except CorruptCheckpoint as bad:
        raise ConfigError(f"checkpoint.resume: {bad}; {_DAMAGED_HINT}") from None


def _newest_undamaged(
    candidates: tuple[Path, ...],
    model_shapes: dict[str, tuple[int, ...]],
    positions_per_micro_step: int,
    warn: bool,
    *damaged: str,
) -> ResumePoint:
    """The first of `candidates` (complete checkpoints of this run, newest first) that passes
    the file checks, skipping each damaged one with a warning that names the file.

    All damaged is an error, not a fresh start: training from scratch in this run folder would
    prune the damaged checkpoints once it saves keep_last of its own, and a checkpoint whose
    damage is an unmounted or half-synced file system would be lost for good. Moving them away
    (or another run.name) is a decision the user takes knowingly. `damaged`: the newer ones
    already skipped, for that error's list.
    """
    for i, path in enumerate(candidates):
        try:
            point = _resume_point(path, model_shapes, positions_per_micro_step, model_only=False)
        except CorruptCheckpoint as bad:
            if warn:
                logger.warning("checkpoint: skipping damaged %s: %s", path, bad)
            damaged = (*damaged, str(bad))
            continue
        # Called with what is wrong with this one, it goes on with the older ones.
        older = candidates[i + 1 :]
        fallback = partial(_newest_undamaged, older, model_shapes, positions_per_micro_step, warn)
        return replace(point, fallback=partial(fallback, *damaged))
    raise ConfigError(
        f"checkpoint.resume=auto: every complete checkpoint of this run is damaged "
        f"({'; '.join(damaged)}); not starting over, which would prune them later: repair "
        "them, move them out of the checkpoint folder, or resume one explicitly"
    )


def _resume_point(
    path: Path,
    model_shapes: dict[str, tuple[int, ...]],
    positions_per_micro_step: int,
    model_only: bool,
) -> ResumePoint:
    """Check that the checkpoint `path` is intact (as far as file sizes and its metadata tell)
    and fits this run. CorruptCheckpoint for a damaged file, ConfigError for a misfit."""
    metadata = check_files(path)
    _check_model(path, metadata, model_shapes)
    if model_only:
        return ResumePoint(path, 0, model_only=True)
    try:
        step, samples = read_progress(path)  # two integers, on every rank
    except Exception as err:  # noqa: BLE001 - the bytes are there (checked above) but unreadable
        files = {
            info.relative_path
            for index, info in metadata.storage_data.items()
            if index.fqn.startswith(f"{TRAIN}.")
        }
        where = path / min(files) if files else path
        raise CorruptCheckpoint(where, f"cannot be read ({type(err).__name__})") from None
    if samples % positions_per_micro_step:
        raise ConfigError(
            f"checkpoint {path}: it has consumed {samples} samples of the global data stream, "
            f"which dp_size x micro_batch_size = {positions_per_micro_step} does not divide, so "
            "the loader cannot continue the stream exactly; choose a mesh and "
            "train.micro_batch_size whose product divides it (keeping the checkpoint's "
            "train.global_batch_size always works), or checkpoint.resume=none to start over"
        )
    return ResumePoint(path, step, model_only=False)


def _check_writable(folder: Path) -> None:
    """Fail now, not at the first save hours later."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"  # per process: ranks probe concurrently
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"checkpoint folder {folder} is not writable ({err.strerror or err}): set "
            "checkpoint.folder or run.output_dir, or checkpoint.interval=0 to not save"
        ) from err


def _check_resume_path(path: Path) -> Path:
    if not path.is_dir():
        raise ConfigError(f"checkpoint.resume: {path} does not exist or is not a directory")
    if not is_complete(path):
        if latest := latest_complete(path):
            hint = f"; it is a folder of checkpoints, pass one of them, e.g. {latest}"
        else:
            hint = " (a save that did not finish, or not a checkpoint)"
        raise ConfigError(f"checkpoint.resume: {path} has no {COMPLETE} marker{hint}")
    return path


def _check_model(path: Path, metadata: Metadata, expected: dict[str, tuple[int, ...]]) -> None:
    """Compare the checkpoint's model entries (from its metadata) with this run's model."""
    saved = {
        key.removeprefix(f"{MODEL}."): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(f"{MODEL}.") and isinstance(meta, TensorStorageMetadata)
    }
    missing = [f"missing {k} {list(v)}" for k, v in expected.items() if k not in saved]
    unexpected = [f"unexpected {k} {list(v)}" for k, v in saved.items() if k not in expected]
    shapes = [
        f"{k}: checkpoint {list(saved[k])} vs model {list(v)}"
        for k, v in expected.items()
        if k in saved and saved[k] != v
    ]
    problems = missing + unexpected + shapes
    if problems:
        counts = [(len(missing), "missing"), (len(unexpected), "unexpected")]
        counts.append((len(shapes), "with another shape"))
        summary = ", ".join(f"{n} {what}" for n, what in counts if n)
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ConfigError(
            f"checkpoint {path} does not fit this model ({summary}: {'; '.join(problems[:10])}"
            f"{more}); set the model.* keys it was trained with (see its config.toml), or "
            "checkpoint.resume=none to start over"
        )


# ---- saving and loading during training ----------------------------------------------------


class CheckpointError(RuntimeError):
    """A save failed for a reason the user must fix (a full disk); the message is one line."""


@dataclass
class _InFlight:
    step: int
    path: Path
    future: Future
    writer: ChecksummingWriter
    started: float
    blocked: float  # seconds the training loop spent starting this save
    finished: float | None = None  # set by a done-callback, in the thread that finishes


class Checkpointer:
    """Saves and loads the states dict of `checkpoint/state.py` for one run.

    Call on every rank: saving and loading are collective. Rank 0 alone writes markers and
    deletes old checkpoints.
    """

    def __init__(self, cfg: CheckpointConfig, folder: Path, is_rank0: bool) -> None:
        self.cfg, self.folder, self.is_rank0 = cfg, folder, is_rank0
        self.in_flight: _InFlight | None = None
        # The async save thread runs collectives (planning, the final gather) while training
        # runs its own. On one group they would interleave and deadlock; a group of its own
        # keeps them apart, and gloo gives DCP the CPU backend it needs even on NCCL runs.
        self.group = None
        if cfg.interval > 0 and cfg.async_mode == "async":
            self.group = dist.new_group(backend="gloo")

    def load(self, states: dict[str, Any], resume: ResumePoint | None) -> ResumePoint | None:
        """Verify `resume` and load it into `states` in place (DCP reshards onto this mesh);
        returns the checkpoint loaded, which with resume=auto is an older one if `resume`
        is damaged (see check_resume). None: nothing to load."""
        # Every rank chose on its own, from its view of the file system. A node that does not
        # see the newest marker yet (NFS caching) would load another step: refuse, loudly.
        choices: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(choices, None if resume is None else str(resume.path))
        if len(set(choices)) > 1:
            raise RuntimeError(f"ranks disagree on the checkpoint to resume: {choices}")
        if resume is None:
            return None
        while damaged := self._damaged_files(resume.path):
            why = damaged[0] + (f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else "")
            if resume.fallback is None:
                raise ConfigError(f"checkpoint.resume: {why}; {_DAMAGED_HINT}")
            if self.is_rank0:
                logger.warning("checkpoint: skipping damaged %s: %s", resume.path, why)
            resume = resume.fallback(why)  # every rank has the same findings: same choice
        start = time.perf_counter()
        wanted = [MODEL] if resume.model_only else [k for k in states if k != CONFIG]
        dcp.load({k: states[k] for k in wanted}, checkpoint_id=resume.path)
        if self.is_rank0:
            what = "model weights only, starting at step 0" if resume.model_only else "all state"
            logger.info(
                "resumed from %s (%s, step %d) in %.3f s",
                resume.path,
                what,
                resume.step,
                time.perf_counter() - start,
            )
        return resume

    def _damaged_files(self, path: Path) -> list[str]:
        """Check the content of every file against the manifest: each rank sums its share of
        the files (about equal bytes), and every rank learns every finding ('file why')."""
        start = time.perf_counter()
        try:
            manifest = read_manifest(path)
        except CorruptCheckpoint as bad:  # check_resume read it fine: it changed since
            return [str(bad)]
        if manifest is None:
            if self.is_rank0:
                logger.warning(
                    "checkpoint %s has no checksums (saved before they were recorded): "
                    "loading it unverified", path
                )  # fmt: skip
            return []
        sizes = {name: entry["bytes"] for name, entry in manifest.items()}
        share = split_by_size(sizes, dist.get_world_size())[dist.get_rank()]
        found: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(found, verify_files(path, share))
        damaged = sorted(problem for problems in found for problem in problems)
        if self.is_rank0 and not damaged:
            logger.info(
                "checkpoint %s: %d files (%.0f MiB) match their checksums, verified in %.3f s",
                path, len(sizes), sum(sizes.values()) / 2**20, time.perf_counter() - start,
            )  # fmt: skip
        return damaged

    def maybe_save(self, step: int, states: dict[str, Any], last: bool) -> bool:
        """Save if `step` is due (returns whether it did); first finish an async save that is
        done, without blocking on one that is not."""
        if self.in_flight is not None and self.in_flight.future.done():
            self._finish()
        if not self.cfg.interval or (step % self.cfg.interval and not last):
            return False
        self.save(step, states)
        return True

    def save(self, step: int, states: dict[str, Any]) -> None:
        start = time.perf_counter()
        self.wait()  # at most one save in flight: it holds a full CPU copy of the state
        path = step_dir(self.folder, step)
        if self.is_rank0:
            # A directory left by an earlier attempt at this step must not look complete while
            # it is being overwritten. No rank writes before DCP's first collective, which
            # rank 0 joins only after this.
            (path / COMPLETE).unlink(missing_ok=True)
            (path / PENDING).unlink(missing_ok=True)
        # The writer is built here, not inferred by DCP from a path, so the storage can be
        # swapped in one place (and tests can slow it down or crash it). It records checksums.
        writer = ChecksummingWriter(str(path))
        if self.cfg.async_mode == "off":
            try:
                dcp.save(states, storage_writer=writer)
            except (Exception, CheckpointException) as err:  # DCP's is a BaseException
                raise self._save_error(step, path, err) from None
            blocked = time.perf_counter() - start
            self._mark_complete(step, path, writer, blocked, total=blocked)
            return
        response = dcp.async_save(states, storage_writer=writer, process_group=self.group)
        # torch may return an AsyncSaveResponse (staging and upload futures) or a Future.
        future = getattr(response, "upload_completion", response)
        blocked = time.perf_counter() - start
        self.in_flight = _InFlight(step, path, future, writer, start, blocked)
        future.add_done_callback(
            lambda _, s=self.in_flight: setattr(s, "finished", time.perf_counter())
        )

    def wait(self) -> None:
        """Block until the async save in flight (if any) is finished and marked complete."""
        if self.in_flight is not None:
            self._finish()

    def _finish(self) -> None:
        """Mark the finished async save complete; raises its error if it failed."""
        done, self.in_flight = self.in_flight, None
        assert done is not None
        try:
            done.future.result()
        except (Exception, CheckpointException) as err:
            raise self._save_error(done.step, done.path, err) from None
        total = (done.finished or time.perf_counter()) - done.started
        self._mark_complete(done.step, done.path, done.writer, done.blocked, total)

    def _save_error(self, step: int, path: Path, err: BaseException) -> BaseException:
        """A full disk (or another OS error) as one line; anything else as it came.

        On a full disk torch's writer often reports only `[enforce fail at inline_container.cc]
        unexpected pos` (its short write), inside DCP's per-rank tracebacks. DCP gives every
        rank the same error, so every rank raises the same line.
        """
        failures = getattr(err, "failures", {})  # DCP's CheckpointException: rank -> error
        causes = [err, *(exc for exc, _ in failures.values())]
        os_errors = [e for e in causes if isinstance(e, OSError) and e.errno]
        full = any(e.errno in (errno.ENOSPC, errno.EDQUOT) for e in os_errors)
        if not (full or os_errors or "unexpected pos" in str(err)):
            return err
        if os_errors and not full:
            return CheckpointError(
                f"checkpoint step {step}: {os_errors[0].strerror} writing {path} "
                "(the earlier checkpoints are intact)"
            )
        if self.is_rank0:  # a partial save is useless (resuming skips it) and holds space
            shutil.rmtree(path, ignore_errors=True)
        return CheckpointError(
            f"checkpoint step {step}: no space left on device writing {path} (the partial "
            "save is deleted, the earlier checkpoints are intact): free space, lower "
            "checkpoint.keep_last or set checkpoint.folder"
        )

    def _mark_complete(
        self, step: int, path: Path, writer: ChecksummingWriter, blocked: float, total: float
    ) -> None:
        """Rank 0 turns the manifest into the COMPLETE marker, then prunes.

        Called once this rank's save returned. DCP's last collective gathers every rank's write
        results (and checksums) on rank 0, which then writes the metadata and the manifest
        (`COMPLETE.tmp`); only after that does rank 0's save (or its future) return. So every
        rank has finished writing, and the marker can go: by a rename, which cannot fail on a
        full disk and is atomic, so a reader sees either no marker or the whole manifest.
        """
        if not self.is_rank0:
            return
        os.replace(path / PENDING, path / COMPLETE)
        _fsync_dir(path)
        logger.info(
            "checkpoint step %d: blocked %.3f s, total %.3f s, checksums %.3f s (%s)",
            step, blocked, total, writer.checksum_seconds, path,
        )  # fmt: skip
        self._prune(step)

    def _prune(self, newest: int) -> None:
        """Delete checkpoints older than the one just completed, keeping keep_last in all.

        Only older ones: a newer directory can exist when a run resumed from an earlier step,
        and it is not this function's to judge. Partial directories older than a complete one
        are leftovers of crashed saves and go too.
        """
        if self.cfg.keep_last == 0:
            return
        older = [(s, p) for s, p in list_step_dirs(self.folder) if s < newest]
        complete = [p for _, p in older if is_complete(p)]
        doomed = complete[: max(0, len(complete) - (self.cfg.keep_last - 1))]
        doomed += [p for _, p in older if not is_complete(p)]
        for path in doomed:
            # Marker first: a deletion cut short must not leave a "complete" half directory.
            (path / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
            logger.info("checkpoint: deleted %s (keep_last=%d)", path, self.cfg.keep_last)


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the directory entry, not just the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
