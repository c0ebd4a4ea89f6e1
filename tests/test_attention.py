"""model/attention.py against SDPA: same outputs and gradients, in float64 to rounding, causal
and with document masks.

The block sizes are shrunk in some cases so that a short sequence still spans several query
blocks and head chunks (including ragged last ones), the paths a real run takes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import model.attention as attention
from data.documents import document_ids
from model.attention import attention as dispatch
from model.attention import chunked_causal_attention, document_mask
from model.llama import LlamaArgs, Transformer


def _attend(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "head_dim", "rows", "elements"),
    [
        (4, 4, 64, 16, 128, 1 << 21),  # one block: all heads, all rows
        (4, 4, 50, 8, 16, 16 * 50),  # 4 query blocks (the last ragged), one head per chunk
        (6, 2, 37, 16, 8, 3 * 8 * 37),  # GQA, 5 query blocks, chunks of 3 heads over 12
        (3, 1, 19, 4, 4, 2 * 4 * 19),  # multi-query, head chunks that do not divide 6
    ],
)
def test_matches_sdpa_in_float64(monkeypatch, heads, kv_heads, seq, head_dim, rows, elements):
    monkeypatch.setattr(attention, "QUERY_ROWS", rows)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", elements)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, head_dim, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(2, kv_heads, seq, head_dim, generator=gen, dtype=torch.float64) for _ in "kv"
    )
    dout = torch.randn_like(q)
    got = _attend(chunked_causal_attention, q, k, v, dout)
    want = _attend(_sdpa, q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def _documents(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, seq) document ids of random layouts: an EOS (id 0 here) with probability 1/6."""
    tokens = torch.randint(0, 6, (batch, seq), generator=gen)
    tokens[0, :3] = 0  # documents of one token, at the window start
    return document_ids(tokens, eos_id=0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "rows", "elements"),
    [
        (4, 4, 64, 128, 1 << 21),  # one block per batch element
        (4, 4, 50, 16, 16 * 50),  # 4 query blocks (the last ragged), one head per chunk
        (6, 2, 37, 8, 4 * 8 * 37),  # GQA, chunks of 4 heads that do not divide 6
        (3, 1, 19, 4, 64 * 4 * 19),  # multi-query; a chunk would span batch elements: capped
    ],
)
def test_document_masked_chunked_matches_sdpa_mask_in_float64(
    monkeypatch, heads, kv_heads, seq, rows, elements
):
    """The chunked kernel with document ids (per-block id comparisons, keys before the
    block's first document skipped) = SDPA with the boolean mask: outputs and gradients."""
    monkeypatch.setattr(attention, "QUERY_ROWS", rows)
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", elements)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, heads, seq, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(3, kv_heads, seq, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    dout = torch.randn_like(q)
    ids = _documents(3, seq, gen)
    assert (ids[:, -1] >= 2).all()  # at least three documents in every row
    chunked = _attend(
        lambda *t: dispatch(*t, document_mask(ids, "chunked"), "chunked"), q, k, v, dout
    )
    sdpa = _attend(lambda *t: dispatch(*t, document_mask(ids, "sdpa"), "sdpa"), q, k, v, dout)
    causal = _attend(_sdpa, q, k, v, dout)
    for name, c, s, plain in zip(("out", "dq", "dk", "dv"), chunked, sdpa, causal, strict=True):
        torch.testing.assert_close(c, s, rtol=1e-10, atol=1e-12, msg=name)
        assert (c - plain).abs().max() > 0.1, name  # the mask is not the causal one


def test_document_mask_is_causal_within_documents():
    """SDPA's boolean mask: key j visible to query i iff j <= i in the same document."""
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = document_mask(ids, "sdpa")[0, 0]
    want = [[i >= j and ids[0, i] == ids[0, j] for j in range(6)] for i in range(6)]
    assert mask.tolist() == want
    assert document_mask(None, "sdpa") is None and document_mask(ids, "chunked") is ids


def test_bf16_error_is_sdpa_sized():
    """In bf16 both round; ours must not drift further from the float64 truth than SDPA's."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 4, 256, 16, generator=gen, dtype=torch.float64) for _ in "qkvd")
    truth = _attend(_sdpa, q, k, v, dout)
    bf16 = [t.bfloat16() for t in (q, k, v, dout)]
    ours = _attend(chunked_causal_attention, *bf16)
    sdpa = _attend(_sdpa, *bf16)
    for name, t, o, s in zip(("out", "dq", "dk", "dv"), truth, ours, sdpa, strict=True):
        err_ours = (o.double() - t).norm() / t.norm()
        err_sdpa = (s.double() - t).norm() / t.norm()
        assert err_ours < 2 * err_sdpa + 1e-3, f"{name}: {err_ours:.2e} vs SDPA {err_sdpa:.2e}"


def test_model_option_changes_only_the_kernel():
    """model.attention='chunked' gives the same logits and gradients as 'sdpa' (fp64)."""
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    results = []
    for impl in ("sdpa", "chunked"):
        model = Transformer(replace(args, attention=impl))
        model.init_weights(seed=0, rope_len=24)
        model.double()
        logits = model(tokens)
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    (sdpa_logits, sdpa_grads), (ours_logits, ours_grads) = results
    torch.testing.assert_close(ours_logits, sdpa_logits, rtol=1e-10, atol=1e-12)
    for ours, sdpa in zip(ours_grads, sdpa_grads, strict=True):
        torch.testing.assert_close(ours, sdpa, rtol=1e-9, atol=1e-12)


def test_compiles_without_graph_breaks():
    """compile.enabled compiles each block with fullgraph=True, so attention must trace whole
    (Dynamo's trace and AOTAutograd's: the backend that skips kernel generation)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 40, 8, generator=gen)
    k, v = (torch.randn(2, 2, 40, 8, generator=gen) for _ in "kv")
    dout = torch.randn_like(q)
    compiled = torch.compile(chunked_causal_attention, fullgraph=True, backend="aot_eager")
    got = _attend(compiled, q, k, v, dout)
    want = _attend(_sdpa, q, k, v, dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)


def test_custom_op_registration_is_consistent():
    """opcheck: schema, fake (meta) shapes and autograd registration agree with the kernels."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=gen, requires_grad=True) for _ in "qkv")
    torch.library.opcheck(attention._attention, (q, k, v, None, 0))
    # No double backward: the backward op is checked on inputs that do not require grad.
    q, k, v = (t.detach() for t in (q, k, v))
    out = attention._attention(q, k, v, None, 0)
    dout = torch.randn_like(out)
    torch.library.opcheck(attention._attention_backward, (dout, q, k, v, out, None, 0))
    ids = document_ids(torch.randint(0, 4, (1, 24), generator=gen), eos_id=0)
    torch.library.opcheck(attention._attention, (q.requires_grad_(), k, v, ids, 0))
    out = attention._attention(q.detach(), k, v, ids, 0)
    torch.library.opcheck(attention._attention_backward, (dout, q.detach(), k, v, out, ids, 0))
    # Context parallel's later chunk: the last 8 queries over all 24 keys.
    late = q.detach()[:, :, 16:].requires_grad_()
    torch.library.opcheck(attention._attention, (late, k, v, ids, 16))


def test_document_masked_layers_share_one_saved_mask():
    """On CPU SDPA, the document mask all layers save for backward is one float tensor: SDPA
    given a boolean mask would save a float copy of it in every layer (model/attention.py)."""
    seq, layers = 24, 3
    args = LlamaArgs(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=64)
    model = Transformer(replace(args, multiple_of=32, attention="sdpa"))
    model.init_weights(seed=0, rope_len=seq)
    tokens = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(3))
    ids = torch.arange(seq).repeat(2, 1) // 8  # three documents of 8 tokens per row
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = model(tokens, document_ids=ids)
    masks = {t.untyped_storage().data_ptr() for t in saved if t.shape[-2:] == (seq, seq)}
    assert len(masks) == 1, f"{len(masks)} (seq, seq) tensors saved over {layers} layers"
    logits.sum().backward()  # and the additive mask gives the same attention as the boolean one
    bool_mask = document_mask(ids, "sdpa")
    float_mask = document_mask(ids, "sdpa", torch.float32)
    q, k, v = (
        torch.randn(2, 4, seq, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)
    )
    ours, boolean = dispatch(q, k, v, float_mask, "sdpa"), dispatch(q, k, v, bool_mask, "sdpa")
    torch.testing.assert_close(ours, boolean, rtol=0, atol=0)


def _reference_varlen(q, k, v, cu_seqlens, max_len):
    """FlashAttention's varlen kernel (CUDA only) on CPU: each sequence of the packed (tokens,
    heads, head_dim) tensors, causal, through SDPA."""
    assert max_len >= int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    bounds = cu_seqlens.tolist()
    outs = [_sdpa(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)))[0].transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)]  # fmt: skip
    return torch.cat(outs)


def test_varlen_mask_cuts_each_row_into_its_documents():
    """A document per run of equal ids, a new one at each row: 2 + 3, then 1 + 2 + 2 tokens."""
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    mask = document_mask(ids, "varlen")
    assert mask.cu_seqlens.tolist() == [0, 2, 5, 6, 8, 10] and mask.max_len == 5
    assert mask.cu_seqlens.dtype == torch.int32
    same = torch.zeros(2, 4, dtype=torch.long)  # one document a row: still cut at the row
    assert document_mask(same, "varlen").cu_seqlens.tolist() == [0, 4, 8]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_varlen_packing_equals_the_document_mask_in_float64(monkeypatch, heads, kv_heads):
    """model.attention='varlen' packs (batch, heads, seq, head_dim) into the kernel's (tokens,
    heads, head_dim) and back: with the kernel's math on CPU, the outputs and gradients of SDPA
    with the document mask, GQA included."""
    monkeypatch.setattr(attention, "_varlen_kernel", lambda: _reference_varlen)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, heads, 40, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(3, kv_heads, 40, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    dout = torch.randn_like(q)
    ids = _documents(3, 40, gen)
    varlen = _attend(lambda *t: dispatch(*t, document_mask(ids, "varlen"), "varlen"), q, k, v, dout)
    sdpa = _attend(lambda *t: dispatch(*t, document_mask(ids, "sdpa"), "sdpa"), q, k, v, dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), varlen, sdpa, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_varlen_is_refused_where_it_cannot_run():
    """On CPU, and under context parallel, model.attention='varlen' is one config line."""
    from configs import ConfigError
    from model.attention import check_attention

    check_attention("varlen", on_gpu=True, cp=1)
    check_attention("sdpa", on_gpu=False, cp=2)
    with pytest.raises(ConfigError, match="needs a CUDA device: on CPU use 'sdpa'"):
        check_attention("varlen", on_gpu=False, cp=1)
    with pytest.raises(ConfigError, match="'varlen' with parallel.cp > 1"):
        check_attention("varlen", on_gpu=True, cp=2)
