"""Llama 3 architecture, single-device code.

Parallelism is applied from outside (see `parallel/`): nothing here imports `torch.distributed`.
The only parallel knowledge is `fsdp_units`, the plain list of modules that become FSDP units.

Build order used by `train.py` (as in torchtitan and lingua): construct on the meta device,
shard, `to_empty(device=...)`, then `init_weights(seed)`, so no rank ever holds the full model.
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
class LlamaArgs:
    """Concrete shape of a Llama model (resolved from a flavor plus overrides)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    """The FFN hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the FFN hidden size (2/3 of 4 x dim)."""
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: bool = False
    """Llama 3.1 long-context frequency scaling (factor 8 for 8B+, 32 for 1B/3B)."""
    rope_scaling_factor: float = 8.0
    """Llama 3.1's RoPE scaling factor (with rope_scaling)."""
    max_seq_len: int = 8192
    """Longest sequence of the published model (HF's max_position_embeddings)."""
    tie_embeddings: bool = False
    attention: AttentionImpl = "sdpa"
    """How attention is computed, not what: see ModelConfig.attention."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        # Llama's SwiGLU sizing: 2/3 of 4*dim keeps the parameter count of a 4*dim GELU MLP,
        # then an optional multiplier, rounded up to `multiple_of` for matmul-friendly shapes.
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# The debug flavor is the shape other FSDP trainers use as their debug model, so throughput
# numbers are comparable. The others are Meta's published Llama 3.x shapes.
FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048),
    "1B": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128_256,
        ffn_dim_multiplier=1.5,
        rope_scaling=True,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
        max_seq_len=131_072,
    ),
    "3B": LlamaArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128_256,
        ffn_dim_multiplier=1.0,
        rope_scaling=True,
        rope_scaling_factor=32.0,
        tie_embeddings=True,
        max_seq_len=131_072,
    ),
    "8B": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128_256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_scaling=True,
        max_seq_len=131_072,
    ),
    "70B": LlamaArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128_256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_scaling=True,
        max_seq_len=131_072,
    ),
    "405B": LlamaArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128_256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_scaling=True,
        max_seq_len=131_072,
    ),
}


def build_args(cfg: ModelConfig) -> LlamaArgs:
    """Resolve a flavor plus overrides to a concrete shape, rejecting impossible ones."""
    args = resolve_args(cfg, FLAVORS)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of"):
        if getattr(args, name) < 1:
            raise ConfigError(f"model: {name} must be >= 1, got {getattr(args, name)}")
    if args.ffn_dim_multiplier is not None and args.ffn_dim_multiplier <= 0:
        raise ConfigError(f"model.ffn_dim_multiplier must be > 0, got {args.ffn_dim_multiplier}")
    if args.dim % args.n_heads != 0:
        raise ConfigError(f"model: dim={args.dim} is not divisible by n_heads={args.n_heads}")
    if args.n_heads % args.n_kv_heads != 0:
        raise ConfigError(
            f"model: n_heads={args.n_heads} is not a multiple of n_kv_heads={args.n_kv_heads}"
        )
    if args.head_dim % 2 != 0:
        raise ConfigError(f"model: head_dim={args.head_dim} must be even for RoPE")
    return args


def rope_frequencies(args: LlamaArgs, seq_len: int, device: torch.device | None) -> torch.Tensor:
    """cos/sin table of shape (seq_len, head_dim // 2, 2) in float32."""
    d = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    if args.rope_scaling:
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, and blend smoothly
        # in between, so the model keeps local precision while reaching longer contexts.
        low_freq_factor, high_freq_factor, old_context = 1.0, 4.0, 8192
        wavelen = 2 * math.pi / freqs
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smooth = smooth.clamp(0.0, 1.0)
        freqs = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of each head: Meta's layout, not HF's halves.

    x: (batch, seq, heads, head_dim); rope: (seq, head_dim // 2, 2), a table of which the first
    seq positions are used, or (batch, seq, head_dim // 2, 2), each token's own row.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rope = rope[..., : x.shape[1], None, :, :]  # a head dimension, to broadcast over heads
    cos, sin = rope[..., 0], rope[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


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
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.impl = args.attention
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Mask | None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallel this rank holds n_heads / tp of them (model.TPStyle).
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # SDPA wants (batch, heads, seq, head_dim); enable_gqa broadcasts the shared kv heads
        # without materializing repeated copies.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = attention(q, k, v, mask, self.impl)  # causal, or within documents (mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Mask | None) -> torch.Tensor:
        # Every input positional: tensor parallel's PrepareModuleInput maps them one to one.
        x = x + self.attention(self.attention_norm(x), rope, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer index keeps parameter names stable if layers are removed
        # (e.g. split across pipeline stages), which keeps checkpoints portable.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: it is a function of the config, recomputed in init_weights, and must
        # not appear in checkpoints. Sized for max_seq_len lazily (see forward) to save memory.
        self.register_buffer("rope", torch.empty(0), persistent=False)

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

    def init_buffers(self, rope_len: int) -> None:
        """The RoPE table for sequences up to `rope_len`, and the embedding tie: what is not a
        parameter's own value, after `to_empty` or weights loaded from elsewhere."""
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # nn.Module.to_empty() gives each module its own copy of a shared parameter (FSDP2's
            # keeps the tie): share it again, or the output projection would train separately.
            self.output.weight = self.tok_embeddings.weight
        self.rope = rope_frequencies(self.args, rope_len, self.rope.device)


def _assign_whole(param: torch.Tensor, draw: Draw) -> None:
    param.copy_(draw(tuple(slice(0, n) for n in param.shape)))


def _init_std(name: str, args: LlamaArgs) -> float | None:
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


def fsdp_units(model: Transformer) -> list[nn.Module]:
    """Modules sharded as their own FSDP unit (all-gathered and freed one at a time).

    The embeddings, final norm and output projection stay in the root unit.
    """
    return list(model.layers.values())


def output_layer(model: Transformer) -> nn.Module:
    """The output projection that `forward(..., hidden_only=True)` leaves out."""
    return model.output


def block_shapes(args: LlamaArgs) -> list[BlockShape]:
    """Every block alike: attention and a SwiGLU FFN (the planner's view, model/blocks.py)."""
    attention = AttentionShape(args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim)
    return [BlockShape(attention, FFNShape(args.ffn_hidden_dim))] * args.n_layers


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
    "layers.*.ffn_norm": "sequence",
    "layers.*.feed_forward": "gather_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    "norm": "sequence",
    "output": "output",
}


def build_model(args: LlamaArgs) -> Transformer:
    """The model, on the caller's default device (the trainer builds it on meta)."""
    return Transformer(args)


def fp8_linears(model: Transformer) -> list[str]:
    """Linear layers FP8 may convert: all of them (the FP8 policy filters by shape and
    fp8.skip, which keeps the output projection in high precision by default)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def flops_per_token(model: Transformer, seq_len: int) -> int:
    """Training FLOPs per token: 6·N for the matmuls (2 forward + 4 backward per weight, N the
    parameters outside the input embedding, whose lookup is no matmul) plus the attention
    scores and values, 12·layers·dim·seq (2 matmuls × 2 flops × 3 for forward+backward). Like
    PaLM and torchtitan we count the full, not causally halved, attention matrix, so MFU
    numbers compare with theirs.
    """
    args = model.args
    n = sum(p.numel() for p in model.parameters())
    if not args.tie_embeddings:  # tied, the matrix is also the output projection's
        n -= model.tok_embeddings.weight.numel()
    return 6 * n + 12 * args.n_layers * args.dim * seq_len
