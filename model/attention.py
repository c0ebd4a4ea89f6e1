"""Causal attention in blocks of plain PyTorch ops: a faster CPU path than SDPA at small heads.

`scaled_dot_product_attention` on CPU runs a flash-attention kernel whose inner matmuls are
(block x head_dim) tiles. At head_dim 16-64 those tiles are too thin to keep the vector units
busy, and in bf16 its backward is slower still (BENCHMARKS.md: forward+backward 1.8-2.1x slower
than this file on the debug shape, head_dim 16, seq 512). Here each step is a batched matmul over a
chunk of heads and a block of query rows, small enough to stay in cache:

- forward: scores = q k^T * scale + causal mask, p = softmax(scores), out = p v;
- backward recomputes p from q and k (as flash attention does: nothing of size seq^2 is saved),
  then dv = p^T dout, ds = p * (dout v^T - rowsum(dout * out)), dq = ds k, dk = ds^T q.

Query block j only attends to keys [0, end of block j), so the upper triangle is mostly skipped.
The math is SDPA's, to rounding (tests/test_attention.py checks both directions in float64).
Use it for bf16 on CPU (bench/attention.py): in fp32 the flash kernel is faster, and on GPUs
SDPA's fused kernels are far ahead of anything built from separate ops.
"""

# No `from __future__ import annotations`: torch.library reads the custom ops' signatures.
import torch
from torch.autograd.function import FunctionCtx

# Size of one (heads x query rows x keys) score block: 2M bf16 values (4 MiB, within L3) in
# blocks of 128 query rows measured fastest on the debug shape among 1-128 heads x 64-512 rows.
BLOCK_ELEMENTS = 1 << 21
QUERY_ROWS = 128


def chunked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q (batch, heads, seq, head_dim) with k, v (batch, kv_heads, seq,
    head_dim); heads must be a multiple of kv_heads (grouped-query attention)."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:  # each kv head serves n_rep query heads; autograd sums their gradients
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return _attention(q, k, v)


def _blocks(n_heads: int, seq: int) -> list[tuple[slice, int, int]]:
    """(heads, first query row, end query row) of every block, in order."""
    rows = min(seq, QUERY_ROWS)
    heads = max(1, BLOCK_ELEMENTS // (rows * seq))
    return [
        (slice(h, h + heads), r, min(r + rows, seq))
        for h in range(0, n_heads, heads)
        for r in range(0, seq, rows)
    ]


def _probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Softmax of the scores of query rows [r0, r1) over keys [0, r1): later keys are masked."""
    scale = q.shape[-1] ** -0.5
    scores = torch.baddbmm(mask[r0:r1, :r1], q[:, r0:r1], k[:, :r1].transpose(1, 2), alpha=scale)
    return torch.softmax(scores, dim=-1)


def _causal_mask(seq: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask: 0 where a query may see a key, -inf above the diagonal."""
    return torch.full((seq, seq), float("-inf"), dtype=like.dtype, device=like.device).triu(1)


# The forward and backward are custom ops, opaque to torch.compile: traced into, the block loop
# became one graph of separate matmuls and copies that ran slower than eager (BENCHMARKS.md).
# As ops, compiled blocks fuse everything around attention and call these as they are.
@torch.library.custom_op("fsdp2_trainer::chunked_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    seq, head_dim = q.shape[-2:]
    # (batch * heads, seq, head_dim): one batch dimension for bmm.
    q3, k3, v3 = (t.reshape(-1, seq, head_dim) for t in (q, k, v))
    mask = _causal_mask(seq, q)
    out = torch.empty_like(q3)
    for heads, r0, r1 in _blocks(q3.shape[0], seq):
        p = _probs(q3[heads], k3[heads], mask, r0, r1)
        out[heads, r0:r1] = torch.bmm(p, v3[heads, :r1])
    return out.view(q.shape)


@torch.library.custom_op("fsdp2_trainer::chunked_attention_backward", mutates_args=())
def _attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seq, head_dim = q.shape[-2:]
    scale = head_dim**-0.5
    q3, k3, v3, out3, dout3 = (t.reshape(-1, seq, head_dim) for t in (q, k, v, out, dout))
    # rowsum(dout * out) = rowsum(p * dp): the softmax backward's correction term, summed
    # in at least fp32.
    acc = torch.promote_types(q.dtype, torch.float32)
    delta = (dout3.to(acc) * out3.to(acc)).sum(-1, keepdim=True).to(q.dtype)
    mask = _causal_mask(seq, q)
    dq = torch.empty_like(q3)
    dk, dv = torch.zeros_like(k3), torch.zeros_like(v3)
    for heads, r0, r1 in _blocks(q3.shape[0], seq):
        q_, k_, v_, do = q3[heads], k3[heads], v3[heads], dout3[heads, r0:r1]
        p = _probs(q_, k_, mask, r0, r1)
        dv[heads, :r1].baddbmm_(p.transpose(1, 2), do)
        ds = torch.bmm(do, v_[:, :r1].transpose(1, 2)).sub_(delta[heads, r0:r1]).mul_(p)
        dq[heads, r0:r1] = torch.bmm(ds, k_[:, :r1]).mul_(scale)
        dk[heads, :r1].baddbmm_(ds.transpose(1, 2), q_[:, r0:r1], alpha=scale)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


# Shapes for tracing: every output is a new contiguous tensor shaped like its input.
@_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


@_attention_backward.register_fake
def _(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_inputs_and_output(ctx: FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs, output)


def _backward(ctx: FunctionCtx, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v, out = ctx.saved_tensors
    return _attention_backward(dout, q, k, v, out)


_attention.register_autograd(_backward, setup_context=_save_inputs_and_output)
