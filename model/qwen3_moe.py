"""Qwen3-MoE: the mixture-of-experts family of `model.FAMILIES`, single-device code.

It is Qwen3 (model/qwen3.py: QK-norm, head_dim of its own, RoPE theta 1e6 in HF's layout) whose
FFN is a mixture of experts in every block (model/moe.py): a softmax top-k router and
`n_experts` SwiGLU experts of hidden size `moe_ffn_dim`, stacked and computed with grouped GEMMs.
The attention, norms and RoPE are Qwen3's own classes, imported. The published models have no
shared expert and no dense layer (HF's `decoder_sparse_step` 1, `mlp_only_layers` empty); the
HF mapping rejects configs that have them.

Beyond the dense contract, an MoE family provides `aux_loss`, `expert_load` and
`expert_modules` (model/__init__.py says what the trainer may assume of them). The Hugging Face
mapping is `model/qwen3_moe_hf.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from configs import ConfigError
from model import (
    AttentionImpl,
    ModelConfig,
    TPStyle,
    canonical_name,
    qwen3,
    random_init,
    resolve_args,
)
from model.attention import Mask, document_mask
from model.blocks import AttentionShape, BlockShape, ExpertsShape, FFNShape
from model.moe import GroupedExperts, MoE, MoETerms
from model.qwen3 import Attention, RMSNorm, rope_frequencies
from model.random_init import Draw


@dataclass(frozen=True)
class Qwen3MoEArgs:
    """Concrete shape of a Qwen3-MoE model (resolved from a flavor plus overrides)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    """Size of one attention head, set on its own (not dim // n_heads)."""
    vocab_size: int
    n_experts: int
    """Experts per MoE layer (HF's num_experts)."""
    top_k: int
    """Experts each token is routed to (HF's num_experts_per_tok)."""
    moe_ffn_dim: int
    """Hidden size of one expert's SwiGLU (HF's moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Renormalize the top_k routing probabilities to sum to 1 (all published Qwen3-MoE)."""
    aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss: Qwen3-MoE's router_aux_loss_coef (model/moe.py)."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss (Qwen3-MoE trains without one)."""
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40_960
    """Longest sequence of the published model (HF's max_position_embeddings)."""
    tie_embeddings: bool = False
    attention: AttentionImpl = "sdpa"
    """How attention is computed, not what: see ModelConfig.attention."""


# The published shapes are the config.json files of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B
# on the Hugging Face Hub (Qwen3 technical report, arXiv:2505.09388, table 2): 128 experts, 8
# per token, norm_topk_prob, 4 kv heads of 128, vocab 151936, untied, rope_theta 1e6,
# max_position_embeddings 40960; parameter counts (30.5B / 3.3B active, 235B / 22B active):
# tests/test_qwen3_moe.py. `debug` is qwen3's debug shape with 4 layers of 8 experts, top 2.
_QWEN3_MOE = dict(head_dim=128, vocab_size=151_936, n_kv_heads=4, n_experts=128, top_k=8)
FLAVORS: dict[str, Qwen3MoEArgs] = {
    "debug": Qwen3MoEArgs(
        dim=256, n_layers=4, n_heads=16, n_kv_heads=4, head_dim=32, vocab_size=2048,
        n_experts=8, top_k=2, moe_ffn_dim=128,
    ),
    "30B-A3B": Qwen3MoEArgs(dim=2048, n_layers=48, n_heads=32, moe_ffn_dim=768, **_QWEN3_MOE),
    "235B-A22B": Qwen3MoEArgs(dim=4096, n_layers=94, n_heads=64, moe_ffn_dim=1536, **_QWEN3_MOE),
}  # fmt: skip


def build_args(cfg: ModelConfig) -> Qwen3MoEArgs:
    """Resolve a flavor plus overrides to a concrete shape, rejecting impossible ones (an unknown
    flavor or a field this family does not have, e.g. qwen3's ffn_dim, is a ConfigError from
    `resolve_args`)."""
    args = resolve_args(cfg, FLAVORS)
    sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "n_experts",
             "top_k", "moe_ffn_dim")  # fmt: skip
    for name in sizes:
        if getattr(args, name) < 1:
            raise ConfigError(f"model: {name} must be >= 1, got {getattr(args, name)}")
    if args.top_k > args.n_experts:
        raise ConfigError(
            f"model: top_k={args.top_k} exceeds n_experts={args.n_experts} (each token is "
            "routed to top_k different experts)"
        )
    for name in ("aux_loss_coef", "router_z_loss_coef"):
        if getattr(args, name) < 0:
            raise ConfigError(f"model.{name} must be >= 0 (0 = off), got {getattr(args, name)}")
    if args.n_heads % args.n_kv_heads != 0:
        raise ConfigError(
            f"model: n_heads={args.n_heads} is not a multiple of n_kv_heads={args.n_kv_heads}"
        )
    if args.head_dim % 2 != 0:
        raise ConfigError(f"model: head_dim={args.head_dim} must be even for RoPE")
    if args.dim % 8 or args.moe_ffn_dim % 8:
        raise ConfigError(
            f"model: dim={args.dim} and moe_ffn_dim={args.moe_ffn_dim} must be multiples of 8: "
            "the experts' grouped GEMMs (torch._grouped_mm) need 16-byte rows in bfloat16"
        )
    return args


class TransformerBlock(nn.Module):
    def __init__(self, args: Qwen3MoEArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)  # Qwen3's: the shape fields it reads are ours too
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(
            args.dim, args.moe_ffn_dim, args.n_experts, args.top_k, args.norm_topk_prob,
            args.aux_loss_coef, args.router_z_loss_coef,
        )  # fmt: skip

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: Mask | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (x, this layer's aux loss summed over sequences, tokens per expert): the aux terms
        leave the block as outputs, never as state (compile, AC recompute, FSDP: model/)."""
        x = x + self.attention(self.attention_norm(x), rope, mask)
        out, aux, load = self.moe(self.ffn_norm(x), mask)  # mask: its aux terms under cp
        return x + out, aux, load


class Qwen3MoE(nn.Module):
    def __init__(self, args: Qwen3MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", torch.empty(0), persistent=False)
        # What the last forward routed: read by the trainer through `aux_loss` and
        # `expert_load` below. Plain attributes, not buffers: never checkpointed.
        self.last_aux_loss: torch.Tensor | None = None
        self.last_expert_load: torch.Tensor | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """tokens: (batch, seq) int64 -> logits: (batch, seq, vocab), as Qwen3's forward; the
        auxiliary loss and the expert load of this forward are kept for the trainer."""
        if tokens.shape[1] > self.rope.shape[0]:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds the RoPE table "
                f"({self.rope.shape[0]}); rebuild it with init_buffers(rope_len)"
            )
        h = self.tok_embeddings(tokens)
        mask = document_mask(document_ids, self.args.attention, h.dtype)
        rope = self.rope if positions is None else self.rope[positions]
        aux, load = [], []
        for layer in self.layers.values():
            h, layer_aux, layer_load = layer(h, rope, mask)
            aux.append(layer_aux)
            load.append(layer_load)
        # The mean over layers: the coefficients mean the same at any depth.
        self.last_aux_loss = torch.stack(aux).mean()
        self.last_expert_load = torch.stack(load).detach()
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


def _init_std(name: str, args: Qwen3MoEArgs) -> float | None:
    """Qwen3's policy (model.qwen3._init_std); each expert's up and down projections are
    depth-scaled like a dense FFN's w2 and w3, the router and the gates w1 get 0.02."""
    if name.endswith(("moe.experts.w2", "moe.experts.w3")):
        layer = int(name.split(".")[1])
        return 0.02 / math.sqrt(2 * (layer + 1))
    return qwen3._init_std(name, args)


# Tensor parallel (model.TPStyle, parallel/tp.py): attention as Qwen3's; the MoE layer runs
# whole on every tp rank ("replicate": its input gathered, its output split back along the
# sequence). Splitting experts across ranks is expert parallel's job, not tensor parallel's.
TP_PLAN: dict[str, TPStyle] = {
    "tok_embeddings": "embedding",
    "layers.*.attention_norm": "sequence",
    "layers.*.attention": "gather_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.attention.q_norm": "per_head",
    "layers.*.attention.k_norm": "per_head",
    "layers.*.ffn_norm": "sequence",
    "layers.*.moe": "replicate",
    "norm": "sequence",
    "output": "output",
}


def build_model(args: Qwen3MoEArgs) -> Qwen3MoE:
    """The model, on the caller's default device (the trainer builds it on meta)."""
    return Qwen3MoE(args)


# Copied from model.llama.fsdp_units with Transformer->Qwen3MoE
def fsdp_units(model: Qwen3MoE) -> list[nn.Module]:
    """Modules sharded as their own FSDP unit (all-gathered and freed one at a time).

    The embeddings, final norm and output projection stay in the root unit.
    """
    return list(model.layers.values())


# Copied from model.llama.output_layer with Transformer->Qwen3MoE
def output_layer(model: Qwen3MoE) -> nn.Module:
    """The output projection that `forward(..., hidden_only=True)` leaves out."""
    return model.output


def block_shapes(args: Qwen3MoEArgs) -> list[BlockShape]:
    """Every block alike: attention and n_experts SwiGLU experts, top_k per token, no shared
    expert (model/blocks.py)."""
    attention = AttentionShape(args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim)
    experts = ExpertsShape(args.n_experts, args.top_k, FFNShape(args.moe_ffn_dim))
    return [BlockShape(attention, experts=experts)] * args.n_layers


def fp8_linears(model: Qwen3MoE) -> list[str]:
    """The attention projections and the output: the only nn.Linear layers. The router and
    the stacked experts are not Linear layers, so FP8 leaves them in high precision."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """Each MoE layer's experts (stacked weights, dim 0 = expert), in layer order."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def active_params(model: nn.Module) -> int:
    """Parameters one token uses: every dense one, top_k / n_experts of the experts'."""
    args = model.args
    experts = {id(p) for m in expert_modules(model) for p in m.parameters()}
    return sum(
        p.numel() * args.top_k // args.n_experts if id(p) in experts else p.numel()
        for p in model.parameters()
    )


def flops_per_token(model: Qwen3MoE, seq_len: int) -> int:
    """Training FLOPs per token over the *active* parameters (for MFU): 6 per active weight
    outside the input embedding (a tied one counts, as the output projection), plus Qwen3's
    attention term 12·layers·(n_heads·head_dim)·seq. The router's top-k, sort and gathers
    are not counted."""
    args = model.args
    n = active_params(model)
    if not args.tie_embeddings:
        n -= model.tok_embeddings.weight.numel()
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The last forward's auxiliary loss, summed over its sequences (model/__init__.py)."""
    return model.last_aux_loss


def expert_load(model: nn.Module) -> torch.Tensor:
    """Tokens routed to each expert by the last forward, (layers, experts) float32."""
    return model.last_expert_load


def step_terms(model: nn.Module) -> MoETerms:
    """The aux loss and the expert load, per step (model/__init__.py, `StepTerms`)."""
    return MoETerms(model)
