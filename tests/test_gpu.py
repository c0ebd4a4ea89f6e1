"""GPU checks (NCCL, bf16, MFU, init on CUDA), skipped where no CUDA device is visible, as in CI;
and, on any machine, the kernel grouping `bench/gpu.py --profile` prints."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train import TINY, train_losses

REPO = Path(__file__).resolve().parents[1]


def needs_gpu(test: Callable) -> Callable:
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
    return pytest.mark.gpu(skip(test))


@needs_gpu
def test_trains_on_one_gpu_with_nccl_in_bf16(tiny_dataset: str, tmp_path: Path) -> None:
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--parallel.param_dtype=bfloat16", "--train.steps=8",
        "--train.micro_batch_size=8",
    ]  # fmt: skip
    losses = run_distributed(train_losses, 1, argv)[0]
    assert losses[-1] < losses[0]


@needs_gpu
def test_moe_trains_on_one_gpu_with_grouped_gemm_in_bf16(tiny_dataset: str, tmp_path: Path) -> None:
    """The experts' torch._grouped_mm on CUDA (bf16), eager and in compiled blocks."""
    from tests.test_moe_trainer import MOE

    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY, *MOE,
        "--parallel.device=cuda", "--parallel.param_dtype=bfloat16", "--train.steps=8",
        "--train.micro_batch_size=8",
    ]  # fmt: skip
    for name, extra in (("eager", []), ("compiled", ["--compile.enabled"])):
        losses = run_distributed(train_losses, 1, [*argv, f"--run.name={name}", *extra])[0]
        assert losses[-1] < losses[0] - 0.5, (name, losses)


@needs_gpu
def test_gpu_fp32_matches_cpu_fp32(tiny_dataset: str, tmp_path: Path) -> None:
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.param_dtype=float32", "--train.steps=4", "--train.micro_batch_size=8",
    ]  # fmt: skip
    cpu = run_distributed(train_losses, 1, [*argv, "--parallel.device=cpu"])[0]
    gpu = run_distributed(train_losses, 1, [*argv, "--parallel.device=cuda"])[0]
    # Same initial weights (model/random_init.py); TF32 is off by default for matmuls in
    # PyTorch, so the remaining differences are summation order.
    torch.testing.assert_close(torch.tensor(gpu), torch.tensor(cpu), rtol=1e-4, atol=0)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_init_on_cuda_is_bitwise_the_cpu_init(dtype: torch.dtype) -> None:
    """Every parameter, bit for bit, whole and as a shard (a region of rows and columns)."""
    from dataclasses import replace

    from model import random_init
    from model.llama import FLAVORS, Transformer

    args = replace(FLAVORS["debug"], n_layers=2)  # untied: the plain-normal embedding too
    on = {}
    for device in ("cpu", "cuda"):
        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device=device)
        model.to(dtype).init_weights(seed=3, rope_len=16)
        on[device] = {n: p.detach().cpu() for n, p in model.named_parameters()}
    for name, value in on["cpu"].items():
        assert torch.equal(on["cuda"][name], value), name
    shape, region = (1000, 300), (slice(123, 877), slice(7, 260))
    shards = [
        random_init.normal(5, "w", shape, region, 0.02, truncated, torch.device(device)).cpu()
        for device in ("cpu", "cuda")
        for truncated in (True, False)
    ]
    assert torch.equal(shards[0], shards[2]) and torch.equal(shards[1], shards[3])


@dataclass
class _DocumentAttention:
    """A CUDA document-attention case: 2 rows of 512 tokens, several documents a row with
    boundaries inside 128-token blocks, GQA (8 query heads, 2 kv heads)."""

    ids: torch.Tensor
    inputs: list[torch.Tensor]  # q, k, v and the output's gradient, float64
    dense: torch.Tensor  # SDPA's (batch, 1, seq, seq) boolean mask

    @classmethod
    def make(cls) -> _DocumentAttention:
        from data.documents import document_ids
        from model.attention import document_mask

        gen = torch.Generator(device="cuda").manual_seed(0)
        batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 512, 64
        ids = document_ids(torch.randint(0, 64, (batch, seq), device="cuda", generator=gen), 0)
        assert (ids[:, -1] >= 3).all()  # several documents per row
        shapes = [(batch, heads, seq, head_dim), *[(batch, kv_heads, seq, head_dim)] * 2]
        shapes.append((batch, heads, seq, head_dim))
        inputs = [torch.randn(s, device="cuda", generator=gen, dtype=torch.float64) for s in shapes]
        return cls(ids, inputs, document_mask(ids.cpu(), "sdpa").cuda())

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense, enable_gqa=True)

    def run(self, fn: Callable, dtype: torch.dtype) -> list[torch.Tensor]:
        """`fn(q, k, v)`'s output and the gradients of q, k, v, in `dtype`, as float64."""
        inputs = [t.to(dtype) for t in self.inputs]
        q, k, v, dout = (t.detach().clone().requires_grad_(i < 3) for i, t in enumerate(inputs))
        out = fn(q, k, v)
        out.backward(dout)
        return [out.detach().double(), q.grad.double(), k.grad.double(), v.grad.double()]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_document_attention_matches_sdpa_with_the_same_mask(dtype: torch.dtype) -> None:
    """On CUDA a document mask runs compiled FlexAttention with a BlockMask: its output and
    gradients are as close to the float64 truth (SDPA with the boolean mask) as SDPA's own in
    the same dtype; GQA, several documents per row, boundaries inside 128-token blocks."""
    from model.attention import BlockMask, attention, document_mask

    case = _DocumentAttention.make()
    block_mask = document_mask(case.ids, "sdpa")
    assert isinstance(block_mask, BlockMask)
    truth = case.run(case.sdpa, torch.float64)
    flex = case.run(lambda q, k, v: attention(q, k, v, block_mask, "sdpa"), dtype)
    ref = case.run(case.sdpa, dtype)
    causal = case.run(lambda q, k, v: attention(q, k, v, None, "sdpa"), dtype)
    slack = 1e-5 if dtype == torch.float32 else 1e-3
    for name, t, f, r, c in zip(("out", "dq", "dk", "dv"), truth, flex, ref, causal, strict=True):
        err_flex, err_sdpa = ((x - t).norm() / t.norm() for x in (f, r))
        assert err_flex < 2 * err_sdpa + slack, f"{name}: flex {err_flex:.2e}, SDPA {err_sdpa:.2e}"
        assert (c - t).norm() / t.norm() > 0.1, name  # the document mask is not causal's


@needs_gpu
def test_varlen_document_attention_is_as_close_to_the_truth_as_sdpa() -> None:
    """model.attention='varlen': FlashAttention's variable-length kernel on the packed
    documents gives outputs and gradients as close to the float64 truth (SDPA with the boolean
    mask) as SDPA's own in bf16; GQA (the kernel's own, or the heads repeated on a torch
    without it), several documents a row, boundaries inside 128-token blocks."""
    from model.attention import VarlenMask, attention, document_mask

    case = _DocumentAttention.make()
    mask = document_mask(case.ids, "varlen")
    assert isinstance(mask, VarlenMask)
    truth = case.run(case.sdpa, torch.float64)
    varlen = case.run(lambda q, k, v: attention(q, k, v, mask, "varlen"), torch.bfloat16)
    ref = case.run(case.sdpa, torch.bfloat16)
    for name, t, got, r in zip(("out", "dq", "dk", "dv"), truth, varlen, ref, strict=True):
        err, err_sdpa = ((x - t).norm() / t.norm() for x in (got, r))
        assert err < 2 * err_sdpa + 1e-3, f"{name}: varlen {err:.2e}, SDPA {err_sdpa:.2e}"


@needs_gpu
def test_varlen_document_masking_trains_as_flex_attention(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """The trainer with data.attention_mask=document and model.attention='varlen', eager and
    in compiled blocks with op-level AC (bf16): the losses of FlexAttention's run."""
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--parallel.param_dtype=bfloat16", "--train.steps=6",
        "--train.micro_batch_size=8", "--data.attention_mask=document",
    ]  # fmt: skip
    compiled = ["--compile.enabled=true", "--ac.mode=op"]
    runs = {
        "flex": [], "varlen": ["--model.attention=varlen"],
        "varlen_compiled": ["--model.attention=varlen", *compiled],
    }  # fmt: skip
    got = {name: run_distributed(train_losses, 1, [*argv, f"--run.name={name}", *extra])[0]
           for name, extra in runs.items()}  # fmt: skip
    assert got["varlen"][-1] < got["varlen"][0]
    for name in ("varlen", "varlen_compiled"):
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(got["flex"]), rtol=2e-2,
                                   atol=0, msg=name)  # fmt: skip


@needs_gpu
@pytest.mark.parametrize("documents", [False, True])
def test_flex_attention_under_context_parallel_gives_the_rows_of_the_whole(documents: bool) -> None:
    """Context parallel on CUDA: FlexAttention with the mask_mod over whole-sequence rows
    (model/attention.py `_flex_split_mask`), each of 2 ranks' queries against the whole K/V,
    gives its rows of whole-sequence attention and the gradients add up (one GPU: the gather
    is faked, as tests/test_cp.py does on CPU with SDPA and the chunked kernel)."""
    from tests.test_cp import check_split_attention

    check_split_attention("cuda", "sdpa", documents, torch.float32)


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallel needs 2 GPUs")
def test_context_parallel_trains_on_two_gpus(short_docs: str, tmp_path: Path) -> None:
    """cp 2 on 2 GPUs with NCCL, document-masked (FlexAttention under the split mask): the fp32
    losses of one GPU."""
    from tests.test_train import FP32, assert_close

    argv = [
        f"--data.path={short_docs}", f"--run.output_dir={tmp_path}", *TINY, *FP32,
        "--model.vocab_size=260", "--parallel.device=cuda", "--train.steps=4",
        "--train.micro_batch_size=8", "--data.attention_mask=document",
        "--data.document_positions=true",
    ]  # fmt: skip
    one = run_distributed(train_losses, 1, [*argv, "--run.name=one"])[0]
    split = run_distributed(train_losses, 2, [*argv, "--run.name=cp", "--parallel.cp=2"])[0]
    assert_close(split, one, rtol=1e-4)


@needs_gpu
def test_document_masking_trains_compiled_on_one_gpu(tiny_dataset: str, tmp_path: Path) -> None:
    """data.attention_mask=document on CUDA (FlexAttention, its BlockMask through FSDP's hooks
    and into compiled blocks with op-level AC): the losses of the eager run, and falling."""
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--parallel.param_dtype=float32", "--train.steps=6",
        "--train.micro_batch_size=8", "--data.attention_mask=document",
    ]  # fmt: skip
    eager = run_distributed(train_losses, 1, [*argv, "--run.name=eager"])[0]
    compiled = run_distributed(
        train_losses, 1, [*argv, "--run.name=compiled", "--compile.enabled=true", "--ac.mode=op"]
    )[0]
    assert eager[-1] < eager[0]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=0)


@needs_gpu
def test_graph_fsdp_matches_eager_fsdp2_on_one_gpu(short_docs: str, tmp_path: Path) -> None:
    """compile.fsdp='graph' on CUDA (Triton kernels, NCCL; dp_shard 1, where the gathers are
    in-graph casts): float32 with full AC, tied embeddings, document masking (FlexAttention)
    and (from torch 2.13) the chunked loss over 6 steps of 2 micro-batches within 1e-4 of
    eager FSDP2 (the tolerance of the compiled-blocks test above: Triton's float32 reductions
    are not bitwise eager's; 1e-5 on CPU), bf16 within the eager bf16 test's 5e-3."""
    base = [
        f"--data.path={short_docs}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--train.steps=6", "--train.micro_batch_size=4",
        "--ac.mode=full", "--model.tie_embeddings=true", "--data.attention_mask=document",
    ]  # fmt: skip
    from parallel.graph_fsdp import torch_release

    if torch_release() >= (2, 13):  # refused before (check_graph_fsdp): measured on torch 2.11
        base.append("--train.loss_chunk_tokens=48")
    graph = ["--compile.enabled=true", "--compile.fsdp=graph"]
    for dtype, rtol in (("float32", 1e-4), ("bfloat16", 5e-3)):
        argv = [*base, f"--parallel.param_dtype={dtype}"]
        eager = run_distributed(train_losses, 1, [*argv, f"--run.name=eager-{dtype}"])[0]
        compiled = run_distributed(
            train_losses, 1, [*argv, *graph, f"--run.name=graph-{dtype}"], timeout=600
        )[0]
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=rtol, atol=0)


@needs_gpu
def test_cuda_graphs_replay_the_graph_paths_steps(tiny_dataset: str, tmp_path: Path) -> None:
    """compile.cudagraphs with compile.fsdp='graph' on one GPU, 2 micro-batches a step and a
    validation between steps: the losses of the graph path without CUDA graphs (fp32)."""
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--parallel.param_dtype=float32", "--train.steps=6",
        "--train.micro_batch_size=4", "--train.eval_interval=3", "--train.eval_batches=1",
        "--compile.enabled=true", "--compile.fsdp=graph",
    ]  # fmt: skip
    cudagraphs = ["--run.name=cudagraphs", "--compile.cudagraphs=true"]
    plain = run_distributed(train_losses, 1, [*argv, "--run.name=plain"], timeout=600)[0]
    graphs = run_distributed(train_losses, 1, [*argv, *cudagraphs], timeout=600)[0]
    torch.testing.assert_close(torch.tensor(graphs), torch.tensor(plain), rtol=1e-5, atol=0)


@needs_gpu
def test_graph_fsdp_with_float8_matches_eager_fsdp2_on_one_gpu(
    short_docs: str, tmp_path: Path
) -> None:
    """compile.fsdp='graph' with fp8 (torchao's float8 matmuls, tensorwise, every Linear but the
    output; dp_shard 1: each converted weight cast to float8 inside the graph with its whole
    scale) over 6 steps of bf16 within the eager bf16 test's 5e-3 of eager FSDP2 with fp8."""
    argv = [
        f"--data.path={short_docs}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--train.steps=6", "--train.micro_batch_size=4",
        "--fp8.enabled=true", "--fp8.filter=none", "--parallel.param_dtype=bfloat16",
    ]  # fmt: skip
    eager = run_distributed(train_losses, 1, [*argv, "--run.name=eager"])[0]
    graph = ["--compile.enabled=true", "--compile.fsdp=graph", "--run.name=graph"]
    compiled = run_distributed(train_losses, 1, [*argv, *graph], timeout=600)[0]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=5e-3, atol=0)


def test_memory_summary_names_where_the_cached_memory_sits() -> None:
    """launch/memory.py's summary of a snapshot (torch's layout): segments grouped by stream,
    pool and size class, the one caching the most first, with its largest free block."""
    from launch.memory import GIB, summarize, summary_lines

    def segment(stream: int, kind: str, blocks: list[tuple[int, str]]) -> dict:
        total = sum(size for size, _ in blocks)
        used = sum(size for size, state in blocks if state == "active_allocated")
        return {"stream": stream, "segment_pool_id": (0, 0), "segment_type": kind,
                "total_size": total, "allocated_size": used, "active_size": used,
                "blocks": [{"size": size, "state": state} for size, state in blocks]}  # fmt: skip

    snapshot = {"segments": [
        segment(0, "large", [(4 * GIB, "active_allocated"), (GIB // 2, "inactive")]),
        segment(0, "large", [(2 * GIB, "active_allocated")]),
        segment(7, "large", [(GIB, "inactive"), (GIB, "active_allocated"), (GIB, "inactive")]),
        segment(0, "small", [(2**20, "active_allocated"), (2**19, "inactive")]),
    ]}  # fmt: skip
    groups = summarize(snapshot)
    assert [(g["stream"], g["kind"]) for g in groups] == [(7, "large"), (0, "large"), (0, "small")]
    assert groups[0] | {} == {"stream": 7, "pool": (0, 0), "kind": "large", "segments": 1,
                              "reserved": 3 * GIB, "allocated": GIB, "active": GIB,
                              "largest_free": GIB}  # fmt: skip
    assert groups[1]["segments"] == 2 and groups[1]["largest_free"] == GIB // 2
    lines = summary_lines(5, groups)
    assert lines[0].startswith("memory after step 5: reserved 9.50 GiB, allocated 7.00 GiB")
    assert "stream 7 pool (0, 0) large: 1 segments" in lines[1] and "cached 2.00 GiB" in lines[1]


@needs_gpu
def test_a_memory_snapshot_of_a_step_is_written_and_summarized(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """metrics.memory_snapshot_step on one GPU: the allocator's snapshot of that step (with
    its history) and its summary, whose reserved memory is the segments'."""
    import pickle

    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--parallel.device=cuda", "--train.steps=3", "--train.micro_batch_size=8",
            "--metrics.memory_snapshot_step=2"]  # fmt: skip
    run_distributed(train_losses, 1, argv)
    out = tmp_path / "debug" / "memory"
    snapshot = pickle.loads((out / "step2_rank0.pickle").read_bytes())
    assert snapshot["device_traces"] and snapshot["device_traces"][0]  # the step's history
    reserved = sum(s["total_size"] for s in snapshot["segments"])
    summary = (out / "step2_rank0.txt").read_text()
    assert f"reserved {reserved / 2**30:.2f} GiB" in summary.splitlines()[0]


def test_cuda_memory_peaks_are_those_of_the_interval_since_the_last_log(monkeypatch) -> None:
    """torchtitan's rule, so that the two trainers' peaks after warm-up read alike: each read of
    the allocator's peaks starts a new interval."""
    from launch.metrics import memory_stats

    peaks = {"allocated": 5 * 2**30, "reserved": 6 * 2**30}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda d: peaks.update(allocated=2**30, reserved=2 * 2**30))  # fmt: skip
    gpu = torch.device("cuda", 0)
    first, second = memory_stats(gpu), memory_stats(gpu)
    assert first == {"memory/max_allocated_gib": 5.0, "memory/max_reserved_gib": 6.0}
    assert second == {"memory/max_allocated_gib": 1.0, "memory/max_reserved_gib": 2.0}


@needs_gpu
def test_a_transient_peak_shows_in_its_own_interval_only() -> None:
    from launch.metrics import memory_stats

    gpu = torch.device("cuda", 0)
    memory_stats(gpu)
    transient = torch.empty(2**30, dtype=torch.uint8, device=gpu)
    del transient
    first = memory_stats(gpu)["memory/max_allocated_gib"]
    second = memory_stats(gpu)["memory/max_allocated_gib"]
    assert first >= 1.0 and second <= first - 1.0


def _bench_gpu():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _event(name: str, ts: float, dur: float, cat: str, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": tid}


def test_profile_groups_device_kernels_by_union_of_intervals() -> None:
    """GPU trace: kernels only (CPU ops ignored); overlapping streams counted once; busy is
    the union of all kernels, span first start to last end."""
    trace = {
        "traceEvents": [
            _event("aten::mm", 0, 1000, "cpu_op"),
            _event("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 100, "kernel", tid=7),
            _event("nvjet_tst_128x256_64x4", 50, 100, "kernel", tid=8),  # overlaps: 150 in all
            _event("pytorch_flash::flash_fwd_kernel", 200, 50, "kernel", tid=7),
            _event("Memcpy DtoD (Device -> Device)", 260, 10, "gpu_memcpy", tid=7),
            _event("void at::native::direct_copy_kernel_cuda", 270, 10, "kernel", tid=7),
            _event("triton_poi_fused_mul_silu_0", 300, 40, "kernel", tid=7),
            _event("ncclDevKernel_AllGather_RING_LL", 300, 100, "kernel", tid=9),
            _event("void at::native::vectorized_elementwise_kernel", 500, 0, "kernel", tid=7),
        ]
    }
    profile = _bench_gpu().kernel_groups(trace)
    groups = {g: (row["count"], round(row["ms"] * 1e3)) for g, row in profile["groups"].items()}
    assert groups == {
        "GEMM": (2, 150), "attention": (1, 50), "copies": (2, 20), "Triton": (1, 40),
        "collectives": (1, 100), "other": (1, 0),
    }  # fmt: skip
    assert profile["source"] == "device kernels"
    assert round(profile["span_ms"] * 1e3) == 500 and round(profile["busy_ms"] * 1e3) == 320


def test_profile_groups_cpu_ops_by_self_time() -> None:
    """CPU trace (no kernels): nested ops by self time; an unnamed child belongs to its
    parent's group, and all of an attention op's children to attention."""
    trace = {
        "traceEvents": [
            _event("aten::linear", 0, 100, "cpu_op"),
            _event("aten::t", 0, 10, "cpu_op"),  # GEMM, through aten::linear
            _event("aten::mm", 10, 80, "cpu_op"),
            _event("aten::scaled_dot_product_attention", 100, 50, "cpu_op"),
            _event("aten::bmm", 110, 30, "cpu_op"),  # inside attention: attention
            _event("aten::copy_", 150, 20, "cpu_op"),
            _event("CompiledFunction", 200, 100, "cpu_op"),  # Inductor's C++ kernels
            _event("aten::mm", 250, 40, "cpu_op"),
            _event("aten::_fused_adamw_", 300, 25, "cpu_op", tid=2),
        ]
    }
    profile = _bench_gpu().kernel_groups(trace)
    ms = {g: round(row["ms"] * 1e3) for g, row in profile["groups"].items()}
    assert ms == {
        "GEMM": 140, "attention": 50, "copies": 20, "Triton": 60, "collectives": 0, "other": 25
    }  # fmt: skip
    assert profile["source"] == "CPU ops (self time)"
    assert round(profile["span_ms"] * 1e3) == 325 and round(profile["busy_ms"] * 1e3) == 295


def test_profile_groups_a_real_cpu_trace(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 4, 64, 32, requires_grad=True)
    linear = torch.nn.Linear(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        linear(y).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    result = _bench_gpu().kernel_groups(json.loads((tmp_path / "trace.json").read_text()))
    groups = result["groups"]
    assert groups["attention"]["ms"] > 0 and groups["GEMM"]["ms"] > 0
    total = sum(row["ms"] for row in groups.values())
    assert total == pytest.approx(result["busy_ms"], rel=0.05)  # self times tile busy time


def train_and_dump_nccl_recorder(argv: list[str], run_dir: str) -> int:
    """train.main on one NCCL rank with the flight recorder on, then this rank's dump of it
    (NCCL writes one only on a timeout, which one rank cannot have)."""
    import train
    from launch.health import dump_flight_recorder

    assert train.main(argv) == 0
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == f"{run_dir}/comm_traces/rank_"
    return dump_flight_recorder(Path(run_dir), 0, nccl=True) is not None


@needs_gpu
def test_nccl_flight_recorder_is_on_and_its_dump_reads(tiny_dataset: str, tmp_path: Path) -> None:
    """The recorder init_distributed turns on records the run's NCCL collectives, and both
    launch.hangs and torch's own analyzer read the dump. (A hang itself needs 2 GPUs.)"""
    from torch.distributed.flight_recorder.fr_trace import main as fr_trace

    from launch.hangs import report

    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--train.steps=3", "--train.micro_batch_size=8",
    ]  # fmt: skip
    run_dir = tmp_path / "debug"
    assert run_distributed(train_and_dump_nccl_recorder, 1, argv, str(run_dir)) == [True]
    lines = report(run_dir)
    assert any(
        re.match(r"  rank 0 group .*: #\d+ (allreduce|all_reduce)", line) for line in lines
    ), lines
    fr_trace([str(run_dir / "comm_traces"), "--prefix", "rank_"])  # raises if it cannot read it
