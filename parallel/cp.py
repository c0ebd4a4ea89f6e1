"""Context parallel: each sequence split over the cp ranks, attention exact across the split.

**The split, load-balanced.** A window of seq tokens is cut into 2 x cp equal chunks and cp
rank i keeps two of them: chunk i and chunk 2cp-1-i (torchtitan's and Megatron's scheme). Under
causal attention a query's work grows with its position, so a plain split into cp contiguous
pieces would give the last rank 2cp-1 times the first one's attention work, and every rank
would wait for it; paired head and tail chunks give every rank the same work.

**Attention: K/V all-gathered per layer.** Each layer all-gathers the keys and values of the
whole sequence over the cp ranks (its backward reduce-scatters their gradients) and computes
its own queries against them. It is exact by construction, runs the kernels the model already
has (SDPA, the chunked CPU kernel, FlexAttention, each with a mask over whole-sequence
positions, model/attention.py), and needs only collectives gloo has. Ring attention would
keep 1/cp of the keys at a time and overlap the transfers with compute, but needs a
log-sum-exp merge of partial results inside every kernel and point-to-point sends; with GQA the
gathered K/V are small next to the activations. torchtitan made the same choice.

**What travels with the tokens** (`split_batch`). Document ids count EOS from the window start
and per-document positions count from each document's start, so both are derived from the
whole window (data/documents.py) before each rank keeps its chunks of inputs, targets,
document ids and RoPE positions (without per-document positions, each token's row in the
window). The model receives its local tokens with their own positions; its `document_mask`
call, under the hook `apply_cp` installs (model/attention.py `SEQUENCE_SPLIT`), gathers the
whole window's document ids once per forward.

**The loss and the weights.** Each rank sums the loss over its own targets; train.py divides
by the global target count, an all-reduce over every rank, cp ranks included, so the
normalization does not change. The cp ranks hold the same weights and see different tokens,
as data-parallel ranks do: FSDP shards over dp_shard x cp and reduces gradients over both
(parallel/runtime.py `dp_mesh`). The data loader gives every cp rank of a dp rank the same
sequences (`dp_rank_and_size` leaves cp out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from configs import ConfigError
from model.attention import SEQUENCE_SPLIT, SplitMask, split_mask
from parallel.dims import ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Batch = TypeVar("Batch", bound=NamedTuple)

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def check_cp(cfg: ParallelConfig, seq_len: int) -> None:
    """ConfigError, before any collective, for a context-parallel degree this run cannot take.
    tp, ep, fp8, compiled blocks and MoE families need nothing here: FSDP's dp_shard x cp mesh
    and the tp mesh share a root (parallel/runtime.py), EP groups span dp_shard x cp
    (parallel/ep.py), a float8 Linear works token by token, Dynamo traces the SplitMask and the
    gather's collectives, and an MoE sums its per-sequence counts over the split (model/moe.py
    `aux_loss`); tests/test_cp.py runs each against one process."""
    cp = cfg.cp
    if cp == 1:
        return
    if seq_len % (2 * cp) != 0:
        raise ConfigError(
            f"parallel.cp={cp} must split data.seq_len ({seq_len}) into 2 x cp = {2 * cp} equal "
            "chunks (each cp rank holds one early and one late chunk, for an even share of "
            "causal attention): choose a seq_len that 2 x cp divides"
        )


def chunk_spans(rank: int, cp: int, local: int) -> tuple[tuple[int, int, int], ...]:
    """Rank `rank`'s two chunks of a sequence of cp x `local` tokens, as (first local index,
    first row in the sequence, length): chunk rank, then chunk 2cp-1-rank."""
    chunk = local // 2
    return (0, rank * chunk, chunk), (chunk, (2 * cp - 1 - rank) * chunk, chunk)


def split_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along `dim`: chunks rank and 2cp-1-rank of 2cp."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def unsplit_sequence(gathered: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the cp ranks' parts concatenated in rank order along `dim`."""
    parts = gathered.chunk(2 * cp, dim=dim)  # rank 0's two chunks, rank 1's, ...
    ordered: list[torch.Tensor] = [parts[0]] * (2 * cp)
    for rank in range(cp):
        ordered[rank], ordered[2 * cp - 1 - rank] = parts[2 * rank], parts[2 * rank + 1]
    return torch.cat(ordered, dim=dim)


def split_after(to_batch: Callable[..., Batch], mesh: DeviceMesh) -> Callable[..., Batch]:
    """`to_batch`, then this rank's share (`split_batch`) on the 1D cp `mesh`: the document ids
    and positions are derived from the whole window before the split."""
    rank, cp = mesh.get_local_rank(), mesh.size()
    return lambda *loaded: split_batch(to_batch(*loaded), rank, cp)


def split_batch(batch: Batch, rank: int, cp: int) -> Batch:
    """This rank's share of a micro-batch (a NamedTuple of (batch, seq) tensors or None, with
    `inputs` and `positions` fields): every field split along the sequence, the positions first made
    explicit, so each token keeps the RoPE position it had in the whole window. A field of one
    value per row (DPO's precomputed reference, (batch,)) stays whole."""
    if batch.positions is None:
        inputs = batch.inputs
        rows = torch.arange(inputs.shape[1], device=inputs.device)
        batch = batch._replace(positions=rows.expand(inputs.shape))
    return type(batch)(*(t if t is None or t.dim() == 1 else split_sequence(t, rank, cp)
                         for t in batch))  # fmt: skip


class _GatherSequence(torch.autograd.Function):
    """(batch, heads, local seq, head_dim) -> the whole sequence, from every cp rank; backward:
    each rank gets the sum over ranks of its rows' gradients (every rank's queries saw them).

    Inside a compiled block Dynamo traces this Function whole (fullgraph) and rewrites its
    in-place collectives as functional ones (torch.ops._c10d_functional), so it needs no
    custom op and no `torch.compiler.disable`, which would break the graph at every layer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        return _gather(x, group, cp, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cp = ctx.cp
        # The collective works along dim 0: the sequence first, parts in rank order.
        seq_first = grad.movedim(2, 0)
        parts = torch.cat([split_sequence(seq_first, r, cp, dim=0) for r in range(cp)])
        out = parts.new_empty((parts.shape[0] // cp, *parts.shape[1:]))
        _reduce_scatter(out, parts.contiguous(), group=ctx.group)
        return out.movedim(0, 2), None, None


def _gather(x: torch.Tensor, group: dist.ProcessGroup, cp: int, dim: int) -> torch.Tensor:
    seq_first = x.movedim(dim, 0).contiguous()
    out = seq_first.new_empty((cp * seq_first.shape[0], *seq_first.shape[1:]))
    _all_gather(out, seq_first, group=group)
    return unsplit_sequence(out, cp, dim=0).movedim(0, dim)


class ContextSplit:
    """The hook `apply_cp` installs: for the length of the model's forward, `document_mask`
    returns this rank's SplitMask (model/attention.py)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.rank, self.cp = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        self._token: Any = None

    def __call__(
        self, document_ids: torch.Tensor | None, impl: str, dtype: torch.dtype | None
    ) -> SplitMask:
        # The model sees only its tokens' document ids; a query compares with every key's.
        if document_ids is not None:
            document_ids = _gather(document_ids, self.group, self.cp, dim=1)
        local = self._local_seq
        spans = chunk_spans(self.rank, self.cp, local)
        seq = local * self.cp
        device = self._device
        gather, total = self.gather, self.sum_over_split
        return split_mask(spans, seq, gather, document_ids, impl, device, total, dtype)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(x, self.group, self.cp)

    def sum_over_split(self, x: torch.Tensor) -> torch.Tensor:
        total = x.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs["tokens"]
        self._local_seq, self._device = tokens.shape[1], tokens.device
        self._token = SEQUENCE_SPLIT.set(self)

    def exit(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._token is not None:
            SEQUENCE_SPLIT.reset(self._token)
            self._token = None


def apply_cp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every sequence over the 1D cp `mesh` in place: hooks around the model's forward
    make each layer's attention gather the keys and values of the whole sequence. The model
    then takes this rank's tokens as `split_batch` leaves them (with their positions)."""
    split = ContextSplit(mesh)
    model.register_forward_pre_hook(split.enter, with_kwargs=True)
    # always_call: a forward that raises must not leave the hook set.
    model.register_forward_hook(split.exit, with_kwargs=True, always_call=True)
