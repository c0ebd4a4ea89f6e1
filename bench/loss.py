"""The loss at a real vocabulary: eager vs compiled cross-entropy (`compile.loss`).

    python bench/loss.py                         # 1B's shape: 2048 tokens x vocab 128,256, bf16
    python bench/loss.py --tokens 8192 --device cuda
    python bench/loss.py --tokens 32768 --variants chunked --chunk-tokens 4096   # loss chunks

The trainer's loss upcasts the compute-dtype logits to float32 for a stable log-softmax. Eager,
that stores a float32 copy of the (tokens x vocab) logits, the float32 log-softmax for backward
and a float32 gradient before the cast back; compiled (`compile.enabled` with `compile.loss`,
the default), Inductor fuses upcast, log-softmax and NLL into kernels that read the bf16 logits
and write a bf16 gradient. Each variant runs in its own process, forward + backward of the loss
alone on given logits; reported: median seconds per call after warm-up (compilation included in
warm-up) and the peak memory above what is held between calls (the logits, their gradient,
the targets; CPU: peak RSS after a reset of the high-water mark; GPU: peak allocated).

`whole` and `chunked` start one step earlier, from the final hidden states (tokens x
--hidden-dim, bf16) and a bf16 output projection (vocab x hidden-dim): `whole` projects all
tokens and takes the eager loss, as `train.loss_chunk_tokens=0` does; `chunked` is the trainer's
`ChunkedLoss` (parallel/loss.py) with --chunk-tokens. What is held between calls is then the
hidden states and the weight; the logits and all gradients are part of the peak. The hidden
size only sets the matmuls' cost (the logits' size does not depend on it): keep it small on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(variant: str, a: argparse.Namespace) -> dict:
    import torch

    from parallel.compile import CompileConfig, compile_loss
    from parallel.loss import ChunkedLoss
    from train import cross_entropy_sum

    torch.manual_seed(0)
    tokens, vocab, device, iters = a.tokens, a.vocab, a.device, a.iters
    targets = torch.randint(0, vocab, (1, tokens), device=device)
    if variant in ("whole", "chunked"):  # from the hidden states: projection + loss
        bf16 = {"device": device, "dtype": torch.bfloat16}
        inputs = torch.randn(1, tokens, a.hidden_dim, **bf16).requires_grad_()
        output = torch.nn.Linear(a.hidden_dim, vocab, bias=False, **bf16)
        held = [inputs, output.weight]
        if variant == "chunked":
            fn = ChunkedLoss(output, a.chunk_tokens, cross_entropy_sum)
        else:
            fn = lambda h, t: cross_entropy_sum(output(h), t)  # noqa: E731
    else:  # from given logits: the loss alone
        inputs = torch.randn(1, tokens, vocab, device=device).to(torch.bfloat16).requires_grad_()
        held = [inputs]
        fn = compile_loss(cross_entropy_sum, CompileConfig(enabled=variant == "compiled"))

    def step() -> None:
        for t in held:
            t.grad = None
        fn(inputs, targets).backward()

    if a.warmup:
        step()  # warm-up (and compilation)
    for t in held:
        t.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # reset the peak RSS (Linux: VmHWM), so compilation's own memory is not counted
        Path("/proc/self/clear_refs").write_text("5")
        base = _status_kib("VmRSS") * 1024
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _status_kib("VmHWM") * 1024 - base
    return {"variant": variant, "s_per_call": statistics.median(times), "peak_bytes": peak,
            "base_bytes": base}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["eager", "compiled"],
                   choices=["eager", "compiled", "whole", "chunked"])  # fmt: skip
    p.add_argument("--hidden-dim", type=int, default=64, help="whole, chunked: hidden size")
    p.add_argument("--chunk-tokens", type=int, default=4096, help="chunked: tokens per chunk")
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="measure the first call (at long sequences, to save a call's time)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(a.child, a)))
        return 0
    logits_gib = a.tokens * a.vocab * 2 / 2**30
    print(f"loss forward+backward, {a.tokens} tokens x vocab {a.vocab:,} "
          f"(bf16 logits {logits_gib:.2f} GiB), {a.device}")  # fmt: skip
    print("| variant | s per call | peak memory above the inputs, gradients included |")
    print("|---|---|---|")
    argv = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
            ("tokens", "vocab", "device", "iters", "hidden_dim", "chunk_tokens")]  # fmt: skip
    argv += [] if a.warmup else ["--no-warmup"]
    for variant in a.variants:
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, *argv],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        r = json.loads(out.strip().splitlines()[-1])
        name = f"chunked by {a.chunk_tokens}" if variant == "chunked" else variant
        print(f"| {name} | {r['s_per_call']:.3f} | {r['peak_bytes'] / 2**30:.2f} GiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
