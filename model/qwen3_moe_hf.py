"""Qwen3-MoE's Hugging Face mapping (`model.HFMapping`): weight names and config.json both ways,
for `Qwen3MoeForCausalLM`. `model.HF_MAPPINGS` names it; it imports `model/qwen3_moe.py`.

The files hold each expert's projections as tensors of their own,
`model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` in nn.Linear's (out, in) layout:
the published checkpoints, and what transformers 5 writes with `save_pretrained` (in memory it
fuses them into stacked tensors and converts on load and save). Our stacked `experts.w1`
(experts, hidden, dim) is those gate_proj tensors one per row of dim 0, so `split_names` lists
them and `checkpoint/hf.py` writes and reads each row as it is: no transpose, no permutation
(RoPE is in HF's layout, as in model/qwen3_hf.py).
"""

from __future__ import annotations

from typing import Any

import torch

from configs import ConfigError
from model import canonical_name
from model.qwen3_moe import Qwen3MoEArgs

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.weight": "mlp.gate.weight",
    # One tensor per expert: `*` is the expert's index (split_names).
    "moe.experts.w1": "mlp.experts.*.gate_proj.weight",
    "moe.experts.w3": "mlp.experts.*.up_proj.weight",
    "moe.experts.w2": "mlp.experts.*.down_proj.weight",
}


def hf_name(name: str) -> str:
    """e.g. layers.0.moe.router.weight -> model.layers.0.mlp.gate.weight; a stacked expert
    weight gets the pattern of its per-expert names (`*` = the expert, see split_names)."""
    name = canonical_name(name)
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    _, layer, rest = name.split(".", 2)  # "layers", index, name inside the block
    return f"model.layers.{layer}.{_IN_LAYER[rest]}"


def split_names(name: str, args: Any) -> list[str] | None:
    """The HF tensors of a stacked expert weight, one per expert in order; None otherwise."""
    pattern = hf_name(name)
    if "*" not in pattern:
        return None
    return [pattern.replace("*", str(e)) for e in range(args.n_experts)]


def rotated_head_dim(name: str, args: Any) -> int | None:
    """None for every weight: our RoPE layout is HF's."""
    return None


def config_json(
    args: Any, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
) -> dict:
    """config.json of a `Qwen3MoeForCausalLM` with the shape of `args`, in the keys of the
    published files. The router z-loss has no HF key (HF's training has none)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.moe_ffn_dim,
        "norm_topk_prob": args.norm_topk_prob,
        # Every layer is an MoE layer, none a dense MLP. intermediate_size would size the dense
        # ones; the published files give top_k x moe_intermediate_size, as here.
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "intermediate_size": args.top_k * args.moe_ffn_dim,
        "router_aux_loss_coef": args.aux_loss_coef,
        "output_router_logits": False,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _unsupported(cfg: dict, rope_type: str, n_layers: int) -> list[str]:
    """The settings of an HF Qwen3-MoE config.json that model/qwen3_moe.py does not implement."""
    if cfg.get("layer_types") is not None:
        sliding = any(t != "full_attention" for t in cfg["layer_types"])
    else:
        sliding = (
            bool(cfg.get("use_sliding_window", False))
            and cfg.get("sliding_window") is not None
            and cfg.get("max_window_layers", 28) < n_layers
        )
    # transformers' rule: layer i is a dense MLP if listed in mlp_only_layers or if
    # (i + 1) is not a multiple of decoder_sparse_step.
    step, mlp_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(n_layers) if i in mlp_only or (i + 1) % step != 0]
    checks = {
        "model_type": cfg.get("model_type", "qwen3_moe") != "qwen3_moe",
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "attention_dropout": bool(cfg.get("attention_dropout", 0.0)),
        "sliding window attention": sliding,
        f"rope_type {rope_type}": rope_type != "default",
        f"dense MLP layers {dense} (decoder_sparse_step, mlp_only_layers)": bool(dense),
        "shared experts": bool(cfg.get("shared_expert_intermediate_size")),
    }
    return [key for key, is_bad in checks.items() if is_bad]


def args_from_config_json(cfg: dict, path: str) -> Any:
    """Our Qwen3MoEArgs for an HF config.json; ConfigError naming what our model cannot run."""
    try:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        n_layers = cfg["num_hidden_layers"]
        if bad := _unsupported(cfg, rope_type, n_layers):
            raise ConfigError(f"{path}: unsupported by model.qwen3_moe: {', '.join(bad)}")
        n_heads = cfg["num_attention_heads"]
        # transformers 5 writes num_local_experts; the published files num_experts.
        n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if n_experts is None:
            raise KeyError("num_experts")
        return Qwen3MoEArgs(
            dim=cfg["hidden_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim", 128),
            vocab_size=cfg["vocab_size"],
            n_experts=n_experts,
            top_k=cfg["num_experts_per_tok"],
            moe_ffn_dim=cfg["moe_intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", False),  # Qwen3MoeConfig's default
            aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)),
            max_seq_len=cfg.get("max_position_embeddings", 32_768),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
        )
    except KeyError as e:
        raise ConfigError(f"{path}: missing key {e}") from e


def mismatches(ours: Any, theirs: Any) -> list[str]:
    """'field ours vs theirs' for every setting that changes the model's function (not the
    loss coefficients or max_seq_len: settings of a training run, not of the weights)."""
    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "n_experts",
              "top_k", "moe_ffn_dim", "norm_topk_prob", "norm_eps", "rope_theta",
              "tie_embeddings"]  # fmt: skip
    return [
        f"{name} {getattr(ours, name)} vs {getattr(theirs, name)}"
        for name in fields
        if getattr(ours, name) != getattr(theirs, name)
    ]
