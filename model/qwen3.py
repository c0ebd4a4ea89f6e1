"""Qwen3 (dense) architecture, single-device code: the second family of `model.FAMILIES`.

Qwen3 is Llama 3's decoder with four changes, each marked `# Qwen3:` below:

- **QK-norm**: q and k go through an RMSNorm over each head (weights `q_norm`, `k_norm` of
  shape (head_dim,)) before RoPE, which keeps attention logits bounded without a softcap;
- **head_dim** is a field of its own: q_proj writes n_heads * head_dim, which may differ from dim
  (0.6B: 16 heads x 128 = 2048 for dim 1024);
- **RoPE** with theta 1e6 and no frequency scaling, in HF's rotate-half layout (see apply_rope);
- the FFN size is a fixed `ffn_dim` (HF's intermediate_size), not derived from dim.

Parameter names, the init policy and the contract functions (`build_args`, `build_model`,
`fsdp_units`, `fp8_linears`, `flops_per_token`) follow `model/llama.py`, so the trainer,
`parallel/` and `checkpoint/` treat both families alike. The Hugging Face mapping is
`model/qwen3_hf.py`, named in `model.HF_MAPPINGS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from configs import ConfigError
from model import AttentionImpl, ModelConfig, TPStyle, canonical_name, random_init, resolve_args
from model.attention import Mask, attention, document_mask
from model.blocks import AttentionShape, BlockShape, FFNShape
from model.random_init import Draw


@dataclass(frozen=True)
class QwenArgs:
    """Concrete shape of a Qwen3 model (resolved from a flavor plus overrides)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    """Size of one attention head, set on its own (not dim // n_heads)."""
    vocab_size: int
    ffn_dim: int
    """SwiGLU hidden size (HF's intermediate_size)."""
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40_960
    """Longest sequence of the published model (HF's max_position_embeddings)."""
    tie_embeddings: bool = False
    attention: AttentionImpl = "sdpa"
    """How attention is computed, not what: see ModelConfig.attention."""


# The published shapes are those of the config.json files of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B} on
# the Hugging Face Hub (also in the Qwen3 technical report, arXiv:2505.09388, table 1): all have
# head_dim 128, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960;
# the three small ones tie their embeddings. Parameter counts: tests/test_qwen3.py.
# `debug` is llama's debug shape (dim 256, 6 layers, 16 heads) made Qwen3-like: 8 kv heads,
# head_dim 32 so that n_heads * head_dim (512) != dim, tied embeddings, ffn_dim 3 * dim.
_QWEN3 = dict(head_dim=128, vocab_size=151_936)
FLAVORS: dict[str, QwenArgs] = {
    "debug": QwenArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, vocab_size=2048,
        ffn_dim=768, tie_embeddings=True,
    ),
    "0.6B": QwenArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072,
                     tie_embeddings=True, **_QWEN3),
    "1.7B": QwenArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144,
                     tie_embeddings=True, **_QWEN3),
    "4B": QwenArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728,
                   tie_embeddings=True, **_QWEN3),
    "8B": QwenArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **_QWEN3),
    "14B": QwenArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408, **_QWEN3),
}  # fmt: skip


def build_args(cfg: ModelConfig) -> QwenArgs:
    """Resolve a flavor plus overrides to a concrete shape, rejecting impossible ones
    (an unknown flavor or a field Qwen3 does not have, e.g. llama3's multiple_of, is a
    ConfigError from `resolve_args`)."""
    args = resolve_args(cfg, FLAVORS)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim"):
        if getattr(args, name) < 1:
            raise ConfigError(f"model: {name} must be >= 1, got {getattr(args, name)}")
    if args.n_heads % args.n_kv_heads != 0:
        raise ConfigError(
            f"model: n_heads={args.n_heads} is not a multiple of n_kv_heads={args.n_kv_heads}"
        )
    if args.head_dim % 2 != 0:
        raise ConfigError(f"model: head_dim={args.head_dim} must be even for RoPE")
    return args


def rope_frequencies(args: QwenArgs, seq_len: int, device: torch.device | None) -> torch.Tensor:
    """cos/sin table of shape (seq_len, head_dim // 2, 2) in float32 (no long-context scaling)."""
    d = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x[i] with x[i + head_dim/2] (HF's rotate-half layout) in each head.

    Llama's model.llama.apply_rope rotates adjacent pairs instead, Meta's layout, so its
    checkpoints match Meta's; its HF mapping then reorders q/k rows inside each head. Qwen3 was
    published in HF's layout, so computing RoPE in that layout here makes our weights HF's
    weights as they are: no row permutation, and none for the per-head q_norm/k_norm gains,
    which a permutation of q/k rows would also have to reorder.

    x: (batch, seq, heads, head_dim); rope: (seq, head_dim // 2, 2), a table of which the first
    seq positions are used, or (batch, seq, head_dim // 2, 2), each token's own row.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    rope = rope[..., : x.shape[1], None, :, :]  # a head dimension, to broadcast over heads
    cos, sin = rope[..., 0], rope[..., 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


# Copied from model.llama.RMSNorm
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm runs aten::_fused_rms_norm (a dedicated CUDA kernel, where the formula took
        # ~6 kernels and float32 copies of x). It computes x * rsqrt(mean(x^2) + eps) * weight
        # in float32 (bf16 would lose too much precision in the mean of squares) and rounds
        # once: bit-identical to the formula in float32, one rounding fewer in bf16.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: QwenArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.impl = args.attention
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)  # Qwen3: QK-norm, one gain per
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)  # position in a head, shared by heads

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Mask | None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel this rank holds n_heads / tp of them (model.TPStyle).
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        # Qwen3: normalize each head of q and k over head_dim, then rotate (HF's order).
        q, k = apply_rope(self.q_norm(q), rope), apply_rope(self.k_norm(k), rope)
        # SDPA wants (batch, heads, seq, head_dim); enable_gqa broadcasts the shared kv heads
        # without materializing repeated copies. Its default scale is head_dim ** -0.5.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = attention(q, k, v, mask, self.impl)  # causal, or within documents (mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: QwenArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # Qwen3: a fixed hidden size
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    # Copied from model.llama.FeedForward.forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


# Copied from model.llama.TransformerBlock with LlamaArgs->QwenArgs
class TransformerBlock(nn.Module):
    def __init__(self, args: QwenArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Mask | None) -> torch.Tensor:
        # Every input positional: tensor parallel's PrepareModuleInput maps them one to one.
        x = x + self.attention(self.attention_norm(x), rope, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Qwen3(nn.Module):
    def __init__(self, args: QwenArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by layer index, as in llama: names stay stable if layers are removed, and
        # parallel/ac.py and parallel/compile.py wrap the entries of `layers` in place.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Named `output` like llama's, so fp8.skip's default ("output") keeps it in high precision.
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: a function of the config, rebuilt by init_buffers, never checkpointed.
        self.register_buffer("rope", torch.empty(0), persistent=False)

    # Copied from model.llama.Transformer.forward
    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """tokens: (batch, seq) int64 -> logits: (batch, seq, vocab). `document_ids` (batch,
        seq): a token attends only to earlier tokens of its own document (None: to every
        earlier token). `positions` (batch, seq): each token's RoPE position (None: 0..seq-1).
        `hidden_only`: the final norm's output (batch, seq, dim) instead of the logits. See
        model/__init__.py."""
        if tokens.shape[1] > self.rope.shape[0]:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the RoPE table "
                f"({self.rope.shape[0]}); rebuild it with init_buffers(rope_len)"
            )
        h = self.tok_embeddings(tokens)
        # Once per forward, not per layer: a FlexAttention block mask costs a kernel to build.
        mask = document_mask(document_ids, self.args.attention, h.dtype)
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        # hidden_only: the trainer applies `output` itself, a chunk of tokens at a time.
        h = self.norm(h)
        return h if hidden_only else self.output(h)

    # Copied from model.llama.Transformer.init_weights
    @torch.no_grad()
    def init_weights(
        self,
        seed: int = 0,
        rope_len: int | None = None,
        assign: Callable[[torch.Tensor, Draw], None] | None = None,
    ) -> None:
        """Initialize every parameter from `seed` alone, identically on any mesh and device.

        Each element is a function of the seed, the parameter's name and the element's index
        (model/random_init.py), so the result depends neither on the order of initialization,
        nor on how the model is split, nor on the device. `assign(param, draw)` stores the
        values: `draw(region)` returns those of a region of the full parameter (one slice per
        dimension); by default the whole parameter is drawn; a sharded trainer draws only its
        shard (see `parallel.fsdp.assign_local_shard`).
        """
        assign = assign or _assign_whole
        args = self.args
        self.init_buffers(rope_len or args.max_seq_len)  # first: it restores the tie
        for name, param in self.named_parameters():
            key = canonical_name(name)
            std = _init_std(key, args)
            if std is None:  # RMSNorm gains start at 1
                draw: Draw = partial(random_init.ones, tuple(param.shape), device=param.device)
            else:
                # Untied embeddings: a plain normal; everything else truncated at 3 std.
                truncated = key != "tok_embeddings.weight" or args.tie_embeddings
                draw = partial(
                    random_init.normal, seed, key, tuple(param.shape),
                    std=std, truncated=truncated, device=param.device,
                )  # fmt: skip
            assign(param, draw)

    # Copied from model.llama.Transformer.init_buffers
    def init_buffers(self, rope_len: int) -> None:
        """The RoPE table for sequences up to `rope_len`, and the embedding tie: what is not a
        parameter's own value, after `to_empty` or weights loaded from elsewhere."""
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # nn.Module.to_empty() gives each module its own copy of a shared parameter (FSDP2's
            # keeps the tie): share it again, or the output projection would train separately.
            self.output.weight = self.tok_embeddings.weight
        self.rope = rope_frequencies(self.args, rope_len, self.rope.device)


# Copied from model.llama._assign_whole
def _assign_whole(param: torch.Tensor, draw: Draw) -> None:
    param.copy_(draw(tuple(slice(0, n) for n in param.shape)))


# Copied from model.llama._init_std with LlamaArgs->QwenArgs
def _init_std(name: str, args: QwenArgs) -> float | None:
    """Standard deviation for a parameter, or None for RMSNorm gains (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name == "tok_embeddings.weight":
        # Untied: unit-variance embeddings (the first RMSNorm rescales them). Tied: the output
        # projection's scale, since the same matrix produces the logits.
        return args.dim**-0.5 if args.tie_embeddings else 1.0
    if name == "output.weight":
        return args.dim**-0.5
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")):
        # Depth-scaled init for projections that write into the residual stream keeps the
        # residual variance from growing with the number of layers.
        layer = int(name.split(".")[1])
        return 0.02 / math.sqrt(2 * (layer + 1))
    return 0.02


# Tensor parallel (model.TPStyle, applied by parallel/tp.py): heads and FFN features split
# inside each block, the norms' activations split along the sequence between them.
TP_PLAN: dict[str, TPStyle] = {
    "tok_embeddings": "embedding",
    "layers.*.attention_norm": "sequence",
    "layers.*.attention": "gather_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    # Qwen3: QK-norm is per head, so it runs on this rank's heads as they are.
    "layers.*.attention.q_norm": "per_head",
    "layers.*.attention.k_norm": "per_head",
    "layers.*.ffn_norm": "sequence",
    "layers.*.feed_forward": "gather_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    "norm": "sequence",
    "output": "output",
}


def build_model(args: QwenArgs) -> Qwen3:
    """The model, on the caller's default device (the trainer builds it on meta)."""
    return Qwen3(args)


# Copied from model.llama.fsdp_units with Transformer->Qwen3
def fsdp_units(model: Qwen3) -> list[nn.Module]:
    """Modules sharded as their own FSDP unit (all-gathered and freed one at a time).

    The embeddings, final norm and output projection stay in the root unit.
    """
    return list(model.layers.values())


# Copied from model.llama.output_layer with Transformer->Qwen3
def output_layer(model: Qwen3) -> nn.Module:
    """The output projection that `forward(..., hidden_only=True)` leaves out."""
    return model.output


def block_shapes(args: QwenArgs) -> list[BlockShape]:
    """Every block alike: attention and a SwiGLU FFN of ffn_dim (model/blocks.py)."""
    attention = AttentionShape(args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim)
    return [BlockShape(attention, FFNShape(args.ffn_dim))] * args.n_layers


def fp8_linears(model: Qwen3) -> list[str]:
    """Linear layers FP8 may convert: all of them (the FP8 policy filters by shape and
    fp8.skip, which keeps the output projection in high precision by default)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def flops_per_token(model: Qwen3, seq_len: int) -> int:
    """Training FLOPs per token: 6·N for the matmuls (N the parameters outside the input
    embedding; a tied embedding counts, as the output projection) plus the attention scores and
    values, 12·layers·(n_heads·head_dim)·seq: the attention width is n_heads·head_dim, which in
    Qwen3 need not be dim. Full, not causally halved, like llama's (comparable MFU)."""
    args = model.args
    n = sum(p.numel() for p in model.parameters())
    if not args.tie_embeddings:
        n -= model.tok_embeddings.weight.numel()
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
