"""Saving and loading during training: the `Checkpointer`, on every rank.

`Checkpointer` runs in the training loop: loads the resume point, saves when due (in the
background with `async_mode = "async"`), writes the marker, deletes old checkpoints
(keep_last), and turns a full disk into one line (`CheckpointError`).

Loading verifies first: the content of every file against the manifest
(`checkpoint/integrity.py`). The files are dealt out to the ranks by size, each rank sums its
share, and all ranks learn every mismatch (one all_gather). A damaged checkpoint that
`resume=auto` chose falls back to the next older complete one (`ResumePoint.fallback`, see
`checkpoint/resume.py`); a damaged explicit `checkpoint.resume=<path>` is a ConfigError.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from checkpoint.integrity import (
    COMPLETE,
    PENDING,
    ChecksummingWriter,
    CorruptCheckpoint,
    read_manifest,
    split_by_size,
    verify_files,
)
from checkpoint.layout import (
    CheckpointConfig,
    complete_checkpoints,
    existing_ancestor,
    is_complete,
    list_step_dirs,
    step_dir,
)
from checkpoint.resume import DAMAGED_HINT, ResumePoint
from checkpoint.state import CONFIG, MESH, MODEL
from configs import ConfigError

logger = logging.getLogger(__name__)


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


def warn_if_low_space(folder: Path, checkpoint_bytes: int) -> None:
    """Warn (rank 0, at startup) when the checkpoint folder's file system has less free space
    than one checkpoint of this run: its first save would fail hours from now otherwise."""
    where = existing_ancestor(folder)  # the folder may not exist yet
    free = shutil.disk_usage(where).free
    if free < checkpoint_bytes:
        logger.warning(
            "checkpoint: %s has %.2f GB free, less than one checkpoint of this run (about %.2f "
            "GB): its saves will fail; free space or set checkpoint.folder",
            where, free / 1e9, checkpoint_bytes / 1e9,
        )  # fmt: skip


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

    def load(
        self, states: dict[str, Any], resume: ResumePoint | None, total_steps: int
    ) -> ResumePoint | None:
        """Verify `resume` and load it into `states` in place (DCP reshards onto this mesh);
        returns the checkpoint loaded, which with resume=auto is an older one if `resume`
        is damaged (see check_resume). None: nothing to load. Rank 0 logs the run's start
        (`resuming ... at step N of total_steps`) only here, once the checkpoint it names is
        verified, so no line names a checkpoint that is then skipped."""
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
                raise ConfigError(f"checkpoint.resume: {why}; {DAMAGED_HINT}")
            if self.is_rank0:
                logger.warning("checkpoint: skipping damaged %s: %s", resume.path, why)
            resume = resume.fallback(why)  # every rank has the same findings: same choice
        start = time.perf_counter()
        written_only = (CONFIG, MESH)  # for tools and humans (the mesh: launch/elastic.py)
        wanted = [MODEL] if resume.model_only else [k for k in states if k not in written_only]
        dcp.load({k: states[k] for k in wanted}, checkpoint_id=resume.path)
        seconds = time.perf_counter() - start
        if self.is_rank0 and resume.model_only:
            logger.info("starting at step 0 of %d from the model weights of %s (loaded in "
                        "%.3f s)", total_steps, resume.path, seconds)  # fmt: skip
        elif self.is_rank0:
            logger.info("resuming %s at step %d of %d (all state, loaded in %.3f s)",
                        resume.path, resume.step, total_steps, seconds)  # fmt: skip
        return resume

    def _damaged_files(self, path: Path) -> list[str]:
        """Check the content of every file against the manifest: each rank sums its share of
        the files (about equal bytes), and every rank learns every finding ('file why')."""
        start = time.perf_counter()
        try:
            manifest = read_manifest(path)
        except CorruptCheckpoint as bad:  # check_resume read it fine: it changed since
            return [str(bad)]
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

    @property
    def save_done(self) -> bool:
        """This rank's part of the async save in flight is done (for the step's all-reduce)."""
        return self.in_flight is not None and self.in_flight.future.done()

    def maybe_save(self, step: int, states: dict[str, Any], last: bool, finish: bool) -> bool:
        """Save if `step` is due (returns whether it did). First, when some rank's async save
        is done (`finish`: the step's all-reduce of `save_done`), finish it here too, waiting
        for this rank's part: every rank then raises a failed save's error after the same
        step. Deciding alone, a rank whose part was done first stopped, and a peer whose part
        was not went on into the next step's collectives and lost it ("peer lost")."""
        if self.in_flight is not None and finish:
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
        # overwrite=True: said, not left to a default torch has announced it may change.
        writer = ChecksummingWriter(str(path), overwrite=True)
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
        # Only what is true: a run that never saved has nothing to fall back on.
        earlier = [p for p in complete_checkpoints(self.folder) if p != path]
        kept = (
            f"{earlier[0].name} and older are intact" if earlier
            else "this run has no earlier checkpoint: a restart starts over"
        )  # fmt: skip
        if os_errors and not full:
            return CheckpointError(
                f"checkpoint step {step}: {os_errors[0].strerror} writing {path} ({kept})"
            )
        if self.is_rank0:  # a partial save is useless (resuming skips it) and holds space
            shutil.rmtree(path, ignore_errors=True)
        return CheckpointError(
            f"checkpoint step {step}: no space left on device writing {path} (the partial "
            f"save is deleted, {kept}): free space, lower checkpoint.keep_last or set "
            "checkpoint.folder"
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
