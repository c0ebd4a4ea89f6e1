"""Attention for both families: the one dispatch (`attention`), and causal attention in blocks
of plain PyTorch ops, a faster CPU path than SDPA at small heads.

`attention(q, k, v, mask, impl)` is what a family's attention module calls after RoPE. `mask`
is None for plain causal attention over the whole window, or what `document_mask` built once
per forward from the batch's document ids (data.attention_mask = "document", docs/data.md):
each query then sees only earlier keys of its own document. Which kernel runs:

| | causal (mask None) | document mask |
|---|---|---|
| CUDA | SDPA `is_causal` (or chunked) | FlexAttention with a BlockMask, both compiled |
| CUDA, model.attention = "varlen" | SDPA `is_causal` | FlashAttention's varlen kernel |
| CPU, model.attention = "sdpa" | SDPA `is_causal` | SDPA with a (batch, 1, seq, seq) mask |
| CPU, model.attention = "chunked" | chunked causal | chunked, comparing document ids per block |

"varlen" (`VarlenMask`, CUDA only: launch/check.py refuses it elsewhere) packs the batch's
documents into one sequence of sequences, as FlashAttention's variable-length kernels take them
(`torch.nn.attention.varlen.varlen_attn`): each document a causal attention of its own, with no
mask built and no masked block visited. Its cumulative lengths come from the document ids once
per forward; the longest length it is told is the window (an upper bound: no host sync, and one
shape for compiled blocks), which costs only early-exiting thread blocks when a window holds
many short documents.

Under context parallel (parallel/cp.py) `document_mask` returns a `SplitMask` instead, ids or
not: this rank's queries are some rows of the sequence and `attention` gathers the whole
sequence's keys and values through it, then runs the same kernels with a mask over
whole-sequence positions (FlexAttention on CUDA, SDPA with a mask, or the chunked kernel on
each run of rows at its offset).

CPU SDPA's mask is additive (0 where a key is seen, -inf elsewhere) in the attention's dtype,
which `document_mask` takes: SDPA turns a boolean mask into such a float copy itself and saves
that copy for backward, in every layer (0.5 GiB over 4 layers at 8k tokens under cp 2,
BENCHMARKS.md); given the float mask it saves a reference to the one tensor all layers share.

`scaled_dot_product_attention` on CPU runs a flash-attention kernel whose inner matmuls are
(block x head_dim) tiles. At head_dim 16-64 those tiles are too thin to keep the vector units
busy, and in bf16 its backward is slower still (BENCHMARKS.md: forward+backward 1.8-2.1x slower
than this file on the debug shape, head_dim 16, seq 512). Here each step is a batched matmul over a
chunk of heads and a block of query rows, small enough to stay in cache:

- forward: scores = q k^T * scale + causal mask, p = softmax(scores), out = p v;
- backward recomputes p from q and k (as flash attention does: nothing of size seq^2 is saved),
  then dv = p^T dout, ds = p * (dout v^T - rowsum(dout * out)), dq = ds k, dk = ds^T q.

Query block j only attends to keys [0, end of block j), so the upper triangle is mostly skipped;
with document ids, to keys [start of the document of its first row, end of block j).
The math is SDPA's, to rounding (tests/test_attention.py checks both directions in float64).
Use it for bf16 on CPU (bench/attention.py): in fp32 the flash kernel is faster, and on GPUs
SDPA's fused kernels are far ahead of anything built from separate ops.
"""

# No `from __future__ import annotations`: torch.library reads the custom ops' signatures.
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# Size of one (heads x query rows x keys) score block: 2M bf16 values (4 MiB, within L3) in
# blocks of 128 query rows measured fastest on the debug shape among 1-128 heads x 64-512 rows.
BLOCK_ELEMENTS = 1 << 21
QUERY_ROWS = 128


@dataclass(frozen=True)
class VarlenMask:
    """The batch's documents as FlashAttention's variable-length kernel takes them (model.attention
    = "varlen"): the (batch x seq) tokens in order, cut into documents."""

    cu_seqlens: torch.Tensor
    """(documents + 1,) int32: where each document starts in the flattened tokens, then their
    number."""
    max_len: int
    """An upper bound of a document's length: the window's."""


# What `document_mask` builds for `attention`: a FlexAttention BlockMask (CUDA), a boolean
# or additive float (batch, 1, seq, seq) mask (CPU SDPA), the (batch, seq) document ids
# themselves (chunked), or the documents' lengths (varlen).
Mask = BlockMask | torch.Tensor | VarlenMask


@dataclass(frozen=True)
class SplitMask:
    """The mask of a sequence split over ranks (context parallel, parallel/cp.py): this rank's
    tokens are some rows of the whole sequence, and each of its queries sees the whole
    sequence's earlier keys (of its document), which `gather` brings."""

    rows: torch.Tensor
    """(local seq,) int64: each local token's row in the whole sequence."""
    spans: tuple[tuple[int, int, int], ...]
    """The local tokens as runs of consecutive rows: (first local index, its row, length)."""
    gather: Callable[[torch.Tensor], torch.Tensor]
    """(batch, heads, local seq, head_dim) -> (batch, heads, seq, head_dim), the whole
    sequence in order; differentiable (its backward sends each rank its rows' gradients)."""
    document_ids: torch.Tensor | None
    """(batch, seq): the whole sequence's document ids, or None (causal)."""
    kernel_mask: Mask | None
    """A BlockMask over (local queries, all keys) on CUDA, SDPA's (batch or 1, 1, local seq,
    seq) mask on CPU (see `sdpa_mask`); None for the chunked kernel, which takes `spans`."""
    seq: int = 0
    """Tokens in the whole sequence."""
    sum_over_split: Callable[[torch.Tensor], torch.Tensor] | None = None
    """x (no gradient) summed over the ranks holding the other parts of the same sequences: for
    a term of a whole sequence from its parts (an MoE's tokens per expert, model/moe.py)."""


# Context parallel's hook: while it holds a function (parallel/cp.py sets it for the length of
# the split model's forward), `document_mask` returns that function's SplitMask, which then
# travels to every layer's `attention` as its mask (also into activation checkpointing's
# recompute, after the forward). A family that calls `document_mask` and `attention` therefore
# runs under context parallel as it is.
SplitFn = Callable[[torch.Tensor | None, str, torch.dtype | None], SplitMask]
SEQUENCE_SPLIT: ContextVar[SplitFn | None] = ContextVar("sequence_split", default=None)


def document_mask(
    document_ids: torch.Tensor | None, impl: str, dtype: torch.dtype | None = None
) -> Mask | SplitMask | None:
    """The mask of a batch whose token i belongs to document `document_ids[b, i]` (ids
    nondecreasing along the sequence: each document one contiguous run), for `attention`.
    Built once per forward and shared by every layer; None (plain causal) without ids; a
    SplitMask, ids or not, under context parallel (`SEQUENCE_SPLIT`). `dtype`: the
    attention's (the embeddings' output), for CPU SDPA's additive mask (None: boolean)."""
    # Dynamo cannot read a ContextVar; a model compiled whole (compile.fsdp="graph") is never
    # split: that setting refuses context parallel.
    split = None if torch.compiler.is_compiling() else SEQUENCE_SPLIT.get()
    if split is not None:
        return split(document_ids, impl, dtype)
    if document_ids is None:
        return None
    if impl == "varlen":
        return varlen_mask(document_ids)
    if document_ids.device.type == "cuda":
        return _flex_block_mask(document_ids)
    if impl == "chunked":  # compared block by block inside the kernel: nothing seq^2 is built
        return document_ids
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return sdpa_mask(same.tril_().unsqueeze(1), dtype)  # (batch, 1, seq, seq): all heads


def check_attention(impl: str | None, on_gpu: bool, cp: int) -> None:
    """ConfigError, before any process group, for a model.attention this run cannot use."""
    from configs import ConfigError

    if impl != "varlen":
        return
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"model.attention='varlen': torch {torch.__version__} has no "
            "torch.nn.attention.varlen; use 'sdpa' (FlexAttention for document masks)"
        ) from None
    if not on_gpu:
        raise ConfigError(
            "model.attention='varlen' runs FlashAttention's variable-length kernel, which needs "
            "a CUDA device: on CPU use 'sdpa', or 'chunked' for bf16"
        )
    if cp > 1:
        raise ConfigError(
            "model.attention='varlen' with parallel.cp > 1: a rank holds parts of documents "
            "whose keys come from other ranks; use 'sdpa' (FlexAttention over the gathered keys)"
        )


def varlen_mask(document_ids: torch.Tensor) -> VarlenMask:
    """Each row's documents (ids nondecreasing along it) as consecutive sequences of the
    flattened batch: a new one wherever the id changes or a row begins."""
    batch, seq = document_ids.shape
    flat = document_ids.flatten()
    starts = flat[1:] != flat[:-1]
    starts[seq - 1 :: seq] = True  # the first token of each later row
    ends = torch.nonzero(starts).flatten() + 1
    edges = [ends.new_zeros(1), ends, ends.new_full((1,), batch * seq)]
    return VarlenMask(torch.cat(edges).to(torch.int32), seq)


def sdpa_mask(allowed: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`allowed` (True: the query sees the key) as SDPA's additive mask in `dtype`: 0 or -inf.
    Every query sees at least itself, so no row is all -inf. `dtype` None: `allowed` itself."""
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def split_mask(
    spans: tuple[tuple[int, int, int], ...],
    seq: int,
    gather: Callable[[torch.Tensor], torch.Tensor],
    document_ids: torch.Tensor | None,
    impl: str,
    device: torch.device,
    sum_over_split: Callable[[torch.Tensor], torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> SplitMask:
    """The SplitMask of the local tokens `spans` (see SplitMask) of a sequence of `seq` tokens,
    whose document ids are `document_ids` (batch, seq), or None for causal attention; `dtype`
    as `document_mask`'s."""
    rows = torch.cat([torch.arange(g, g + n, device=device) for _, g, n in spans])
    kernel_mask: Mask | None = None
    if rows.device.type == "cuda":
        kernel_mask = _flex_split_mask(rows, document_ids, seq)
    elif impl != "chunked":
        keys = torch.arange(seq, device=rows.device)
        kernel_mask = (keys[None, :] <= rows[:, None])[None]  # (1, local, seq)
        if document_ids is not None:
            kernel_mask = kernel_mask & (document_ids[:, rows, None] == document_ids[:, None, :])
        kernel_mask = sdpa_mask(kernel_mask.unsqueeze(1), dtype)  # broadcast over heads
    return SplitMask(rows, spans, gather, document_ids, kernel_mask, seq, sum_over_split)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask | SplitMask | None,
    impl: str,
) -> torch.Tensor:
    """Attention of q (batch, heads, seq, head_dim) with k, v (batch, kv_heads, seq, head_dim),
    heads a multiple of kv_heads: causal (mask None), or as `document_mask` built `mask`.
    `impl` is model.attention: 'sdpa', 'chunked' or 'varlen'."""
    gqa = q.shape[1] != k.shape[1]  # SDPA and flex broadcast the shared kv heads, no copies
    if isinstance(mask, SplitMask):
        return _split_attention(q, k, v, mask, impl)
    if isinstance(mask, VarlenMask):
        return varlen_attention(q, k, v, mask)
    if isinstance(mask, BlockMask):
        flex, _ = _compiled_flex()
        return flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    if impl == "chunked":
        return chunked_causal_attention(q, k, v, mask)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_as(mask, q), enable_gqa=gqa)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask
) -> torch.Tensor:
    """`attention` of each document of `mask` on its own, causal, through FlashAttention's
    variable-length kernel: (batch, heads, seq, head_dim) in and out, the kernel's (tokens,
    heads, head_dim) between."""
    batch, heads, seq, head_dim = q.shape

    def packed(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(batch * seq, x.shape[1], head_dim)

    out = _varlen_kernel()(packed(q), packed(k), packed(v), mask.cu_seqlens, mask.max_len)
    return out.view(batch, seq, heads, head_dim).transpose(1, 2)


@functools.cache
def _varlen_kernel() -> Callable[..., torch.Tensor]:
    """varlen_attn, causal, with grouped-query heads: `(q, k, v, cu_seqlens, max_len) -> out`.
    torch 2.11 on takes `window_size=(-1, 0)` for causal (2.10 took is_causal); one without
    `enable_gqa` gets the shared kv heads repeated."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}

    def kernel(q, k, v, cu_seqlens, max_len):  # type: ignore[no-untyped-def]
        gqa = {}
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                gqa = {"enable_gqa": True}
            else:
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **causal, **gqa)

    return kernel


def _as(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """SDPA takes a boolean mask or a float one of q's dtype: a float mask of another dtype (a
    family that guessed the dtype wrong) is converted, correct but copied in every layer."""
    return mask if mask.dtype in (torch.bool, q.dtype) else mask.to(q.dtype)


@functools.cache
def _compiled_flex() -> tuple:
    """flex_attention and create_block_mask, compiled on first use (creating the wrappers
    imports Dynamo, ~2 s, which CPU-only runs never need). Eager flex_attention is a slow
    reference implementation; compiled, it generates one fused kernel that skips the masked
    blocks. Inside an already compiled block, Dynamo traces straight through it."""
    return torch.compile(flex_attention), torch.compile(create_block_mask)


def _flex_block_mask(document_ids: torch.Tensor) -> BlockMask:
    def causal_same_document(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        same = document_ids[b, q_idx] == document_ids[b, kv_idx]
        return (kv_idx <= q_idx) & same

    batch, seq = document_ids.shape
    _, block_mask = _compiled_flex()
    return block_mask(causal_same_document, batch, None, seq, seq, device=document_ids.device)


def _split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SplitMask, impl: str
) -> torch.Tensor:
    """This rank's queries against the whole sequence's keys and values (context parallel)."""
    gqa = q.shape[1] != k.shape[1]
    k, v = mask.gather(k), mask.gather(v)
    if isinstance(mask.kernel_mask, BlockMask):
        flex, _ = _compiled_flex()
        return flex(q, k, v, block_mask=mask.kernel_mask, enable_gqa=gqa)
    if impl == "chunked":
        # Each run of consecutive rows is a causal chunk at its offset: it sees keys up to its
        # own end, so the keys after it are never touched.
        ids = mask.document_ids
        return torch.cat(
            [
                chunked_causal_attention(
                    q[:, :, a : a + n],
                    k[:, :, : g + n],
                    v[:, :, : g + n],
                    None if ids is None else ids[:, : g + n],
                    offset=g,
                )
                for a, g, n in mask.spans
            ],
            dim=2,
        )
    mask_ = _as(mask.kernel_mask, q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_, enable_gqa=gqa)


def _flex_split_mask(rows: torch.Tensor, document_ids: torch.Tensor | None, seq: int) -> BlockMask:
    """Local query q_idx is row rows[q_idx] of the whole sequence; kv_idx indexes the whole
    sequence: causal (and same-document) over the whole sequence's positions."""

    def causal(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return kv_idx <= rows[q_idx]

    def causal_same_document(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        row = rows[q_idx]
        return (kv_idx <= row) & (document_ids[b, row] == document_ids[b, kv_idx])

    _, block_mask = _compiled_flex()
    if document_ids is None:
        return block_mask(causal, None, None, len(rows), seq, device=rows.device)
    batch = document_ids.shape[0]
    return block_mask(causal_same_document, batch, None, len(rows), seq, device=rows.device)


def chunked_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """Causal attention of q (batch, heads, seq, head_dim) with k, v (batch, kv_heads,
    offset + seq, head_dim): the queries are the last seq rows of the key sequence (offset > 0:
    a later chunk of a sequence under context parallel, which sees every key before it). Heads
    must be a multiple of kv_heads (grouped-query attention). With `document_ids` (batch,
    offset + seq), nondecreasing along the sequence, a query sees only the keys of its own
    document."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # each kv head serves n_rep query heads; autograd sums their gradients
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return _attention(q, k, v, document_ids, offset)


def _blocks(
    n_heads: int, seq: int, keys: int, group: int | None = None
) -> list[tuple[slice, int, int]]:
    """(heads, first query row, end query row) of every block, in order. `group`: heads per
    batch element, when no block may span two of them (their document masks differ)."""
    rows = min(seq, QUERY_ROWS)
    heads = max(1, BLOCK_ELEMENTS // (rows * keys))
    if group is None:
        chunks = [(h, h + heads) for h in range(0, n_heads, heads)]
    else:
        heads = min(heads, group)
        chunks = [
            (b + h, b + min(h + heads, group))
            for b in range(0, n_heads, group)
            for h in range(0, group, heads)
        ]
    rows_at = range(0, seq, rows)
    return [(slice(h0, h1), r, min(r + rows, seq)) for h0, h1 in chunks for r in rows_at]


def _masked_blocks(
    q: torch.Tensor, document_ids: torch.Tensor | None, offset: int
) -> Iterator[tuple[slice, int, int, int, int, torch.Tensor]]:
    """Every block as (heads, r0, r1, k0, k1, additive mask): query rows [r0, r1) of those heads
    (of the (batch * heads) flattened q), which are rows [offset + r0, k1 = offset + r1) of the
    key sequence, see at most keys [k0, k1), the mask (0 or -inf) says which of them."""
    batch, n_heads, seq, _ = q.shape
    keys = offset + seq
    causal = _causal_mask(keys, q)
    if document_ids is None:
        for heads, r0, r1 in _blocks(batch * n_heads, seq, keys):
            yield heads, r0, r1, 0, offset + r1, causal[offset + r0 : offset + r1, : offset + r1]
        return
    for heads, r0, r1 in _blocks(batch * n_heads, seq, keys, group=n_heads):
        ids = document_ids[heads.start // n_heads]
        g0, g1 = offset + r0, offset + r1  # the block's rows in the key sequence
        # Each document is one run of ids: the earliest a row of this block may see is the
        # first token of row r0's document. Earlier keys are skipped, not just masked.
        k0 = int(torch.searchsorted(ids, ids[g0 : g0 + 1]))
        other = ids[g0:g1, None] != ids[None, k0:g1]
        yield heads, r0, r1, k0, g1, causal[g0:g1, k0:g1].masked_fill(other, float("-inf"))


def _probs(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, r0: int, r1: int, k0: int, k1: int
) -> torch.Tensor:
    """Softmax of the scores of query rows [r0, r1) over keys [k0, k1), `mask` added."""
    scale = q.shape[-1] ** -0.5
    scores = torch.baddbmm(mask, q[:, r0:r1], k[:, k0:k1].transpose(1, 2), alpha=scale)
    return torch.softmax(scores, dim=-1)


def _causal_mask(seq: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask: 0 where a query may see a key, -inf above the diagonal."""
    return torch.full((seq, seq), float("-inf"), dtype=like.dtype, device=like.device).triu(1)


# The forward and backward are custom ops, opaque to torch.compile: traced into, the block loop
# became one graph of separate matmuls and copies that ran slower than eager (BENCHMARKS.md).
# As ops, compiled blocks fuse everything around attention and call these as they are.
@torch.library.custom_op("fsdp2_trainer::chunked_attention", mutates_args=())
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor | None,
    offset: int,
) -> torch.Tensor:
    # (batch * heads, seq, head_dim): one batch dimension for bmm.
    q3, k3, v3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v))
    out = torch.empty_like(q3)
    for heads, r0, r1, k0, k1, mask in _masked_blocks(q, document_ids, offset):
        p = _probs(q3[heads], k3[heads], mask, r0, r1, k0, k1)
        out[heads, r0:r1] = torch.bmm(p, v3[heads, k0:k1])
    return out.view(q.shape)


@torch.library.custom_op("fsdp2_trainer::chunked_attention_backward", mutates_args=())
def _attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    document_ids: torch.Tensor | None,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = q.shape[-1] ** -0.5
    q3, k3, v3, out3, dout3 = (t.reshape(-1, *t.shape[-2:]) for t in (q, k, v, out, dout))
    # rowsum(dout * out) = rowsum(p * dp): the softmax backward's correction term, summed
    # in at least fp32.
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout3.to(acc) * out3.to(acc)).sum(-1, keepdim=True).to(q.dtype)
    dq = torch.empty_like(q3)
    dk, dv = torch.zeros_like(k3), torch.zeros_like(v3)
    for heads, r0, r1, k0, k1, mask in _masked_blocks(q, document_ids, offset):
        q_, k_, v_, do = q3[heads], k3[heads], v3[heads], dout3[heads, r0:r1]
        p = _probs(q_, k_, mask, r0, r1, k0, k1)
        dv[heads, k0:k1].baddbmm_(p.transpose(1, 2), do)
        ds = torch.bmm(do, v_[:, k0:k1].transpose(1, 2)).sub_(delta[heads, r0:r1]).mul_(p)
        dq[heads, r0:r1] = torch.bmm(ds, k_[:, k0:k1]).mul_(scale)
        dk[heads, k0:k1].baddbmm_(ds.transpose(1, 2), q_[:, r0:r1], alpha=scale)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


# Shapes for tracing: every output is a new contiguous tensor shaped like its input.
@_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor | None,
    offset: int,
) -> torch.Tensor:
    return q.new_empty(q.shape)


@_attention_backward.register_fake
def _(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    document_ids: torch.Tensor | None,
    offset: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_inputs_and_output(ctx: FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    *tensors, ctx.offset = inputs
    ctx.save_for_backward(*tensors, output)


def _backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, document_ids, out = ctx.saved_tensors
    return (*_attention_backward(dout, q, k, v, out, document_ids, ctx.offset), None, None)


_attention.register_autograd(_backward, setup_context=_save_inputs_and_output)
