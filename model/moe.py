"""Mixture-of-experts layer for any family: a softmax top-k router, stacked SwiGLU experts
computed by grouped GEMMs, and the auxiliary losses. Single-device code, like the rest of
model/; `model/qwen3_moe.py` builds its blocks from it.

One MoE layer maps tokens x (batch, seq, dim) to (batch, seq, dim) in four steps:

1. **Route** (`Router`): logits = x W_r^T, probabilities = softmax in float32, the top_k experts
   of each token and their probabilities (renormalized to sum to 1 with `norm_topk_prob`).
2. **Dispatch**: the tokens x top_k (token, expert) pairs sorted by expert, with the number of
   pairs per expert.
3. **Experts** (`GroupedExperts`): each expert's SwiGLU on its contiguous run of rows, as three
   `torch._grouped_mm` calls over all experts at once (no Python loop over experts).
4. **Combine**: each pair's output back at its token, weighted by its routing probability and
   summed over the token's top_k experts.

Expert parallel (`apply_ep`, parallel/ep.py) wraps `GroupedExperts` alone: an all-to-all
before its forward sends each pair to the rank that holds its expert (the counts tell how many
go where), one after it brings the outputs back; routing, dispatch and combine stay here,
unchanged. `GroupedExperts.forward(x, counts)` therefore takes rows already sorted by expert and
the count per expert, and its stacked weights have the expert as dim 0, the dim EP splits.
"""

# No `from __future__ import annotations`: torch.library reads the custom ops' signatures.
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx

from model.attention import Mask, SplitMask


def local(weight: torch.Tensor) -> torch.Tensor:
    """The part of `weight` this device computes with. Tensor parallel keeps the whole MoE layer
    replicated on every tp rank and expert parallel splits the experts across ranks, both as
    distributed tensors (DTensor) whose rows stay local: the routed tokens never leave this
    device inside the layer, so it multiplies them by the local tensor (`to_local`, through
    which gradients flow back). A plain tensor is returned as it is. Duck-typed, on the class
    (which torch.compile resolves; it does not see an instance's DTensor methods): model code
    never imports torch.distributed."""
    return weight.to_local() if hasattr(type(weight), "to_local") else weight


# ---- grouped GEMM ---------------------------------------------------------------------------
# torch._grouped_mm(a, b, offs) multiplies row group g of a (rows offs[g-1]:offs[g]) by b[g];
# rows past offs[-1] are left unwritten (so every caller here covers all rows: offs[-1] =
# rows). On torch 2.13 it runs on CPU (float32, bfloat16, float16) as
# on CUDA, but its meta function accepts bfloat16 only, so torch.compile cannot trace a float32
# call. As custom ops (like model/attention.py's kernel) the forward and backward are opaque to
# compile: the same calls run eagerly inside compiled blocks, in any of those dtypes.


@torch.library.custom_op("fsdp2_trainer::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """F.linear per row group: rows offs[g-1]:offs[g] of x (rows, k) times w[g]^T, w (groups,
    n, k) -> (rows, n). `offsets` (groups,) int32: cumulative row counts. k and n must make
    16-byte rows (multiples of 8 in bfloat16, of 4 in float32)."""
    try:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    except NotImplementedError as e:  # no kernel for this device in this torch build
        raise RuntimeError(
            f"torch {torch.__version__} has no torch._grouped_mm for {x.device.type} tensors, "
            "which the MoE experts need: use torch >= 2.13 on CPU (CUDA: 2.11 and newer)"
        ) from e


@torch.library.custom_op("fsdp2_trainer::grouped_linear_backward", mutates_args=())
def _grouped_linear_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # A gradient may arrive expanded (stride 0): not a valid layout. With no rows (under expert
    # parallel a rank may receive none) .contiguous() keeps those strides: make a fresh one.
    fresh = torch.zeros_like(grad, memory_format=torch.contiguous_format)
    grad = grad.contiguous() if grad.numel() else fresh
    grad_x = torch._grouped_mm(grad, w, offs=offsets)
    # (n, rows) x (rows, k), groups along the rows: one (n, k) block per group, w's layout.
    grad_w = torch._grouped_mm(grad.transpose(0, 1), x, offs=offsets)
    return grad_x, grad_w


@grouped_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[1]))


@_grouped_linear_backward.register_fake
def _(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _save_for_backward(ctx: FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, w, offsets = ctx.saved_tensors
    return (*_grouped_linear_backward(grad, x, w, offsets), None)


grouped_linear.register_autograd(_backward, setup_context=_save_for_backward)


# ---- the layer ------------------------------------------------------------------------------


class Router(nn.Module):
    """Softmax top-k routing (Qwen3-MoE's, as transformers computes it)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> logits (tokens, experts) in x's dtype, probabilities (float32),
        and the top_k experts of each token (tokens, top_k) with their weights in x's dtype."""
        logits = F.linear(x, local(self.weight))
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:  # the chosen experts' weights sum to 1
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights.to(x.dtype), experts


class GroupedExperts(nn.Module):
    """n_experts SwiGLU FFNs, their weights stacked with the expert as dim 0 and each expert's
    matrix in nn.Linear's (out, in) layout: w1 (gate) and w3 (up) (experts, hidden, dim),
    w2 (down) (experts, dim, hidden)."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (rows, dim) sorted by expert, `counts` (experts,) rows per expert (this module's
        experts: all of them, or under expert parallel this rank's) -> (rows, dim)."""
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        hidden = F.silu(grouped_linear(x, local(self.w1), offsets))
        hidden = hidden * grouped_linear(x, local(self.w3), offsets)
        return grouped_linear(hidden, local(self.w2), offsets)


class MoE(nn.Module):
    """Route, dispatch, experts, combine; and this layer's auxiliary losses, per sequence."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        aux_loss_coef: float,
        router_z_loss_coef: float,
    ) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_coef, self.router_z_loss_coef = aux_loss_coef, router_z_loss_coef
        self.router = Router(dim, n_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(dim, hidden, n_experts)

    def forward(
        self, x: torch.Tensor, mask: Mask | SplitMask | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (batch, seq, dim) -> (output (batch, seq, dim), the auxiliary loss summed over the
        batch's sequences (float32 scalar, coefficients applied), tokens per expert (experts,)
        float32). Every input positional and returned: compile, AC and TP see plain tensors.
        `mask`: the block's attention mask; only a SplitMask (context parallel) matters here,
        whose x holds parts of sequences (`aux_loss`)."""
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        logits, probs, weights, chosen = self.router(tokens)
        # Dispatch: the (token, expert) pairs in expert order; a stable sort keeps each
        # expert's tokens in sequence order, so the result does not depend on the sort kernel.
        pair_expert = chosen.flatten()
        order = torch.argsort(pair_expert, stable=True)
        # Pairs up to and including each expert: static shapes, unlike bincount.
        ends = torch.searchsorted(
            pair_expert[order], torch.arange(self.n_experts, device=x.device), right=True
        )
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        # Each token's top_k copies, then the permutation: backward sums a token's top_k
        # gradients in a fixed order (a gather with repeated indices would add them with
        # atomics on GPUs, in no fixed order).
        pairs = tokens.unsqueeze(1).expand(-1, self.top_k, -1).reshape(-1, dim)
        routed = self.experts(pairs[order], counts)
        # Combine: undo the permutation, weight each pair, sum each token's top_k outputs.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        out = routed[inverse].view(-1, self.top_k, dim) * weights.unsqueeze(-1)
        split = mask if isinstance(mask, SplitMask) else None
        aux = self.aux_loss(logits, probs, chosen, batch, split)
        return out.sum(dim=1).view(batch, seq, dim), aux, counts.float()

    def aux_loss(
        self,
        logits: torch.Tensor,
        probs: torch.Tensor,
        chosen: torch.Tensor,
        batch: int,
        split: SplitMask | None = None,
    ) -> torch.Tensor:
        """Coefficient-weighted auxiliary losses, each computed per sequence and summed over
        the batch's sequences (the trainer divides by the step's sequences; model/__init__.py):

        - load balance (Switch Transformer, in transformers' scale): n_experts * sum_e f_e P_e,
          f_e the tokens of the sequence routed to expert e over its length (summing to top_k)
          and P_e the mean router probability of e: top_k when balanced, more when not;
        - router z-loss (ST-MoE): the mean over the sequence's tokens of logsumexp(logits)^2,
          which keeps router logits small.

        Under context parallel (`split`) each rank holds parts of the sequences: f needs the
        whole sequence's counts, summed over the ranks (f carries no gradient), while P and the
        z-loss's mean are sums over tokens, so each rank adds its tokens' share, divided by the
        whole length. The ranks' results then add up to the terms of the whole sequences.
        """
        aux = probs.new_zeros(())
        seq = chosen.shape[0] // batch
        length = seq if split is None else split.seq

        def mean_over_sequence(x: torch.Tensor) -> torch.Tensor:  # over dim 1, the sequence
            return x.mean(dim=1) if split is None else x.sum(dim=1) / length

        if self.aux_loss_coef > 0:
            per_seq = chosen.view(batch, -1)
            # f is a count: no gradient flows through it (only through P, as in the paper).
            counts = probs.new_zeros(batch, self.n_experts).scatter_add_(
                1, per_seq, probs.new_ones(per_seq.shape)
            )
            if split is not None:
                counts = split.sum_over_split(counts)
            f = counts / length
            p = mean_over_sequence(probs.view(batch, seq, self.n_experts))
            aux = aux + self.aux_loss_coef * self.n_experts * (f * p).sum()
        if self.router_z_loss_coef > 0:
            z = mean_over_sequence(torch.logsumexp(logits.float(), dim=-1).square().view(batch, -1))
            aux = aux + self.router_z_loss_coef * z.sum()
        return aux


class MoETerms:
    """A mixture-of-experts model's step terms (model/__init__.py, `StepTerms`), for any family
    whose model keeps its last forward's aux loss in `last_aux_loss` (summed over the
    micro-batch's sequences) and the tokens routed to each expert in `last_expert_load`
    (MoE layers, experts): the extra loss is the aux loss over the step's sequences; the
    statistics are that value and the load, logged as `loss/aux` and the load per MoE layer,
    named by its block's index: `blocks` lists them (None: every block is an MoE layer)."""

    def __init__(self, model: nn.Module, blocks: list[int] | None = None) -> None:
        self.model, self.blocks = model, blocks
        self.load: torch.Tensor | None = None  # tokens per expert since the last log step
        self.aux = 0.0

    def collect(self, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        aux = self.model.last_aux_loss / sequences
        return aux, torch.cat([aux.detach()[None], self.model.last_expert_load.flatten()])

    def after_step(self, stats: torch.Tensor, log: bool) -> dict[str, float]:
        self.aux = stats[0].item()
        load = stats[1:].view(-1, self.model.last_expert_load.shape[-1])
        self.load = load if self.load is None else self.load + load
        if not log:
            return {}
        scalars = {"loss/aux": self.aux} | expert_load_scalars(self.load, self.blocks)
        self.load = None
        return scalars


def expert_load_scalars(
    tokens_per_expert: torch.Tensor, blocks: list[int] | None = None
) -> dict[str, float]:
    """TensorBoard scalars of a mixture of experts' load, from the tokens routed to each expert
    (MoE layers, experts), summed over ranks: per layer, the busiest expert's tokens over the
    mean (1 = balanced; n_experts / top_k = every token on the same top_k experts) and the
    busiest expert's share of the layer's routed tokens, named by the layer's block index
    (`blocks`; None: 0, 1, ...); and the worst layer's ratio, for the log line."""
    busiest = tokens_per_expert.max(dim=1).values
    total = tokens_per_expert.sum(dim=1).clamp(min=1)
    over_mean = busiest / (total / tokens_per_expert.shape[1])
    share = busiest / total
    scalars = {"expert_load/max_over_mean": over_mean.max().item()}
    layers = range(len(over_mean)) if blocks is None else blocks
    for layer, ratio, part in zip(layers, over_mean.tolist(), share.tolist(), strict=True):
        scalars[f"expert_load/max_over_mean_layer{layer:02d}"] = ratio
        scalars[f"expert_load/busiest_share_layer{layer:02d}"] = part
    return scalars
