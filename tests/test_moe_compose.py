"""Expert parallel composed with tensor parallel and with compiled blocks (parallel/ep.py):
qwen3_moe's trainer runs against one process, the planner's bytes against a measured step.

Each run is a real gloo launch of tests/test_families.py's tiny qwen3_moe (4 experts of
hidden 32, top 2, both aux losses on), fp32, 6 steps: losses, grad norms, aux losses and the
expert load within 1e-5 of one process. Compiled runs cost a compile per rank, so there are
few of them and each checks several things at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed import run_distributed
from tests.test_families import STEPS, assert_same_run, run_argv, scalars
from tests.test_moe_trainer import MOE, train
from tests.test_train import COMPILED, assert_close, train_losses

DOCUMENTS = ["--data.attention_mask=document", "--data.document_positions=true"]


@pytest.fixture(scope="module")
def one(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: one process, 4 micro-batches of 2 per step."""
    return train(tiny_dataset, tmp_path_factory.mktemp("one"), "one", 1)


def assert_same_load(got: dict, want: dict) -> None:
    """The aux loss (assert_same_run) and the expert load of one process, every step."""
    for tag in (t for t in want if t.startswith("expert_load/")):
        assert_close(got[tag], want[tag], rtol=1e-5)


@pytest.mark.slow
def test_ep_tp_equals_one_process_and_resumes_on_another_layout(
    one: dict, tiny_dataset: str, tmp_path: Path
) -> None:
    """ep 2 x tp 2 on 4 ranks (the EP groups are the tp pairs, the experts FSDP-sharded over the
    other two; full AC, 2 micro-batches of 1 per rank) gives the one-process run. Each tp rank
    computes half of the routed rows (the planner test below measures the all-to-all bytes).
    ep 2 x tp 2's step-3 checkpoint resumes at ep 4 x tp 2 (one EP group of 4, one expert
    each) with the same losses."""
    args = ["--parallel.ep=2", "--parallel.tp=2"]
    eptp = train(tiny_dataset, tmp_path, "ep2_tp2", 4, *args, "--ac.mode=full",
                 "--train.micro_batch_size=1", "--checkpoint.interval=3")  # fmt: skip
    assert_same_run(eptp, one)
    assert_same_load(eptp, one)
    step3 = tmp_path / "ep2_tp2" / "checkpoints" / "step-3"
    resumed = train(tiny_dataset, tmp_path, "ep4_tp2", 4, "--parallel.ep=4", "--parallel.tp=2",
                    f"--checkpoint.resume={step3}")  # fmt: skip
    assert_same_run(resumed, one, slice(3, None))


@pytest.mark.slow
@pytest.mark.drill  # 8 processes on 2 cores (about 20 CPU-s); ep x tp runs by default above
def test_ep_tp_inside_hsdp_equals_one_process(one: dict, tiny_dataset: str, tmp_path: Path) -> None:
    """ep 2 x tp 2 inside HSDP 2 x dp_shard 2, on 8 ranks of 2 nodes, gives the one-process
    run (losses, grad norm, aux losses, expert loads)."""
    hsdp = train(tiny_dataset, tmp_path, "hsdp_ep2_tp2", 8, "--parallel.ep=2", "--parallel.tp=2",
                 nodes=2)  # fmt: skip
    assert_same_run(hsdp, one)
    assert_same_load(hsdp, one)


def train_counting_graphs(argv: list[str]) -> tuple[list[float], list[int]]:
    """train_losses, and after each step the number of graphs Dynamo has compiled so far in
    this process: a recompile adds one."""
    import torch._dynamo.utils

    import train as trainer

    step, graphs = trainer.train_step, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return result

    trainer.train_step = counted
    try:
        return train_losses(argv), graphs
    finally:
        trainer.train_step = step


def compiled_run(dataset: str, out: Path, name: str, world: int, *extra: str) -> dict:
    """A compiled run on `world` ranks: losses, rank 0's scalars and graphs after each step."""
    argv = run_argv(dataset, out, "qwen3_moe", name, f"--train.steps={STEPS}",
                    "--metrics.tensorboard=true", "--metrics.log_interval=1",
                    *COMPILED, *extra)  # fmt: skip
    losses, graphs = run_distributed(train_counting_graphs, world, argv, timeout=600)[0]
    return {"losses": losses, "graphs": graphs} | scalars(out / name)


@pytest.mark.slow
def test_ep_in_pipeline_stages_equals_one_process_and_resumes_without(
    one: dict, tiny_dataset: str, tmp_path: Path
) -> None:
    """Expert parallel inside pipeline stages, on 4 ranks (2 stages of 1 block, 1F1B): pp 2 x
    dp_shard 2 with ep 2 (an EP group is a stage's two data-parallel ranks), pp 2 x tp 2 with
    ep 2 (the stage's tp pair, each computing half the routed rows) and pp 2 x cp 2 with ep 2
    (the stage's cp pair) give the one-process run: losses, the gradient norm over both
    stages, aux losses and expert loads. The pp 2 x ep 2 step-3 checkpoint resumes without pp
    at ep 4 (one expert a rank) with the same losses. (Run once, not kept for the suite's
    time: ZBV and interleaved 1F1B x tp 2 with ep 2 on 4 blocks, and compiled 1F1B x ep 2
    with full AC, all exact.)"""
    pp = ["--parallel.pp=2", "--parallel.ep=2"]
    layouts = {"pp2_ep2": ["--checkpoint.interval=3"], "pp2_tp2_ep2": ["--parallel.tp=2"],
               "pp2_cp2_ep2": ["--parallel.cp=2"]}  # fmt: skip
    for name, extra in layouts.items():
        got = train(tiny_dataset, tmp_path, name, 4, *pp, *extra)
        assert_same_run(got, one)
        assert_same_load(got, one)
    step3 = tmp_path / "pp2_ep2" / "checkpoints" / "step-3"
    resumed = train(tiny_dataset, tmp_path, "ep4", 4, "--parallel.ep=4",
                    f"--checkpoint.resume={step3}")  # fmt: skip
    assert_same_run(resumed, one, slice(3, None))
    assert_same_load(resumed, {k: v[3:] for k, v in one.items()})


@pytest.mark.slow
def test_ep_compiled_equals_one_process_without_recompiles(
    one: dict, tiny_dataset: str, tmp_path: Path
) -> None:
    """Compiled blocks (compile.fullgraph, the default) under EP, against eager on one process:
    ep 2 on 2 ranks with full AC and 2 micro-batches of 1 per rank; and ep 2 x cp 2 on 2 ranks
    (the EP group is the cp pair) with op-level AC, document-masked with per-document
    positions; and one
    process with compile.moe_regions, the same regions without EP (bench/gpu.py's case). Each
    block is compiled in regions around its experts: the norms (one graph for both),
    attention, the router and the experts' compute, plus the loss: 5 graphs, all made in the
    first step, though the rows each rank's experts receive change from micro-batch to
    micro-batch."""
    ep = compiled_run(tiny_dataset, tmp_path, "ep2", 2, "--parallel.ep=2", "--ac.mode=full",
                      "--train.micro_batch_size=1")  # fmt: skip
    assert_same_run(ep, one)
    assert_same_load(ep, one)
    assert ep["graphs"] == [5] * STEPS
    masked = train(tiny_dataset, tmp_path, "one_masked", 1, *DOCUMENTS)
    cp = compiled_run(tiny_dataset, tmp_path, "ep2_cp2", 2, "--parallel.ep=2", "--parallel.cp=2",
                      "--ac.mode=op", *DOCUMENTS)  # fmt: skip
    assert_same_run(cp, masked)
    assert_same_load(cp, masked)
    assert cp["graphs"] == [5] * STEPS
    regions = compiled_run(tiny_dataset, tmp_path, "regions", 1, "--compile.moe_regions")
    assert_same_run(regions, one)
    assert regions["graphs"] == [5] * STEPS


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "op"])  # op-level AC recomputes the collectives too
def test_planner_matches_measured_ep_tp_bytes(tiny_dataset: str, tmp_path: Path, ac: str) -> None:
    """ep 2 x tp 2 on 4 ranks with full or op-level AC, one step of 2 micro-batches: FSDP's
    bytes over dp_shard and expert_shard, tp's gathers (the MoE layer's own, and EP's of the
    routed rows, recompute included) and reduce-scatters, the all-to-all (each tp rank sends
    its half of the rows: the mean over the ranks is exact) and the sharded state, as the
    planner says."""
    from parallel.plan import plan_communication, plan_memory
    from tests.test_tp import assert_as_planned, measured_tp_step

    results, job, shape = measured_tp_step(
        tiny_dataset, tmp_path, *MOE, "--parallel.ep=2", f"--ac.mode={ac}"
    )
    p, tokens = job.parallel, 2 * job.data.seq_len
    planned = plan_communication(
        shape, 1, 2, p.param_dtype, p.reduce_dtype, grad_accum_steps=2, tp=2, tokens=tokens,
        ac_mode=job.ac.mode, ep=2,
    )  # fmt: skip
    mem = plan_memory(shape, 2, 2, job.data.seq_len, p.param_dtype, tp=2, ep=2)
    for result in results:
        assert_as_planned(result, planned, mem, ("dp_shard", "expert_shard"))
    sent = [r["sent"][("ep", "all_to_all")] for r in results]
    assert sum(sent) / len(sent) == pytest.approx(planned["ep"]["all_to_all"], rel=0.01)


def test_moe_regions_without_compile_is_a_warning() -> None:
    """compile.moe_regions with compile.enabled off would do nothing: said in rank 0's log."""
    from configs import parse_config
    from launch.check import unintended_settings
    from launch.job import JobConfig

    job = parse_config(JobConfig, [*MOE, "--compile.moe_regions"])
    assert unintended_settings(job) == [
        "compile.moe_regions=True has no effect with compile.enabled=false"
    ]
    # Any compile setting does nothing without compile: the backend, say.
    job = parse_config(JobConfig, [*MOE, "--compile.backend=aot_eager", "--compile.loss=false"])
    assert unintended_settings(job) == [
        "compile.backend='aot_eager', compile.loss=False have no effect with compile.enabled=false"
    ]


@pytest.mark.slow
def test_experts_compute_compiled_once_for_any_row_count() -> None:
    """The experts' compiled compute (parallel/ep.py, its row count unbacked) equals eager in
    values and gradients for 7, 0, 1 and 5 rows with one graph: under EP a rank may receive
    any number of rows, none included, and no count recompiles."""
    import torch
    import torch._dynamo.utils

    from model.moe import GroupedExperts
    from parallel.compile import CompileConfig
    from parallel.ep import _compiled_compute

    torch.manual_seed(0)
    experts = GroupedExperts(16, 8, 2)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.1)
    compiled = _compiled_compute(GroupedExperts.forward, CompileConfig(enabled=True))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for counts in ([3, 4], [0, 0], [0, 1], [5, 0]):
        rows = torch.randn(sum(counts), 16, requires_grad=True)
        got = compiled(experts, rows, torch.tensor(counts))
        want = GroupedExperts.forward(experts, rows, torch.tensor(counts))
        grad = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, (rows, *experts.parameters()), grad),
                        torch.autograd.grad(want, (rows, *experts.parameters()), grad),
                        strict=True):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
