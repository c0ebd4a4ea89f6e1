"""Qwen3's Hugging Face mapping (`model.HFMapping`): weight names and config.json both ways.
`checkpoint/hf.py` reads and writes the files through it. `model.HF_MAPPINGS` names it; it
imports `model/qwen3.py` (for `QwenArgs`), never the reverse.

Unlike Llama's mapping there is no row permutation: model/qwen3.py computes RoPE in HF's
rotate-half layout (see `model.qwen3.apply_rope`), so every tensor is HF's as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from configs import ConfigError
from model import canonical_name
from model.qwen3 import QwenArgs

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
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def hf_name(name: str) -> str:
    """e.g. layers.0.attention.q_norm.weight -> model.layers.0.self_attn.q_norm.weight."""
    name = canonical_name(name)
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    _, layer, rest = name.split(".", 2)  # "layers", index, name inside the block
    return f"model.layers.{layer}.{_IN_LAYER[rest]}"


def rotated_head_dim(name: str, args: Any) -> int | None:
    """None for every weight: our RoPE layout is HF's (see the module docstring)."""
    return None


def config_json(
    args: Any, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
) -> dict:
    """config.json of a `Qwen3ForCausalLM` with the shape of `args`, in the keys of the
    published Qwen3 files (`rope_theta`, `rope_scaling`), which transformers 4 and 5 both read."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        # Every layer attends to the whole sequence (the published models too).
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        # Null, not omitted, when unknown: omitted, transformers would pick its own defaults.
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _unsupported(cfg: dict, rope_type: str) -> list[str]:
    """The settings of an HF Qwen3 config.json that model/qwen3.py does not implement."""
    n_layers = cfg.get("num_hidden_layers", 0)
    if cfg.get("layer_types") is not None:
        sliding = any(t != "full_attention" for t in cfg["layer_types"])
    else:  # transformers' rule: layers from max_window_layers on use the window
        sliding = (
            bool(cfg.get("use_sliding_window", False))
            and cfg.get("sliding_window") is not None
            and cfg.get("max_window_layers", 28) < n_layers
        )
    checks = {
        "model_type": cfg.get("model_type", "qwen3") != "qwen3",
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "attention_dropout": bool(cfg.get("attention_dropout", 0.0)),
        "sliding window attention": sliding,
        f"rope_type {rope_type}": rope_type != "default",
    }
    return [key for key, is_bad in checks.items() if is_bad]


def args_from_config_json(cfg: dict, path: str) -> Any:
    """Our QwenArgs for an HF config.json; ConfigError naming what our model cannot run."""
    try:
        # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`
        # (null in the published models) and `rope_theta`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if bad := _unsupported(cfg, rope_type):
            raise ConfigError(f"{path}: unsupported by model.qwen3: {', '.join(bad)}")
        n_heads = cfg["num_attention_heads"]
        return QwenArgs(
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim", 128),  # Qwen3Config's default, whatever the width
            vocab_size=cfg["vocab_size"],
            ffn_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)),
            max_seq_len=cfg.get("max_position_embeddings", 32_768),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
        )
    except KeyError as e:
        raise ConfigError(f"{path}: missing key {e}") from e


def mismatches(ours: Any, theirs: Any) -> list[str]:
    """'field ours vs theirs' for every setting that changes the model (not max_seq_len: a run
    may train shorter sequences than the model was made for)."""
    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim"]
    fields += ["norm_eps", "rope_theta", "tie_embeddings"]
    return [
        f"{name} {getattr(ours, name)} vs {getattr(theirs, name)}"
        for name in fields
        if getattr(ours, name) != getattr(theirs, name)
    ]
