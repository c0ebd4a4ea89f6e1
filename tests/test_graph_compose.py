"""compile.fsdp='graph' composed with tensor parallel, pipeline stages and float8
(parallel/graph_fsdp.py): the one-process run on each mesh, and checkpoints that cross between
the graph and FSDP2's hooks both ways.

Each mesh trains one chain in one spawn of its ranks (tests/test_pp.py `train_many`): eager
FSDP2 for 6 steps, saving every 2; the graph path resumed from eager's step 2, to step 6,
saving every 2; eager again, resumed from the graph's step 4. The graph's steps 3-6 and the
last run's steps 5-6 must be the one-process run's (float32, 1e-5; float8: eager float8 on the
same mesh, within the float8 tests' tolerance), so each path reads the other's checkpoint as
its own. The graph is compiled with `aot_eager`: Dynamo, AOTAutograd and the collectives in
the graph as with Inductor, without generating kernels (a third of the time); Inductor's own
passes over these graphs (buckets, resharding) are tests/test_graph_fsdp.py's, and the drills
run the compositions under Inductor.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from parallel.plan import graph_buckets
from tests.distributed import run_distributed
from tests.test_pp import train_many
from tests.test_train import FP32, TINY, train_losses

GRAPH = ["--compile.enabled=true", "--compile.fsdp=graph", "--compile.backend=aot_eager"]
INDUCTOR = ["--compile.enabled=true", "--compile.fsdp=graph"]
CHAIN = ["--train.steps=6", "--train.micro_batch_size=2", "--checkpoint.interval=2",
         "--checkpoint.keep_last=0", "--data.attention_mask=document"]  # fmt: skip
FP8 = ["--fp8.enabled=true", "--fp8.emulate=true", "--fp8.filter=none"]
MESHES = {  # world, mesh flags
    "dp2_tp2": (4, ["--parallel.tp=2"]),
    "pp2_dp2_interleaved": (4, ["--parallel.pp=2", "--parallel.pipeline.schedule=interleaved_1f1b",
                                "--model.n_layers=4", "--model.tie_embeddings=true"]),
    "fp8_dp2": (2, FP8),
    # Drills: HSDP with tp (8 ranks), pp with tp, float8 with tp, and Inductor's kernels.
    "hsdp2x2_tp2": (8, ["--parallel.dp_replicate=2", "--parallel.tp=2"]),
    "pp2_dp2_tp2": (8, ["--parallel.pp=2", "--parallel.tp=2", "--model.n_layers=4"]),
    "fp8_dp2_tp2": (4, [*FP8, "--parallel.tp=2"]),
}  # fmt: skip


def argv(dataset: str, out: Path, name: str, *extra: str) -> list[str]:
    return [f"--data.path={dataset}", f"--run.output_dir={out}", f"--run.name={name}",
            *TINY, *FP32, *CHAIN, *extra]  # fmt: skip


def chain(dataset: str, out: Path, mesh: str, graph: list[str]) -> dict[str, Any]:
    """The module docstring's three runs on `mesh`'s ranks, and the reference: the
    one-process run (float8: eager on the mesh, the chain's first run); "graph_sent": what
    rank 0's all-gathers sent in the graph's run (`train_counted`)."""
    world, flags = MESHES[mesh]
    step = out / "{}" / "checkpoints" / "step-{}"
    runs = {
        "eager": argv(dataset, out, f"{mesh}-eager", *flags),
        "graph": argv(dataset, out, f"{mesh}-graph", *flags, *graph,
                      f"--checkpoint.resume={str(step).format(f'{mesh}-eager', 2)}"),
        "back": argv(dataset, out, f"{mesh}-back", *flags,
                     f"--checkpoint.resume={str(step).format(f'{mesh}-graph', 4)}"),
    }  # fmt: skip
    got, sent = run_distributed(train_counted, world, list(runs.values()), str(out),
                                timeout=900)[0]  # fmt: skip
    losses = dict(zip(runs, got, strict=True)) | {"graph_sent": sent[1]}
    if "fp8.enabled=true" in " ".join(flags):
        losses["reference"] = losses["eager"]
    else:
        model = [f for f in flags if f.startswith("--model.")]
        one = argv(dataset, out, f"{mesh}-one", *model)
        losses["reference"] = run_distributed(train_losses, 1, one)[0]
    return losses


def assert_chain(losses: dict[str, list[float]], rtol: float, atol: float) -> None:
    want = torch.tensor(losses["reference"])
    for run, first in (("eager", 0), ("graph", 2), ("back", 4)):
        got = torch.tensor(losses[run])
        torch.testing.assert_close(got, want[first:], rtol=rtol, atol=atol, msg=run)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, graph", [
    pytest.param("dp2_tp2", GRAPH, id="dp2_tp2"),
    pytest.param("pp2_dp2_interleaved", GRAPH, id="pp2_dp2_interleaved"),
    pytest.param("hsdp2x2_tp2", GRAPH, marks=pytest.mark.drill, id="hsdp2x2_tp2"),
    pytest.param("pp2_dp2_tp2", GRAPH, marks=pytest.mark.drill, id="pp2_dp2_tp2"),
    pytest.param("dp2_tp2", INDUCTOR, marks=pytest.mark.drill, id="dp2_tp2-inductor"),
    pytest.param("pp2_dp2_interleaved", INDUCTOR, marks=pytest.mark.drill,
                 id="pp2_dp2_interleaved-inductor"),
])  # fmt: skip
def test_graph_with_tp_and_pp_is_the_one_process_run(
    short_docs: str, tmp_path: Path, mesh: str, graph: list[str]
) -> None:
    """Float32, 6 steps of 2 micro-batches a rank, document masking: FSDP 2 x tp 2 (each
    weight a DTensor on (dp_shard, tp) with FSDP2's placements, its tp part gathered in the
    graph), pp 2 x FSDP 2 with interleaved 1F1B and tied embeddings (each stage its own graph),
    and in the drills HSDP 2 x 2 x tp 2, pp 2 x FSDP 2 x tp 2 and the first two under
    Inductor: the graph's losses and those of eager resumed from its checkpoint equal one
    process within 1e-5."""
    losses = chain(short_docs, tmp_path, mesh, graph)
    assert_chain(losses, rtol=0, atol=1e-5)
    flags = MESHES[mesh][1]
    if "--parallel.pp=2" in flags or graph == INDUCTOR:  # pp: rank 0 gathers its stages only
        return
    # Every weight crossed as the planner's tp-aware term says (bucket_mb=0: one bucket each);
    # tp's own all-gathers of activations cross too.
    shape = planned_shape(argv(short_docs, tmp_path, mesh, *flags))
    planned = set(graph_buckets(shape, 2, "float32", "float32", 0.0, tp=2).all_gather)
    sent = {n * 2 * 4 for kind, n in losses["graph_sent"] if kind == "float"}
    assert planned <= sent, (planned - sent, sent)


def train_counted(argvs: list[list[str]], folder: str) -> tuple[list[list[float]], list]:
    """tests/test_pp.py's train_many with each training step under the profiler (not the
    build, whose `to_empty` cannot swap parameters the profiler holds; not the checkpoints,
    whose metadata crosses by all-gather too): each run's losses, and the sizes of what this
    rank's gloo all-gathers sent in its steps, by element type: Counter({(type, elements):
    calls})."""
    from torch.profiler import ProfilerActivity, profile

    import train as trainer

    step, sent = trainer.train_step, []

    def profiled(*args: Any, **kwargs: Any) -> Any:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            result = step(*args, **kwargs)
        for event in prof.profiler.kineto_results.events():  # these have the input types
            if event.name() == "gloo:all_gather" and event.shapes():
                numel = int(torch.tensor(event.shapes()[0]).prod())
                sent[-1][(event.dtypes()[0], numel)] += 1
        return result

    def run(argv: list[str]) -> list[float]:
        sent.append(Counter())
        return train_losses(argv)

    trainer.train_step = profiled
    try:
        return train_many(argvs, folder, run), sent
    finally:
        trainer.train_step = step


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["fp8_dp2", pytest.param("fp8_dp2_tp2", marks=pytest.mark.drill)])
def test_graph_gathers_float8_weights_and_is_the_eager_float8_run(
    short_docs: str, tmp_path: Path, mesh: str
) -> None:
    """Float8 (emulated, tensorwise, every Linear but the output): the graph's losses and those
    of eager resumed from its checkpoint are eager FSDP2's with float8 on the same mesh, within
    the float8 tests' tolerance (the drill: with tp 2 too). What the graph gathers of a
    converted weight is its float8 bytes (1 per element, sent as uint8: gloo has no float8),
    never its float32 values; the other weights cross in float32."""
    losses = chain(short_docs, tmp_path, mesh, GRAPH)
    assert_chain(losses, rtol=1e-3, atol=0)
    if mesh != "fp8_dp2":
        return
    shape = planned_shape(argv(short_docs, tmp_path, mesh, *FP8))
    f8 = {n: f for u in shape.units for n, f in zip(u.shapes, u.float8_gathered, strict=True)}
    assert any(f8.values()) and not all(f8.values())
    by_type: dict[str, set[int]] = {}
    for kind, numel in losses["graph_sent"]:
        by_type.setdefault(kind, set()).add(numel * 2)  # gathered: 2 ranks' shards
    converted = {math.prod(s) for s, f in f8.items() if f}
    assert by_type.get("unsigned char") == converted, (by_type, converted)
    assert not by_type.get("float", set()) & converted, (by_type, converted)
    # The planner's gathered bytes per parameter (parallel/plan.py, bucket_mb=0: one bucket
    # each) are what crossed: 1 byte per float8 element, 4 per float32 one.
    sent = {n * (1 if kind == "unsigned char" else 4) for kind, n in losses["graph_sent"]}
    planned = graph_buckets(shape, 2, "float32", "float32", 0.0).all_gather
    assert {2 * n for n in sent} == set(planned)


def planned_shape(argv: list[str]) -> Any:
    """The planner's ModelShape of the run `argv` configures."""
    from configs import parse_config
    from launch.job import JobConfig
    from model import get_family
    from parallel.plan import model_shape

    job = parse_config(JobConfig, argv)
    family = get_family(job.model.name)
    return model_shape(family, family.build_args(job.model), job.fp8, job.lora, job.train.freeze)


def test_planner_counts_the_composed_graphs_gathers(
    short_docs: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner's graph terms (parallel/plan.py): a float8-gathered weight's bucket bytes
    are half its bf16 ones and its gradient's the same; at tp 2 a split weight gathers half
    its elements, a replicated one all; with 'never' the gathered weights held are the whole
    model at those sizes. A dry run plans pp 2 x FSDP 2 x tp 2 with float8 under the graph."""
    import train
    from parallel.plan import plan_memory

    base = argv(short_docs, tmp_path, "plan")
    plain, f8 = planned_shape(base), planned_shape([*base, *FP8])
    b16, b8 = (graph_buckets(s, 2, "bfloat16", "float32", 0.0) for s in (plain, f8))
    flags = [f for u in f8.units for f in u.float8_gathered]
    assert any(flags) and not all(flags)
    for half, whole, f in zip(b8.all_gather, b16.all_gather, flags, strict=True):
        assert half == (whole // 2 if f else whole)
    assert b8.reduce_scatter == b16.reduce_scatter
    split = [t for u in plain.units for t in (u.tp_split or (False,) * len(u.shapes))]
    tp2 = graph_buckets(plain, 2, "bfloat16", "float32", 0.0, tp=2).all_gather
    assert any(split) and not all(split)
    for part, whole, t in zip(tp2, b16.all_gather, split, strict=True):
        assert part == (whole // 2 if t else whole)
    held = plan_memory(f8, 2, 1, 32, "bfloat16", reshard_after_forward="never",
                       graph_bucket_bytes=max(b8.all_gather))["gathered_params"]  # fmt: skip
    assert held == sum(b8.all_gather)
    dry = [*base, *FP8, "--parallel.pp=2", "--parallel.tp=2", "--model.n_layers=4",
           "--compile.enabled=true", "--compile.fsdp=graph", "--dry-run"]  # fmt: skip
    for name, value in (("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "8")):  # planned, not run
        monkeypatch.setenv(name, value)
    assert train.main(dry) == 0
    assert "# compile.fsdp='graph': per micro-batch" in capsys.readouterr().out
