"""Where a run's checkpoints live: the `[checkpoint]` settings and the on-disk layout.

The checkpoint of step N is the DCP directory `<run dir>/checkpoints/step-<N>/` (see
`checkpoint/state.py` for its keys). It counts only once the marker file `COMPLETE` exists:
rank 0 writes it after DCP finished on every rank, so a crash or `kill -9` mid-save leaves a
directory without the marker, which resuming skips, and the previous checkpoint intact.

This module lists and names those directories; choosing one to resume is
`checkpoint/resume.py`, writing them `checkpoint/checkpointer.py`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from checkpoint.integrity import COMPLETE
from configs import ConfigError, check_folder_name

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d+)")


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
    """Dtype of the weights written by the Hugging Face export tool. Not applied to
    `--adapters-only` exports, which are float32 unless `--dtype` says otherwise."""
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
        if self.init_from_hf is not None and not self.init_from_hf.strip():
            # Falsy, it would be taken for "not set": the run would train from random weights.
            raise ConfigError(
                f"checkpoint.init_from_hf={self.init_from_hf!r} names no folder: give a local "
                "Hugging Face directory, or leave the key out (none) to start from random weights"
            )
        if self.init_from_hf and self.resume not in ("auto", "none"):
            # Two sources of weights: which would win is a guess, so neither is chosen silently.
            raise ConfigError(
                f"checkpoint.init_from_hf and checkpoint.resume={self.resume!r} both give the "
                "weights to start from: set one (resume=<path> with load_model_only=true starts "
                "a new run from another run's checkpoint)"
            )
        check_folder_name("checkpoint.folder", self.folder, absolute=True)


def checkpoint_folder(cfg: CheckpointConfig, run_dir: Path) -> Path:
    return run_dir / cfg.folder  # an absolute cfg.folder replaces run_dir


def existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing parent: where a folder that is not
    there yet would be created (its file system, its permissions)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


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
