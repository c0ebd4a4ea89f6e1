"""Muon (optim.name="muon", parallel/muon.py): torch.optim.Muon's math on whole matrices, the
same run on every mesh, its state in checkpoints, and bad settings."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from configs import ConfigError, parse_config
from launch.job import JobConfig
from parallel.muon import Muon, MuonConfig, muon_groups, muon_parameters, owned_matrices
from tests.distributed import run_distributed
from tests.test_families import assert_same_run, run_argv, train_run
from tests.test_train import FP8, TINY, train_losses

# Keller Jordan's lr rule at his lr; Newton-Schulz in float32 for the 1e-5 parity (in bfloat16,
# torch's, a last-bit difference of a gradient can round differently: 4e-5 on the EP run).
MUON = [
    "--optim.name=muon",
    "--optim.muon.lr=0.02",
    "--optim.muon.adjust_lr_fn=original",
    "--optim.muon.ns_dtype=float32",
]
STEPS = 4


def muon_group(params: list[torch.Tensor], **settings: object) -> dict:
    cfg = MuonConfig(**settings)  # type: ignore[arg-type]
    return {"params": params, "algorithm": "muon", "lr": cfg.lr, "weight_decay": cfg.weight_decay,
            "momentum": cfg.momentum, "nesterov": cfg.nesterov, "ns_steps": cfg.ns_steps,
            "ns_coefficients": cfg.ns_coefficients, "adjust_lr_fn": cfg.adjust_lr_fn,
            "ns_dtype": cfg.ns_dtype}  # fmt: skip


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
def test_whole_matrices_step_as_torch_muon_to_the_bit(nesterov: bool, rule: str) -> None:
    """Wide, tall and square matrices, 3 steps: the parameters are torch.optim.Muon's, bitwise."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 8), (8, 32), (12, 12)]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov,
                "adjust_lr_fn": rule}  # fmt: skip
    reference = torch.optim.Muon(theirs, **settings)  # type: ignore[arg-type]
    optimizer = Muon([muon_group(ours, **settings)], kernel="fused")
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        reference.step()
        optimizer.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


def test_adamw_groups_step_as_torch_adamw_and_experts_one_at_a_time() -> None:
    """The AdamW groups are torch.optim.AdamW's, bitwise; a 3-D expert stack is stepped as
    torch.optim.Muon steps each expert's matrix on its own (its lr scaled by the matrix)."""
    torch.manual_seed(0)
    experts = torch.nn.Parameter(torch.randn(3, 16, 8))
    apart = [torch.nn.Parameter(e.detach().clone()) for e in experts]
    norm = torch.nn.Parameter(torch.randn(8))
    norm_ref = torch.nn.Parameter(norm.detach().clone())
    adamw = {"algorithm": "adamw", "lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8,
             "weight_decay": 0.0}  # fmt: skip
    optimizer = Muon([muon_group([experts], lr=0.02), {"params": [norm]} | adamw], kernel="fused")
    reference = torch.optim.Muon(apart, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    reference_adamw = torch.optim.AdamW([norm_ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0,
                                        fused=True)  # fmt: skip
    for _ in range(3):
        experts.grad, norm.grad = torch.randn_like(experts), torch.randn_like(norm)
        for e, g in zip(apart, experts.grad, strict=True):
            e.grad = g.clone()
        norm_ref.grad = norm.grad.clone()
        optimizer.step()
        reference.step()
        reference_adamw.step()
    assert torch.equal(experts, torch.stack(apart))
    assert torch.equal(norm, norm_ref)
    assert set(optimizer.state[norm]) == {"step", "exp_avg", "exp_avg_sq"}


def test_which_parameters_muon_trains() -> None:
    """The blocks' matrices; not the embedding, the output projection, norms or LoRA adapters;
    frozen parameters go nowhere (no state)."""
    from model.llama import FLAVORS, Transformer, fsdp_units
    from parallel.freeze import apply_freeze
    from parallel.lora import LoRAConfig, apply_lora

    args = replace(FLAVORS["debug"], dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64)
    model = Transformer(args)
    apply_freeze(model, ["layers.0.*"])
    names = muon_parameters(model, fsdp_units(model))
    assert names == [f"layers.1.{m}.weight" for m in ("attention.wq", "attention.wk",
                     "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                     "feed_forward.w3")]  # fmt: skip
    adamw = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    groups = muon_groups(model, fsdp_units(model), MuonConfig(), adamw)
    grouped = [p for g in groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped})
    assert {id(p) for p in grouped} == {id(p) for p in model.parameters() if p.requires_grad}
    lora = Transformer(args)
    apply_lora(lora, LoRAConfig(enabled=True))
    assert muon_parameters(lora, fsdp_units(lora)) == []  # the adapters go to AdamW


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--optim.muon.lr=0", "optim.muon.lr must be > 0, got 0"),
        ("--optim.muon.momentum=1", "optim.muon.momentum must be in [0, 1), got 1"),
        ("--optim.muon.ns_steps=100", "optim.muon.ns_steps must be in [1, 99], got 100"),
        ("--optim.muon.ns_coefficients=1.0,2.0", "optim.muon.ns_coefficients must be three"),
        ("--optim.muon.weight_decay=-0.1", "optim.muon.weight_decay must be >= 0"),
        ("--optim.muon.adjust_lr_fn=rms", "adjust_lr_fn"),
        ("--optim.name=sgd", "optim.name"),
    ],
)
def test_bad_settings_are_one_config_error(arg: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(JobConfig, ["--optim.name=muon", arg])


def orthogonalize_on_a_mesh(dp_replicate: int) -> None:
    """On this rank: matrices split unevenly by rows and by columns, 5 of a shape (owners
    0, 1, 2, 3, 0), and an expert stack split by expert: each rank's parts of the results are
    those of torch.optim.Muon's orthogonalization of the whole matrices, bitwise."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from parallel.muon import newton_schulz, orthogonalize

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (dp_replicate, world // dp_replicate))
    torch.manual_seed(0)  # every rank draws the same whole matrices
    whole = [torch.randn(10, 6) for _ in range(5)] + [torch.randn(6, 10) for _ in range(5)]
    whole.append(torch.randn(4, 6, 8))  # experts
    placements = [[Replicate(), Shard(0)]] * 5 + [[Replicate(), Shard(1)]] * 5
    placements.append([Replicate(), Shard(0)])
    split = [distribute_tensor(w, mesh, p) for w, p in zip(whole, placements, strict=True)]
    coefficients = (3.4445, -4.7750, 2.0315)
    parts = orthogonalize(split, 5, coefficients, torch.bfloat16)
    for w, s, part in zip(whole, split, parts, strict=True):
        full = torch.stack(
            [newton_schulz(m.bfloat16(), 5, coefficients) for m in w.view(-1, *w.shape[-2:])]
        )
        expected = distribute_tensor(full.view(w.shape), mesh, s.placements).to_local()
        assert torch.equal(part, expected)
    dist.destroy_process_group()


def test_sharded_matrices_are_orthogonalized_whole() -> None:
    """HSDP 2x2: the shards over dp_shard, the same work on both replicas (FSDP 1x4 runs the
    same all-to-alls over 4 ranks: test_every_mesh_is_the_one_process_run)."""
    run_distributed(orthogonalize_on_a_mesh, 4, 2, nodes=2)


def test_cross_section_settings(tiny_dataset: str, tmp_path: Path) -> None:
    """Muon with CPU offload: one config error; [optim.muon] keys changed under AdamW: a
    warning, not an error."""
    from launch.check import check_config, unintended_settings
    from parallel.dims import LaunchEnv

    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, num_nodes=1)
    base = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY]
    offload = parse_config(JobConfig, [*base, *MUON, "--parallel.cpu_offload=true"])
    with pytest.raises(ConfigError, match="optim.name='muon' with parallel.cpu_offload"):
        check_config(offload, env)
    adamw = parse_config(JobConfig, [*base, "--optim.muon.lr=0.02"])
    assert unintended_settings(adamw) == [
        "optim.muon.lr=0.02 has no effect with optim.name='adamw'"
    ]
    assert unintended_settings(parse_config(JobConfig, [*base, *MUON])) == []


# ---- the same run on every mesh -------------------------------------------------------------


def argv(dataset: str, out: Path, name: str, *extra: str) -> list[str]:
    """tests/test_families.py's tiny Llama run, with Muon."""
    return run_argv(dataset, out, "llama3", name, *MUON, f"--train.steps={STEPS}", *extra)


def train(
    dataset: str,
    out: Path,
    name: str,
    world: int,
    *extra: str,
    nodes: int = 1,
    family: str = "llama3",
) -> dict:
    """The Muon run on `world` ranks: the losses and rank 0's TensorBoard scalars."""
    return train_run(dataset, out, family, name, world, *MUON, *extra, nodes=nodes, steps=STEPS)


def test_owners_take_turns_across_buckets() -> None:
    """Round-robin owners carry over from bucket to bucket: over buckets of 3 matrices on 2
    ranks, neither rank owns every bucket's extra matrix."""
    assert owned_matrices(3, 2) == [[0, 2], [1]]
    assert owned_matrices(3, 2, first_owner=3) == [[1], [0, 2]]
    owned = [0, 0]
    first = 0
    for count in (3, 3, 1, 3):
        for rank, indices in enumerate(owned_matrices(count, 2, first)):
            owned[rank] += len(indices)
        first += count
    assert owned == [5, 5]


@pytest.mark.slow
def test_every_mesh_is_the_one_process_run(tiny_dataset: str, tmp_path: Path) -> None:
    """FSDP 1x4, HSDP 2x2, tp 2 and FSDP 2 x tp 2 (matrices split over two mesh dims: the
    redistribute path) give the 1-process losses and grad norms within 1e-5."""
    one = train(tiny_dataset, tmp_path, "one", 1)
    assert one["losses"][-1] < one["losses"][0] - 0.2, one["losses"]
    assert_same_run(train(tiny_dataset, tmp_path, "fsdp", 4), one)
    assert_same_run(train(tiny_dataset, tmp_path, "hsdp", 4, nodes=2), one)
    assert_same_run(train(tiny_dataset, tmp_path, "tp", 2, "--parallel.tp=2"), one)
    assert_same_run(train(tiny_dataset, tmp_path, "fsdp-tp", 4, "--parallel.tp=2"), one)


@pytest.mark.slow
def test_expert_parallel_moe_is_the_one_process_run(tiny_dataset: str, tmp_path: Path) -> None:
    """qwen3_moe with EP 2 on 2 ranks: each expert's matrix orthogonalized on its own, on the
    rank that holds it; the 1-process losses, grad norms and aux losses within 1e-5."""
    one = train(tiny_dataset, tmp_path, "one", 1, family="qwen3_moe")
    ep = train(tiny_dataset, tmp_path, "ep", 2, "--parallel.ep=2", family="qwen3_moe")
    assert_same_run(ep, one)


# ---- checkpoints ----------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_resumes_bitwise_and_on_another_mesh(tiny_dataset: str, tmp_path: Path) -> None:
    """FSDP over 2 ranks saves at step 2: its momentum buffers for Muon's matrices, AdamW's
    moments for the rest. Resumed there on 2 ranks, steps 3-4 are the straight run's, bitwise;
    on 1 process (the buffers resharded by DCP) within 1e-5."""
    from tests.test_checkpoint import ckpt
    from tests.test_finetune import load_entries

    save = ["--checkpoint.interval=2", "--checkpoint.keep_last=0"]
    straight = train(tiny_dataset, tmp_path, "straight", 2, *save)
    step2 = ckpt(tmp_path, "straight", 2)
    same = train(tiny_dataset, tmp_path, "same", 2, f"--checkpoint.resume={step2}")
    assert same["losses"] == straight["losses"][2:]
    one = train(tiny_dataset, tmp_path, "one", 1, f"--checkpoint.resume={step2}")
    assert_same_run(one, straight, steps=slice(2, None))

    state = load_entries(step2, ("optimizer",))["optimizer"]["state"]
    assert set(state["layers.0.attention.wq.weight"]) == {"momentum_buffer"}
    assert state["layers.0.attention.wq.weight"]["momentum_buffer"].shape == (64, 64)
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight"):
        assert set(state[name]) == {"step", "exp_avg", "exp_avg_sq"}, name


@pytest.mark.slow
def test_switching_optimizer_on_resume_is_one_config_error(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Muon checkpoint resumed with optim.name=adamw: one config error line; allowed with
    checkpoint.load_model_only (the optimizer starts afresh)."""
    from launch.check import check_config
    from parallel.dims import LaunchEnv
    from tests.test_checkpoint import ckpt
    from tests.test_mixture import config_error

    run_distributed(train_losses, 1, argv(tiny_dataset, tmp_path, "muon", "--train.steps=1",
                                          "--checkpoint.interval=1"))  # fmt: skip
    resume = f"--checkpoint.resume={ckpt(tmp_path, 'muon', 1)}"
    adamw = [*argv(tiny_dataset, tmp_path, "adamw", resume), "--optim.name=adamw"]
    error = config_error(adamw, caplog)
    assert "optim.name: 'muon' -> 'adamw'" in error and "load_model_only" in error
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, num_nodes=1)
    job = parse_config(JobConfig, [*adamw, "--checkpoint.load_model_only=true"])
    assert check_config(job, env).resume is not None


# ---- with the rest of the trainer -----------------------------------------------------------


@pytest.mark.slow
def test_frozen_parameters_and_clipping_under_fsdp(tiny_dataset: str, tmp_path: Path) -> None:
    """Block 0 and the embedding frozen, the gradient clipped hard (0.05, every step): FSDP
    over 2 ranks gives the 1-process run (4 micro-batches a step there, 2 here); the frozen
    parameters get no optimizer state."""
    from tests.test_checkpoint import ckpt
    from tests.test_finetune import load_entries

    tune = ["--train.freeze=tok_embeddings.*,layers.0.*", "--train.max_grad_norm=0.05"]
    one = train(tiny_dataset, tmp_path, "one", 1, *tune, "--checkpoint.interval=0")
    fsdp = train(tiny_dataset, tmp_path, "fsdp", 2, *tune, f"--checkpoint.interval={STEPS}")
    assert_same_run(fsdp, one)
    assert min(one["grad_norm"]) > 0.05  # clipped at every step
    saved = load_entries(ckpt(tmp_path, "fsdp", STEPS), ("model", "optimizer"))
    trainable = {n for n in saved["model"] if not n.startswith(("tok_embeddings.", "layers.0."))}
    assert set(saved["optimizer"]["state"]) == trainable


@pytest.mark.slow
def test_lora_adapters_train_with_adamw(tiny_dataset: str, tmp_path: Path) -> None:
    """LoRA's adapters are AdamW's (parallel/muon.py says why): a LoRA run with Muon is the
    LoRA run with AdamW, bitwise."""
    lora = ["--lora.enabled=true", "--lora.rank=4"]
    muon = train(tiny_dataset, tmp_path, "muon", 1, *lora)
    adamw = train(tiny_dataset, tmp_path, "adamw", 1, *lora, "--optim.name=adamw")
    assert muon["losses"] == adamw["losses"]


@pytest.mark.slow
def test_float8_trains_with_muon_on_its_high_precision_weights(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Float8 matmuls (emulated on CPU), FSDP over 2 ranks: Muon steps the float32 weights
    behind torchao's wrappers; the losses stay within 1% of the same run without float8."""
    common = ["--parallel.param_dtype=bfloat16", "--fp8.filter=none", "--train.steps=6"]
    plain = train(tiny_dataset, tmp_path, "plain", 2, *common)
    fp8 = train(tiny_dataset, tmp_path, "fp8", 2, *common, *FP8)
    assert fp8["losses"] != plain["losses"]  # float8 really ran
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.2
    torch.testing.assert_close(
        torch.tensor(fp8["losses"]), torch.tensor(plain["losses"]), rtol=1e-2, atol=0
    )
