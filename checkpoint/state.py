"""What a checkpoint holds: each piece of training state as a `Stateful` that DCP saves and loads.

`build_states` gathers them into the one dict handed to `dcp.save` / `dcp.load`; its top-level
keys (the constants MODEL, OPTIMIZER, ... below) are the checkpoint format that resume and
`checkpoint/export.py` rely on, read without a process group by `read_progress` and
`read_run_config`:

| key | what | on resume |
|---|---|---|
| `model` | `get_model_state_dict`: FQN -> DTensor shard (full shapes in the metadata) | loaded |
| `optimizer` | `get_optimizer_state_dict`: AdamW moments and step (or Muon's), by FQN | loaded |
| `lr_scheduler` | `LambdaLR.state_dict()` (its lambdas are rebuilt from the config) | loaded |
| `dataloader` | the train loader's state: global stream positions consumed | loaded |
| `train` | step, samples and tokens seen, RNG states | loaded |
| `config` | the resolved config as TOML text, for tools and humans | never |
| `mesh` | world, nodes, dp_replicate, dp_shard, grad accumulation (launch/elastic.py) | never |

DCP saves sharded tensors once per shard and replicated values (plain tensors, Python objects)
once, deduplicated across ranks; every rank reads what it needs when loading, so a checkpoint
loads on any mesh.
"""

from __future__ import annotations

import pickle
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader

from configs import ConfigError

# The checkpoint's top-level keys: the format that resume, export and tools read.
MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN = "train"
CONFIG = "config"
MESH = "mesh"
# What a checkpoint's mesh entry records (launch/elastic.py's Mesh).
MESH_FIELDS = ("world_size", "nodes", "dp_replicate", "dp_shard", "grad_accum_steps")


def plain_tensors(state: Any) -> Any:
    """The same nested state with tensor-subclass wrappers replaced by the plain tensors they wrap.

    FP8 training (torchao) wraps each weight, and AdamW's moments made from it with zeros_like,
    in a tensor subclass. Saved as is, a checkpoint would need torchao to be read and would not
    load into a bf16 run. The plain tensor shares the wrapper's storage, so DCP still loads in
    place into the live parameters and optimizer state.
    """
    if isinstance(state, dict):
        return {k: plain_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_tensors(v) for v in state]
    if isinstance(state, DTensor):
        local = _unwrap(state.to_local())
        if local is state.to_local():
            return state
        return DTensor.from_local(local, state.device_mesh, state.placements,
                                  shape=state.shape, stride=state.stride())  # fmt: skip
    return _unwrap(state) if isinstance(state, torch.Tensor) else state


def _unwrap(tensor: torch.Tensor) -> torch.Tensor:
    # Traceable wrapper subclasses expose their inner tensors through __tensor_flatten__.
    while type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        inner, _ = tensor.__tensor_flatten__()
        if len(inner) != 1:
            break
        tensor = getattr(tensor, inner[0])
    return tensor


class ModelState(Stateful):
    """The model's parameters by FQN (`tok_embeddings.weight`, `layers.0.attention.wq.weight`).

    Model and optimizer go through `torch.distributed.checkpoint.state_dict`, which knows
    FSDP2's DTensor parameters and keys both by FQN, so either loads onto any mesh. They are two
    Statefuls (as in torchtitan) so that each is a top-level key of the checkpoint.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return plain_tensors(get_model_state_dict(self.model))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """AdamW state (moments and step per parameter FQN, and the param groups); under Muon
    (parallel/muon.py) a momentum buffer for each of Muon's matrices instead."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return plain_tensors(get_optimizer_state_dict(self.model, self.optimizer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Under pipeline parallel each rank's groups list its own stages' parameters (a middle
        # stage's may have none), and DCP keeps one rank's copy of this plain object. A rank
        # whose parameters it does not name takes its own groups: their settings are the
        # config's, set again after loading anyway (train.py, apply_optimizer_config).
        own = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        named = {name for group in state_dict["param_groups"] for name in group["params"]}
        if any(name not in named for group in own for name in group["params"]):
            state_dict["param_groups"] = own
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class DataLoaderState(Stateful):
    """The train loader's position, stored as one pickled entry.

    DCP loads into a template of the same keys as what was saved, but a `StatefulDataLoader`'s
    state dict changes shape once it has been iterated (and with workers), so a fresh loader
    cannot serve as the template; one opaque entry can. The state is the global number of stream
    positions consumed, identical on every rank and independent of the mesh (see
    data/loader.py), so the single copy DCP keeps after deduplication is right for every rank of
    any mesh whose dp_size * micro_batch_size divides it.
    """

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return {"state": pickle.dumps(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(pickle.loads(state_dict["state"]))


@dataclass
class TrainState(Stateful):
    """Progress counters and RNG states.

    All ranks are seeded alike and nothing in the trainer draws per-rank random numbers, so
    the RNG states are identical everywhere and the one copy DCP keeps is right for every rank.
    They are stored as bytes, not tensors, so that a checkpoint made on CPU loads on a GPU run
    (and back) even though the CUDA state is absent on one side.
    """

    step: int = 0
    """Optimizer steps completed."""
    samples_seen: int = 0
    """Sequences consumed = the train loader's global stream position."""
    tokens_seen: int = 0
    """Input tokens consumed (samples_seen x seq_len while seq_len is unchanged)."""

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "rng": {
                "cpu": torch.get_rng_state().numpy().tobytes(),
                "cuda": b"" if cuda is None else cuda.numpy().tobytes(),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.samples_seen = int(state_dict["samples_seen"])
        self.tokens_seen = int(state_dict["tokens_seen"])
        rng = state_dict["rng"]
        torch.set_rng_state(torch.frombuffer(bytearray(rng["cpu"]), dtype=torch.uint8))
        if rng["cuda"] and torch.cuda.is_initialized():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(rng["cuda"]), dtype=torch.uint8))


def build_states(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: StatefulDataLoader,
    progress: TrainState,
    config_toml: str,
    mesh: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The dict handed to DCP: every entry a Stateful, plus the config text and the mesh it is
    saved on (both written, never loaded)."""
    return {
        MODEL: ModelState(model),
        OPTIMIZER: OptimizerState(model, optimizer),
        LR_SCHEDULER: scheduler,  # LRScheduler has state_dict/load_state_dict: a Stateful
        DATALOADER: DataLoaderState(loader),
        TRAIN: progress,
        CONFIG: config_toml,
    } | ({MESH: dict(mesh)} if mesh is not None else {})


# ---- reading a checkpoint in one process, with no process group -----------------------------


def load_no_dist(state_dict: dict, path: Path) -> None:
    """dcp.load by one process (every rank may call it before the process group exists)."""
    with warnings.catch_warnings():  # DCP warns that no_dist means one process: intended
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(state_dict, checkpoint_id=path, no_dist=True)


def read_progress(path: Path) -> tuple[int, int]:
    """(optimizer steps done, samples of the global data stream consumed) of a checkpoint."""
    progress = {TRAIN: {"step": 0, "samples_seen": 0}}
    load_no_dist(progress, path)
    return progress[TRAIN]["step"], progress[TRAIN]["samples_seen"]


def read_run_config(checkpoint_dir: Path, entries: set[str]) -> tuple[dict, str]:
    """The run's resolved config from the checkpoint's config entry (`entries`: its top-level
    keys), and where it was read."""
    if CONFIG not in entries:  # build_states gives every checkpoint one
        raise ConfigError(f"{checkpoint_dir} has no config entry: not a checkpoint of this trainer")
    state = {CONFIG: ""}
    load_no_dist(state, checkpoint_dir)
    text, source = state[CONFIG], f"{checkpoint_dir} (config entry)"
    try:
        return tomllib.loads(text), source
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot read the config from {source}: {e}") from e


def read_mesh(path: Path) -> dict[str, int] | None:
    """The mesh entry of a checkpoint ({field: value} of MESH_FIELDS), or None for one saved
    without it (by an older version of this trainer)."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if not all(f"{MESH}.{name}" in keys for name in MESH_FIELDS):
        return None
    state = {MESH: dict.fromkeys(MESH_FIELDS, 0)}
    load_no_dist(state, path)
    return state[MESH]
