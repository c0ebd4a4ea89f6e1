"""Hugging Face Llama format: weight names, the q/k row permutation, config.json, both ways.

    save_hf_weights(model, out_dir)          # plain model -> safetensors + config.json
    load_hf_weights(model, hf_dir)           # safetensors -> plain or FSDP-sharded model
    check_hf_config(args, hf_dir)            # ConfigError if config.json describes another shape

Our attention applies RoPE to adjacent pairs (x[2i], x[2i+1]) of each head (Meta's layout);
`transformers` rotates the first half of a head against the second half. The two are the same
model once the rows of wq and wk are reordered inside each head: HF row `p * head_dim/2 + i`
holds our row `2i + p` (p = 0, 1). This is the permutation of HF's
`convert_llama_weights_to_hf.py`.

Loading never materializes a full tensor on a rank: each rank reads, with
`safe_open(...).get_slice(name)`, only the rows of its own shard.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard

from configs import ConfigError
from model.llama import LlamaArgs, Transformer, rope_frequencies

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # the size HF's save_pretrained uses ("5GB")

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


def hf_name(name: str) -> str:
    """HF name of one of our parameter names, e.g. layers.0.attention.wq.weight ->
    model.layers.0.self_attn.q_proj.weight."""
    # torch.compile and activation checkpointing insert these segments into parameter names.
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    _, layer, rest = name.split(".", 2)  # "layers", index, name inside the block
    return f"model.layers.{layer}.{_IN_LAYER[rest]}"


def _is_rotated(name: str) -> bool:
    return name.endswith(_ROTATED)


def to_hf_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder the rows of wq or wk from our adjacent-pair layout to HF's half-split layout."""
    return weight.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).reshape(weight.shape)


# ---- config.json ------------------------------------------------------------------------------


def hf_config(
    args: LlamaArgs,
    dtype: torch.dtype,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict:
    """config.json of a `LlamaForCausalLM` with the shape of `args`; the token ids are the
    training data's tokenizer's (None when unknown)."""
    rope_scaling = None
    if args.rope_scaling:  # the constants hard-coded in model.llama.rope_frequencies
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
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


def read_hf_config(hf_dir: str | Path) -> LlamaArgs:
    """The shape described by `<hf_dir>/config.json`; ConfigError if our model cannot run it."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"Hugging Face config not found: {path}")
    cfg = json.loads(path.read_text())
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
            # model.llama.rope_frequencies hard-codes Llama 3.1's constants.
            "llama3 rope constants": rope_type == "llama3"
            and (
                rope.get("low_freq_factor", 1.0),
                rope.get("high_freq_factor", 4.0),
                rope.get("original_max_position_embeddings", 8192),
            )
            != (1.0, 4.0, 8192),
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


def check_hf_config(args: LlamaArgs, hf_dir: str | Path) -> None:
    """ConfigError listing every field where `args` and `<hf_dir>/config.json` disagree."""
    theirs = read_hf_config(hf_dir)
    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim"]
    fields += ["norm_eps", "rope_theta", "rope_scaling", "tie_embeddings"]
    if args.rope_scaling and theirs.rope_scaling:
        fields.append("rope_scaling_factor")
    diffs = [
        f"{name} {getattr(args, name)} vs {getattr(theirs, name)}"
        for name in fields
        if getattr(args, name) != getattr(theirs, name)
    ]
    if diffs:
        raise ConfigError(
            f"model config does not match {Path(hf_dir) / 'config.json'} (ours vs theirs): "
            + ", ".join(diffs)
        )


# ---- writing ----------------------------------------------------------------------------------


def _umask() -> int:
    """The process umask. Linux shows it in /proc; elsewhere setting and restoring it is the
    only way to read it (for an instant, files other threads create would ignore it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_hf_weights(
    model: Transformer,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> list[Path]:
    """Write a plain (unsharded) model as HF safetensors plus config.json; returns the files.

    One `model.safetensors`, or, past `max_shard_bytes`, `model-0000i-of-0000n.safetensors`
    files and `model.safetensors.index.json`. A tied output projection is not written. Every
    file gets the mode the umask gives new files, like config.json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # named_parameters() lists a tied weight once, under tok_embeddings: no lm_head.weight.
    shards: list[dict[str, tuple[str, torch.Tensor]]] = [{}]
    shard_bytes = total_bytes = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * dtype.itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][hf_name(name)] = (name, param)
        shard_bytes += nbytes
        total_bytes += nbytes
    n = len(shards)
    files = (
        [SINGLE_FILE]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    head_dim = model.args.head_dim
    for file, shard in zip(files, shards, strict=True):
        # Converted one file at a time, so a bf16 export never holds a second full copy.
        tensors = {}
        for key, (name, param) in shard.items():
            value = to_hf_rows(param, head_dim) if _is_rotated(name) else param
            tensors[key] = value.detach().to(dtype).contiguous()
        save_file(tensors, out / file, metadata={"format": "pt"})
        # safetensors creates its files with mode 0600 whatever the umask, so a model exported
        # for a team would be readable by its owner only.
        (out / file).chmod(0o666 & ~_umask())
    if n > 1:
        weight_map = {key: file for file, shard in zip(files, shards, strict=True) for key in shard}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = hf_config(model.args, dtype, bos_token_id, eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / file for file in files]


# ---- reading ----------------------------------------------------------------------------------


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index when the weights are split, else the single file."""
    if not hf_dir.is_dir():
        raise ConfigError(f"Hugging Face model directory not found: {hf_dir}")
    if (hf_dir / INDEX_FILE).is_file():
        weight_map = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
        files = {name: hf_dir / file for name, file in weight_map.items()}
    elif (hf_dir / SINGLE_FILE).is_file():
        with safe_open(hf_dir / SINGLE_FILE, framework="pt", device="cpu") as f:
            files = dict.fromkeys(f.keys(), hf_dir / SINGLE_FILE)
    else:
        raise ConfigError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")
    if missing := sorted({str(f) for f in files.values() if not f.is_file()}):
        raise ConfigError(f"{hf_dir / INDEX_FILE} lists missing files: {', '.join(missing)}")
    return files


def local_ranges(param: torch.Tensor) -> list[tuple[int, int]] | None:
    """[start, end) of this rank's shard along every dimension of `param` (global indices);
    None when this rank is not on the parameter's mesh.

    A plain tensor is all local. For a DTensor, each Shard(d) placement splits dimension d the
    way torch.chunk does (equal chunks of ceil(n / k), the last ones shorter or empty), nested in
    placement order; Replicate() leaves it whole.
    """
    ranges = [(0, n) for n in param.shape]
    if not isinstance(param, DTensor):
        return ranges
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    for mesh_dim, placement in enumerate(param.placements):
        if type(placement) is Shard:  # exactly Shard: its subclasses (strided) split differently
            start, end = ranges[placement.dim]
            chunk = math.ceil((end - start) / param.device_mesh.size(mesh_dim))
            lo = min(start + coordinate[mesh_dim] * chunk, end)
            ranges[placement.dim] = (lo, min(lo + chunk, end))
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"loading HF weights into {placement} is not supported")
    local_shape = tuple(end - start for start, end in ranges)
    if local_shape != tuple(param.to_local().shape):  # DTensor changed its chunking rule
        raise RuntimeError(
            f"computed local shape {local_shape}, DTensor has {param.to_local().shape}"
        )
    return ranges


def _read(tensor_slice, ranges: list[tuple[int, int]], head_dim: int | None) -> torch.Tensor:
    """Read exactly the rows (and columns) in `ranges`, in our row order.

    For wq/wk (`head_dim` given), our rows [a, b) of one head are HF rows of the same head:
    the even ones are a contiguous run in its first half, the odd ones in its second half.
    So a shard that starts or ends inside a head still reads only its own rows, in two runs.
    """
    (lo, hi), cols = ranges[0], tuple(slice(*r) for r in ranges[1:])
    if head_dim is None or lo == hi:
        return tensor_slice[(slice(lo, hi), *cols)]
    half, blocks = head_dim // 2, []
    for head_start in range(lo - lo % head_dim, hi, head_dim):
        a, b = max(lo, head_start) - head_start, min(hi, head_start + head_dim) - head_start
        even = tensor_slice[(slice(head_start + (a + 1) // 2, head_start + (b + 1) // 2), *cols)]
        odd = tensor_slice[(slice(head_start + half + a // 2, head_start + half + b // 2), *cols)]
        block = torch.empty((b - a, *even.shape[1:]), dtype=even.dtype)
        block[a % 2 :: 2], block[1 - a % 2 :: 2] = even, odd
        blocks.append(block)
    return torch.cat(blocks)


def _check_tensors(
    hf_dir: Path, params: dict[str, tuple[str, torch.Tensor]], slices: dict, unexpected: set[str]
) -> None:
    """One ConfigError naming every missing, mis-shaped and unexpected tensor."""
    problems = [
        f"missing {key} {list(p.shape)}" for key, (_, p) in params.items() if key not in slices
    ]
    problems += [
        f"{key} has shape {list(sl.get_shape())}, model expects {list(params[key][1].shape)}"
        for key, sl in slices.items()
        if list(sl.get_shape()) != list(params[key][1].shape)
    ]
    # Some older exports store the RoPE table; it is a function of the config, not a weight.
    extra = sorted(k for k in unexpected if not k.endswith("rotary_emb.inv_freq"))
    problems += [f"unexpected {key}" for key in extra[:5]]
    if len(extra) > 5:
        problems.append(f"and {len(extra) - 5} more unexpected tensors")
    if problems:
        raise ConfigError(f"{hf_dir} does not match the model: " + "; ".join(problems))


@torch.no_grad()
def load_hf_weights(model: Transformer, hf_dir: str | Path, rope_len: int | None = None) -> None:
    """Fill every parameter of `model` from a local HF Llama safetensors directory.

    A drop-in for `model.init_weights(seed, rope_len, assign)`: it also builds the RoPE table.
    The model may be plain or sharded by `fully_shard` (DTensor parameters, Shard(0) on a 1D
    mesh or (Replicate(), Shard(0)) on a 2D one, after `to_empty`); each rank reads only the
    slices of its own shards. Missing tensors, unexpected ones and shape mismatches raise one
    ConfigError that names them all, before anything is read. Settings that are not shapes
    (rope_theta, norm_eps, rope scaling) are in config.json: compare them with
    `check_hf_config` first.
    """
    hf_dir = Path(hf_dir)
    files = _weight_files(hf_dir)
    # named_parameters() lists a tied weight once (tok_embeddings), so a tied model expects no
    # lm_head.weight, and one in the files is reported: it would be a different model.
    params = {hf_name(n): (n, p) for n, p in model.named_parameters()}
    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for file in set(files.values())
        }
        slices = {key: handles[files[key]].get_slice(key) for key in params if key in files}
        _check_tensors(hf_dir, params, slices, set(files) - set(params))
        head_dim = model.args.head_dim
        for key, (name, param) in params.items():
            ranges = local_ranges(param)
            if ranges is None:
                continue
            value = _read(slices[key], ranges, head_dim if _is_rotated(name) else None)
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(value)
    model.rope = rope_frequencies(model.args, rope_len or model.args.max_seq_len, model.rope.device)
