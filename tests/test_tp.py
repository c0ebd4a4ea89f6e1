"""Tensor parallel (with sequence parallel) as the third mesh dimension, on real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs import ConfigError
from launch.job import JobConfig
from parallel.dims import LaunchEnv, ParallelConfig, resolve_dims
from tests.distributed import run_distributed
from tests.test_train import COMPILED, FP32, assert_close, run, train_losses

STEPS = ["--train.steps=4", "--train.micro_batch_size=2"]


def env(world: int, local: int | None = None, nodes: int = 1) -> LaunchEnv:
    return LaunchEnv(0, 0, world, local or world, nodes)


@pytest.mark.parametrize(
    ("cfg", "launch", "expected"),
    [
        (ParallelConfig(tp=2), env(4), (1, 2)),
        (ParallelConfig(tp=2, dp_replicate=2), env(8), (2, 2)),
        (ParallelConfig(tp=4), env(4), (1, 1)),
        (ParallelConfig(mesh="auto", tp=2), env(8, 8, 1), (1, 4)),
        (ParallelConfig(mesh="auto", tp=8), env(128, 8, 16), (16, 1)),
        (ParallelConfig(mesh="auto", tp=2), env(16, 8, 2), (2, 4)),
    ],
)
def test_resolve_dims_with_tp(cfg: ParallelConfig, launch: LaunchEnv, expected: tuple) -> None:
    assert resolve_dims(cfg, launch) == expected


def test_tp_mesh_errors_name_every_number() -> None:
    with pytest.raises(ConfigError, match=r"tp \(3\) must divide the ranks per node \(4"):
        resolve_dims(ParallelConfig(tp=3), env(4))
    # tp must stay inside a node: 2 nodes x 2 ranks cannot hold tp=4.
    with pytest.raises(ConfigError, match=r"tp \(4\) must divide the ranks per node \(2"):
        resolve_dims(ParallelConfig(tp=4), env(4, 2, 2))
    with pytest.raises(ConfigError, match=r"dp_replicate \(2\) x dp_shard \(4\) x tp \(2\) = 16"):
        resolve_dims(ParallelConfig(tp=2, dp_replicate=2, dp_shard=4), env(8))
    with pytest.raises(ConfigError, match="tp must be >= 1"):
        ParallelConfig(tp=0)


@pytest.mark.parametrize(
    ("override", "bad"),
    [
        # Heads name the tp values that fit, and never suggest the vocabulary.
        ("--model.n_kv_heads=1", r"heads .*not: n_kv_heads=1\): this model cannot use tensor"),
        (
            ["--model.dim=96", "--model.n_heads=6", "--model.n_kv_heads=3"],
            r"n_kv_heads=3; not: n_kv_heads=3\): choose tp in \[3\]$",
        ),
        ("--model.vocab_size=511", r"tp=2 must divide model.vocab_size \(511\): set model.vocab"),
    ],
)
def test_model_that_tp_cannot_split_is_a_config_error(
    tiny_dataset: str, tmp_path: Path, override: str | list[str], bad: str
) -> None:
    """Checked in check_config, before any process group: one line with every number."""
    from configs import parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from tests.test_train import TINY

    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY]
    overrides = [override] if isinstance(override, str) else override
    job = parse_config(JobConfig, [*argv, "--parallel.tp=2", *overrides])
    with pytest.raises(ConfigError, match=bad) as err:
        check_config(job, env(2))
    assert "\n" not in str(err.value)
    assert ("vocab_size" in str(err.value)) == ("vocab_size" in "".join(overrides))


@pytest.mark.slow
def test_fp32_parity_tp_with_fsdp(tiny_dataset: str, tmp_path: Path) -> None:
    """1 process = (dp_shard 2, tp 2), losses within 1e-5 per step (tp 2 alone, for every
    family with a TP_PLAN: tests/test_families.py; HSDP x tp: the drill below, and the
    gradients on that 3D mesh: test_grad_norm_and_clipping_on_3d_mesh_equal_one_process)."""
    single = run(tiny_dataset, tmp_path, 1, 1, FP32 + STEPS)
    shard_tp = run(tiny_dataset, tmp_path, 4, 1, FP32 + STEPS + ["--parallel.tp=2"])
    assert_close(shard_tp, single, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.drill  # 8 processes on 2 cores; HSDP x tp's gradients run by default (below)
def test_fp32_parity_tp_with_hsdp(tiny_dataset: str, tmp_path: Path) -> None:
    """1 process = (dp_replicate 2, dp_shard 2, tp 2) on 8 ranks, losses within 1e-5."""
    single = run(tiny_dataset, tmp_path, 1, 1, FP32 + STEPS)
    three_d = run(tiny_dataset, tmp_path, 8, 2, FP32 + STEPS + ["--parallel.tp=2"])
    assert_close(three_d, single, rtol=1e-5)


def grads_after_one_step(
    dims: tuple[int, int, int], family_name: str, compiled: bool = False
) -> dict:
    """Global grad norm and clipped gradients of one forward/backward of a fixed batch, on a
    (dp_replicate, dp_shard, tp) mesh; every dp rank sees the same batch, so the reduced
    gradients are the 1-process ones. `compiled`: each block torch.compile'd, as train.py."""
    import torch

    from data.documents import MicroBatch
    from model import canonical_name, get_family
    from parallel.compile import CompileConfig, apply_compile
    from parallel.dims import ParallelConfig
    from parallel.fsdp import apply_fsdp, assign_local_shard
    from parallel.objective import summed_loss
    from parallel.runtime import build_mesh, dp_mesh, init_distributed
    from parallel.tp import apply_tp, loss_context
    from parallel.workarounds import tp_compile_workarounds
    from train import clip_grad_norm

    device = torch.device("cpu")
    init_distributed(device, LaunchEnv.from_env(), 60)
    family = get_family(family_name)
    from model import ModelConfig

    args = family.build_args(
        ModelConfig(name=family_name, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    )
    with torch.device("meta"):
        model = family.build_model(args)
    mesh = build_mesh(device, *dims)
    if dims[2] > 1:
        apply_tp(model, family, mesh["tp"])
    tp_compile_workarounds(model, family, dims[2], compiled, "none")
    apply_compile(
        model, family.fsdp_units(model), CompileConfig(enabled=compiled, backend="aot_eager")
    )
    apply_fsdp(
        model, family.fsdp_units(model), dp_mesh(mesh), ParallelConfig(param_dtype="float32")
    )
    model.to_empty(device=device)
    model.init_weights(seed=0, rope_len=16, assign=assign_local_shard)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with loss_context(dims[2]):  # the trainer's loss: split logits under loss parallel
        loss = summed_loss(model, MicroBatch(tokens, tokens)) / tokens.numel()
        loss.backward()
    norm = clip_grad_norm(model, max_norm=0.1)
    grads = {
        canonical_name(n): getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
        for n, p in model.named_parameters()
    }
    torch.distributed.destroy_process_group()
    return {"norm": norm.item(), "grads": grads}


# One family each for the clipping and the compiled-TP gradients: both test mechanics that no
# family changes (the norm's reduction over placements, workaround 1's embedding output); each
# family's TP plan has its own parity test in tests/test_families.py.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3"])
def test_grad_norm_and_clipping_on_3d_mesh_equal_one_process(family: str) -> None:
    """DTensor gradients on (dp_replicate 2, dp_shard 2, tp 2): the same norm as 1 process,
    and the same clipped gradients (placements on all three dims reduce correctly)."""
    import torch

    ref = run_distributed(grads_after_one_step, 1, (1, 1, 1), family)[0]
    got = run_distributed(grads_after_one_step, 8, (2, 2, 2), family, nodes=2)[0]
    assert ref["norm"] > 0.1  # clipping really scaled the gradients
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3"])
def test_compiled_tp_gradients_equal_one_process(family: str) -> None:
    """Compiled blocks at tp 2: every gradient as 1 process, the embedding's included (on torch
    2.13 it came back zero while the block received the embedding's async output; see
    parallel/workarounds.py, workaround 1)."""
    import torch

    ref = run_distributed(grads_after_one_step, 1, (1, 1, 1), family)[0]
    got = run_distributed(grads_after_one_step, 2, (1, 1, 2), family, True)[0]
    assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5)
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["op", pytest.param("full", marks=pytest.mark.drill)])
def test_fp32_parity_tp_with_compile(tiny_dataset: str, tmp_path: Path, ac: str) -> None:
    """tp 2 with compiled blocks = 1 process, losses within 1e-5 per step (at tp > 1 the loss
    itself is not compiled: loss parallel, see train.py). With op-level AC inside the compiled
    block; with full AC around it (train.py's order at tp > 1). Without AC: the gradient test.
    Measured exact on 4 steps; also (dp_shard 2, tp 2) and (dp_replicate 2, dp_shard 2, tp 2),
    left out here for time (1 and 2 minutes on 2 cores)."""
    steps = [*FP32, "--train.steps=4", "--train.micro_batch_size=4", f"--ac.mode={ac}"]
    single = run(tiny_dataset, tmp_path, 1, 1, steps)
    compiled = run(tiny_dataset, tmp_path, 2, 1, [*steps, "--parallel.tp=2", *COMPILED])
    assert_close(compiled, single, rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_saved_at_tp2_resumes_at_tp1_and_other_dp(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Save at (dp_shard 2, tp 2), resume at 1 process and at dp_shard 2 without TP: the losses
    continue the straight run (DCP reshards the TP DTensors; the data position carries over).
    The exported model of the TP checkpoint equals that of a DP-only run's."""
    import torch

    from checkpoint.export import load_checkpoint_model

    steps = ["--train.steps=4", "--train.micro_batch_size=2", "--checkpoint.interval=2"]
    steps.append("--checkpoint.keep_last=0")
    base = [*FP32, *steps]
    straight = run(tiny_dataset, tmp_path, 4, 1, [*base, "--parallel.tp=2", "--run.name=tp"])
    saved = tmp_path / "tp" / "checkpoints" / "step-2"
    for world, name in [(1, "one"), (2, "dp2")]:
        extra = [*base, f"--run.name={name}", f"--checkpoint.resume={saved}"]
        assert_close(run(tiny_dataset, tmp_path, world, 1, extra), straight[2:], rtol=1e-5)
    dp_only = run(tiny_dataset, tmp_path, 2, 1, [*base, "--run.name=dp"])
    assert_close(dp_only, straight, rtol=1e-5)
    from_tp = load_checkpoint_model(tmp_path / "tp" / "checkpoints" / "step-4").state_dict()
    from_dp = load_checkpoint_model(tmp_path / "dp" / "checkpoints" / "step-4").state_dict()
    assert from_tp.keys() == from_dp.keys()
    # Not bitwise: the meshes sum in different orders and Adam's m / sqrt(v) turns a 1e-7
    # gradient difference into up to ~3e-6 on a weight whose gradient is near zero.
    for key, value in from_dp.items():
        where = lambda m, k=key: f"{k}: {m}"  # noqa: E731
        torch.testing.assert_close(from_tp[key], value, rtol=1e-4, atol=1e-5, msg=where)


def float8_styles_at_tp2() -> list[str]:
    """Style class of every converted layer after float8 + apply_tp (2 ranks, tp 2)."""
    import torch

    from model import ModelConfig, get_family
    from parallel.float8 import Float8Config, apply_float8
    from parallel.runtime import build_mesh, init_distributed
    from parallel.tp import apply_tp

    init_distributed(torch.device("cpu"), LaunchEnv.from_env(), 60)
    family = get_family("llama3")
    args = family.build_args(ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2))
    with torch.device("meta"):
        model = family.build_model(args)
    apply_float8(model, Float8Config(enabled=True, emulate=True, filter="none"))
    plan = apply_tp(model, family, build_mesh(torch.device("cpu"), 1, 1, 2)["tp"], True)
    torch.distributed.destroy_process_group()
    return sorted({type(plan[n]).__name__ for n in plan if n.endswith(("wq", "wo", "w2"))})


@pytest.mark.slow
def test_fp8_tp_uses_float8_styles_and_matches_fsdp(tiny_dataset: str, tmp_path: Path) -> None:
    """fp8 (emulated) at tp 2: with float8 collectives (NCCL) converted layers get torchao's
    float8 TP styles; on gloo (no float8 collectives) the plain styles, and the losses match
    FSDP on 2 ranks with the same float8 casts (tensorwise scales are global amaxes)."""
    import torch

    from tests.test_float8 import _argv

    styles = run_distributed(float8_styles_at_tp2, 2)[0]
    assert styles == ["Float8ColwiseParallel", "Float8RowwiseParallel"]
    fp8 = ["--train.steps=4", "--fp8.enabled=true", "--fp8.emulate=true"]
    fsdp = run_distributed(train_losses, 2, _argv(tiny_dataset, tmp_path / "a", *fp8))[0]
    tp = run_distributed(
        train_losses, 2, _argv(tiny_dataset, tmp_path / "b", *fp8, "--parallel.tp=2")
    )[0]
    assert fsdp[-1] < fsdp[0]
    torch.testing.assert_close(torch.tensor(tp), torch.tensor(fsdp), rtol=1e-3, atol=0)


@pytest.mark.slow
def test_tp_with_full_ac_matches_tp(tiny_dataset: str, tmp_path: Path) -> None:
    """Full AC at tp 2 gives the losses of plain tp 2 (and so of 1 process)."""
    tp2 = [*FP32, "--train.steps=2", "--train.micro_batch_size=4", "--parallel.tp=2"]
    plain = run(tiny_dataset, tmp_path, 2, 1, tp2)
    ac = run(tiny_dataset, tmp_path, 2, 1, [*tp2, "--ac.mode=full"])
    assert_close(ac, plain, rtol=1e-6)


def tp_instrumented_step(argv: list[str]) -> dict:
    """test_plan's instrumented step, plus the bytes of DTensor's (tensor-parallel)
    collectives, which go through the functional collectives."""
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    from tests.test_plan import RING, _local_bytes, instrumented_step

    sent: dict[str, float] = {}
    originals = {"all_gather_single": funcol.all_gather_single,
                 "reduce_scatter_single": funcol.reduce_scatter_single,
                 "all_reduce": funcol.all_reduce}  # fmt: skip

    def spy(name: str, collective: str):  # noqa: ANN202
        def call(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            group = args[1] if len(args) > 1 else kwargs.get("group")
            group_name = funcol._resolve_group_name(group)
            size = c10d._resolve_process_group(group_name).size()
            sent[collective] = sent.get(collective, 0) + RING[collective](
                _local_bytes(tensor), size
            )
            return originals[name](tensor, *args, **kwargs)

        return call

    funcol.all_gather_single = spy("all_gather_single", "all_gather")
    funcol.reduce_scatter_single = spy("reduce_scatter_single", "reduce_scatter")
    funcol.all_reduce = spy("all_reduce", "all_reduce")
    try:
        result = instrumented_step(argv)
    finally:
        for name, fn in originals.items():
            setattr(funcol, name, fn)
    return result | {"tp_sent": sent}


def measured_tp_step(dataset: str, out: Path, *extra: str) -> tuple[list[dict], JobConfig, object]:
    """One instrumented step of 2 micro-batches of the tiny Llama with tp 2 on 4 ranks: each
    rank's measured bytes and state, the job, and the model's shape for the planner."""
    from configs import parse_config
    from model import get_family
    from parallel.plan import model_shape
    from tests.test_train import TINY

    argv = [f"--data.path={dataset}", f"--run.output_dir={out}", *TINY, "--train.steps=1",
            "--train.micro_batch_size=2", "--parallel.tp=2", *extra]  # fmt: skip
    results = run_distributed(tp_instrumented_step, 4, argv)
    job = parse_config(JobConfig, argv)
    family = get_family(job.model.name)
    return results, job, model_shape(family, family.build_args(job.model))


def assert_as_planned(result: dict, planned: dict, mem: dict, dims: tuple[str, ...]) -> None:
    """One rank's bytes on `dims` and tp's gathers and reduce-scatters within 1% of the
    planner's, its sharded state within 10%."""
    for dim in dims:
        for collective, expected in planned[dim].items():
            measured = result["sent"].get((dim, collective), 0)
            assert measured == pytest.approx(expected, rel=0.01), (dim, collective, result)
    for collective in ("all_gather", "reduce_scatter"):
        expected, measured = planned["tp"][collective], result["tp_sent"].get(collective, 0)
        assert measured == pytest.approx(expected, rel=0.01), (collective, result["tp_sent"])
    for key, measured in result["state"].items():
        assert measured == pytest.approx(mem[key], rel=0.10), (key, result["state"], mem)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "full", "op"])  # op: the collectives recomputed too
def test_planner_matches_measured_tp_bytes(tiny_dataset: str, tmp_path: Path, ac: str) -> None:
    """(dp_shard 2, tp 2), one step of 2 micro-batches: the FSDP bytes per dim, the TP
    activation bytes and the sharded state per rank as the planner says."""
    from parallel.plan import plan_communication, plan_memory

    results, job, shape = measured_tp_step(tiny_dataset, tmp_path, f"--ac.mode={ac}")
    p, tokens = job.parallel, 2 * job.data.seq_len
    planned = plan_communication(
        shape, 1, 2, p.param_dtype, p.reduce_dtype, grad_accum_steps=2, tp=2, tokens=tokens,
        ac_mode=job.ac.mode,
    )  # fmt: skip
    mem = plan_memory(shape, 2, 2, job.data.seq_len, p.param_dtype, tp=2)
    for result in results:
        assert_as_planned(result, planned, mem, ("dp_shard", "dp_replicate"))
        # Besides the loss's per-token floats, only the norm gains' gradients (and the grad
        # norm) are all-reduced over tp: no activations, no gathered logits.
        loss_bytes, other = planned["tp"]["all_reduce"], result["tp_sent"].get("all_reduce", 0)
        assert loss_bytes <= other < loss_bytes + 0.05 * planned["tp"]["reduce_scatter"]


@pytest.mark.slow
def test_planner_matches_measured_tp_cp_bytes(tiny_dataset: str, tmp_path: Path) -> None:
    """(cp 2, tp 2) on 4 ranks, one step of 2 micro-batches: FSDP over dp_shard x cp, the TP
    activation bytes of half sequences and the K/V gathers of half the heads, as planned."""
    from parallel.plan import plan_communication, plan_memory

    results, job, shape = measured_tp_step(
        tiny_dataset, tmp_path, "--train.global_batch_size=4", "--parallel.cp=2"
    )
    p, tokens = job.parallel, 2 * job.data.seq_len
    planned = plan_communication(
        shape, 1, 1, p.param_dtype, p.reduce_dtype, grad_accum_steps=2, tp=2, tokens=tokens, cp=2
    )
    assert planned["cp"]["all_gather"] > 0 and planned["tp"]["all_gather"] > 0
    mem = plan_memory(shape, 1, 2, job.data.seq_len, p.param_dtype, tp=2, cp=2)
    for result in results:
        assert_as_planned(result, planned, mem, ("dp_shard", "cp"))
