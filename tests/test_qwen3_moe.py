"""Qwen3-MoE (model/qwen3_moe.py, model/moe.py, model/qwen3_moe_hf.py) on one device: published
sizes, the grouped GEMM against a per-expert loop, routing, the auxiliary losses and their
normalization, config errors, and its routing settings through HF files both ways. The family
contract (init on every mesh, document masking, parity with tensor and expert parallel, resume,
logits both ways): tests/test_families.py; the trainer's other MoE features:
tests/test_moe_trainer.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from configs import ConfigError
from model import FAMILIES, ModelConfig, count_params, get_hf_mapping, moe_family, qwen3_moe_hf
from model.moe import MoE
from model.qwen3_moe import FLAVORS, Qwen3MoE, Qwen3MoEArgs, build_args, build_model
from tests.test_families import unit_scale

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

SEQ = 16
# GQA, 4 experts of which each token takes 2; both aux losses on.
SMALL = Qwen3MoEArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=128,
                     n_experts=4, top_k=2, moe_ffn_dim=32, aux_loss_coef=0.01,
                     router_z_loss_coef=0.001)  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def initialized(args: Qwen3MoEArgs = SMALL, seed: int = 0) -> Qwen3MoE:
    model = build_model(args)
    model.init_weights(seed=seed, rope_len=SEQ)
    return model


def meta_model(args: Qwen3MoEArgs) -> Qwen3MoE:
    with torch.device("meta"):
        return build_model(args)


# ---- shapes --------------------------------------------------------------------------------

# (exact total, exact active per token, published total, published active): Qwen3 technical
# report (arXiv:2505.09388) and the model cards of Qwen/Qwen3-30B-A3B and -235B-A22B.
PARAMS = {
    "30B-A3B": (30_532_122_624, 3_353_032_704, 30.5e9, 3.3e9),
    "235B-A22B": (235_093_634_560, 22_190_763_520, 235e9, 22e9),
}


@pytest.mark.parametrize("flavor", list(PARAMS))
def test_flavors_have_the_published_sizes(flavor: str) -> None:
    """Total and active parameters as published; FLOPs per token count the active ones."""
    from model import qwen3_moe

    args = FLAVORS[flavor]
    exact, active, published, published_active = PARAMS[flavor]
    model = meta_model(args)
    assert count_params(model) == exact and qwen3_moe.active_params(model) == active
    assert abs(exact / published - 1) < 0.02 and abs(active / published_active - 1) < 0.02
    active_matmuls = active - args.vocab_size * args.dim  # the input embedding is a lookup
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert qwen3_moe.flops_per_token(model, 4096) == 6 * active_matmuls + attention


def test_transformers_builds_the_same_parameter_count() -> None:
    transformers = pytest.importorskip("transformers")
    args = FLAVORS["30B-A3B"]
    config = transformers.Qwen3MoeConfig(**qwen3_moe_hf.config_json(args, torch.bfloat16, 0, 0))
    with torch.device("meta"):
        theirs = transformers.Qwen3MoeForCausalLM(config)
    assert sum(p.numel() for p in theirs.parameters()) == PARAMS["30B-A3B"][0]


def test_registered_with_the_moe_contract() -> None:
    family = FAMILIES["qwen3_moe"]
    assert moe_family(family) is family and moe_family(FAMILIES["qwen3"]) is None
    assert get_hf_mapping("qwen3_moe") is qwen3_moe_hf
    model = meta_model(SMALL)
    experts = family.expert_modules(model)
    assert experts == [model.layers["0"].moe.experts, model.layers["1"].moe.experts]
    assert family.fsdp_units(model) == [model.layers["0"], model.layers["1"]]
    # FP8 leaves the router and the experts alone: only real nn.Linear layers are candidates.
    linears = family.fp8_linears(model)
    assert len(linears) == 2 * 4 + 1 and not any("moe" in n for n in linears)


# ---- the MoE layer -------------------------------------------------------------------------


def per_expert_loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The reference: each token through each of its top_k experts, one expert at a time."""
    tokens = x.reshape(-1, x.shape[-1])
    _, _, weights, chosen = moe.router(tokens)
    out = torch.zeros_like(tokens)
    e = moe.experts
    for expert in range(moe.n_experts):
        token, slot = torch.nonzero(chosen == expert, as_tuple=True)
        h = tokens[token]
        y = F.linear(F.silu(F.linear(h, e.w1[expert])) * F.linear(h, e.w3[expert]), e.w2[expert])
        out = out.index_add(0, token, y * weights[token, slot, None])
    return out.view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_a_per_expert_loop(dtype: torch.dtype) -> None:
    """Output and every gradient, an expert that receives no token included."""
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden=16, n_experts=4, top_k=2, norm_topk_prob=True, aux_loss_coef=0.0,
              router_z_loss_coef=0.0).to(dtype)  # fmt: skip
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        moe.router.weight[3] = -1.0  # expert 3: far below the others for positive inputs
    x = torch.randn(2, 8, 32).abs().to(dtype) + 0.5
    out, _, counts = moe(x)
    assert counts[3] == 0 and counts.sum() == 2 * 8 * 2
    reference = per_expert_loop(moe, x)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, reference, **tol)
    grads = torch.autograd.grad(out.float().square().sum(), list(moe.parameters()))
    expected = torch.autograd.grad(reference.float().square().sum(), list(moe.parameters()))
    for (name, _), got, want in zip(moe.named_parameters(), grads, expected, strict=True):
        torch.testing.assert_close(got, want, **tol, msg=name)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_softmax_top_k(norm_topk_prob: bool) -> None:
    """Softmax over all experts in float32, then the top_k; renormalized with norm_topk_prob
    (transformers' Qwen3MoeSparseMoeBlock does the same)."""
    torch.manual_seed(1)
    moe = MoE(32, 16, 6, 3, norm_topk_prob, 0.0, 0.0)
    torch.nn.init.normal_(moe.router.weight)
    x = torch.randn(10, 32)
    logits, probs, weights, chosen = moe.router(x)
    torch.testing.assert_close(probs, torch.softmax(x @ moe.router.weight.T, dim=-1))
    expected, top = torch.topk(probs, 3, dim=-1)
    assert torch.equal(chosen, top)
    if norm_topk_prob:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected)


def test_aux_loss_is_summed_per_sequence_so_any_split_of_the_batch_gives_the_same_total() -> None:
    """The normalization the trainer relies on (model/__init__.py): the aux loss of 4 sequences
    is the sum of the 4 sequences' own, so splitting a step over ranks or micro-batches and
    dividing the sum by the step's sequences gives the same loss and gradients."""
    torch.manual_seed(2)
    moe = MoE(32, 16, 4, 2, True, aux_loss_coef=0.1, router_z_loss_coef=0.01)
    torch.nn.init.normal_(moe.router.weight)
    x = torch.randn(4, 8, 32)
    whole = moe(x)[1]
    parts = torch.stack([moe(x[i : i + 1])[1] for i in range(4)]).sum()
    torch.testing.assert_close(whole, parts)
    # Each term by hand for one sequence: n_experts * sum_e f_e P_e with f_e summing to top_k,
    # and the mean squared logsumexp of the logits.
    seq = x[0]
    logits, probs, _, chosen = moe.router(seq)
    f = torch.bincount(chosen.flatten(), minlength=4).float() / 8
    balance = 4 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(moe(x[:1])[1], 0.1 * balance + 0.01 * z)
    # Perfectly balanced routing gives top_k: uniform probabilities, f_e = top_k / n_experts.
    with torch.no_grad():
        moe.router.weight.zero_()
    assert moe(x)[1].item() == pytest.approx(4 * (0.1 * 2 + 0.01 * math.log(4) ** 2))


def test_model_keeps_the_last_forwards_aux_loss_and_expert_load() -> None:
    family = FAMILIES["qwen3_moe"]
    model = initialized()
    x = torch.randint(0, SMALL.vocab_size, (3, SEQ), generator=torch.Generator().manual_seed(0))
    model(x)
    load = family.expert_load(model)
    assert load.shape == (SMALL.n_layers, SMALL.n_experts) and not load.requires_grad
    assert torch.equal(load.sum(1), torch.full((2,), 3.0 * SEQ * SMALL.top_k))
    aux = family.aux_loss(model)
    assert aux.requires_grad and aux > 0
    model(x[:1])  # the next forward replaces both
    assert family.expert_load(model).sum() == SEQ * SMALL.top_k * SMALL.n_layers


# ---- build_args ----------------------------------------------------------------------------


def test_build_args_applies_overrides() -> None:
    cfg = ModelConfig(name="qwen3_moe", flavor="30B-A3B", n_layers=2, n_experts=16, top_k=4,
                      router_z_loss_coef=1e-3)  # fmt: skip
    assert build_args(cfg) == dataclasses.replace(
        FLAVORS["30B-A3B"], n_layers=2, n_experts=16, top_k=4, router_z_loss_coef=1e-3
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_k": 9}, "top_k=9 exceeds n_experts=8"),
        ({"aux_loss_coef": -0.1}, r"model.aux_loss_coef must be >= 0 \(0 = off\), got -0.1"),
        ({"router_z_loss_coef": -1.0}, "model.router_z_loss_coef must be >= 0"),
        ({"n_experts": 0}, "n_experts must be >= 1"),
        ({"moe_ffn_dim": 100}, "moe_ffn_dim=100 must be multiples of 8"),
        ({"ffn_dim": 512}, "ffn_dim"),  # qwen3's dense FFN size: not a field of this family
    ],
)
def test_build_args_rejects(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        build_args(ModelConfig(name="qwen3_moe", **fields))
    assert "\n" not in str(err.value)


# ---- Hugging Face --------------------------------------------------------------------------


def tokens(args: Qwen3MoEArgs) -> torch.Tensor:
    return torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("flavor", "norm_topk_prob"), [("debug", True), ("debug", False), ("small", False)]
)
def test_logits_equal_transformers_through_hf_files_both_ways(
    flavor: str, norm_topk_prob: bool, tmp_path: Path
) -> None:
    """Ours -> save_hf_weights -> `from_pretrained`: the same logits (fp32, 1e-5). Theirs ->
    `save_pretrained` (transformers 5 fuses the experts in memory and writes one tensor per
    expert) -> load_hf_weights: the same logits, and its config.json reads back as our args.
    Our files read back bitwise. On the family's whole debug flavor (8 experts, 4 layers), with
    and without norm_topk_prob, and on SMALL, whose router z-loss (not an HF setting) is on;
    the test can fail (the experts in another order). The tiny shape with norm_topk_prob, both
    ways, tied and untied: tests/test_families.py."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.hf import check_hf_config, load_hf_weights, save_hf_weights

    shape = FLAVORS["debug"] if flavor == "debug" else SMALL
    args = dataclasses.replace(shape, norm_topk_prob=norm_topk_prob)
    x = tokens(args)
    ours = initialized(args)
    unit_scale(ours, seed=3)
    save_hf_weights(ours, qwen3_moe_hf, tmp_path / "ours", dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, local_files_only=True
    ).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max() <= 1e-5
    loaded = meta_model(args)
    loaded.to_empty(device="cpu")
    load_hf_weights(loaded, qwen3_moe_hf, tmp_path / "ours", rope_len=SEQ)
    for (name, a), b in zip(ours.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    unit_scale(theirs, seed=4)
    theirs.save_pretrained(tmp_path / "theirs")
    saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert qwen3_moe_hf.args_from_config_json(saved, "config.json") == dataclasses.replace(
        args,
        router_z_loss_coef=0.0,  # not an HF setting
    )
    check_hf_config(qwen3_moe_hf, args, tmp_path / "theirs")
    load_hf_weights(loaded, qwen3_moe_hf, tmp_path / "theirs", rope_len=SEQ)
    with torch.no_grad():
        assert (loaded(x) - theirs(x).logits).abs().max() <= 1e-5
        # The test can fail: the same weights with the experts' order reversed differ.
        for layer in loaded.layers.values():
            for w in (layer.moe.experts.w1, layer.moe.experts.w2, layer.moe.experts.w3):
                w.copy_(w.flip(0))
        assert (loaded(x) - theirs(x).logits).abs().max() > 0.1


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"decoder_sparse_step": 2}, r"dense MLP layers \[0\]"),
        ({"mlp_only_layers": [1]}, r"dense MLP layers \[1\]"),
        ({"shared_expert_intermediate_size": 64}, "shared experts"),
        ({"model_type": "qwen2_moe"}, "model_type"),
        ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
         "sliding window attention"),
    ],
)  # fmt: skip
def test_config_json_the_model_cannot_run_is_a_config_error(change: dict, named: str) -> None:
    cfg = qwen3_moe_hf.config_json(SMALL, torch.float32, None, None) | change
    with pytest.raises(ConfigError, match=f"x: unsupported by model.qwen3_moe: {named}"):
        qwen3_moe_hf.args_from_config_json(cfg, "x")


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_config_json_round_trips(flavor: str) -> None:
    args = FLAVORS[flavor]
    cfg = qwen3_moe_hf.config_json(args, torch.bfloat16, 151_643, 151_645)
    assert cfg["num_experts"] == args.n_experts and cfg["norm_topk_prob"] is True
    assert qwen3_moe_hf.args_from_config_json(cfg, "config.json") == args
    other = dataclasses.replace(args, top_k=1, norm_topk_prob=False, aux_loss_coef=0.0)
    assert qwen3_moe_hf.mismatches(args, other) == [
        f"top_k {args.top_k} vs 1",
        "norm_topk_prob True vs False",
    ]
