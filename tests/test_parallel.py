"""Mesh arithmetic, sharded initialization and placements on real gloo ranks."""

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


def reference_weights() -> dict[str, torch.Tensor]:
    """Plain single-device model initialized with the default (copy) assign."""
    model = Transformer(ARGS)
    model.init_weights(seed=7, rope_len=16)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded_weights(dp_replicate: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from parallel.fsdp import apply_fsdp, assign_local_shard
    from parallel.runtime import build_mesh, dp_mesh, init_distributed

    launch = LaunchEnv.from_env()
    device = torch.device("cpu")
    init_distributed(device, launch, 60)
    world = launch.world_size
    mesh = build_mesh(device, dp_replicate, world // dp_replicate)
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_fsdp(model, fsdp_units(model), dp_mesh(mesh), ParallelConfig(param_dtype="float32"))
    model.to_empty(device=device)
    model.init_weights(seed=7, rope_len=16, assign=assign_local_shard)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    placements = {k: str(tuple(v.placements)) for k, v in model.state_dict().items()}
    torch.distributed.destroy_process_group()
    return full, placements


@pytest.mark.parametrize(("world", "dp_replicate"), [(1, 1), (4, 1), (4, 2)])
def test_initial_weights_identical_on_every_mesh(world: int, dp_replicate: int) -> None:
    reference = reference_weights()
    results = run_distributed(sharded_weights, world, dp_replicate, nodes=dp_replicate)
    for full, placements in results:
        assert full.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(full[name], value), name
        expected = "(Shard(dim=0),)" if dp_replicate == 1 else "(Replicate(), Shard(dim=0))"
        assert set(placements.values()) == {expected}


def test_different_seeds_and_parameters_get_different_values() -> None:
    model = Transformer(ARGS)
    model.init_weights(seed=0, rope_len=16)
    a = model.layers["0"].attention.wq.weight.clone()
    b = model.layers["1"].attention.wq.weight.clone()
    model.init_weights(seed=1, rope_len=16)
    assert not torch.equal(a, b)
    assert not torch.equal(a, model.layers["0"].attention.wq.weight)
