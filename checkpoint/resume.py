"""Choosing the checkpoint to resume, and checking it, before any process group exists.

`check_resume` runs in `check_config`, on every rank, before the process group exists: it
finds the checkpoint to resume and rejects one that cannot work (wrong model shapes, a data
position the new mesh cannot continue, a missing path, an unwritable folder) as ConfigError.
It verifies what reads no tensor data (`checkpoint.integrity.check_files`): the manifest
reads and lists every data file, each is there with its size, `.metadata` unpickles, every
file it points into is long enough, the step and data position read back. The content
(checksums) is verified later, by `Checkpointer.load` (`checkpoint/checkpointer.py`), once the
process group exists.

Fallback: a damaged checkpoint is skipped, with one warning naming the file, for the next
older complete one when `resume=auto` chose it (here for a file check, in `Checkpointer.load`
through `ResumePoint.fallback` for a content check); a damaged `checkpoint.resume=<path>` is
one ConfigError naming the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from checkpoint.integrity import COMPLETE, CorruptCheckpoint, check_files
from checkpoint.layout import (
    CheckpointConfig,
    checkpoint_folder,
    complete_checkpoints,
    existing_ancestor,
    is_complete,
    latest_complete,
)
from checkpoint.state import MODEL, TRAIN, read_progress
from configs import ConfigError

logger = logging.getLogger(__name__)

DAMAGED_HINT = "the checkpoint is damaged: resume another one (an older step-N of its run)"


class ModelMismatch(ConfigError):
    """A checkpoint whose parameters (names or shapes) are not this model's. `check_config`
    names the settings behind it from the checkpoint's config (launch/resume_rules.py)."""

    def __init__(self, message: str, path: Path, summary: str, model_only: bool) -> None:
        super().__init__(message)
        self.path, self.summary, self.model_only = path, summary, model_only


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
    check_writable: bool,
) -> ResumePoint | None:
    """Find the checkpoint to resume from and check it fits this run; ConfigError if not.

    Only reads files (and, with check_writable and saving on, checks that the checkpoint folder
    can be written, creating nothing): every rank runs it on the same inputs before any
    collective, so all fail alike.
    `model_shapes`: parameter FQN -> shape of this run's model (built on meta).
    `positions_per_micro_step`: dp_size * micro_batch_size, which must divide the checkpoint's
    data position for the loader to continue the global stream exactly.
    """
    folder = checkpoint_folder(cfg, run_dir)
    if cfg.interval > 0 and check_writable:
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
        raise ConfigError(f"checkpoint.resume: {bad}; {DAMAGED_HINT}") from None


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
    _check_model(path, metadata, model_shapes, model_only)
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
    """Fail now, not at the first save hours later. Creates nothing: the folder, or where it
    would be created, takes a probe file and loses it again. A later error (a damaged explicit
    resume, a network error) then leaves no empty folder behind; the first save makes it."""
    where = existing_ancestor(folder)
    try:
        probe = where / f".write-test-{os.getpid()}"  # per process: ranks probe concurrently
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


def _check_model(
    path: Path, metadata: Metadata, expected: dict[str, tuple[int, ...]], model_only: bool
) -> None:
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
        raise ModelMismatch(
            f"checkpoint {path} does not fit this model ({summary}: {'; '.join(problems[:10])}"
            f"{more}); set the model.* and lora.* keys it was trained with (see its config.toml)",
            path, summary, model_only,
        )  # fmt: skip
