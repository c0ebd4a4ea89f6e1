"""Mesh arithmetic and FSDP's reshard plan on real gloo ranks (initial weights on every mesh, for
every family: tests/test_families.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from configs import ConfigError
from model.llama import FLAVORS, Transformer, fsdp_units
from parallel.dims import LaunchEnv, ParallelConfig, resolve_dims
from tests.distributed import run_distributed

ARGS = replace(FLAVORS["debug"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100)


def env(world: int, local: int | None = None, nodes: int = 1) -> LaunchEnv:
    return LaunchEnv(
        rank=0, local_rank=0, world_size=world, local_world_size=local or world, num_nodes=nodes
    )


@pytest.mark.parametrize(
    ("cfg", "launch", "expected"),
    [
        (ParallelConfig(), env(4), (1, 4)),
        (ParallelConfig(dp_replicate=2), env(4), (2, 2)),
        (ParallelConfig(dp_shard=2, dp_replicate=-1), env(8), (4, 2)),
        (ParallelConfig(mesh="auto"), env(8, 8, 1), (1, 8)),
        (ParallelConfig(mesh="auto"), env(16, 8, 2), (2, 8)),
    ],
)
def test_resolve_dims(cfg: ParallelConfig, launch: LaunchEnv, expected: tuple[int, int]) -> None:
    assert resolve_dims(cfg, launch) == expected


def test_mesh_that_does_not_divide_the_world_names_every_number() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_dims(ParallelConfig(dp_replicate=3), env(4))
    msg = str(err.value)
    assert "dp_replicate (3)" in msg and "dp_shard (-1 -> 1)" in msg and "world size (4" in msg
    with pytest.raises(ConfigError, match=r"dp_replicate \(2\) x dp_shard \(3\) = 6"):
        resolve_dims(ParallelConfig(dp_replicate=2, dp_shard=3), env(4))


def test_auto_mesh_rejects_nodes_with_different_rank_counts() -> None:
    # 6 ranks over 2 nodes, this node has 4: the other has 2.
    with pytest.raises(ConfigError, match="different numbers of ranks"):
        resolve_dims(ParallelConfig(mesh="auto"), env(6, 4, 2))


def test_auto_mesh_with_explicit_degrees_is_rejected_not_rewritten() -> None:
    with pytest.raises(ConfigError, match="mesh='auto'"):
        ParallelConfig(mesh="auto", dp_replicate=2)
    with pytest.raises(ConfigError, match="at most one"):
        ParallelConfig(dp_replicate=-1, dp_shard=-1)


def test_reshard_plan_keeps_blocks_gathered_only_where_nothing_is_sharded() -> None:
    from parallel.fsdp import reshard_plan

    # Blocks in order, then the root.
    assert reshard_plan(3, "default", dp_shard=4) == [True, True, False, False]
    assert reshard_plan(3, "default", dp_shard=1) == [False] * 4
    # Offloading exists to free the GPU copies: it keeps the sharded plan.
    default = [True, True, False, False]
    assert reshard_plan(3, "default", dp_shard=1, cpu_offload=True) == default
    assert reshard_plan(3, "always", dp_shard=1) == [True] * 4  # asked for: kept
    assert reshard_plan(3, "never", dp_shard=8) == [False] * 4


def gathered_after_forward(dp_replicate: int) -> list[bool]:
    """For each block, whether its parameters are still unsharded after forward."""
    from torch.distributed.tensor import DTensor

    from parallel.fsdp import apply_fsdp, assign_local_shard
    from parallel.runtime import build_mesh, dp_mesh, init_distributed

    launch = LaunchEnv.from_env()
    device = torch.device("cpu")
    init_distributed(device, launch, 60)
    mesh = build_mesh(device, dp_replicate, launch.world_size // dp_replicate)
    model = Transformer(ARGS)
    apply_fsdp(model, fsdp_units(model), dp_mesh(mesh), ParallelConfig(param_dtype="float32"))
    model.init_weights(seed=0, rope_len=16, assign=assign_local_shard)
    model(torch.zeros(1, 8, dtype=torch.long))
    gathered = [not isinstance(b.attention.wq.weight, DTensor) for b in fsdp_units(model)]
    torch.distributed.destroy_process_group()
    return gathered


@pytest.mark.parametrize(
    ("world", "dp_replicate", "expected"),
    [(1, 1, [True, True]), (2, 1, [False, True]), (2, 2, [True, True])],
    ids=["one-rank", "fsdp-2", "hsdp-2x1"],
)
def test_apply_fsdp_follows_the_reshard_plan(
    world: int, dp_replicate: int, expected: list[bool]
) -> None:
    """dp_shard = 1 (one rank, or replicas of one) keeps every block gathered after forward;
    sharded, all but the last block are freed."""
    assert run_distributed(gathered_after_forward, world, dp_replicate, nodes=dp_replicate)[0] == (
        expected
    )
