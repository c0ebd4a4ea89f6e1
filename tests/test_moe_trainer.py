"""The trainer with --model.name=qwen3_moe: fp32 losses, grad norms and aux losses equal on every
mesh (1 process with gradient accumulation, FSDP, HSDP, tp 2 on attention, expert parallel with FSDP
accumulating micro-batches and with HSDP), expert-parallel checkpoints resumed without EP,
train.freeze and LoRA under expert parallel, the aux loss and expert load in TensorBoard (every step
and every 4), bad input, and Hugging Face in and out (a random transformers MoE trains through
init_from_hf; its export gives the trainer's val loss in transformers)."""

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
from tests.test_train import FP32, TINY, assert_close, train_losses

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# tests/test_train.py's tiny shape with 4 experts of hidden 32, top 2, both aux losses on (large
# enough coefficients that a wrong normalization shows in the losses and grad norms).
MOE = ["--model.name=qwen3_moe", "--model.n_experts=4", "--model.top_k=2", "--model.moe_ffn_dim=32",
       "--model.aux_loss_coef=0.1", "--model.router_z_loss_coef=0.01"]  # fmt: skip
STEPS = 6


def argv(dataset: str, out: Path, name: str, *extra: str) -> list[str]:
    """Global batch 8 in micro-batches of 2: 4 of them per step on one data-parallel rank."""
    return [f"--data.path={dataset}", f"--run.output_dir={out}", f"--run.name={name}", *TINY,
            *MOE, *FP32, "--train.micro_batch_size=2", f"--train.steps={STEPS}",
            "--metrics.tensorboard=true", "--metrics.log_interval=1", *extra]  # fmt: skip


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every TensorBoard scalar of a run, by tag, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def train(dataset: str, out: Path, name: str, world: int, *extra: str, nodes: int = 1) -> dict:
    """Train on `world` ranks; the losses and rank 0's TensorBoard scalars."""
    args = argv(dataset, out, name, *extra)
    if nodes > 1:
        args.append(f"--parallel.dp_replicate={nodes}")
    losses = run_distributed(train_losses, world, args, nodes=nodes)[0]
    return {"losses": losses} | scalars(out / name)


def assert_same_run(got: dict, want: dict, steps: slice = slice(None)) -> None:
    """fp32: losses, grad norms and aux losses within 1e-5 per step."""
    assert_close(got["losses"], want["losses"][steps], rtol=1e-5)
    for tag in ("grad_norm", "loss/aux"):
        assert_close(got[tag], want[tag][steps], rtol=1e-5)


@pytest.fixture(scope="module")
def straight(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: one process, 4 micro-batches per step."""
    out = tmp_path_factory.mktemp("moe_runs")
    return train(tiny_dataset, out, "straight", 1) | {"out": out}


@pytest.mark.slow
def test_parity_fsdp_hsdp_and_tp_on_attention(straight: dict, tiny_dataset: str) -> None:
    """FSDP 1x4 (1 micro-batch per rank), HSDP 2x2 and tp 2 (the MoE layer whole on both tp
    ranks) give the 1-process losses, grad norms and aux losses. The aux loss is normalized per
    sequence (model/__init__.py): a per-rank or per-micro-batch balance would differ here."""
    out = straight["out"]
    assert straight["losses"][-1] < straight["losses"][0] - 0.5, straight["losses"]
    assert_same_run(train(tiny_dataset, out, "fsdp", 4), straight)
    assert_same_run(train(tiny_dataset, out, "hsdp", 4, nodes=2), straight)
    assert_same_run(train(tiny_dataset, out, "tp", 2, "--parallel.tp=2"), straight)


@pytest.mark.slow
def test_expert_parallel_parity_and_its_checkpoint_resumes_without_ep(
    straight: dict, tiny_dataset: str
) -> None:
    """EP 2 x FSDP 2 accumulating 2 micro-batches of 1 per rank, and HSDP 2x2 with EP 2 (1
    micro-batch per rank, full AC), give the 1-process run; EP 2's checkpoint of step 3
    continues at EP 1 (FSDP 1x2) and on 1 process with the straight run's losses. TensorBoard
    holds the aux loss and every layer's expert load each step at log_interval 1; at 4, on
    steps 4 and 6 (the last), with the aux loss of that step and the load summed since the
    previous point."""
    out = straight["out"]
    # Micro-batches of 1: the all-to-alls run in every micro-batch's forward and backward while
    # the expert gradients accumulate unsharded, reduce-scattered after the last one only.
    ep = train(tiny_dataset, out, "ep", 4, "--parallel.ep=2", "--train.micro_batch_size=1",
               "--checkpoint.interval=3")  # fmt: skip
    assert_same_run(ep, straight)
    # Full AC recomputes each block's forward in backward, all-to-alls included.
    hsdp_ep = train(tiny_dataset, out, "hsdp_ep", 4, "--parallel.ep=2", "--ac.mode=full",
                    "--metrics.log_interval=4", nodes=2)  # fmt: skip
    assert_close(hsdp_ep["losses"], straight["losses"], rtol=1e-5)
    for tag in ("grad_norm", "loss/aux"):  # steps 4 and 6
        assert_close(hsdp_ep[tag], [straight[tag][3], straight[tag][5]], rtol=1e-5)
    step3 = out / "ep" / "checkpoints" / "step-3"
    # Its keys and shapes are the model's own: whole experts, as without EP.
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    with torch.device("meta"):
        model = FAMILIES["qwen3_moe"].build_model(build_args(parse_config(JobConfig, argv(
            tiny_dataset, out, "x")).model))  # fmt: skip
    for name, param in model.state_dict().items():
        assert tuple(saved[f"model.{name}"].size) == tuple(param.shape), name
    for world in (2, 1):
        resumed = train(tiny_dataset, out, f"resumed{world}", world, f"--checkpoint.resume={step3}")
        assert_same_run(resumed, straight, slice(3, None))
    # Expert load: per layer, the busiest expert over the mean (1 = balanced, at most
    # n_experts / top_k = 2) and its share of the layer's routed tokens (at least 1 / 4).
    for layer in range(2):
        ratio = ep[f"expert_load/max_over_mean_layer{layer:02d}"]
        share = ep[f"expert_load/busiest_share_layer{layer:02d}"]
        assert len(ratio) == STEPS and all(1 <= r <= 2 for r in ratio)
        assert share == pytest.approx([r / 4 for r in ratio])
    assert ep["expert_load/max_over_mean"] == pytest.approx(
        [max(a, b) for a, b in zip(ep["expert_load/max_over_mean_layer00"],
                                   ep["expert_load/max_over_mean_layer01"], strict=True)]
    )  # fmt: skip
    assert all(a > 0 and math.isfinite(a) for a in ep["loss/aux"])
    # Every 4 steps: the load of steps 1-4, then of 5-6. Each step routes the same number of
    # tokens, so a window's busiest expert over the mean is at most the mean of its steps'
    # ratios (the max of a sum is at most the sum of the maxima); the last step's alone can
    # exceed it.
    for layer in range(2):
        ratio = hsdp_ep[f"expert_load/max_over_mean_layer{layer:02d}"]
        share = hsdp_ep[f"expert_load/busiest_share_layer{layer:02d}"]
        steps = straight[f"expert_load/max_over_mean_layer{layer:02d}"]
        assert len(ratio) == len(share) == 2 and all(s >= 1 / 4 for s in share), share
        assert share == pytest.approx([r / 4 for r in ratio])
        for got, window in zip(ratio, (steps[:4], steps[4:]), strict=True):
            assert 1 <= got <= sum(window) / len(window) + 1e-6, (got, window)


@pytest.mark.slow
def test_compile_and_ac_keep_the_losses(straight: dict, tiny_dataset: str) -> None:
    """Op-level AC (the grouped GEMMs saved) recomputes to the bit; compiled blocks with it
    (the grouped GEMM a custom op inside them) stay within 1e-5."""
    out = straight["out"]
    op_ac = train(tiny_dataset, out, "op_ac", 1, "--ac.mode=op")
    assert op_ac["losses"] == straight["losses"] and op_ac["grad_norm"] == straight["grad_norm"]
    assert_same_run(train(tiny_dataset, out, "compiled", 1, "--compile.enabled", "--ac.mode=op"),
                    straight)  # fmt: skip


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
        (["--parallel.ep=2", "--parallel.tp=2"], 4, "with parallel.tp=2 is not supported"),
        (["--parallel.ep=2", "--compile.enabled"], 2, "with compile.enabled is not supported"),
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
