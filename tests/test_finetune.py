"""Fine-tuning: frozen parameters (`train.freeze`) and LoRA (`[lora]`). The model starts as the
base model, exactly; only what trains changes; parity across meshes and with tensor parallel;
exact resume; export merged (transformers) and as PEFT adapters; float8 base layers; the
planner's counts; every bad input as one config error."""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

import train
from checkpoint.export import load_checkpoint_model, main
from checkpoint.hf import save_hf_weights
from configs import ConfigError, config_to_toml, parse_config
from launch.check import check_config, resume_changes
from launch.job import JobConfig
from model import ModelConfig, get_family, get_hf_mapping
from parallel.dims import LaunchEnv
from parallel.freeze import apply_freeze
from parallel.lora import LoRAConfig, LoRALayer, apply_lora, init_lora, merge_lora
from parallel.objective import summed_loss
from tests.distributed import run_distributed
from tests.test_train import COMPILED, FP8, FP32, TINY, assert_close, train_losses

os.environ["HF_HUB_OFFLINE"] = "1"  # transformers and peft never reach for the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
EVERY_LINEAR = ["*.attention.*", "*.feed_forward.*"]
SEQ = 32


def plain_model(family: str = "llama3", lora: LoRAConfig | None = None, **shape: Any) -> Any:
    """A model of unit-scale random weights (init_weights' 0.02 would make attention nearly
    uniform, hiding a wrong layout), with LoRA's adapters B = 0 if `lora`."""
    fam = get_family(family)
    args = fam.build_args(ModelConfig(name=family, **(SMALL | shape)))
    model = fam.build_model(args)
    model.init_weights(seed=0, rope_len=SEQ)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else
                        noise * param.shape[-1] ** -0.5)  # fmt: skip
    if lora is not None:
        apply_lora(model, lora)
        init_lora(model, seed=0, assign=lambda p, draw: p.copy_(draw((slice(None),) * p.ndim)))
    return model


def tokens(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(2))


def perturb_adapters(model: nn.Module, seed: int = 3) -> None:
    """Adapters as after training: B no longer zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_lora_keeps_names_starts_as_the_base_model_and_merges(family: str) -> None:
    """Base weights keep their names and freeze; only the adapters train; with B = 0 the
    logits are the base model's, bitwise; merged, the plain model gives the adapted logits."""
    shape = {"head_dim": 16} if family == "qwen3" else {}
    base = plain_model(family, **shape)
    cfg = LoRAConfig(enabled=True, rank=4, alpha=8.0, targets=EVERY_LINEAR)
    model = plain_model(family, cfg, **shape)
    names = dict(model.named_parameters())
    base_names = dict(base.named_parameters())
    adapters = {n for n in names if ".lora_" in n}
    assert set(names) - adapters == set(base_names)
    assert len(adapters) == 2 * 7 * 2  # q k v o w1 w2 w3, A and B, in 2 layers
    assert {n for n, p in names.items() if p.requires_grad} == adapters
    assert names["layers.1.attention.wq.lora_a.weight"].shape == (4, 64)
    assert not names["layers.1.feed_forward.w2.lora_b.weight"].any()  # B starts at zero
    assert names["layers.1.feed_forward.w2.lora_a.weight"].std() > 0
    with torch.no_grad():
        assert torch.equal(model(tokens()), base(tokens()))
        perturb_adapters(model)
        adapted = model(tokens())
        assert (adapted - base(tokens())).abs().max() > 0.1
        merge_lora(model)
        assert not any(isinstance(m, LoRALayer) for m in model.modules())
        assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}
        assert dict(model.named_parameters()).keys() == base_names.keys()
        torch.testing.assert_close(model(tokens()), adapted, rtol=1e-5, atol=1e-5)


def test_freeze_patterns_match_names_and_tied_weights() -> None:
    model = plain_model(tie_embeddings=True)
    frozen = apply_freeze(model, ["output.weight", "layers.[0].*"])
    assert "output.weight" in frozen and "tok_embeddings.weight" not in frozen
    assert not model.tok_embeddings.weight.requires_grad  # tied: the same tensor
    assert all(not p.requires_grad for p in model.layers["0"].parameters())
    assert all(p.requires_grad for p in model.layers["1"].parameters())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--train.freeze=layers.9.*"], "train.freeze: 'layers.9.*' matches no parameter of "
         "this model (globs over names such as 'tok_embeddings.weight')"),
        (["--train.freeze=tok_embeddings.*,*"], "freezes every parameter: nothing would train"),
        (["--lora.enabled=true", "--lora.targets=*.attention.wq,*.attn.q"],
         "lora.targets: '*.attn.q' matches no Linear layer of this model"),
        (["--lora.rank=0"], "lora.rank must be >= 1, got 0"),
        (["--lora.alpha=-1"], "lora.alpha must be > 0, got -1.0"),
        (["--lora.dropout=1"], "lora.dropout must be in [0, 1), got 1.0"),
        (["--lora.enabled=true", "--lora.targets="], "lora.targets is empty"),
        (["--lora.enabled=true", "--train.freeze=layers.0.*"],
         "train.freeze with lora.enabled: LoRA already freezes every parameter but its adapters"),
        (["--lora.enabled=true", "--lora.targets=output", "--model.tie_embeddings=true"],
         "lora.targets: output shares its weight with another module (tied embeddings)"),
    ],
    ids=["freeze-unmatched", "freeze-all", "lora-unmatched", "rank", "alpha", "dropout",
         "no-targets", "lora-and-freeze", "lora-tied"],
)  # fmt: skip
def test_bad_finetune_input_is_one_config_error(
    tiny_dataset: str, tmp_path: Path, extra: list[str], message: str, caplog
) -> None:
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY, *extra]
    os.environ.pop("WORLD_SIZE", None)  # this process is a 1-rank launch
    with caplog.at_level(logging.ERROR, logger="train"):
        assert train.main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0]
    assert message in errors[0], errors[0]


# ---- a LoRA run on 2 ranks, from a Hugging Face base model -------------------------------------


def hf_base(out: Path) -> Path:
    """A random base model of TINY's shape as Hugging Face safetensors (fp32)."""
    job = parse_config(JobConfig, TINY)
    model = plain_model(**{k: getattr(job.model, k) for k in SMALL})
    save_hf_weights(model, get_hf_mapping("llama3"), out, torch.float32)
    return out


def lora_argv(dataset: str, out: Path, name: str, *extra: str) -> list[str]:
    return [
        f"--data.path={dataset}", f"--run.output_dir={out}", f"--run.name={name}", *TINY, *FP32,
        "--train.steps=4", "--train.micro_batch_size=2", "--lora.enabled=true", "--lora.rank=4",
        f"--lora.targets={','.join(EVERY_LINEAR)}", "--checkpoint.interval=2",
        "--checkpoint.keep_last=0", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 ranks FSDP, LoRA on every Linear of the blocks, 4 fp32 steps from a random HF base
    model, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("lora")
    base = hf_base(out / "base")
    argv = lora_argv(tiny_dataset, out, "lora", f"--checkpoint.init_from_hf={base}")
    losses = run_distributed(train_losses, 2, argv)[0]
    return {"out": out, "base": base, "argv": argv, "losses": losses,
            "ckpt": out / "lora" / "checkpoints"}  # fmt: skip


def load_entries(step_dir: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, step_dir.parent / "all.pt")
    entries = torch.load(step_dir.parent / "all.pt", weights_only=False)
    return {k: entries[k] for k in keys}


def test_lora_run_starts_at_the_base_model_and_trains_only_adapters(
    lora_run: dict[str, Any], tiny_dataset: str
) -> None:
    """The first loss is the HF base model's on the first global batch; after 4 steps every
    base weight is still the HF file's, bitwise; the optimizer holds state for adapters only."""
    from checkpoint.hf import load_hf_weights
    from data.documents import MicroBatch
    from data.loader import build_dataloader

    job = parse_config(JobConfig, lora_run["argv"])
    fam = get_family("llama3")
    base = fam.build_model(fam.build_args(job.model))
    load_hf_weights(base, get_hf_mapping("llama3"), lora_run["base"], job.data.seq_len)
    loader = build_dataloader(job.data, "train", dp_rank=0, dp_size=1, micro_batch_size=8, seed=0)
    inputs, targets = next(iter(loader))
    with torch.no_grad():
        expected = summed_loss(base, MicroBatch(inputs, targets)).item() / targets.numel()
    losses = lora_run["losses"]
    assert losses[0] == pytest.approx(expected, rel=1e-6)
    assert losses[-1] < losses[0]

    saved = load_entries(lora_run["ckpt"] / "step-4", ("model", "optimizer"))
    for name, param in base.named_parameters():
        assert torch.equal(saved["model"][name], param.detach()), name
    adapters = {n for n in saved["model"] if ".lora_" in n}
    assert len(adapters) == 2 * 7 * 2 and saved["model"].keys() - adapters == set(
        dict(base.named_parameters())
    )
    assert saved["model"]["layers.0.attention.wq.lora_b.weight"].abs().max() > 0  # trained
    assert set(saved["optimizer"]["state"]) == adapters


def test_lora_export_merged_and_as_peft_adapters(
    lora_run: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Merged: transformers gives our trained model's logits (fp32, 1e-5). --adapters-only:
    PEFT's files, which PeftModel puts on the base model for the same logits. A run without
    LoRA has no adapters to export: one error line."""
    transformers = pytest.importorskip("transformers")
    step = lora_run["ckpt"] / "step-4"
    ours = load_checkpoint_model(step, rope_len=SEQ)
    ids = tokens(512)
    with torch.no_grad():
        expected = ours(ids)
    assert main([str(step), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)

    # The documented command (docs/finetuning.md), no --dtype: float32 adapters, whatever the
    # run's checkpoint.export_dtype (bf16 ones move these logits by ~1e-4).
    with caplog.at_level(logging.INFO, logger="checkpoint.export"):
        assert main([str(step), str(tmp_path / "adapters"), "--adapters-only"]) == 0
    assert f"wrote the LoRA adapters (PEFT layout, float32) to {tmp_path / 'adapters'}" in (
        caplog.messages
    )
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]  # fmt: skip
    written = load_file(tmp_path / "adapters" / "adapter_model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.float32}
    peft = pytest.importorskip("peft")
    base = transformers.LlamaForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    with torch.no_grad():
        assert (base(ids).logits - expected).abs().max() > 1e-2  # the adapters matter
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
        torch.testing.assert_close(adapted(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_adapters_only_without_lora_is_one_error(tmp_path: Path, caplog) -> None:
    model = plain_model()
    step = tmp_path / "run" / "checkpoints" / "step-1"
    write_checkpoint(model, ModelConfig(**SMALL), LoRAConfig(), step)
    assert main([str(step), str(tmp_path / "out"), "--adapters-only"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [
        f"export error: --adapters-only: {step} is not from a LoRA run (its lora.enabled is "
        "false), it has no adapters; export the whole model without --adapters-only"
    ]


@dataclass
class _Run:
    model: ModelConfig
    lora: LoRAConfig = field(default_factory=LoRAConfig)


def write_checkpoint(model: nn.Module, cfg: ModelConfig, lora: LoRAConfig, step: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        state = {"model": model.state_dict(), "config": config_to_toml(_Run(cfg, lora))}
        dcp.save(state, checkpoint_id=step, no_dist=True)
    (step / "COMPLETE").touch()


def test_resume_may_change_lora_dropout_but_not_what_trains(lora_run: dict[str, Any]) -> None:
    """lora.dropout is applied and listed; alpha (the model's math) and the targets (other
    adapters: checkpoint keys) are each one config error."""
    # The run's own argv, resuming: its init_from_hf applied to its first start only.
    resume = f"--checkpoint.resume={lora_run['ckpt'] / 'step-2'}"
    argv = [*lora_run["argv"], resume, "--checkpoint.init_from_hf=none"]
    env = LaunchEnv(0, 0, 2, 2, 1)
    plan = check_config(parse_config(JobConfig, [*argv, "--lora.dropout=0.1"]), env)
    assert plan.resume_changes == ("lora.dropout: 0.0 -> 0.1",)
    with pytest.raises(ConfigError, match="a resume cannot change the model, what trains") as e:
        check_config(parse_config(JobConfig, [*argv, "--lora.alpha=4"]), env)
    assert "lora.alpha: 32.0 -> 4.0" in str(e.value)
    with pytest.raises(ConfigError, match=r"with a changed lora.targets: \['\*.attention.\*', "):
        check_config(parse_config(JobConfig, [*argv, "--lora.targets=*.attention.*"]), env)


def test_a_resume_that_changes_lora_names_the_keys_and_the_way_that_works(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same command with LoRA turned on, or lora.rank changed: one line naming the changed
    [lora] key, and the way that works, followed here: a new run from the checkpoint's export
    (neither a resume nor load_model_only can add or reshape adapters)."""
    run = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY, *FP32,
           "--train.steps=2", "--train.micro_batch_size=8", "--checkpoint.interval=2"]  # fmt: skip
    os.environ.pop("WORLD_SIZE", None)  # this process is a 1-rank launch

    def refused(*extra: str) -> str:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="train"):
            assert train.main([*run, "--train.steps=4", *extra]) == 2
        [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert "model." not in error and "resume=none" not in error, error
        return error

    assert train.main([*run, "--run.name=base"]) == 0
    base = tmp_path / "base" / "checkpoints" / "step-2"
    error = refused("--run.name=base", "--lora.enabled=true")
    assert error.startswith(f"config error: resuming {base} with a changed lora.enabled: False -> "
                            "True (parameters: 16 missing): a checkpoint loads only into the "
                            "model it was saved from, LoRA adapters included")  # fmt: skip
    assert error.endswith(f"start a new run from its export: python -m checkpoint.export {base} "
                          "DIR --dtype float32 (any adapters merged in), then "
                          "--checkpoint.init_from_hf=DIR and a new run.name")  # fmt: skip
    load = [f"--checkpoint.resume={base}", "--checkpoint.load_model_only=true"]
    error = refused("--run.name=other", "--lora.enabled=true", *load)
    assert error.startswith(f"config error: starting from {base} with a changed lora.enabled")
    assert error.endswith("--checkpoint.init_from_hf=DIR in place of checkpoint.resume")

    # The way it names: export, then a new run from the export, LoRA on.
    assert main([str(base), str(tmp_path / "export"), "--dtype", "float32"]) == 0
    lora = ["--run.name=lora", "--lora.enabled=true", "--lora.rank=4"]
    assert train.main([*run, *lora, f"--checkpoint.init_from_hf={tmp_path / 'export'}"]) == 0
    error = refused(*lora, "--lora.rank=8")
    assert error.startswith(
        f"config error: resuming {tmp_path / 'lora' / 'checkpoints' / 'step-2'} with a changed "
        "lora.rank: 4 -> 8 (parameters: 16 with another shape):"
    )


def test_resume_compares_the_fine_tuning_settings_every_checkpoint_saves(tmp_path: Path) -> None:
    """A checkpoint's config entry as train.py saves it (config_to_toml of the job) holds
    train.freeze and [lora]: resuming with the same job changes nothing. One without them is
    no format the trainer writes: one config error, not a run taken to have trained all."""
    job = parse_config(JobConfig, ["--data.path=unused"])
    text = config_to_toml(job)
    # The [lora] table, up to the next table (or the end), and train.freeze: gone.
    without = re.sub(r"\n\[lora\]\n.*?(?=\n\[|\Z)", "\n", text, flags=re.S)
    without = without.replace("\nfreeze = []\n", "\n")
    assert "[lora]" in text and "[lora]" not in without and "[eval]" in without
    for name, config in (("today", text), ("without", without)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"config": config}, checkpoint_id=tmp_path / name, no_dist=True)
    assert resume_changes(job, tmp_path / "today") == []
    with pytest.raises(ConfigError) as err:
        resume_changes(job, tmp_path / "without")
    message = str(err.value)
    assert message.startswith(f"resuming {tmp_path / 'without'} with a changed lora.alpha: None")
    assert "train.freeze: None -> []" in message and "\n" not in message


# ---- parity across meshes, tensor parallel, compile, resume -----------------------------------


def losses_and_grad_norms(argv: list[str]) -> tuple[list[float], list[float]]:
    """train_losses, also returning the gradient norm of every step (train.clip_grad_norm's)."""
    norms: list[float] = []
    clip = train.clip_grad_norm

    def spy(model: nn.Module, max_norm: float, *rest: Any) -> torch.Tensor:
        norm = clip(model, max_norm, *rest)
        norms.append(norm.item())
        return norm

    train.clip_grad_norm = spy  # in this rank's process only
    try:
        return train_losses(argv), norms
    finally:
        train.clip_grad_norm = clip


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def losses_norms_and_log(argv: list[str]) -> tuple[list[float], list[float], list[str]]:
    """losses_and_grad_norms, and the lines the trainer logs (on rank 0)."""
    handler, logger = _Lines(), logging.getLogger("train")
    logger.addHandler(handler), logger.setLevel(logging.INFO)
    return (*losses_and_grad_norms(argv), handler.lines)


def runs(dataset: str, tmp: Path, world: int, nodes: int, extra: list[str]) -> tuple[list, list]:
    argv = [f"--data.path={dataset}", f"--run.output_dir={tmp}", *TINY, *FP32, *extra]
    if nodes > 1:
        argv.append(f"--parallel.dp_replicate={nodes}")
    return run_distributed(losses_and_grad_norms, world, argv, nodes=nodes)[0]


STEPS = ["--train.steps=4", "--train.micro_batch_size=2"]
# Every Linear layer, the output projection too (not tied in TINY): tp 2 splits each one.
LORA_TARGETS = [*EVERY_LINEAR, "output"]
LORA = ["--lora.enabled=true", "--lora.rank=4", f"--lora.targets={','.join(LORA_TARGETS)}"]
HALF = ["--train.freeze=tok_embeddings.*,layers.0.*"]  # the embedding and the first block


@pytest.fixture(scope="module")
def one_process(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Losses and gradient norms on 1 process (fp32, 4 steps): full training, and LoRA on
    every Linear layer; the references of the parity tests below, each trained once."""
    tmp = tmp_path_factory.mktemp("one")
    return {"full": runs(tiny_dataset, tmp, 1, 1, STEPS),
            "lora": runs(tiny_dataset, tmp, 1, 1, [*STEPS, *LORA])}  # fmt: skip


@pytest.mark.slow
def test_lora_parity_one_process_fsdp_hsdp_tp(
    one_process: dict[str, Any], tiny_dataset: str, tmp_path: Path
) -> None:
    """Losses and gradient norms (fp32): LoRA on 1 process = FSDP 1x4 = HSDP 2x2 = tp 2,
    within 1e-5. The first loss is the full model's, exactly; the norms cover what trains only
    (at step 1 B's alone, A's gradient being 0 while B is: less than every weight's). Under
    tp the adapters' placements add no collective (A whole and B split for a column-split
    layer, A split and B whole for a row-split one)."""
    (full, full_norms), (single, norms) = one_process["full"], one_process["lora"]
    assert single[0] == full[0] and single[-1] < single[0]
    assert norms[0] < full_norms[0]
    for world, nodes, tp in [(4, 1, 1), (4, 2, 1), (2, 1, 2)]:
        extra = [*STEPS, *LORA, f"--parallel.tp={tp}"]
        losses, mesh_norms = runs(tiny_dataset, tmp_path, world, nodes, extra)
        assert_close(losses, single, rtol=1e-5), assert_close(mesh_norms, norms, rtol=1e-5)
    placements = run_distributed(adapter_placements, 2, ",".join(LORA_TARGETS))[0]
    column, row = (Shard(0), Replicate(), Shard(0)), (Shard(1), Shard(1), Replicate())
    assert placements["layers.0.attention.wq"] == placements["output"] == column
    assert placements["layers.1.feed_forward.w2"] == row


def adapter_placements(targets: str) -> dict[str, tuple[Placement, ...]]:
    """Placements of each adapted layer's weight, A and B after apply_tp and apply_lora at
    tp = world size (by layer name)."""
    from model import get_family
    from parallel.runtime import build_mesh, init_distributed
    from parallel.tp import apply_tp

    init_distributed(torch.device("cpu"), LaunchEnv.from_env(), 60)
    fam = get_family("llama3")
    with torch.device("meta"):
        model = fam.build_model(fam.build_args(ModelConfig(**SMALL)))
    apply_tp(model, fam, build_mesh(torch.device("cpu"), 1, 1, 2)["tp"])
    apply_lora(model, LoRAConfig(enabled=True, rank=4, targets=targets.split(",")))
    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LoRALayer):
            weights = (layer.weight, layer.lora_a.weight, layer.lora_b.weight)
            out[name] = tuple(w.placements[0] for w in weights)
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.slow
def test_qwen3_lora_tensor_parallel_equals_one_process(tiny_dataset: str, tmp_path: Path) -> None:
    """Qwen3 (per-head q/k norms after the split projections): tp 2 = 1 process, fp32
    losses and norms within 1e-5."""
    extra = [*STEPS, *LORA, f"--lora.targets={','.join(EVERY_LINEAR)}", "--model.name=qwen3",
             "--model.head_dim=16"]  # fmt: skip
    single, norms = runs(tiny_dataset, tmp_path, 1, 1, extra)
    tp, tp_norms = runs(tiny_dataset, tmp_path, 2, 1, [*extra, "--parallel.tp=2"])
    assert single[-1] < single[0]
    assert_close(tp, single, rtol=1e-5), assert_close(tp_norms, norms, rtol=1e-5)


@pytest.mark.slow
def test_lora_compiled_with_activation_checkpointing_equals_eager(
    one_process: dict[str, Any], tiny_dataset: str, tmp_path: Path
) -> None:
    """Blocks compiled (COMPILED: Dynamo and AOTAutograd) and checkpointed with their adapters,
    as bench/gpu.py's fine-tuning suite runs them: the eager LoRA losses within 1e-5 (fp32)."""
    extra = [*STEPS, *LORA, *COMPILED, "--ac.mode=full"]
    compiled, _ = runs(tiny_dataset, tmp_path, 1, 1, extra)
    assert_close(compiled, one_process["lora"][0], rtol=1e-5)


@pytest.mark.slow
def test_lora_resume_is_bitwise_and_reshards(lora_run: dict[str, Any], tiny_dataset: str) -> None:
    """From the LoRA run's step 2 (2 ranks): on the same 2 ranks the losses are the straight
    run's, bitwise; on 1 process within 1e-5 (the checkpoint resharded)."""
    out, losses = lora_run["out"], lora_run["losses"]
    resume = f"--checkpoint.resume={lora_run['ckpt'] / 'step-2'}"
    again = run_distributed(train_losses, 2, lora_argv(tiny_dataset, out, "again", resume))[0]
    assert again == losses[2:]
    one = run_distributed(train_losses, 1, lora_argv(tiny_dataset, out, "one", resume))[0]
    assert_close(one, losses[2:], 1e-5)


@pytest.mark.slow
def test_frozen_parity_checkpoints_and_resume(
    one_process: dict[str, Any], tiny_dataset: str, tmp_path: Path
) -> None:
    """The embedding and block 0 frozen. 2 ranks = 1 process (fp32 losses and norms within
    1e-5); the first loss is the full model's, the norms smaller (what trains only); the log
    counts both kinds of parameters. The checkpoint holds every parameter (the frozen ones as
    initialized) and optimizer state for the trainable ones; resuming step 2 is bitwise on 2
    ranks, within 1e-5 on 1 process; changing train.freeze on resume is one config error,
    starting from its weights alone (load_model_only) is not."""

    def argv(name: str, *extra: str) -> list[str]:
        return [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", f"--run.name={name}",
                *TINY, *FP32, *STEPS, *HALF, "--checkpoint.interval=2", "--checkpoint.keep_last=0",
                *extra]  # fmt: skip

    frozen, frozen_norms, log = run_distributed(losses_norms_and_log, 2, argv("frozen"))[0]
    single, norms = runs(tiny_dataset, tmp_path, 1, 1, [*STEPS, *HALF])
    assert_close(frozen, single, rtol=1e-5), assert_close(frozen_norms, norms, rtol=1e-5)
    full, full_norms = one_process["full"]
    assert single[0] == full[0] and single[1:] != full[1:] and norms[0] < full_norms[0]

    saved = load_entries(tmp_path / "frozen" / "checkpoints" / "step-4", ("model", "optimizer"))
    job = parse_config(JobConfig, argv("x"))
    fam = get_family("llama3")
    initial = fam.build_model(fam.build_args(job.model))
    initial.init_weights(seed=0, rope_len=SEQ)
    trainable = {n for n, _ in initial.named_parameters()
                 if not n.startswith(("tok_embeddings.", "layers.0."))}  # fmt: skip
    n_params = sum(p.numel() for p in initial.parameters())
    n_trainable = sum(p.numel() for n, p in initial.named_parameters() if n in trainable)
    assert (f"model debug: {n_params:,} parameters ({n_trainable:,} trainable, "
            f"{n_params - n_trainable:,} frozen)") in log  # fmt: skip
    assert saved["model"].keys() == dict(initial.named_parameters()).keys()
    assert set(saved["optimizer"]["state"]) == trainable
    for name, param in initial.named_parameters():
        assert torch.equal(saved["model"][name], param.detach()) == (name not in trainable), name
    resume = f"--checkpoint.resume={tmp_path / 'frozen' / 'checkpoints' / 'step-2'}"
    assert run_distributed(train_losses, 2, argv("again", resume))[0] == frozen[2:]
    assert_close(run_distributed(train_losses, 1, argv("one", resume))[0], frozen[2:], 1e-5)
    refreeze = [*argv("again", resume), "--train.freeze=layers.0.*"]
    env = LaunchEnv(0, 0, 2, 2, 1)
    with pytest.raises(ConfigError, match=r"train.freeze: \['tok_embeddings.\*', 'layers.0.\*'\]"):
        check_config(parse_config(JobConfig, refreeze), env)
    # What the error suggests: a new run from the checkpoint's weights may freeze otherwise.
    new_run = [*argv("refrozen", resume), "--checkpoint.load_model_only=true", refreeze[-1]]
    assert check_config(parse_config(JobConfig, new_run), env).resume.model_only


# ---- the planner ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lora", "freeze"),
    [(None, ["tok_embeddings.*", "layers.1[0-5].*", "layers.[0-9].*"]),
     (LoRAConfig(enabled=True), [])],
    ids=["half-frozen", "lora-16"],
)  # fmt: skip
def test_planner_counts_state_for_what_trains(lora: LoRAConfig | None, freeze: list[str]) -> None:
    """8B: the planner's trainable count is the model's own (built on meta, converted as
    train.py does); gradients and AdamW moments shrink by exactly that share, the weights not."""
    from model import llama
    from parallel.plan import model_shape, plan_memory

    args = llama.FLAVORS["8B"]
    with torch.device("meta"):
        model = llama.build_model(args)
    if lora is not None:
        apply_lora(model, lora)
    if freeze:
        apply_freeze(model, freeze)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = model_shape(llama, args, lora=lora, freeze=freeze)
    assert shape.numel(trainable_only=True) == trainable
    assert shape.numel() == sum(p.numel() for p in model.parameters())
    full = plan_memory(model_shape(llama, args), 8, 1, 8192)
    tuned = plan_memory(shape, 8, 1, 8192)
    share = trainable / model_shape(llama, args).numel()
    assert tuned["grads"] == pytest.approx(full["grads"] * share, rel=1e-3)
    assert tuned["optimizer"] == pytest.approx(full["optimizer"] * share, rel=1e-3)
    if lora is None:  # half the blocks frozen, and the embedding: half the activations kept
        assert 0.45 < share < 0.55
        assert tuned["activations"] == pytest.approx(full["activations"] / 2)
        assert tuned["params"] == full["params"]
    else:
        assert share < 0.002 and tuned["activations"] == full["activations"]
        assert tuned["params"] > full["params"]  # plus the adapters


# ---- float8 base layers ---------------------------------------------------------------------


def test_float8_base_layers_with_high_precision_adapters() -> None:
    """fp8 + LoRA: a converted layer stays a torchao Float8Linear (its frozen weight's matmul in
    float8) with plain Linear adapters; with B = 0 the logits are the float8 base model's,
    bitwise; backward reaches the adapters only."""
    pytest.importorskip("torchao", reason="fp8 extra not installed")
    from torchao.float8.float8_linear import Float8Linear

    from parallel.float8 import Float8Config, apply_float8

    fp8 = Float8Config(enabled=True, filter="none", skip=[])
    base, model = plain_model(), plain_model()
    for m in (base, model):
        apply_float8(m, fp8, weights_sharded=False)
    apply_lora(model, LoRAConfig(enabled=True, rank=16, targets=EVERY_LINEAR))
    init_lora(model, seed=0, assign=lambda p, draw: p.copy_(draw((slice(None),) * p.ndim)))
    wq = model.layers["0"].attention.wq
    assert isinstance(wq, Float8Linear) and isinstance(wq, LoRALayer)
    assert type(wq.lora_a) is nn.Linear and type(wq.lora_b) is nn.Linear
    with torch.no_grad():
        assert torch.equal(model(tokens()), base(tokens()))
    model(tokens()).logsumexp(-1).sum().backward()
    assert wq.weight.grad is None and wq.lora_b.weight.grad.abs().max() > 0


@pytest.mark.slow
def test_fp8_lora_tracks_bf16_lora(tiny_dataset: str, tmp_path: Path) -> None:
    """2 ranks, 10 steps: fp8 base layers (tensorwise, float8 all-gather of the frozen
    weights; matmuls emulated, tests/test_train.py's FP8) with bf16 adapters stay within 1% of
    the bf16 LoRA run's losses."""
    pytest.importorskip("torchao", reason="fp8 extra not installed")
    argv = [f"--data.path={tiny_dataset}", *TINY, "--parallel.param_dtype=bfloat16",
            "--train.steps=10", "--train.micro_batch_size=4", *LORA, "--lora.rank=16",
            f"--lora.targets={','.join(EVERY_LINEAR)}"]  # fmt: skip
    bf16 = run_distributed(train_losses, 2, [*argv, f"--run.output_dir={tmp_path / 'a'}"])[0]
    fp8 = run_distributed(
        train_losses, 2,
        [*argv, f"--run.output_dir={tmp_path / 'b'}", *FP8, "--fp8.filter=none"],
    )[0]  # fmt: skip
    assert fp8 != bf16 and fp8[-1] < fp8[0]
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(bf16), rtol=1e-2, atol=0)
