"""Parallel degrees: what the user asked for, checked against what torchrun started.

Everything here is pure arithmetic on environment numbers, so a wrong mesh is reported by
every rank *before* any process group exists and nothing can hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from configs import ConfigError
from parallel.pp_config import PipelineConfig


@dataclass
class ParallelConfig:
    mesh: Literal["manual", "auto"] = "manual"
    """'auto': HSDP with one replica per node when torchrun spans several nodes, else FSDP
    (each over the ranks per node / tp). 'manual': use dp_replicate and dp_shard as given."""
    dp_replicate: int = 1
    """Replica groups (HSDP: usually the number of nodes). 1 = plain FSDP. -1 = the remaining
    ranks (then dp_shard must be given)."""
    dp_shard: int = -1
    """Ranks each replica is sharded over (usually GPUs per node). -1 = the remaining ranks."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel), the innermost mesh dimension: must
    divide the ranks per node, since its collectives run in every layer (fast links only)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (2 chunks each, one early and
    one late, for an even share of causal work), keys and values all-gathered per layer
    (parallel/cp.py); 2 x cp must divide data.seq_len. The cp ranks are data-parallel for the
    weights: FSDP shards over dp_shard x cp."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts families): the experts are split over groups
    of ep consecutive ranks of dp_shard x cp x tp, tokens sent to them by all-to-all
    (parallel/ep.py)."""
    pp: int = 1
    """Pipeline-parallel degree, the outermost mesh dimension (world = pp x dp_replicate x
    dp_shard x cp x tp): the blocks split into stages of contiguous ranges, each stage on its
    own ranks, activations sent between them (parallel/pp.py; [parallel.pipeline])."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """How the pp stages run: the schedule, stages per rank, micro-batches, the split."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """'always' frees gathered parameters after forward (ZeRO-3, least memory); 'never' keeps
    them until backward (ZeRO-2 style, one all-gather fewer per block); 'default' frees them
    except for the last block, whose backward starts right away."""
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of all-gathered parameters and compute. float32 gives exact cross-mesh parity."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduce-scatter / all-reduce."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy)."""
    forward_prefetch: int = 0
    """Blocks to all-gather ahead in forward, set explicitly. 0 = FSDP's implicit prefetch."""
    backward_prefetch: int = 0
    """Blocks to all-gather ahead in backward, set explicitly. 0 = FSDP's implicit prefetch."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """'auto' = CUDA with NCCL when a GPU is visible, else CPU with gloo."""
    timeout_s: int = 600
    """Process-group timeout for start-up and the first step (compile, loading a checkpoint,
    the first all-gathers): a collective that waits longer fails instead of hanging."""
    step_timeout_s: int | None = None
    """The timeout from the second step on, when a step's collectives wait only for slow
    peers: a shorter one names a hung rank sooner. Default: timeout_s, at most 300. It must
    still cover the longest wait of the steady state: a checkpoint save, an evaluation."""

    def __post_init__(self) -> None:
        if self.mesh == "auto" and (self.dp_replicate != 1 or self.dp_shard != -1):
            raise ConfigError(
                "parallel: mesh='auto' chooses dp_replicate and dp_shard itself; "
                f"got dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard} "
                "(drop them or set parallel.mesh='manual')"
            )
        if any(d < 1 and d != -1 for d in (self.dp_replicate, self.dp_shard)) or (
            self.dp_replicate == -1 and self.dp_shard == -1
        ):
            raise ConfigError(
                f"parallel: dp_replicate={self.dp_replicate} and dp_shard={self.dp_shard} must "
                "be >= 1, or -1 ('the remaining ranks') for at most one of them"
            )
        for name in ("tp", "cp", "ep", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.forward_prefetch < 0 or self.backward_prefetch < 0 or self.timeout_s < 1:
            raise ConfigError("parallel: prefetch depths must be >= 0 and timeout_s >= 1")
        if self.step_timeout_s is not None and not 1 <= self.step_timeout_s <= self.timeout_s:
            raise ConfigError(
                f"parallel.step_timeout_s must be in 1..timeout_s ({self.timeout_s}), got "
                f"{self.step_timeout_s}: it is the shorter timeout after the first step"
            )

    @property
    def steady_timeout_s(self) -> int:
        """The timeout after the first step (step_timeout_s, or its default)."""
        return self.step_timeout_s or min(self.timeout_s, 300)


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun (or a plain `python train.py`) tells this process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int

    @classmethod
    def from_env(cls) -> LaunchEnv:
        world = int(os.environ.get("WORLD_SIZE", 1))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        # GROUP_WORLD_SIZE is torchrun's number of agents, i.e. nodes.
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=world,
            local_world_size=local_world,
            num_nodes=nodes,
        )


def resolve_dims(cfg: ParallelConfig, env: LaunchEnv) -> tuple[int, int]:
    """Return (dp_replicate, dp_shard) for this launch, or raise ConfigError.

    The data-parallel dims fill world_size / (pp x cp x tp) ranks; tp is checked first, against
    the ranks of one node (tensor parallel never crosses nodes)."""
    tp, cp, pp = cfg.tp, cfg.cp, cfg.pp
    if env.local_world_size % tp != 0 or env.world_size % tp != 0:
        raise ConfigError(
            f"parallel: tp ({tp}) must divide the ranks per node ({env.local_world_size}, "
            f"world size {env.world_size} = {env.num_nodes} node(s) x {env.local_world_size}): "
            "tensor parallel stays inside a node"
        )
    if env.world_size % (tp * cp) != 0:
        raise ConfigError(
            f"parallel: cp ({cp}){f' x tp ({tp})' if tp > 1 else ''} must divide the world "
            f"size ({env.world_size} ranks: {env.num_nodes} node(s) x {env.local_world_size})"
        )
    if env.world_size % (pp * tp * cp) != 0:
        raise ConfigError(
            f"parallel: pp ({pp}) x cp ({cp}) x tp ({tp}) must divide the world size "
            f"({env.world_size} ranks: {env.num_nodes} node(s) x {env.local_world_size})"
        )
    world = env.world_size // (pp * tp * cp)  # data-parallel ranks of one stage
    if cfg.mesh == "auto":
        if env.local_world_size * env.num_nodes != env.world_size:
            raise ConfigError(
                f"parallel.mesh='auto': nodes run different numbers of ranks "
                f"(WORLD_SIZE={env.world_size}, {env.num_nodes} nodes, this node "
                f"LOCAL_WORLD_SIZE={env.local_world_size}); an HSDP mesh needs the same number "
                "of ranks on every node: start the same --nproc-per-node everywhere, or set "
                "parallel.mesh='manual'"
            )
        if env.num_nodes > 1:
            if pp > 1:  # a stage per group of nodes; HSDP's replicas: the nodes of a stage
                if env.num_nodes % pp != 0 or env.local_world_size % (tp * cp) != 0:
                    raise ConfigError(
                        f"parallel.mesh='auto' with pp={pp}: pp must divide the nodes "
                        f"({env.num_nodes}) and cp x tp the ranks per node; or set "
                        "parallel.mesh='manual'"
                    )
                return env.num_nodes // pp, env.local_world_size // (tp * cp)
            if env.local_world_size % (tp * cp) != 0:
                raise ConfigError(
                    f"parallel.mesh='auto': cp ({cp}) x tp ({tp}) must divide the ranks per "
                    f"node ({env.local_world_size}): a replica is one node"
                )
            return env.num_nodes, env.local_world_size // (tp * cp)
        return 1, world
    rep, shard = cfg.dp_replicate, cfg.dp_shard
    if shard == -1:
        shard = max(1, world // rep)
    if rep == -1:
        rep = max(1, world // shard)
    if pp * rep * shard * cp * tp != env.world_size:
        more = (f" x cp ({cp})" if cp > 1 else "") + (f" x tp ({tp})" if tp > 1 else "")
        first = f"pp ({pp}) x " if pp > 1 else ""
        raise ConfigError(
            f"parallel: {first}dp_replicate ({_show(cfg.dp_replicate, rep)}) x dp_shard "
            f"({_show(cfg.dp_shard, shard)}){more} = {pp * rep * shard * cp * tp} does not equal "
            f"the world size ({env.world_size} ranks: {env.num_nodes} node(s) x "
            f"{env.local_world_size})"
        )
    return rep, shard


def _show(given: int, resolved: int) -> str:
    return f"-1 -> {resolved}" if given == -1 else str(given)
