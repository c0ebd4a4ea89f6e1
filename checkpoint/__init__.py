"""Distributed checkpoints (DCP): save every N steps, resume from the latest complete one, on
any mesh. One module per reason to change:

| module | owns |
|---|---|
| `state.py` | what a checkpoint holds: the dict of `Stateful`s handed to DCP, its keys |
| `layout.py` | `CheckpointConfig`; the step-N directories and the COMPLETE marker on disk |
| `resume.py` | `check_resume`: choosing and checking what to resume, before any process group |
| `checkpointer.py` | `Checkpointer`: save (sync/async, marker, pruning), load (verify, fallback) |
| `integrity.py` | the manifest of file sizes and CRC32s: written at save, checked at resume |
| `hf.py`, `export.py` | Hugging Face safetensors: export a checkpoint, start a run from one |
"""

from checkpoint.checkpointer import Checkpointer, CheckpointError, warn_if_low_space
from checkpoint.integrity import COMPLETE
from checkpoint.layout import (
    CheckpointConfig,
    checkpoint_folder,
    complete_checkpoints,
    is_complete,
    latest_complete,
    list_step_dirs,
    step_dir,
)
from checkpoint.resume import ResumePoint, check_resume
from checkpoint.state import TrainState, build_states

__all__ = [
    "COMPLETE",
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "warn_if_low_space",
    "ResumePoint",
    "TrainState",
    "build_states",
    "check_resume",
    "checkpoint_folder",
    "complete_checkpoints",
    "is_complete",
    "latest_complete",
    "list_step_dirs",
    "step_dir",
]
