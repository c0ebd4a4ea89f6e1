"""Llama 3's Hugging Face mapping (`model.HFMapping`): weight names, the q/k row order, and
config.json both ways. `checkpoint/hf.py` reads and writes the files through it.
`model.HF_MAPPINGS` names it; it imports `model/llama.py` (for `LlamaArgs`), never the reverse.

Our attention applies RoPE to adjacent pairs (x[2i], x[2i+1]) of each head (Meta's layout);
`transformers` rotates the first half of a head against the second half. The two are the same
model once the rows of wq and wk are reordered inside each head: HF row `p * head_dim/2 + i`
holds our row `2i + p` (p = 0, 1), the permutation of HF's `convert_llama_weights_to_hf.py`.
"""

from __future__ import annotations

from configs import ConfigError
from model import canonical_name
from model.llama import LlamaArgs

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
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_ROTATED = ("attention.wq.weight", "attention.wk.weight")  # rows reordered inside each head
# Llama 3.1's RoPE scaling constants, as model.llama.rope_frequencies hard-codes them.
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip


def hf_name(name: str) -> str:
    """e.g. layers.0.attention.wq.weight -> model.layers.0.self_attn.q_proj.weight."""
    name = canonical_name(name)
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    _, layer, rest = name.split(".", 2)  # "layers", index, name inside the block
    return f"model.layers.{layer}.{_IN_LAYER[rest]}"


def rotated_head_dim(name: str, args) -> int | None:
    return args.head_dim if name.endswith(_ROTATED) else None


def config_json(args, dtype, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json of a `LlamaForCausalLM` with the shape of `args`."""
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": args.rope_scaling_factor, **_LLAMA3_ROPE}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # Null, not omitted, when unknown: omitted, transformers would assume 1 and 2, which are
        # ordinary tokens in our tokenizers.
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def args_from_config_json(cfg: dict, path: str):
    """Our LlamaArgs for an HF config.json; ConfigError naming what our model cannot run."""
    try:
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        hidden = cfg["intermediate_size"]
        # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        unsupported = {
            "model_type": cfg.get("model_type", "llama") != "llama",
            "hidden_act": cfg.get("hidden_act", "silu") != "silu",
            "attention_bias": cfg.get("attention_bias", False),
            "mlp_bias": cfg.get("mlp_bias", False),
            "head_dim": cfg.get("head_dim", dim // n_heads) != dim // n_heads,
            "rope_type": rope_type not in ("default", "llama3"),
            "llama3 rope constants": rope_type == "llama3"
            and any(rope.get(k, v) != v for k, v in _LLAMA3_ROPE.items()),
        }
        if bad := [key for key, is_bad in unsupported.items() if is_bad]:
            raise ConfigError(f"{path}: unsupported by model.llama: {', '.join(bad)}")
        return LlamaArgs(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            vocab_size=cfg["vocab_size"],
            # LlamaArgs derives the FFN size; these two make it exactly `intermediate_size`.
            multiple_of=1,
            ffn_dim_multiplier=(hidden + 0.5) / int(2 * (4 * dim) / 3),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)),
            rope_scaling=rope_type == "llama3",
            rope_scaling_factor=rope.get("factor", 8.0),
            max_seq_len=cfg.get("max_position_embeddings", 8192),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
        )
    except KeyError as e:
        raise ConfigError(f"{path}: missing key {e}") from e


def mismatches(ours, theirs) -> list[str]:
    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim"]
    fields += ["norm_eps", "rope_theta", "rope_scaling", "tie_embeddings"]
    if ours.rope_scaling and theirs.rope_scaling:
        fields.append("rope_scaling_factor")
    return [
        f"{name} {getattr(ours, name)} vs {getattr(theirs, name)}"
        for name in fields
        if getattr(ours, name) != getattr(theirs, name)
    ]
