"""Distributed checkpoints (DCP): what is saved (`state.py`) and when and where (`manager.py`)."""

from checkpoint.manager import (
    COMPLETE,
    CheckpointConfig,
    Checkpointer,
    CheckpointError,
    ResumePoint,
    check_resume,
    checkpoint_folder,
    complete_checkpoints,
    is_complete,
    latest_complete,
    list_step_dirs,
    step_dir,
)
from checkpoint.state import TrainState, build_states

__all__ = [
    "COMPLETE",
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
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
