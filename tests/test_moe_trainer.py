"""The trainer with --model.name=qwen3_moe, beyond the family contract of tests/test_families.py
(parity on every mesh, expert parallel and its checkpoint resumed without it): compiled blocks
and op-level AC, train.freeze and LoRA under expert parallel, bad input, and Hugging Face in and
out (a random transformers MoE trains through init_from_hf; its export gives the trainer's val
loss in transformers)."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from configs import ConfigError, parse_config
from launch.job import JobConfig
from model import FAMILIES
from model.qwen3_moe import build_args
from tests.distributed import run_distributed
from tests.test_cli import shipped_dry_run
from tests.test_families import RUN_SHAPE, STEPS, assert_same_run, run_argv, train_run
from tests.test_train import COMPILED, TINY, train_losses

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

MOE = ["--model.name=qwen3_moe", *RUN_SHAPE["qwen3_moe"]]


def argv(dataset: str, out: Path, name: str, *extra: str) -> list[str]:
    """tests/test_families.py's tiny qwen3_moe run (4 experts of hidden 32, top 2, both aux
    losses on): global batch 8 in micro-batches of 2, 4 of them per data-parallel rank."""
    return run_argv(dataset, out, "qwen3_moe", name, f"--train.steps={STEPS}", *extra)


def train(dataset: str, out: Path, name: str, world: int, *extra: str, nodes: int = 1) -> dict:
    """tests/test_families.py's run of qwen3_moe on `world` ranks: losses and scalars."""
    return train_run(dataset, out, "qwen3_moe", name, world, *extra, nodes=nodes)


@pytest.mark.slow
def test_compile_and_ac_keep_the_losses(tiny_dataset: str, tmp_path: Path) -> None:
    """Op-level AC (the grouped GEMMs saved) recomputes to the bit the run without AC (one
    process, 4 micro-batches per step); compiled blocks with it (the grouped GEMM a custom op
    inside them) stay within 1e-5, and so does EP 2 on 2 ranks, whose experts are an FSDP
    unit of one rank inside each checkpointed block (parallel/workarounds.py, 4)."""
    straight = train(tiny_dataset, tmp_path, "straight", 1)
    op_ac = train(tiny_dataset, tmp_path, "op_ac", 1, "--ac.mode=op")
    assert op_ac["losses"] == straight["losses"] and op_ac["grad_norm"] == straight["grad_norm"]
    compiled = train(tiny_dataset, tmp_path, "compiled", 1, *COMPILED, "--ac.mode=op")
    assert_same_run(compiled, straight)
    ep = train(tiny_dataset, tmp_path, "ep_op_ac", 2, "--parallel.ep=2", "--ac.mode=op")
    assert_same_run(ep, straight)


# Block 0 and the embedding frozen (block 0 leaves backward, its all-to-alls too); block 1's
# experts frozen while its attention and router train (backward still crosses its all-to-alls).
FREEZE = "--train.freeze=tok_embeddings.*,layers.0.*,layers.1.moe.experts.*"


@pytest.mark.slow
@pytest.mark.parametrize("tune", [FREEZE, "--lora.enabled=true"], ids=["freeze", "lora"])
def test_freeze_and_lora_under_expert_parallel(
    tiny_dataset: str, tmp_path: Path, tune: str
) -> None:
    """train.freeze and LoRA (adapters on attention: the experts are not Linear layers, so LoRA
    freezes them) with EP 2 on 2 ranks give the 1-process losses, grad norms and aux losses;
    the loss falls. Its checkpoint holds every frozen parameter as initialized, bitwise, every
    trainable one moved, and optimizer state for the trainable ones only."""
    from tests.test_finetune import load_entries

    want = train(tiny_dataset, tmp_path, "one", 1, tune)
    got = train(tiny_dataset, tmp_path, "ep", 2, tune, "--parallel.ep=2",
                f"--checkpoint.interval={STEPS}")  # fmt: skip
    assert_same_run(got, want)
    assert got["losses"][-1] < got["losses"][0] - 0.2, got["losses"]

    saved = load_entries(tmp_path / "ep" / "checkpoints" / f"step-{STEPS}", ("model", "optimizer"))
    job = parse_config(JobConfig, argv(tiny_dataset, tmp_path, "x"))
    initial = FAMILIES["qwen3_moe"].build_model(build_args(job.model))
    initial.init_weights(seed=0, rope_len=job.data.seq_len)
    if tune == FREEZE:
        frozen = ("tok_embeddings.", "layers.0.", "layers.1.moe.experts.")
        trainable = {n for n, _ in initial.named_parameters() if not n.startswith(frozen)}
    else:
        trainable = {n for n in saved["model"] if ".lora_" in n}
        assert trainable == {f"layers.{i}.attention.{w}.lora_{ab}.weight" for i in range(2)
                             for w in ("wq", "wk", "wv", "wo") for ab in "ab"}  # fmt: skip
    assert set(saved["optimizer"]["state"]) == trainable
    for name, param in initial.named_parameters():
        assert torch.equal(saved["model"][name], param.detach()) == (name not in trainable), name
    for name in (n for n in trainable if ".lora_b." in n):  # LoRA's B starts at 0
        assert saved["model"][name].abs().max() > 0, name


# ---- bad input -----------------------------------------------------------------------------


def env(world: int) -> Any:
    from parallel.dims import LaunchEnv

    return LaunchEnv(rank=0, local_rank=0, world_size=world, local_world_size=world, num_nodes=1)


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (["--parallel.ep=3", "--model.n_experts=6"], 4, r"parallel.ep=3 must divide dp_shard=4"),
        (["--parallel.ep=2", "--model.n_experts=5"], 4, "must divide model.n_experts=5"),
        (["--parallel.ep=2", "--model.name=qwen3"], 4, "model qwen3 has no experts"),
        (["--parallel.ep=4", "--parallel.tp=2"], 2, r"must divide dp_shard x tp=2: .* \[2\] "),
        (["--compile.moe_regions", "--model.name=qwen3"], 1, "qwen3 has no experts"),
        (["--model.top_k=5"], 1, "top_k=5 exceeds n_experts=4"),
        (["--model.aux_loss_coef=-1"], 1, "model.aux_loss_coef must be >= 0"),
        (["--parallel.ep=0"], 1, "parallel.ep must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_config_error_before_any_process_group(
    tiny_dataset: str, tmp_path: Path, extra: list[str], world: int, message: str
) -> None:
    from launch.check import check_config

    dense = "--model.name=qwen3" in extra  # the MoE fields would be the error there
    base = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            *([] if dense else MOE)]  # fmt: skip
    with pytest.raises(ConfigError, match=message) as err:
        check_config(parse_config(JobConfig, [*base, *extra]), env(world))
    assert "\n" not in str(err.value)


# ---- Hugging Face --------------------------------------------------------------------------


@pytest.mark.slow
def test_random_hf_moe_trains_through_init_from_hf_and_exports_the_val_loss(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """A random `Qwen3MoeForCausalLM` saved by transformers starts a run (init_from_hf); its
    loss falls, and the checkpoint exported to HF gives, in transformers, the val loss the
    trainer logged on the same batches."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.export import export_checkpoint
    from configs import parse_config
    from data.loader import DataConfig, build_dataloader
    from launch.job import JobConfig
    from model import qwen3_moe_hf
    from model.qwen3_moe import build_args

    job = parse_config(JobConfig, argv(tiny_dataset, tmp_path, "x"))
    args = build_args(job.model)
    config = transformers.Qwen3MoeConfig(**qwen3_moe_hf.config_json(args, torch.float32, 0, 0))
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "random")
    run = argv(tiny_dataset, tmp_path, "hf", f"--checkpoint.init_from_hf={tmp_path / 'random'}",
               "--train.eval_interval=6", "--train.eval_batches=1",
               "--checkpoint.interval=6")  # fmt: skip
    losses, log = run_distributed(train_and_log, 1, run)[0]
    assert losses[-1] < losses[0] - 0.5, losses
    # The start says where its weights came from: every tensor of the file, none random.
    from safetensors import safe_open

    with safe_open(tmp_path / "random" / "model.safetensors", framework="pt") as f:
        n_tensors = len(list(f.keys()))
    assert (f"starting at step 0 of {len(losses)} from the Hugging Face weights in "
            f"{tmp_path / 'random'}: {n_tensors} tensors loaded") in log  # fmt: skip
    assert "from random weights" not in log
    logged = float(re.findall(r"val_loss (\d+\.\d+)", log)[-1])

    export_checkpoint(tmp_path / "hf" / "checkpoints" / "step-6", tmp_path / "out", torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    val = build_dataloader(DataConfig(path=tiny_dataset, seq_len=32), "val", dp_rank=0,
                           dp_size=1, micro_batch_size=8, seed=0)  # fmt: skip
    inputs, targets = next(iter(val))
    with torch.no_grad():
        logits = model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert loss == pytest.approx(logged, abs=1e-4)  # the log line has 4 decimals


def train_and_log(args: list[str]) -> tuple[list[float], str]:
    """train_losses, and rank 0's log lines."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    return train_losses(args), "\n".join(records)


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("config", "nodes", "per_node", "mesh"),
    [
        ("configs/qwen3_moe_debug.toml", 1, 4, "dp_replicate=1 x dp_shard=4 (world size 4)"),
        ("configs/qwen3_moe_30b_a3b.toml", 4, 8,
         "dp_replicate=1 x dp_shard=32 (ep=8 inside dp_shard) (world size 32)"),
    ],
)  # fmt: skip
def test_shipped_configs_resolve_on_their_intended_clusters(
    tmp_path: Path, config: str, nodes: int, per_node: int, mesh: str
) -> None:
    """`train.py <config> --dry-run` (no data needed) plans the mesh its comment names, and
    30B-A3B the memory its comment quotes from the planner (tests/test_cli.py's
    shipped_dry_run)."""
    stdout = shipped_dry_run(config, nodes, per_node, tmp_path)
    assert mesh in stdout
    if "30b" in config:
        [memory] = re.findall(r"estimated memory per rank +(\d+\.\d+ GiB)", stdout)
        assert f"{memory[:-5]} GiB" in (ROOT / config).read_text()  # "53.2 GiB" of "53.23 GiB"


@pytest.mark.slow
def test_the_debug_config_trains_on_cpu(tiny_dataset: str, tmp_path: Path) -> None:
    """configs/qwen3_moe_debug.toml as shipped, on 2 gloo ranks, at a shorter seq_len."""
    argv = [str(ROOT / "configs" / "qwen3_moe_debug.toml"), f"--data.path={tiny_dataset}",
            f"--run.output_dir={tmp_path}", "--data.seq_len=64", "--train.steps=3",
            "--train.eval_interval=0", "--checkpoint.interval=0"]  # fmt: skip
    losses = run_distributed(train_losses, 2, argv)[0]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
