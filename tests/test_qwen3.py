"""Qwen3 (model/qwen3.py, model/qwen3_hf.py), what is its own: published sizes, config.json both
ways and what it cannot run, config errors, llama's init plus QK-norm, the chunked attention and
the RoPE layout against `transformers`, a CPU training smoke test, its shipped configs, activation
checkpointing with QK-norm, and the documented export path. The family contract (init on every
mesh, parity, resume, logits both ways, document masking, golden losses):
tests/test_families.py."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from configs import ConfigError
from model import FAMILIES, ModelConfig, count_params, get_hf_mapping, qwen3, qwen3_hf
from model.qwen3 import FLAVORS, Qwen3, QwenArgs, build_args, build_model
from tests.distributed import run_distributed
from tests.test_cli import shipped_dry_run
from tests.test_families import run_argv, unit_scale
from tests.test_train import train_losses

# transformers must never reach for the network (read when huggingface_hub is first imported).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]
SEQ = 32
# GQA (4 query heads share 2 kv heads) and n_heads * head_dim = 128 != dim = 64: the two places
# where a Llama-shaped assumption would break.
SMALL = QwenArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=128,
                 ffn_dim=96)  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread, like the ranks of tests/distributed.py: on 2 shared, busy cores,
    thread-pool barriers made init_weights of the debug flavor take 20 s instead of 0.4 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qwen_config(**fields: Any) -> ModelConfig:
    """A [model] section naming qwen3."""
    return ModelConfig(name="qwen3", **fields)


# ---- shapes --------------------------------------------------------------------------------

# (exact total, published total, published non-embedding) parameters. Published: the model
# cards of Qwen/Qwen3-* (0.6B/0.44B, 1.7B/1.4B, 4.0B/3.6B, 8.2B/6.95B, 14.8B/13.2B). Exact: what
# these shapes give, which transformers' Qwen3ForCausalLM of the same config.json also counts
# (test_transformers_builds_the_same_parameters).
PARAMS = {
    "0.6B": (596_049_920, 0.6e9, 0.44e9),
    "1.7B": (1_720_574_976, 1.7e9, 1.4e9),
    "4B": (4_022_468_096, 4.0e9, 3.6e9),
    "8B": (8_190_735_360, 8.2e9, 6.95e9),
    "14B": (14_768_307_200, 14.8e9, 13.2e9),
}


def meta_model(args: QwenArgs) -> Qwen3:
    with torch.device("meta"):
        return build_model(args)


@pytest.mark.parametrize("flavor", list(PARAMS))
def test_flavors_have_the_published_sizes(flavor: str) -> None:
    args = FLAVORS[flavor]
    exact, published, published_non_embedding = PARAMS[flavor]
    n = count_params(meta_model(args))
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    assert n == exact
    assert abs(n / published - 1) < 0.015  # the cards round to 2 digits
    assert abs((n - embeddings) / published_non_embedding - 1) < 0.015
    assert (args.head_dim, args.vocab_size, args.rope_theta, args.norm_eps, args.max_seq_len) == (
        128, 151_936, 1e6, 1e-6, 40_960,
    )  # fmt: skip
    assert args.tie_embeddings == (flavor in ("0.6B", "1.7B", "4B"))


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_transformers_builds_the_same_parameters(flavor: str) -> None:
    """Every tensor of Qwen3ForCausalLM, of our config.json, is one of ours with its shape."""
    transformers = pytest.importorskip("transformers")
    args = FLAVORS[flavor]
    config = transformers.Qwen3Config(**qwen3_hf.config_json(args, torch.bfloat16, None, None))
    with torch.device("meta"):
        theirs = transformers.Qwen3ForCausalLM(config)
    ours = {qwen3_hf.hf_name(n): tuple(p.shape) for n, p in meta_model(args).named_parameters()}
    theirs_shapes = {n: tuple(p.shape) for n, p in theirs.named_parameters()}  # tied: once
    assert ours == theirs_shapes


def test_flops_per_token_counts_the_attention_width_not_dim() -> None:
    """0.6B: attention is 16 heads x 128 = 2048 wide, twice its dim."""
    args = FLAVORS["0.6B"]
    model = meta_model(args)
    n = count_params(model)  # tied: the embedding matrix is also the output matmul
    assert qwen3.flops_per_token(model, 4096) == 6 * n + 12 * 28 * 2048 * 4096
    untied = meta_model(FLAVORS["8B"])
    n = count_params(untied) - 151_936 * 4096
    assert qwen3.flops_per_token(untied, 4096) == 6 * n + 12 * 36 * 4096 * 4096


def test_fsdp_units_and_fp8_linears() -> None:
    model = meta_model(SMALL)
    assert qwen3.fsdp_units(model) == [model.layers["0"], model.layers["1"]]
    linears = qwen3.fp8_linears(model)
    assert len(linears) == 2 * 7 + 1 and "output" in linears
    assert "layers.1.attention.wq" in linears and "layers.1.feed_forward.w2" in linears
    names = [n for n, _ in model.named_parameters()]
    assert (
        "layers.0.attention.q_norm.weight" in names and "layers.0.attention.k_norm.weight" in names
    )
    assert dict(model.named_parameters())["layers.0.attention.q_norm.weight"].shape == (32,)


# ---- build_args ----------------------------------------------------------------------------


def test_build_args_applies_overrides() -> None:
    args = build_args(qwen_config(flavor="8B", n_layers=2, head_dim=64, ffn_dim=256))
    assert args == dataclasses.replace(FLAVORS["8B"], n_layers=2, head_dim=64, ffn_dim=256)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"multiple_of": 256}, "model.multiple_of does not apply to qwen3"),
        ({"ffn_dim_multiplier": 1.3}, "model.ffn_dim_multiplier does not apply to qwen3"),
        ({"rope_scaling": True}, "model.rope_scaling does not apply to qwen3"),
        ({"flavor": "70B"}, "'70B' is not a qwen3 flavor: debug, 0.6B, 1.7B, 4B, 8B, 14B"),
        ({"n_kv_heads": 3}, "n_heads=16 is not a multiple of n_kv_heads=3"),
        ({"head_dim": 15}, "head_dim=15 must be even for RoPE"),
        ({"ffn_dim": 0}, "ffn_dim must be >= 1, got 0"),
    ],
)
def test_build_args_rejects(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_args(qwen_config(**({"flavor": "debug"} | fields)))


def test_registered_under_its_name() -> None:
    assert FAMILIES["qwen3"] is qwen3
    assert get_hf_mapping("qwen3") is qwen3_hf


# ---- init ----------------------------------------------------------------------------------


def initialized(args: QwenArgs = SMALL, seed: int = 0) -> Qwen3:
    model = build_model(args)
    model.init_weights(seed=seed, rope_len=SEQ)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_init_is_llamas_for_the_parameters_both_have(tied: bool) -> None:
    """Same seed, names and shapes: the very values of llama's init_weights (the draws depend
    on seed, name and index, so this checks the std policy too); q/k norms start at 1."""
    from model import llama

    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, tie_embeddings=tied)
    theirs = llama.build_model(llama.LlamaArgs(**shape))
    theirs.init_weights(seed=3, rope_len=SEQ)
    ours = initialized(QwenArgs(**shape, head_dim=16, ffn_dim=256), seed=3)
    theirs_state = theirs.state_dict()
    for name, value in ours.state_dict().items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.equal(value, torch.ones(16)), name
        else:
            assert torch.equal(value, theirs_state[name]), name


# ---- Hugging Face --------------------------------------------------------------------------


def hf_model(transformers: Any, args: QwenArgs) -> Any:
    """transformers' own model of our config.json, its eager attention as the reference."""
    config = transformers.Qwen3Config(
        **qwen3_hf.config_json(args, torch.float32, None, None), attn_implementation="eager"
    )
    return transformers.Qwen3ForCausalLM(config).eval()


def tokens(args: QwenArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers_with_chunked_attention_not_in_llamas_layout() -> None:
    """Tied, with the chunked CPU attention: transformers' logits, its weights loaded by name
    alone (tests/test_families.py checks both ways through HF files, with SDPA). The test can
    fail: in Llama's layout the same weights give other logits."""
    transformers = pytest.importorskip("transformers")
    args = dataclasses.replace(SMALL, tie_embeddings=True, attention="chunked")
    ours = initialized(args)
    unit_scale(ours, seed=0)
    theirs = hf_model(transformers, args)
    state = {qwen3_hf.hf_name(n): p.detach() for n, p in ours.named_parameters()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    x = tokens(args)
    with torch.no_grad():
        logits, expected = ours(x), theirs(x).logits
        assert (logits - expected).abs().max() <= 1e-4
        # The test can fail: in Llama's layout (pairs interleaved: the permutation llama's
        # mapping applies) the same weights give other logits.
        for layer in theirs.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight
                proj.weight.copy_(w.unflatten(0, (-1, 2, args.head_dim // 2)).transpose(1, 2)
                                  .reshape(w.shape))  # fmt: skip
        assert (theirs(x).logits - logits).abs().max() > 0.1


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_config_json_round_trips(flavor: str) -> None:
    args = FLAVORS[flavor]
    cfg = qwen3_hf.config_json(args, torch.bfloat16, 151_643, 151_645)
    assert cfg["rope_scaling"] is None and cfg["head_dim"] == args.head_dim
    assert qwen3_hf.args_from_config_json(cfg, "config.json") == args
    assert qwen3_hf.mismatches(args, args) == []
    other = dataclasses.replace(args, head_dim=64, rope_theta=1e4)
    assert qwen3_hf.mismatches(args, other) == [
        f"head_dim {args.head_dim} vs 64",
        "rope_theta 1000000.0 vs 10000.0",
    ]
    assert all(
        qwen3_hf.rotated_head_dim(n, args) is None for n, _ in meta_model(SMALL).named_parameters()
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}}, "rope_type yarn"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "rope_type dynamic"),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
         "sliding window attention"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding window attention"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "qwen3_moe"}, "model_type"),
    ],
)  # fmt: skip
def test_config_json_qwen3_cannot_run_is_a_config_error(change: dict, named: str) -> None:
    cfg = qwen3_hf.config_json(SMALL, torch.float32, None, None) | change
    with pytest.raises(ConfigError, match=f"x/config.json: unsupported by model.qwen3: {named}"):
        qwen3_hf.args_from_config_json(cfg, "x/config.json")


def test_config_json_edge_cases() -> None:
    base = qwen3_hf.config_json(SMALL, torch.float32, None, None)
    # Sliding-window settings under which no layer slides (the window would start past the
    # last layer) are the same model.
    fine = {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}
    assert qwen3_hf.args_from_config_json(base | fine, "x") == SMALL
    # head_dim omitted: transformers' Qwen3Config takes 128, not hidden_size // heads.
    no_head_dim = {k: v for k, v in base.items() if k != "head_dim"}
    assert qwen3_hf.args_from_config_json(no_head_dim, "x").head_dim == 128
    no_hidden = {k: v for k, v in base.items() if k != "hidden_size"}
    with pytest.raises(ConfigError, match="x: missing key 'hidden_size'"):
        qwen3_hf.args_from_config_json(no_hidden, "x")


# ---- training ------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_debug_flavor_trains_on_cpu(tied: bool) -> None:
    """Forward and backward with the model alone: 12 AdamW steps on one random batch more than
    halve the loss (measured: 9.3 -> 3.3 tied, 6.1 -> 0.02 untied)."""
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=256, tie_embeddings=tied)
    model = initialized(args)
    batch = torch.randint(0, 256, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for _ in range(12):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if not tied:  # unit-RMS features times output rows of std dim^-0.5: logits of std ~1
        assert abs(losses[0] - (math.log(256) + 0.5)) < 0.3, losses
    # (Tied, llama's init too starts higher: the normalized input embedding meets its own row
    # in the output projection, a logit of ~sqrt(dim) for the input token.)
    assert losses[-1] < losses[0] / 2, losses


# ---- the trainer with --model.name=qwen3 ---------------------------------------------------


@pytest.mark.parametrize(
    ("config", "nodes", "per_node", "mesh"),
    [
        ("configs/qwen3_debug.toml", 1, 4, "dp_replicate=1 x dp_shard=4"),
        ("configs/qwen3_8b.toml", 2, 8, "dp_replicate=2 x dp_shard=8"),
    ],
)
def test_shipped_configs_resolve_on_their_intended_clusters(
    tmp_path: Path, config: str, nodes: int, per_node: int, mesh: str
) -> None:
    """`train.py <config> --dry-run` (no data needed) plans the intended mesh for the qwen3
    model of the flavor's size (tests/test_cli.py's shipped_dry_run)."""
    assert mesh in shipped_dry_run(config, nodes, per_node, tmp_path)


@pytest.mark.parametrize("ac", ["op", pytest.param("full", marks=pytest.mark.slow)])
def test_trainer_activation_checkpointing_keeps_the_losses(
    tiny_dataset: str, tmp_path: Path, ac: str
) -> None:
    """configs/qwen3_8b.toml trains with ac.mode=op: recomputation (QK-norm included) must
    give the losses of the plain run, to the bit in fp32 on one process."""
    argv = run_argv(tiny_dataset, tmp_path, "qwen3", "ac", "--train.steps=3")
    plain = run_distributed(train_losses, 1, argv)[0]
    assert run_distributed(train_losses, 1, [*argv, f"--ac.mode={ac}"])[0] == plain


@pytest.mark.slow
def test_export_gives_the_trainers_val_loss_in_transformers(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """The documented path: `python train.py` with an eval at the last step, `python -m
    checkpoint.export` of its checkpoint, `from_pretrained`: transformers' loss on the same
    validation batches is the val_loss the trainer logged."""
    transformers = pytest.importorskip("transformers")
    from data.loader import DataConfig, build_dataloader

    root = Path(__file__).resolve().parents[1]
    argv = run_argv(tiny_dataset, tmp_path, "qwen3", "val", "--train.steps=4",
                    "--train.eval_interval=4", "--train.eval_batches=2",
                    "--checkpoint.interval=4")  # fmt: skip
    run = subprocess.run([sys.executable, "train.py", *argv], cwd=root, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    logged = float(re.findall(r"val_loss (\d+\.\d+)", run.stderr)[-1])
    hf = tmp_path / "hf"
    step4 = tmp_path / "val" / "checkpoints" / "step-4"
    export = subprocess.run(
        [sys.executable, "-m", "checkpoint.export", str(step4), str(hf), "--dtype=float32"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, local_files_only=True).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    val = build_dataloader(DataConfig(path=tiny_dataset, seq_len=32), "val", dp_rank=0,
                           dp_size=1, micro_batch_size=8, seed=0)  # fmt: skip
    batches = iter(val)
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(2):  # eval_batches global batches of 8 sequences
            inputs, targets = next(batches)
            logits = model(inputs).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            ).item()
            count += int((targets != -100).sum())
    # The log rounds to 4 decimals.
    assert abs(total / count - logged) <= 1e-4, (total / count, logged)
