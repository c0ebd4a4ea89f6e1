"""The GPU benchmarks the issues ask for, on one GPU, in one command.

    python bench/gpu.py                 # both suites, ~15 min on one H100
    python bench/gpu.py --suite 1b      # 1B: bf16 eager, compile, compile + AC, compile + fp8
    python bench/gpu.py --suite fp8     # 8B-shaped layers: fp8 vs bf16, eager and compiled
    python bench/gpu.py --suite 8b-blocks --profile   # 8 8B blocks, vocab 2048, with a profile
    python bench/gpu.py --suite documents   # 1B at 8k: document masking (flex) vs causal
    python bench/gpu.py --suite finetune    # 1B at 8k: full vs half frozen vs LoRA rank 16
    python bench/gpu.py --suite moe     # 4 layers of Qwen3-30B-A3B: eager, compile, EP's regions
    python bench/gpu.py --suite cp      # 2+ GPUs: 1B at 32k and 64k, cp = GPUs, chunked loss
    python bench/gpu.py --suite pp      # 2+ GPUs: 1B at 8k, pp = GPUs: schedules against FSDP
    python bench/gpu.py --suite muon    # 1B at 8k: AdamW vs Muon (bf16 and fp32 Newton-Schulz)
    python bench/gpu.py --suite loss    # 1B at 8k, vocab 128,256: the whole loss vs chunks of 4096
    python bench/gpu.py --suite lora-fp8    # 1B LoRA rank 16 at vocab 2048: bf16 vs fp8
    python bench/gpu.py --suite documents loss --cases 'causal|chunked' --budget-s 300
    python bench/gpu.py --smoke         # the debug model on any device: checks the harness only

Several suites run in the order given. `--cases REGEX` keeps the cases whose "suite: case" name
it matches. A case whose command (less its run name) equals one already run in this invocation
is not run again: its row repeats that result (several suites share the 1B compiled baseline).
Each case runs under a time limit (`--case-timeout`), and `--budget-s` bounds the whole
command: a case that would start with less than `--min-case-s` left is skipped, so a lease's
one call ends in time with every finished case's numbers.

`--profile` has each case profile its last step with the trainer's own
`--metrics.profile_step` and prints where that step's time went, from the Chrome trace the
trainer writes: GEMM, attention, copies (memcpy, casts, FSDP's copy-in/out), Triton (Inductor's
kernels), collectives and other, each as time and share of the step's span, with the busy time
(any kernel running) against the span. On CPU the trace has no kernels: CPU ops are grouped by
self time instead, which is what `--smoke --profile` checks.

Every case is `python train.py` on one process (FSDP2 on a one-rank mesh, as always), except
the cp suite's, which run under torchrun, one rank per visible GPU; each with the trainer's
own metrics. This script parses rank 0's `step N ... tok/s X ... tflops/dev Y ... mem Z`
lines (tok/s of all ranks, TFLOP/s and memory of one GPU) after warm-up (compilation
included in warm-up) and takes medians. MFU is
reported against the device's dense **bf16** peak for every case, fp8 included, so the
columns compare (the trainer's own log line uses the fp8 peak for fp8 runs).

On the project's GPU machine (torch 2.11, no torchdata or torchao), carry the two wheels
(see bench/README.md) and start the command with the pip line given there.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from throughput import machine_facts, number  # noqa: E402  (bench/ is sys.path[0])

COMMON = [
    "--data.path=outputs/data/stdlib", "--parallel.param_dtype=bfloat16",
    "--parallel.reduce_dtype=float32", "--train.eval_interval=0",
    "--metrics.tensorboard=false", "--checkpoint.interval=0", "--checkpoint.resume=none",
]  # fmt: skip
# torchtitan's Llama 3 benchmarks use 8k-token sequences, one per GPU and step.
SEQ = ["--data.seq_len=8192", "--train.micro_batch_size=1", "--train.global_batch_size=1"]
COMPILE = ["--compile.enabled=true"]
GRAPH_FSDP = "--compile.fsdp=graph"
# The pipeline suites' model: the 1B flavor, 16 micro-batches of one 8k sequence a step.
PP_MODEL = ["--model.flavor=1B", *SEQ, "--train.micro_batch_size=1", "--train.global_batch_size=16"]
# The tied embedding and blocks 0-5 of the 1B flavor: 628M of its 1.24B parameters.
HALF_1B = "tok_embeddings.*,layers.[0-5].*"
FP8 = ["--fp8.enabled=true"]
CHUNKED_LOSS = ["--train.loss_chunk_tokens=4096"]
LORA_16 = ["--lora.enabled=true", "--lora.rank=16"]
SUITES = {
    # Issue "scale and speed": target >= 45% MFU for bf16 + compile.
    "1b": {
        "model": ["--model.flavor=1B", *SEQ],
        "cases": {
            "bf16 eager": [],
            "bf16 compile": COMPILE,
            "bf16 compile + selective AC (every 2nd block)": [*COMPILE, "--ac.mode=selective"],
            "bf16 compile + op-level AC": [*COMPILE, "--ac.mode=op"],
            "fp8 compile": [*COMPILE, *FP8],
        },
    },
    # Issue "GPU speed": the transformer blocks of 8B without its 128k vocabulary, whose output
    # projection would dominate a few-layer model; per-block compile, no AC, as torchtitan runs.
    "8b-blocks": {
        "model": ["--model.flavor=8B", "--model.n_layers=8", "--model.vocab_size=2048", *SEQ],
        "cases": {"bf16 compile": COMPILE, "fp8 compile": [*COMPILE, *FP8]},
    },
    # Issue "FP8": 8B-shaped layers, fewer of them so one GPU holds the model and its states.
    # Target >= 1.30x for fp8 + compile over bf16 + compile.
    "fp8": {
        "model": ["--model.flavor=8B", "--model.n_layers=4", *SEQ],
        "cases": {
            "bf16 eager": [],
            "fp8 eager": FP8,
            "bf16 compile": COMPILE,
            "fp8 compile": [*COMPILE, *FP8],
        },
    },
    # Issue #18 (data for pretraining), document masking: the 1B flavor's 8k-token windows of
    # the stdlib corpus (mean document ~18k tokens, median ~6.5k: a window holds a few), causal
    # SDPA against compiled FlexAttention with the windows' block masks. Target: document
    # masking at most 3% slower than causal.
    "documents": {
        "model": ["--model.flavor=1B", *SEQ],
        "baseline": "bf16 compile causal",
        "cases": {
            "bf16 compile causal": COMPILE,
            "bf16 compile document": [*COMPILE, "--data.attention_mask=document"],
            # Issue 59, lever 1: FlashAttention's varlen kernel on the packed documents.
            "bf16 compile document varlen": [
                *COMPILE,
                "--data.attention_mask=document",
                "--model.attention=varlen",
            ],
        },
        # --smoke runs on CPU, where varlen is refused: the harness is checked with SDPA.
        "smoke": ["--model.attention=sdpa"],
    },
    # Issue #19 (fine-tuning): the 1B flavor at 8k tokens, compiled, in three variants of the
    # same shape: full training, half the parameters frozen (the tied embedding and blocks 0-5:
    # 628M of 1.24B) and LoRA rank 16 on the attention projections (lora.targets' default).
    # tok/s and peak memory against full training.
    "finetune": {
        "model": ["--model.flavor=1B", *SEQ],
        "baseline": "bf16 compile full",
        "cases": {
            "bf16 compile full": COMPILE,
            "bf16 compile half frozen": [*COMPILE, f"--train.freeze={HALF_1B}"],
            "bf16 compile lora 16": [*COMPILE, *LORA_16],
        },
    },
    # Issue #20 (mixture of experts): Qwen3-30B-A3B's layers (dim 2048, 32 query / 4 kv heads,
    # 128 experts of hidden 768, top 8) and vocabulary, 4 of its 48 layers so one H100 holds
    # the model and its fp32 state (the planner: ~62 GiB). The experts run as torch._grouped_mm
    # (bf16); compiled blocks keep it as an opaque custom op. MFU counts active parameters.
    # "regions": the blocks compiled as expert parallel compiles them (parallel/ep.py: norms,
    # attention, router and the experts' compute as graphs, sort and combine eager), at ep 1.
    "moe": {
        "model": [
            "--model.name=qwen3_moe",
            "--model.flavor=30B-A3B",
            "--model.n_layers=4",
            *SEQ,
        ],  # fmt: skip
        "smoke": ["--model.name=qwen3_moe"],
        "baseline": "bf16 eager",
        "cases": {
            "bf16 eager": [],
            "bf16 compile": COMPILE,
            "bf16 compile regions (EP's)": [*COMPILE, "--compile.moe_regions=true"],
        },
    },
    # Issue #31 (Muon): the 1B flavor at 8k tokens, compiled, AdamW against Muon on the blocks'
    # matrices (Newton-Schulz in bfloat16, torch's, and in float32). On one GPU no matrix
    # travels: the difference is the Newton-Schulz matmuls (5 iterations of 3 GEMMs per matrix
    # a step). MFU counts the model's FLOPs only, so Muon's show as a lower MFU.
    "muon": {
        "model": ["--model.flavor=1B", *SEQ],
        "baseline": "bf16 compile adamw",
        "cases": {
            "bf16 compile adamw": COMPILE,
            "bf16 compile muon": [*COMPILE, "--optim.name=muon"],
            "bf16 compile muon fp32 ns": [
                *COMPILE,
                "--optim.name=muon",
                "--optim.muon.ns_dtype=float32",
            ],
        },  # fmt: skip
    },
    # Issue #45 (GPU), the chunked loss (`train.loss_chunk_tokens`) at one GPU: the 1B flavor's
    # own vocabulary of 128,256 at 8k tokens, where the whole loss's logits are 8192 x 128,256
    # (3.9 GiB in fp32 per copy). Peak memory and tok/s against the whole loss, both compiled.
    "loss": {
        "model": ["--model.flavor=1B", *SEQ],
        "baseline": "bf16 compile whole loss",
        "cases": {
            "bf16 compile whole loss": COMPILE,
            "bf16 compile chunked loss": [*COMPILE, *CHUNKED_LOSS],
        },
    },
    # Issue #45 (GPU): LoRA with fp8 against LoRA in bf16. Vocab 2048, so that the blocks (where
    # fp8 applies) and not the output layer decide; the base weights are frozen, so fp8 speeds
    # up only the forward and input-gradient GEMMs and still pays every cast.
    "lora-fp8": {
        "model": ["--model.flavor=1B", "--model.vocab_size=2048", *SEQ],
        "baseline": "bf16 compile lora 16",
        "cases": {
            "bf16 compile lora 16": [*COMPILE, *LORA_16],
            "fp8 compile lora 16": [*COMPILE, *LORA_16, *FP8],
        },
    },
    # Issue #41 (the compiler owns FSDP's collectives): 8B-shaped blocks x 8, vocab 2048 (the
    # side-by-side harness's ours-8b8 shape) on one GPU at dp_shard 1, per-block compile with
    # FSDP2's hooks against the whole model compiled with its casts (compile.fsdp="graph"):
    # FSDP2's copy-in, casts and gradient copies (13.4 ms a step on one H200) become fused
    # casts in the graph. Targets: >= 1.05x torchtitan's bf16 tok/s, reserved memory at most
    # torchtitan's (measure both in ../shared/titan-side-by-side: OURS_X="--compile.fsdp=graph").
    "graph-fsdp": {
        "model": ["--model.flavor=8B", "--model.n_layers=8", "--model.vocab_size=2048", *SEQ],
        "baseline": "bf16 compile",
        "cases": {
            "bf16 compile": COMPILE,
            "bf16 compile graph": [*COMPILE, "--compile.fsdp=graph"],
            # Issue 59, lever 4: the graph's kernels launched as CUDA graphs (host gaps).
            "bf16 compile graph cudagraphs": [
                *COMPILE,
                "--compile.fsdp=graph",
                "--compile.cudagraphs=true",
            ],
        },
        # --smoke runs on CPU, where CUDA graphs are refused: the harness runs without them.
        "smoke": ["--compile.cudagraphs=false"],
    },
    # Issue #56 (compile.fsdp="graph" composed): tensor parallel and pipeline stages need 2 or
    # more GPUs (one rank per GPU, all of them on tp, or on pp); the graph against per-block
    # compile with FSDP2's hooks on the same mesh, bf16 and fp8 (fp8 with the graph on one GPU
    # is bench/gpu_lease.sh part1's ours-8b8-fp8-x). Targets: the graph's tok/s at least the
    # hooks', its reserved memory below theirs (as at dp_shard 1 without tp: -4.4 GiB).
    "graph-tp": {
        "model": ["--model.flavor=8B", "--model.n_layers=8", "--model.vocab_size=2048", *SEQ],
        "all_gpus": True,
        "split": "--parallel.tp",
        "baseline": "bf16 compile tp",
        "cases": {
            "bf16 compile tp": COMPILE,
            "bf16 compile tp graph": [*COMPILE, "--compile.fsdp=graph"],
            "fp8 compile tp": [*COMPILE, *FP8],
            "fp8 compile tp graph": [*COMPILE, *FP8, "--compile.fsdp=graph"],
        },
    },
    "graph-pp": {
        "model": PP_MODEL,
        "all_gpus": True,
        "split": "--parallel.pp",
        "baseline": "bf16 compile 1f1b",
        "cases": {  # compile in each case: --smoke drops the suite's model flags
            "bf16 compile 1f1b": [*COMPILE, "--parallel.pipeline.schedule=1f1b"],
            "bf16 compile 1f1b graph": [*COMPILE, "--parallel.pipeline.schedule=1f1b", GRAPH_FSDP],
            "bf16 compile interleaved 1f1b graph": [
                *COMPILE,
                "--parallel.pipeline.schedule=interleaved_1f1b",
                GRAPH_FSDP,
            ],
        },
        "smoke": ["--train.micro_batch_size=1", "--train.global_batch_size=4"],
    },
    # Issue #34 (context parallel): one sequence of 32k or 64k tokens per step split over all
    # the visible GPUs (parallel.cp = GPUs, one data-parallel rank; FSDP over the cp ranks), the
    # 1B flavor at its vocabulary of 128,256, compiled, full AC, without and with the chunked
    # loss. Per GPU at cp 2 the planner counts 20.5 and 14.6 GiB at 32k, 31.0 and 17.3 GiB at
    # 64k (the compiled loss's logits: 7.8 and 15.7 GiB whole, 2.0 in chunks of 4096); without
    # AC, 64k at cp 2 would need 81 GiB. "all_gpus": one rank per GPU under torchrun, and the
    # suite is refused below 2 GPUs.
    "cp": {
        "model": ["--model.flavor=1B", *SEQ, *COMPILE, "--ac.mode=full"],
        "all_gpus": True,
        "baseline": "bf16 compile 32k",
        "cases": {
            "bf16 compile 32k": ["--data.seq_len=32768"],
            "bf16 compile 32k chunked loss": ["--data.seq_len=32768", *CHUNKED_LOSS],
            "bf16 compile 64k": ["--data.seq_len=65536"],
            "bf16 compile 64k chunked loss": ["--data.seq_len=65536", *CHUNKED_LOSS],
        },
    },
    # Issue #42 (pipeline parallel): the 1B flavor at 8k in bf16 with 16 micro-batches of one
    # sequence per step, cut into pp = GPUs stages ("split"), each schedule against FSDP over the
    # same GPUs at the same global batch (pp 1, the case's own setting wins). Eager: the
    # zero-bubble schedules refuse compiled blocks.
    "pp": {
        "model": PP_MODEL,
        "all_gpus": True,
        "split": "--parallel.pp",
        "baseline": "bf16 fsdp",
        "cases": {
            "bf16 fsdp": ["--parallel.pp=1"],
            "bf16 1f1b": ["--parallel.pipeline.schedule=1f1b"],
            "bf16 interleaved 1f1b": ["--parallel.pipeline.schedule=interleaved_1f1b"],
            "bf16 zbv": ["--parallel.pipeline.schedule=zbv"],
        },
        # --smoke on 2 ranks: micro-batches of one, four per step (ZBV needs 2 x pp).
        "smoke": ["--train.micro_batch_size=1", "--train.global_batch_size=4"],
    },
}
SMOKE_MODEL = ["--model.flavor=debug", "--data.seq_len=128", "--train.micro_batch_size=2"]
SMOKE_MODEL += ["--train.global_batch_size=2"]
FIELDS = {  # log-line field -> key; the trainer prints e.g. `tok/s 1,234  tflops/dev 412.30`
    "tok/s": "tok_s",
    "tflops/dev": "tflops",
    "mem": "mem_gib",
    "rss": "mem_gib",
}
STEP_LINE = re.compile(r"\bstep (\d+)(?:/\d+)?\s+loss\s.*\btok/s\s")  # "step 3/40  loss ..."


def parse_steps(log: str, warmup: int, until: int | None = None) -> dict[str, list[float]]:
    """Samples after warm-up, up to (not including) the interval that ends at step `until`."""
    samples: dict[str, list[float]] = {}
    for line in log.splitlines():
        m = STEP_LINE.search(line)
        if not m or int(m.group(1)) <= warmup or (until and int(m.group(1)) >= until):
            continue
        for field, key in FIELDS.items():
            if f := re.search(rf"(?:^|\s){re.escape(field)} ([\d,.]+)", line):
                samples.setdefault(key, []).append(number(f.group(1)))
    return samples


def bf16_peak() -> float | None:
    import torch

    from launch.metrics import peak_tflops

    if not torch.cuda.is_available():
        return None
    return peak_tflops(torch.device("cuda", 0), "bf16", None)


GROUPS = ["GEMM", "attention", "copies", "Triton", "collectives", "other"]
_PATTERNS = [  # first match wins; names lower-cased
    # Inductor's generated kernels: Triton on GPU; on CPU its C++ runs inside the compiled
    # function's own time.
    ("Triton", ("triton", "cpp_fused", "compiledfunction", "torch-compiled region")),
    ("collectives", ("nccl", "c10d::", "all_gather", "allgather", "reduce_scatter",
                     "allreduce", "all_reduce", "record_param_comms")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("GEMM", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "scaled_mm",
              "mkldnn", "onednn")),
    ("copies", ("memcpy", "memset", "copy", "aten::cat", "chunk_cat", "split_with_sizes")),
]  # fmt: skip


def kernel_group(name: str) -> str | None:
    n = name.lower()
    return next((group for group, keys in _PATTERNS if any(k in n for k in keys)), None)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def kernel_groups(trace: dict) -> dict:
    """Where a profiled step's time went: {"source", "span_ms", "busy_ms", "groups": {group:
    {"ms", "count"}}}. With device events (CUDA kernels, memcpy, memset), each group's time
    is the union of its kernels' intervals (streams may overlap). Without them (a CPU run),
    CPU ops by self time: each op's own time outside its child ops, in the group of the op or,
    if it matches none, of its nearest enclosing op that does (attention claims everything
    inside it, so the batched matmuls of a math-path SDPA count as attention)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    chosen = device or [e for e in events if e.get("cat") == "cpu_op"]
    groups = {g: {"ms": 0.0, "count": 0} for g in GROUPS}
    if not chosen:
        return {"source": "none", "span_ms": 0.0, "busy_ms": 0.0, "groups": groups}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in chosen]
    if device:
        named = [
            (kernel_group(e["name"]) or "other", sp) for e, sp in zip(chosen, spans, strict=True)
        ]
        for group in GROUPS:
            mine = [sp for g, sp in named if g == group]
            groups[group] = {"ms": _union_us(mine) / 1e3, "count": len(mine)}
    else:
        for group, self_us in _cpu_self_times(chosen):
            groups[group]["ms"] += self_us / 1e3
            groups[group]["count"] += 1
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    return {
        "source": "device kernels" if device else "CPU ops (self time)",
        "span_ms": (stop - start) / 1e3,
        "busy_ms": _union_us(spans) / 1e3,
        "groups": groups,
    }


def _cpu_self_times(ops: list[dict]) -> list[tuple[str, float]]:
    """(group, self time in us) of each CPU op, nesting read per thread from the intervals."""
    out: list[tuple[str, float]] = []
    by_thread: dict[tuple, list[dict]] = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [end, group, own time left]
        for e in thread:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                out.append((stack[-1][1], stack.pop()[2]))
            parent = stack[-1][1] if stack else None
            own = kernel_group(e["name"])
            group = "attention" if parent == "attention" else own or parent or "other"
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, group, dur])
        out += [(group, left) for _, group, left in stack]
    return out


def profile_table(profile: dict) -> list[str]:
    span = profile["span_ms"] or 1.0
    lines = [f"time by kernel group ({profile['source']}), profiled step span "
             f"{profile['span_ms']:.1f} ms:", "", "| group | count | ms | % of span |",
             "|---|---|---|---|"]  # fmt: skip
    for group, row in profile["groups"].items():
        lines.append(
            f"| {group} | {row['count']} | {row['ms']:.2f} | {100 * row['ms'] / span:.1f}% |"
        )
    lines.append(f"| busy (any running) | | {profile['busy_ms']:.2f} | "
                 f"{100 * profile['busy_ms'] / span:.1f}% |")  # fmt: skip
    return lines


def run_case(
    suite: str,
    name: str,
    args: list[str],
    opts: argparse.Namespace,
    ranks: int = 1,
    timeout_s: float | None = None,
) -> dict:
    label = re.sub(r"[^a-z0-9]+", "-", f"{suite} {name}".lower()).strip("-")
    cmd = [sys.executable, "train.py"]
    if ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += [*COMMON, *args, f"--train.steps={opts.steps}"]
    cmd += [f"--metrics.warmup_steps={opts.warmup}", f"--metrics.log_interval={opts.interval}"]
    cmd += [f"--run.output_dir={opts.out.parent / 'runs'}", f"--run.name={label}"]
    if opts.profile:  # the last step, left out of the throughput samples
        cmd.append(f"--metrics.profile_step={opts.steps}")
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, check=False, timeout=timeout_s
        )
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # a hang or a slow compile costs only its own case
        out = [b.decode(errors="replace") if isinstance(b, bytes) else b or "" for b in
               (e.stdout, e.stderr)]  # fmt: skip
        log, rc = "".join(out) + f"\nError: case timed out after {timeout_s:.0f} s", -9
    (opts.out.parent / f"{label}.log").write_text(log)
    result = {"suite": suite, "case": name, "command": shlex.join(cmd[1:]), "ok": False}
    result["ranks"] = ranks
    result["wall_s"] = round(time.perf_counter() - start, 1)
    if rc != 0:
        # One case failing (fp8 on an old GPU, compile on an odd toolchain) must not cost
        # the others: record the error line and go on.
        result["error"] = next(
            (ln for ln in reversed(log.splitlines()) if "Error" in ln), log[-300:]
        )
        print(f"  {label}: FAILED ({result['error']})", file=sys.stderr)
        return result
    samples = parse_steps(log, opts.warmup, opts.steps if opts.profile else None)
    if "tok_s" not in samples:
        result["error"] = "no step line after warm-up: add --steps"
        return result
    result |= {k: statistics.median(v) for k, v in samples.items()} | {"ok": True}
    result["samples"] = len(samples["tok_s"])
    if opts.peak and "tflops" in result:
        result["mfu_bf16_pct"] = 100 * result["tflops"] / opts.peak
    print(f"  {label}: {result['tok_s']:,.0f} tok/s", file=sys.stderr)
    if opts.profile:
        trace = opts.out.parent / "runs" / label / "profile" / f"step{opts.steps}_rank0.json"
        result["profile"] = kernel_groups(json.loads(trace.read_text()))
    return result


def markdown(report: dict) -> str:
    lines = [f"device: {report['device']}, bf16 peak {report['peak_tflops']} TFLOP/s"]
    for suite in dict.fromkeys(r["suite"] for r in report["results"]):
        rows = [r for r in report["results"] if r["suite"] == suite]
        lines += ["", f"### {suite}", "", "| case | tok/s | TFLOP/s | MFU (bf16 peak) | "
                  "peak memory GiB | vs baseline |", "|---|---|---|---|---|---|"]  # fmt: skip
        by_name = {r["case"]: r for r in rows if r["ok"]}
        for r in rows:
            if not r["ok"]:
                lines.append(f"| {r['case']} | failed: {r['error'][:80]} | | | | |")
                continue
            # The suite's baseline case, or else the bf16 case of the same mode (fp8 rows).
            baseline = SUITES.get(suite, {}).get("baseline")
            base = by_name.get(baseline or r["case"].replace("fp8", "bf16", 1))
            ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base and base is not r else ""
            mfu = f"{r['mfu_bf16_pct']:.1f}%" if "mfu_bf16_pct" in r else "-"
            split = SUITES.get(r["suite"], {}).get("split", "--parallel.cp").split(".")[-1]
            case = r["case"] + (f" ({split} {r['ranks']})" if r.get("ranks", 1) > 1 else "")
            case += f" (= {r['same_as']})" if "same_as" in r else ""
            lines.append(
                f"| {case} | {r['tok_s']:,.0f} | {r.get('tflops', 0):.1f} | {mfu} | "
                f"{r.get('mem_gib', 0):.2f} | {ratio} |"
            )
        for r in rows:
            if r.get("profile") and "same_as" not in r:
                lines += ["", f"#### {r['case']}", "", *profile_table(r["profile"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", nargs="+", choices=[*SUITES, "all"], default=["all"])
    p.add_argument("--cases", default="", help='regex over "suite: case" names to keep')
    p.add_argument("--case-timeout", type=float, default=900, help="seconds a case may run")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for the whole command")
    p.add_argument("--min-case-s", type=float, default=60, help="skip a case with less left")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=15, help="steps left out (compile included)")
    p.add_argument("--interval", type=int, default=5, help="steps per logged sample")
    p.add_argument("--smoke", action="store_true", help="debug model, 4 steps: harness check")
    p.add_argument(
        "--profile", action="store_true", help="profile each case's last step: time by kernel group"
    )
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/gpu/gpu.json")
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.steps, opts.warmup, opts.interval = 4, 2, 1
    began = time.perf_counter()
    import torch

    gpus = torch.cuda.device_count()
    suites = list(SUITES) if "all" in opts.suite else list(dict.fromkeys(opts.suite))
    # A multi-rank suite takes every GPU (the smoke: 2 ranks, gloo on CPU); it needs two.
    ranks = {s: (2 if opts.smoke else gpus) if SUITES[s].get("all_gpus") else 1 for s in suites}
    for suite in [s for s in suites if ranks[s] < 2 and SUITES[s].get("all_gpus")]:
        refusal = f"bench/gpu.py --suite {suite} needs 2 or more GPUs; {gpus} visible"
        if opts.suite == [suite]:
            sys.exit(refusal)
        print(f"{refusal}: skipped", file=sys.stderr)
        suites.remove(suite)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    if not (REPO / "outputs/data/stdlib").exists():
        subprocess.run([sys.executable, "-m", "data.prepare"], cwd=REPO, check=True)
    opts.peak = bf16_peak()
    report = {
        "machine": machine_facts(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "peak_tflops": opts.peak,
        "smoke": opts.smoke,
        "results": [],
    }
    done: dict[tuple, dict] = {}  # (arguments, ranks) -> the result of that command
    for suite in suites:
        # --smoke: the family's debug flavor (a suite may name its family), after the case's
        # own arguments so that its short sequences win over a case's sequence length.
        smoke = [*SMOKE_MODEL, *SUITES[suite].get("smoke", [])]
        model = [] if opts.smoke else SUITES[suite]["model"]
        # The split over all GPUs: cp by default, or the suite's own dimension (pp); a case's
        # own setting of it comes after, and wins.
        dim = SUITES[suite].get("split", "--parallel.cp")
        split = [f"{dim}={ranks[suite]}"] if SUITES[suite].get("all_gpus") else []
        for name, args in SUITES[suite]["cases"].items():
            if opts.cases and not re.search(opts.cases, f"{suite}: {name}"):
                continue
            args = [*model, *split, *args, *(smoke if opts.smoke else [])]
            key = (tuple(args), ranks[suite])
            if same := done.get(key):  # the same command already ran: its numbers, not a rerun
                report["results"].append(
                    same
                    | {"suite": suite, "case": name, "same_as": f"{same['suite']}: {same['case']}"}
                )
                continue
            left = opts.budget_s - (time.perf_counter() - began) if opts.budget_s else math.inf
            if left < opts.min_case_s:
                print(f"  {suite}: {name}: SKIPPED, {left:.0f} s of budget left", file=sys.stderr)
                report["results"].append(
                    {
                        "suite": suite,
                        "case": name,
                        "ok": False,
                        "error": f"skipped: {left:.0f} s of budget left",
                    }
                )
                continue
            timeout = min(opts.case_timeout, left)
            report["results"].append(run_case(suite, name, args, opts, ranks[suite], timeout))
            done[key] = report["results"][-1]
            # Written after every case: a call cut short still returns what finished.
            opts.out.write_text(json.dumps(report, indent=2) + "\n")
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    return 0 if all(r["ok"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
