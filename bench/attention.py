"""Causal attention forward+backward on one CPU thread: SDPA against model/attention.py.

    python bench/attention.py            # ~3 minutes on 2 cores; keep the machine idle
    python bench/attention.py --documents   # causal vs document masks, debug shapes, bf16

For each shape and dtype, the median of --repeats timed forward+backward passes (after two
warm-up passes) of `F.scaled_dot_product_attention(is_causal=True)` and of
`chunked_causal_attention`, on the same inputs. Prints a Markdown table.

`--documents`: for the debug model's shapes in bf16, each kernel causal against the same
kernel with a document mask (`model.attention.attention`, as the model calls it) of windows
holding 1 document (the usual window of the stdlib corpus at seq 512) or 4 equal ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.attention import attention, chunked_causal_attention, document_mask  # noqa: E402

# (batch, heads, seq, head_dim): the debug model at the debug config's and the torchtitan
# comparison's sequence lengths, then head_dim 64 (GPT-2-small-like) at three lengths.
SHAPES = [(4, 16, 256, 16), (8, 16, 512, 16), (4, 12, 256, 64), (1, 12, 1024, 64), (2, 8, 2048, 64)]

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_fwd_bwd(fn: Attention, shape: tuple[int, ...], dtype: torch.dtype, repeats: int) -> float:
    """Median milliseconds of one forward+backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in "qkv")
    dout = torch.randn(shape, generator=gen).to(dtype)
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        fn(q, k, v).backward(dout)
        if i >= 2:  # the first passes grow the allocator's pools
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def documents(repeats: int) -> None:
    """Causal against document-masked attention, per kernel, at the debug shapes in bf16."""
    print("| batch x heads x seq x head_dim | kernel | documents per window | causal ms | "
          "document ms | document / causal |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for shape in SHAPES[:2]:
        batch, _, seq, _ = shape
        for kernel in ("sdpa", "chunked"):
            causal = time_fwd_bwd(partial(attention, mask=None, impl=kernel), shape, torch.bfloat16,
                                  repeats)  # fmt: skip
            for n_docs in (1, 4):
                ids = (torch.arange(seq) * n_docs // seq).int().expand(batch, seq)
                mask = document_mask(ids, kernel)
                fn = partial(attention, mask=mask, impl=kernel)
                ms = time_fwd_bwd(fn, shape, torch.bfloat16, repeats)
                name = " x ".join(map(str, shape))
                print(f"| {name} | {kernel} | {n_docs} | {causal:.1f} | {ms:.1f} | "
                      f"{ms / causal:.2f} |", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--documents", action="store_true", help="causal vs document masks")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as one rank of the 2-rank runs gets
    if args.documents:
        documents(args.repeats)
        return 0
    print("| batch x heads x seq x head_dim | dtype | SDPA ms | chunked ms | speed-up |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            ref = time_fwd_bwd(sdpa, shape, dtype, args.repeats)
            ours = time_fwd_bwd(chunked_causal_attention, shape, dtype, args.repeats)
            name = " x ".join(map(str, shape))
            dt = str(dtype).removeprefix("torch.")
            print(f"| {name} | {dt} | {ref:.1f} | {ours:.1f} | {ref / ours:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
