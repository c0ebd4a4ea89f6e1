"""A test family with every shape the model contract allows (model/__init__.py), for the tests.

It is registered only by the tests that run the contract on it (`registered()`, a fixture in
tests/conftest.py), never in `model.FAMILIES`: it stands for the family a fork writes, and keeps
the trainer's tools honest about what such a family may do:

- blocks of two kinds: a dense first block (`n_dense_layers`), attention and a two-matrix GeLU
  MLP, then mixture-of-experts blocks: a softmax top-k router, SwiGLU experts (model/moe.py) and
  a shared SwiGLU expert every token goes through, each FFN of its own width;
- a persistent buffer: each router's bias, which only picks the experts (DeepSeek-V3's
  auxiliary-loss-free balancing, arXiv:2412.19437, section 2.1.2), set by `init_weights` and
  moved by the step terms' `after_step` from the expert load summed over the ranks;
- an operation after the output projection: logit soft-capping (Gemma 2), inside the output
  module (the contract's output path), so the chunked loss applies it too.

Its code imports only model/ and torch, as a family of model/ would (docs/forking.md): copied
into model/ with a line in `FAMILIES` it is a family of the trainer. `undescribed()` is the same
family without the contract's optional `block_shapes`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from configs import ConfigError
from model import (
    FAMILIES,
    AttentionImpl,
    ModelConfig,
    TPStyle,
    canonical_name,
    random_init,
    resolve_args,
)
from model.attention import Mask, document_mask
from model.blocks import AttentionShape, BlockShape, ExpertsShape, FFNShape
from model.llama import Attention, RMSNorm
from model.moe import GroupedExperts, MoE, MoETerms, Router, local
from model.qwen3 import rope_frequencies
from model.random_init import Draw

NAME = "zoo"
UNDESCRIBED = "zoo_undescribed"


@dataclass(frozen=True)
class ZooArgs:
    """Concrete shape of a zoo model (resolved from a flavor plus overrides)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    """Hidden size of the dense blocks' GeLU MLP."""
    n_experts: int
    """Routed experts per MoE block."""
    top_k: int
    """Experts each token is routed to."""
    moe_ffn_dim: int
    """Hidden size of one routed expert's SwiGLU."""
    shared_ffn_dim: int
    """Hidden size of the shared expert's SwiGLU."""
    n_dense_layers: int = 1
    """Blocks, from the first, whose FFN is the dense MLP; the others are MoE blocks."""
    aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss (model/moe.py)."""
    router_z_loss_coef: float = 0.0
    """Weight of the router z-loss."""
    bias_update_rate: float = 0.001
    """How far each step moves an expert's routing bias towards balance (DeepSeek-V3's gamma,
    here times the expert's shortfall from the mean load, relative to it)."""
    logit_softcap: float = 30.0
    """Logits become softcap * tanh(logits / softcap) (Gemma 2's final soft-capping)."""
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention: AttentionImpl = "sdpa"
    """How attention is computed, not what: see ModelConfig.attention."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# `debug` trains on CPU; `16B` has DeepSeek-V2-Lite's sizes (one dense block, 64 experts of
# which 6 per token, two shared experts as one of twice the width), for the planner.
FLAVORS: dict[str, ZooArgs] = {
    "debug": ZooArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=512,
                     n_experts=8, top_k=2, moe_ffn_dim=64, shared_ffn_dim=128),
    "16B": ZooArgs(dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102_400,
                   ffn_dim=10_944, n_experts=64, top_k=6, moe_ffn_dim=1408, shared_ffn_dim=2816),
}  # fmt: skip


def build_args(cfg: ModelConfig) -> ZooArgs:
    """Resolve a flavor plus overrides to a concrete shape, rejecting impossible ones."""
    args = resolve_args(cfg, FLAVORS)
    sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "n_experts",
             "top_k", "moe_ffn_dim", "shared_ffn_dim")  # fmt: skip
    if bad := [f"{n}={getattr(args, n)}" for n in sizes if getattr(args, n) < 1]:
        raise ConfigError(f"model: {', '.join(bad)}: must be >= 1")
    if not 0 <= args.n_dense_layers < args.n_layers:
        raise ConfigError(
            f"model.n_dense_layers={args.n_dense_layers} must be in [0, n_layers="
            f"{args.n_layers}): at least one block is a mixture of experts"
        )
    if args.top_k > args.n_experts:
        raise ConfigError(f"model: top_k={args.top_k} exceeds n_experts={args.n_experts}")
    if args.dim % args.n_heads or args.n_heads % args.n_kv_heads or args.head_dim % 2:
        raise ConfigError(
            f"model: dim={args.dim}, n_heads={args.n_heads}, n_kv_heads={args.n_kv_heads}: "
            "n_heads must divide dim into an even head_dim, n_kv_heads divide n_heads"
        )
    if args.dim % 8 or args.moe_ffn_dim % 8:  # the experts' grouped GEMMs: 16-byte rows
        raise ConfigError(f"model: dim and moe_ffn_dim must be multiples of 8 ({args})")
    if args.logit_softcap <= 0 or min(args.aux_loss_coef, args.router_z_loss_coef) < 0:
        raise ConfigError("model: logit_softcap must be > 0, the loss coefficients >= 0")
    return args


class GeluMLP(nn.Module):
    """The dense blocks' FFN: two matrices, GeLU between them."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class SharedExpert(nn.Module):
    """A SwiGLU every token goes through, beside the routed experts. Plain weights computed with
    `local`, as the router's: under tensor parallel it runs whole inside the replicated MoE
    layer (TPStyle "replicate"), its weights replicated DTensors."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(hidden, dim))
        self.w2 = nn.Parameter(torch.empty(dim, hidden))
        self.w3 = nn.Parameter(torch.empty(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(F.linear(x, local(self.w1))) * F.linear(x, local(self.w3))
        return F.linear(hidden, local(self.w2))


class BiasedRouter(Router):
    """Softmax top-k routing whose choice adds a per-expert bias (a persistent buffer: state,
    checkpointed); the weights stay the unbiased probabilities, renormalized."""

    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__(dim, n_experts, top_k, norm_topk_prob=True)
        self.register_buffer("bias", torch.empty(n_experts))

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, local(self.weight))
        probs = torch.softmax(logits.float(), dim=-1)
        experts = torch.topk(probs + local(self.bias), self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(x.dtype), experts


class SharedMoE(MoE):
    """model.moe.MoE with the biased router, plus the shared expert."""

    def __init__(self, args: ZooArgs) -> None:
        super().__init__(args.dim, args.moe_ffn_dim, args.n_experts, args.top_k, True,
                         args.aux_loss_coef, args.router_z_loss_coef)  # fmt: skip
        self.router = BiasedRouter(args.dim, args.n_experts, args.top_k)
        self.shared = SharedExpert(args.dim, args.shared_ffn_dim)

    def forward(
        self, x: torch.Tensor, mask: Mask | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, aux, load = super().forward(x, mask)
        return out + self.shared(x), aux, load


class ZooBlock(nn.Module):
    """Attention, then the dense MLP (-> x) or the mixture of experts (-> x, aux, load)."""

    def __init__(self, args: ZooArgs, dense: bool) -> None:
        super().__init__()
        self.dense = dense
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)  # llama's: the fields it reads are ours too
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if dense:
            self.feed_forward = GeluMLP(args.dim, args.ffn_dim)
        else:
            self.moe = SharedMoE(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Mask | None) -> Any:
        x = x + self.attention(self.attention_norm(x), rope, mask)
        if self.dense:
            return x + self.feed_forward(self.ffn_norm(x))
        out, aux, load = self.moe(self.ffn_norm(x), mask)
        return x + out, aux, load


class SoftCappedOutput(nn.Module):
    """The output path: the projection, then soft-capping. The projection is a Linear of its
    own, so LoRA and float8 see a plain Linear and the cap stays outside it."""

    def __init__(self, dim: int, vocab_size: int, cap: float) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, vocab_size, bias=False)
        self.cap = cap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.cap * torch.tanh(self.proj(h) / self.cap)


class Zoo(nn.Module):
    def __init__(self, args: ZooArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): ZooBlock(args, i < args.n_dense_layers) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = SoftCappedOutput(args.dim, args.vocab_size, args.logit_softcap)
        if args.tie_embeddings:
            self.output.proj.weight = self.tok_embeddings.weight
        self.register_buffer("rope", torch.empty(0), persistent=False)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_expert_load: torch.Tensor | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """tokens (batch, seq) -> soft-capped logits (batch, seq, vocab); the MoE blocks' aux
        loss and expert load are kept for the step terms, as Qwen3-MoE keeps them."""
        if tokens.shape[1] > self.rope.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the RoPE table")
        h = self.tok_embeddings(tokens)
        mask = document_mask(document_ids, self.args.attention, h.dtype)
        rope = self.rope if positions is None else self.rope[positions]
        aux, load = [], []
        for layer in self.layers.values():
            out = layer(h, rope, mask)
            if isinstance(out, tuple):
                h, layer_aux, layer_load = out
                aux.append(layer_aux)
                load.append(layer_load)
            else:
                h = out
        self.last_aux_loss = torch.stack(aux).mean()
        self.last_expert_load = torch.stack(load).detach()
        h = self.norm(h)
        return h if hidden_only else self.output(h)

    @torch.no_grad()
    def init_weights(
        self,
        seed: int = 0,
        rope_len: int | None = None,
        assign: Callable[[torch.Tensor, Draw], None] | None = None,
    ) -> None:
        """Every parameter from `seed` by name (model/random_init.py), then the routing biases:
        zero, on every rank, after `to_empty` left them undefined."""
        assign = assign or _assign_whole
        self.init_buffers(rope_len or self.args.max_seq_len)
        for name, param in self.named_parameters():
            key = canonical_name(name)
            std = _init_std(key, self.args)
            if std is None:
                draw: Draw = partial(random_init.ones, tuple(param.shape), device=param.device)
            else:
                truncated = key != "tok_embeddings.weight" or self.args.tie_embeddings
                draw = partial(random_init.normal, seed, key, tuple(param.shape), std=std,
                               truncated=truncated, device=param.device)  # fmt: skip
            assign(param, draw)
        for router in routers(self):
            router.bias.zero_()

    def init_buffers(self, rope_len: int) -> None:
        """The RoPE table and the embedding tie (the routing biases are state: init_weights)."""
        if self.args.tie_embeddings and self.output.proj.weight is not self.tok_embeddings.weight:
            self.output.proj.weight = self.tok_embeddings.weight
        self.rope = rope_frequencies(self.args, rope_len, self.rope.device)


def _assign_whole(param: torch.Tensor, draw: Draw) -> None:
    param.copy_(draw(tuple(slice(0, n) for n in param.shape)))


def _init_std(name: str, args: ZooArgs) -> float | None:
    """Llama's policy: norm gains 1, embeddings by tying, depth-scaled projections into the
    residual stream (and each expert's up projection, as Qwen3-MoE's), 0.02 for the rest."""
    if name.endswith("norm.weight"):
        return None
    if name == "tok_embeddings.weight":
        return args.dim**-0.5 if args.tie_embeddings else 1.0
    if name == "output.proj.weight":
        return args.dim**-0.5
    residual = ("attention.wo.weight", "feed_forward.w2.weight", "experts.w2", "experts.w3",
                "shared.w2")  # fmt: skip
    if name.endswith(residual):
        return 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1))
    return 0.02


def routers(model: nn.Module) -> list[BiasedRouter]:
    return [m for m in model.modules() if isinstance(m, BiasedRouter)]


class RoutingBiasTerms(MoETerms):
    """The aux loss and expert load (model.moe.MoETerms, logged by block), and after each step
    each router's bias moved towards balance: by `bias_update_rate` x (mean - load) / mean,
    up for an expert below the mean load, down above (DeepSeek-V3 moves it by the rate times
    the sign; a relative step keeps a bias that swings back and forth from landing on exactly
    0 again). The load is summed over micro-batches and ranks: every rank makes the same
    update."""

    def __init__(self, model: nn.Module) -> None:
        args = model.args
        super().__init__(model, blocks=list(range(args.n_dense_layers, args.n_layers)))
        self.routers, self.rate = routers(model), args.bias_update_rate

    def after_step(self, stats: torch.Tensor, log: bool) -> dict[str, float]:
        load = stats[1:].view(len(self.routers), -1)
        with torch.no_grad():
            for router, tokens in zip(self.routers, load, strict=True):
                mean = tokens.mean().clamp(min=1)
                local(router.bias).add_(self.rate * (mean - tokens) / mean)
        return super().after_step(stats, log)


# The contract (model/__init__.py) ----------------------------------------------------------

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
    "layers.*.moe": "replicate",
    "norm": "sequence",
    "output.proj": "output",
}


def build_model(args: ZooArgs) -> Zoo:
    return Zoo(args)


def fsdp_units(model: Zoo) -> list[nn.Module]:
    return list(model.layers.values())


def output_layer(model: Zoo) -> nn.Module:
    """The whole output path: projection and soft-capping."""
    return model.output


def block_shapes(args: ZooArgs) -> list[BlockShape]:
    attention = AttentionShape(args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim)
    dense = BlockShape(attention, ffn=FFNShape(args.ffn_dim, matrices=2))
    experts = ExpertsShape(args.n_experts, args.top_k, FFNShape(args.moe_ffn_dim),
                           shared=FFNShape(args.shared_ffn_dim))  # fmt: skip
    moe = BlockShape(attention, experts=experts)
    return [dense if i < args.n_dense_layers else moe for i in range(args.n_layers)]


def fp8_linears(model: Zoo) -> list[str]:
    """Every nn.Linear (fp8.skip's default 'output' keeps the output module's projection)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def flops_per_token(model: Zoo, seq_len: int) -> int:
    """6 per active weight (top_k of each MoE block's routed experts) outside an untied input
    embedding, plus the attention's 12·layers·(n_heads·head_dim)·seq."""
    args = model.args
    experts = {id(p) for m in expert_modules(model) for p in m.parameters()}
    n = sum(p.numel() * args.top_k // args.n_experts if id(p) in experts else p.numel()
            for p in model.parameters())  # fmt: skip
    if not args.tie_embeddings:
        n -= model.tok_embeddings.weight.numel()
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def step_terms(model: nn.Module) -> RoutingBiasTerms:
    return RoutingBiasTerms(model)


# Registration, for the tests only ------------------------------------------------------------


def undescribed() -> SimpleNamespace:
    """This family as a fork might write it without `block_shapes`, which the contract makes
    optional: every other part is this module's own. The tests that run it hold the trainer's
    tools to that word (they infer what they need from the model, as the planner does)."""
    names = ["FLAVORS", "build_args", "build_model", "fsdp_units", "output_layer", "fp8_linears",
             "expert_modules", "flops_per_token", "step_terms", "TP_PLAN"]  # fmt: skip
    return SimpleNamespace(**{n: globals()[n] for n in names})


@contextmanager
def registered() -> Iterator[None]:
    """`model.FAMILIES` with this family as "zoo", for the duration (then as it was)."""
    before = FAMILIES.get(NAME)
    FAMILIES[NAME] = sys.modules[__name__]  # type: ignore[assignment]
    try:
        yield
    finally:
        if before is None:
            del FAMILIES[NAME]
        else:
            FAMILIES[NAME] = before


def call_registered(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with the family registered: for the ranks of tests/distributed.py, which
    import model.FAMILIES afresh (`partial(call_registered, fn)` pickles by reference)."""
    with registered():
        return fn(*args)
