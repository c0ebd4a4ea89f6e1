"""Elastic restarts: the mesh for the world torchrun starts after a node is lost.

    NNODES=1:2 MAX_RESTARTS=3 ... launch/multinode.sh configs/debug.toml --parallel.mesh=auto

With `--nnodes=MIN:MAX`, torchrun's agents on the nodes that remain restart their workers as a
smaller world when one agent dies. Each restart runs train.py from the top: `check_config`
picks the mesh for the new world here (`choose_mesh`), the run resumes from the newest complete
checkpoint (DCP reshards it, the data position is a global stream position), and the global
batch stays the same: gradient accumulation grows. A mesh that follows the world is
`parallel.mesh='auto'` (dp_replicate = nodes, dp_shard = ranks per node) or
`parallel.dp_replicate=-1` with dp_shard given; dp_shard stays inside a node either way.

A world that cannot hold the run (the global batch does not divide, tp or ep do not fit) is
one ConfigError that names the nodes left and the node counts that would fit: the run never
trains with another batch. Every checkpoint records the mesh it was saved on (the `mesh`
entry, checkpoint/state.py), which is how a resumed run knows the world it came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from checkpoint import checkpoint_folder, latest_complete
from checkpoint.state import read_mesh
from configs import ConfigError
from launch.job import JobConfig
from model import ModelFamily
from parallel.dims import LaunchEnv, resolve_dims
from parallel.ep import check_ep

# Exit status of the ranks after a node was lost and the step in flight was saved: not 0, so
# that torchrun restarts the workers on the nodes that remain (a clean exit would end the run).
NODE_LOST_EXIT = 3


class NodeLost(RuntimeError):
    """A rank's launcher died (its node is gone): the step in flight was saved by every rank."""


@dataclass(frozen=True)
class Mesh:
    """The data-parallel layout of one world, as recorded in every checkpoint."""

    world_size: int
    nodes: int
    dp_replicate: int
    dp_shard: int
    grad_accum_steps: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def choose_mesh(job: JobConfig, family: ModelFamily, args: Any, env: LaunchEnv) -> Mesh:
    """The mesh and gradient accumulation for this world, or ConfigError. The global batch is
    fixed: accumulation = global / (micro x data-parallel ranks) must be whole."""
    dp_replicate, dp_shard = resolve_dims(job.parallel, env)
    fsdp_ranks = dp_shard * job.parallel.cp  # FSDP and EP take cp ranks as data-parallel ones
    check_ep(family, args, job.parallel, fsdp_ranks, job.model.name, job.compile)
    # Under ft.enabled (parallel/ft.py) the global batch is split over the replica groups too.
    dp, t = dp_replicate * dp_shard * (job.ft.groups if job.ft.enabled else 1), job.train
    if t.global_batch_size % (t.micro_batch_size * dp) != 0:
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel ranks ({dp})"
        )
    accum = t.global_batch_size // (t.micro_batch_size * dp)
    return Mesh(env.world_size, env.num_nodes, dp_replicate, dp_shard, accum)


def saved_mesh(job: JobConfig) -> Mesh | None:
    """The mesh of the checkpoint this run would resume (checkpoint.resume: auto or a path);
    None for a fresh start or a checkpoint from before meshes were recorded."""
    cfg = job.checkpoint
    if cfg.resume == "none" or cfg.load_model_only:
        return None
    path: Path | None = Path(cfg.resume)
    if cfg.resume == "auto":
        path = latest_complete(checkpoint_folder(cfg, Path(job.run.output_dir) / job.run.name))
    recorded = read_mesh(path) if path is not None and path.is_dir() else None
    return Mesh(**recorded) if recorded is not None else None


def restarted() -> bool:
    """torchrun restarted this worker group (--max-restarts) at least once."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0


# What a plain torchrun lacks for a restart to work (the launch scripts export it).
FRESH_STORE = (
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (launch/torchrun.sh, "
    "multinode.sh and hsdp.sbatch do), so that each restart gets a fresh store"
)


def shared_store_problem(environ: Mapping[str, str]) -> str | None:
    """The one line for a worker that torchrun restarted on the rendezvous store of its first
    start (TORCHELASTIC_USE_AGENT_STORE, torchrun's default): the store still holds the first
    start's keys, so the new process group reads the addresses of ranks that are gone and
    waits for them (gloo's connectFullMesh fails after its retries; after a lost node, the
    ranks wait out parallel.timeout_s, 600 s by default), without a line of the trainer's.
    None for a first start, or a fresh store."""
    restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart == 0:
        return None
    return (
        f"torchrun restarted the workers (restart {restart} of "
        f"{environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}) on the rendezvous store of their "
        "first start, whose stale keys would have the new process group wait for ranks that "
        f"are gone; stopping instead: {FRESH_STORE}, then run the same command again (it "
        "resumes from the newest checkpoint)"
    )


def shared_store_warning(environ: Mapping[str, str]) -> str | None:
    """At a first start under torchrun with --max-restarts > 0 and the shared store: a
    restart would stop (`shared_store_problem`); one warning line, said before it matters."""
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restarts == 0 or restart > 0:
        return None
    return (
        f"torchrun --max-restarts={restarts} shares its rendezvous store with the workers: a "
        f"restart would stop with one line instead of training on; {FRESH_STORE}"
    )


def mesh_for_world(job: JobConfig, family: ModelFamily, args: Any, env: LaunchEnv) -> Mesh:
    """`choose_mesh`, and when this world cannot hold the run but the checkpoint's could, one
    line that says what changed, the nodes left and what would fit."""
    try:
        return choose_mesh(job, family, args, env)
    except ConfigError as err:
        before = saved_mesh(job)
        if before is None or before.world_size == env.world_size:
            raise
        raise ConfigError(f"{shrink_problem(job, family, args, env, before)}: {err}") from None


def shrink_problem(
    job: JobConfig, family: ModelFamily, args: Any, env: LaunchEnv, before: Mesh
) -> str:
    """'world 8 -> 6 after a restart (3 nodes left of 4, 2 ranks each; fits on 1, 2 or 4
    nodes, or here with train.micro_batch_size=1)'."""
    per_node = env.local_world_size
    nodes = [
        n for n in range(1, max(before.nodes, env.num_nodes) + 1)
        if _fits(job, family, args, LaunchEnv(0, 0, n * per_node, per_node, n))
    ]  # fmt: skip
    fits = f"fits on {_or(nodes)} node(s)" if nodes else "fits on no number of such nodes"
    smaller = [
        m for m in range(job.train.micro_batch_size - 1, 0, -1)
        if _fits(replace(job, train=replace(job.train, micro_batch_size=m)), family, args, env)
    ]  # fmt: skip
    if smaller:
        fits += f", or here with train.micro_batch_size={smaller[0]}"
    when = "after a restart" if restarted() else "since the checkpoint"
    return (
        f"world {before.world_size} -> {env.world_size} {when} ({env.num_nodes} node(s) left "
        f"of {before.nodes}, {per_node} ranks each; the run {fits})"
    )


def unfit_node_counts(
    job: JobConfig, family: ModelFamily, args: Any, env: LaunchEnv, min_nodes: int
) -> str | None:
    """At launch, for --nnodes=MIN:MAX: the node counts between MIN and this launch's that could
    not hold the run, as one warning line (None when all can): a restart on them would stop."""
    per_node, unfit = env.local_world_size, {}
    for n in range(min_nodes, env.num_nodes):
        try:
            choose_mesh(job, family, args, LaunchEnv(0, 0, n * per_node, per_node, n))
        except ConfigError as err:
            unfit[n] = str(err)
    if not unfit:
        return None
    first = min(unfit)
    return (
        f"nodes {min_nodes}:{env.num_nodes}: a restart on {_or(sorted(unfit))} node(s) would "
        f"stop instead of training with another batch (on {first}: {unfit[first]})"
    )


def _fits(job: JobConfig, family: ModelFamily, args: Any, env: LaunchEnv) -> bool:
    try:
        choose_mesh(job, family, args, env)
    except ConfigError:
        return False
    return True


def _or(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def restart_line(before: Mesh | None, now: Mesh, step: int) -> str | None:
    """'world 4 -> 2 after a restart: dp_replicate 2 -> 1, grad accumulation 1 -> 2, resumed
    from step 12', or None when the world did not change."""
    if before is None or before.world_size == now.world_size:
        return None
    named = {"dp_replicate": "dp_replicate", "dp_shard": "dp_shard",
             "grad_accum_steps": "grad accumulation"}  # fmt: skip
    changes = [
        f"{name} {getattr(before, key)} -> {getattr(now, key)}"
        for key, name in named.items()
        if getattr(before, key) != getattr(now, key)
    ]
    when = "after a restart" if restarted() else "since the checkpoint"
    return (
        f"world {before.world_size} -> {now.world_size} {when}: "
        f"{', '.join(changes) or 'same mesh'}, resumed from step {step}"
    )
