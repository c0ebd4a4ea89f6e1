"""Pipeline parallel (parallel/pp.py, parallel/pp_plan.py): the same run as one process on every
mesh it accepts, checkpoints across pp degrees, one config line for what it refuses.

The trainer runs share their processes: one spawn of N ranks trains several configurations in
turn (`train_many`), since starting ranks costs more than the tiny model. The models have 4
blocks (2 stages per rank on 2 ranks) and tied embeddings: the first and the last stage each
hold the tied weight (on two ranks, or on one in the V schedules), so every run here also
shows that the two copies train as the one weight of the run without pp.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from checkpoint.export import export_checkpoint
from configs import ConfigError, parse_config
from model import FAMILIES, ModelConfig
from parallel.pp_plan import (
    PipelineConfig,
    balanced_split,
    bubble_fraction,
    check_pipeline,
    in_flight,
    p2p_bytes,
    stage_ranks,
)
from tests.distributed import _free_port, run_distributed
from tests.test_families import assert_same_run as assert_same_losses
from tests.test_families import run_argv, scalars
from tests.test_tasks import write_tasks
from tests.test_train import COMPILED, assert_close

PP_SHAPE = ["--model.n_layers=4", "--model.tie_embeddings=true", "--train.steps=6",
            "--metrics.tensorboard=true", "--metrics.log_interval=1"]  # fmt: skip
DEFAULT = ModelConfig().name


def train_many(
    argvs: list[list[str]], folder: str, train: Callable[[list[str]], Any] | None = None
) -> list[Any]:
    """Train each argv in turn in this rank (with `train`, default train_losses), each in a
    process group of its own: on a port that rank 0 finds free just before the run and hands
    the others through `folder` (a second group on the first one's store would wait forever;
    ports chosen all at once may be taken by the time a later run starts)."""
    import os
    import time

    from tests.test_train import train_losses

    losses = []
    for i, argv in enumerate(argvs):
        note = Path(folder) / f"port-{i}"
        if os.environ["RANK"] == "0":
            (Path(folder) / "next").write_text(str(_free_port()))
            (Path(folder) / "next").rename(note)
        deadline = time.monotonic() + 300
        while not note.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.environ["MASTER_PORT"] = note.read_text()
        losses.append((train or train_losses)(argv))
    return losses


def spawn(dataset: str, out: Path, family: str, world: int, runs: dict[str, list[str]]) -> dict:
    """Train `runs` ({name: extra args}) on `world` ranks in one spawn: {name: the losses and
    rank 0's TensorBoard scalars}."""
    mc, lm = write_tasks(out)  # validation and both kinds of eval task, at steps 3 and 6
    evals = ["--train.eval_interval=3", "--train.eval_batches=1", f"--eval.tasks.mc.path={mc}",
             f"--eval.tasks.lm.path={lm}", "--eval.tasks.lm.kind=completion"]  # fmt: skip
    argvs = [run_argv(dataset, out, family, name, *PP_SHAPE, *evals, *extra)
             for name, extra in runs.items()]  # fmt: skip
    folder = tempfile.mkdtemp(dir=out)
    losses = run_distributed(train_many, world, argvs, folder, timeout=600)[0]
    return {n: {"losses": got} | scalars(out / n) for n, got in zip(runs, losses, strict=True)}


@pytest.fixture(scope="module")
def reference(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """`reference(family)`: one process, 4 micro-batches of 2 per step, a checkpoint at step 3
    (trained once per module), with its output folder as "out"."""
    runs: dict[str, dict[str, Any]] = {}

    def run(family: str) -> dict[str, Any]:
        if family not in runs:
            out = tmp_path_factory.mktemp(f"pp_{family}")
            one = {"one": ["--checkpoint.interval=3"]}
            runs[family] = spawn(tiny_dataset, out, family, 1, one)["one"] | {"out": out}
        return runs[family]

    return run


def assert_same_run(got: dict, want: dict, steps: slice = slice(None)) -> None:
    """Losses, grad norms, step-term losses (test_families) and, at steps 3 and 6 (of those in
    `steps`), the validation loss and the eval tasks' scores within 1e-5."""
    evals = [t for t in want if t.startswith(("loss/val", "eval/")) and t != "time/eval_s"]
    per_step = {t: v for t, v in want.items() if t not in evals}
    assert_same_losses({t: v for t, v in got.items() if t not in evals}, per_step, steps)
    assert "loss/val" in evals and any(t.startswith("eval/mc/") for t in evals), list(want)
    for tag in evals:
        last = want[tag][-len(got[tag]) :]
        assert_close(got[tag], last, rtol=1e-5)


def _families(quick: str) -> list[Any]:
    """Every family: `quick` in the quick tier, qwen3_moe in the full run, qwen3 (a dense block
    like llama3's, with the same pipeline code path) in the drills (-m drill), for the suite's
    time."""
    marks = {quick: [], "qwen3": [pytest.mark.drill]}
    return [pytest.param(f, marks=marks.get(f, [pytest.mark.slow])) for f in FAMILIES]


@pytest.fixture(scope="module")
def pipelined(
    reference: Callable[[str], dict], tiny_dataset: str
) -> Callable[[str], dict[str, dict]]:
    """`pipelined(family)`: pp 2 on 2 ranks with 1F1B (a checkpoint at step 3), interleaved
    1F1B (2 stages per rank) and ZBV, in one spawn (once per module), beside the reference."""
    runs: dict[str, dict[str, dict]] = {}
    schedules = {
        "1f1b": ["--parallel.pp=2", "--checkpoint.interval=3"],
        "interleaved": ["--parallel.pp=2", "--parallel.pipeline.schedule=interleaved_1f1b"],
        "zbv": ["--parallel.pp=2", "--parallel.pipeline.schedule=zbv"],
    }

    def run(family: str) -> dict[str, dict]:
        if family not in runs:
            runs[family] = spawn(tiny_dataset, reference(family)["out"], family, 2, schedules)
        return runs[family]

    return run


@pytest.mark.parametrize("family", _families(DEFAULT))
def test_every_schedule_gives_the_one_process_run(
    family: str, reference: Callable[[str], dict], pipelined: Callable[[str], dict]
) -> None:
    """pp 2 on 2 ranks, 4 micro-batches per step: 1F1B, interleaved 1F1B with 2 stages per
    rank and zero-bubble V give the one-process losses, gradient norms (over every stage),
    step-term losses (an MoE's aux loss, summed over the stages' blocks), validation loss and
    eval scores within 1e-5; the 1F1B run's checkpoint holds the same keys and shapes as the
    one-process run's."""
    from torch.distributed.checkpoint import FileSystemReader

    want, got = reference(family), pipelined(family)
    assert want["losses"][-1] < want["losses"][0] - 0.5, want["losses"]
    for name in ("1f1b", "interleaved", "zbv"):
        assert_same_run(got[name], want)

    def keys(run: str) -> dict[str, tuple]:
        path = want["out"] / run / "checkpoints" / "step-3"
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: tuple(getattr(v, "size", ())) for k, v in meta.items() if k != "config"}

    assert keys("1f1b") == keys("one")


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", [f if f == DEFAULT else pytest.param(f, marks=pytest.mark.drill) for f in FAMILIES]
)  # ~40 s of 2 cores each; qwen3 and qwen3_moe run in the drills (-m drill)
def test_pp_composes_and_resumes_across_pp_degrees(
    family: str,
    reference: Callable[[str], dict],
    pipelined: Callable[[str], dict],
    tiny_dataset: str,
) -> None:
    """On 4 ranks, in one spawn: pp 2 x dp_shard 2 (2 micro-batches per rank), pp 2 x tp 2,
    DualPipeV x dp_shard 2 and (the default family) pp 2 x cp 2 give the one-process run; the
    pp 2 run's step-3 checkpoint resumed at pp 4 and at pp 1 (FSDP 1x4), and the one-process
    checkpoint at pp 2 x dp_shard 2, continue it."""
    want = reference(family)
    out = want["out"]
    pipelined(family)  # its 1F1B run saved step 3
    one, step3 = (out / run / "checkpoints" / "step-3" for run in ("one", "1f1b"))
    runs = {
        "pp2_dp2": ["--parallel.pp=2"],
        "pp2_tp2": ["--parallel.pp=2", "--parallel.tp=2"],
        "dualpipev": ["--parallel.pp=2", "--parallel.pipeline.schedule=dualpipev",
                      "--train.micro_batch_size=1"],
        "to_pp4": ["--parallel.pp=4", f"--checkpoint.resume={step3}",
                   "--train.micro_batch_size=1"],
        "to_pp1": [f"--checkpoint.resume={step3}", "--train.micro_batch_size=1"],
        "from_one": ["--parallel.pp=2", f"--checkpoint.resume={one}"],
    }  # fmt: skip
    if family == DEFAULT:
        runs["pp2_cp2"] = ["--parallel.pp=2", "--parallel.cp=2"]
    got = spawn(tiny_dataset, out, family, 4, runs)
    for name in ("pp2_dp2", "pp2_tp2", "dualpipev", "pp2_cp2"):
        if name in got:
            assert_same_run(got[name], want)
    for name in ("to_pp4", "to_pp1", "from_one"):
        assert_same_run(got[name], want, slice(3, None))
    # The Hugging Face export of the pp 2 checkpoint is the one-process checkpoint's.
    exported = {}
    for run in ("1f1b", "one"):
        export_checkpoint(out / run / "checkpoints" / "step-3", out / f"hf_{run}", torch.float32)
        exported[run] = load_file(out / f"hf_{run}" / "model.safetensors")
    assert exported["1f1b"].keys() == exported["one"].keys()
    for key, tensor in exported["one"].items():
        torch.testing.assert_close(exported["1f1b"][key], tensor, rtol=1e-5, atol=1e-6)


COMPOSED = {  # each against one process with the same settings
    "ac_lora": ["--ac.mode=full", "--lora.enabled=true"],
    # The tied embedding frozen by its other name: both stages' copies freeze, none is sent.
    "freeze_documents_chunks": ["--train.freeze=layers.0.*,output.weight",
                                "--data.attention_mask=document", "--train.loss_chunk_tokens=16"],
    "muon": ["--optim.name=muon"],
}  # fmt: skip


@pytest.mark.slow
def test_pp_composes_with_the_trainers_features(
    reference: Callable[[str], dict], tiny_dataset: str, tmp_path: Path
) -> None:
    """pp 2 gives the one-process run with full AC and LoRA, with a frozen block and tied
    embedding, document masking and the chunked loss, with Muon (ZBV: 2 stages per rank, its
    owners within each stage), from Hugging Face weights (each rank reads its stages'
    tensors), and compiled (1F1B, against the plain reference)."""
    want = reference(DEFAULT)
    hf = tmp_path / "hf"  # the reference's step 3, exported: a start from Hugging Face weights
    export_checkpoint(want["out"] / "one" / "checkpoints" / "step-3", hf, torch.float32)
    composed = COMPOSED | {"from_hf": [f"--checkpoint.init_from_hf={hf}"]}
    alone = spawn(tiny_dataset, tmp_path, DEFAULT, 1, composed)
    runs = {name: ["--parallel.pp=2", *extra] for name, extra in composed.items()}
    runs["muon"].append("--parallel.pipeline.schedule=zbv")
    runs["compiled"] = ["--parallel.pp=2", *COMPILED]
    got = spawn(tiny_dataset, tmp_path, DEFAULT, 2, runs)
    for name in composed:
        assert_same_run(got[name], alone[name])
    assert_same_run(got["compiled"], want)


# ---- config checks, before any collective -----------------------------------------------------


def _check(tiny_dataset: str, tmp_path: Path, world: int, *extra: str) -> Any:
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    argv = run_argv(tiny_dataset, tmp_path, "llama3", "check", "--model.n_layers=4",
                    "--model.tie_embeddings=false", *extra)  # fmt: skip
    return check_config(parse_config(JobConfig, argv), LaunchEnv(0, 0, world, world, 1))


@pytest.mark.parametrize(
    ("world", "extra", "says"),
    [
        (4, ["--parallel.pp=3"], "must divide the world size"),
        (2, ["--parallel.pp=2", "--parallel.pipeline.stages_per_rank=2"], "runs 1 stage(s)"),
        (2, ["--parallel.pp=2", "--parallel.pipeline.schedule=interleaved_1f1b",
             "--parallel.pipeline.stages_per_rank=3"], "the model has 4 blocks"),
        (2, ["--parallel.pp=2", "--parallel.pipeline.split=3,2"], "sum to the model's 4"),
        (2, ["--parallel.pp=2", "--parallel.pipeline.microbatches=2"], "the step has 4"),
        (2, ["--parallel.pp=2", "--parallel.pipeline.schedule=zbv",
             "--train.micro_batch_size=4"], "at least 4 micro-batches"),
        (2, ["--parallel.pp=2", "--parallel.pipeline.schedule=zbv", "--compile.enabled=true"],
         "compiled blocks hide"),
    ],
)  # fmt: skip
def test_config_errors_say_what_would_work(
    world: int, extra: list[str], says: str, tiny_dataset: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        _check(tiny_dataset, tmp_path, world, *extra)
    assert says in str(err.value), err.value
    assert "\n" not in str(err.value)


def test_accepted_mesh_and_split(tiny_dataset: str, tmp_path: Path) -> None:
    """pp is outside the data-parallel dims: 8 ranks at pp 2 x tp 2 leave dp_shard 2."""
    plan = _check(tiny_dataset, tmp_path, 8, "--parallel.pp=2", "--parallel.tp=2",
                  "--parallel.pipeline.split=1,3")  # fmt: skip
    assert (plan.pp, plan.dp_replicate, plan.dp_shard, plan.tp) == (2, 1, 2, 2)
    assert plan.grad_accum_steps == 2


# ---- the split and the planner's terms ----------------------------------------------------------


def test_split_balances_cost_with_the_output_on_the_last_stage() -> None:
    assert balanced_split([1.0] * 6, 0.6, 2) == [3, 3]
    assert balanced_split([1.0] * 8, 0.0, 4) == [2, 2, 2, 2]
    # An output projection worth 1.2 blocks: the last stage takes fewer blocks.
    assert balanced_split([1.0] * 80, 1.2, 8) == [10, 10, 10, 10, 10, 10, 11, 9]
    assert balanced_split([1.0] * 78, 2.0, 8) == [10, 10, 10, 10, 10, 10, 10, 8]
    # The heavy block alone: no stage costs more than 5.
    assert balanced_split([1.0, 5.0, 1.0, 1.0, 1.0], 0.0, 3) == [1, 1, 3]


def test_stage_placement_loop_and_v() -> None:
    assert stage_ranks(2, 1, "1f1b") == [0, 1]
    assert stage_ranks(2, 2, "interleaved_1f1b") == [0, 1, 0, 1]
    assert stage_ranks(4, 2, "zbv") == [0, 1, 2, 3, 3, 2, 1, 0]


def test_bubble_in_flight_and_p2p_terms() -> None:
    assert bubble_fraction("1f1b", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("zbv", 4, 8, 2) == 0.0
    assert bubble_fraction("1f1b", 1, 8, 1) == 0.0
    assert in_flight("gpipe", 4, 8, 1) == 8 and in_flight("1f1b", 4, 8, 1) == 4
    assert in_flight("interleaved_1f1b", 2, 4, 2) == pytest.approx(2.5)
    # 1F1B on 4 ranks: the middle ranks send both ways, the ends one way.
    assert [p2p_bytes("1f1b", 4, 8, 1, 10.0, r) for r in range(4)] == [80, 160, 160, 80]
    # V: the turn between stage p-1 and p stays on rank p-1.
    assert [p2p_bytes("zbv", 2, 8, 2, 10.0, r) for r in range(2)] == [160, 160]


def test_pipeline_config_checks() -> None:
    cfg = PipelineConfig(schedule="interleaved_1f1b", stages_per_rank=2)
    check_pipeline(cfg, 2, 4, 4, compiled=False)
    with pytest.raises(ConfigError, match="multiple of pp"):
        check_pipeline(cfg, 2, 4, 3, compiled=False)
    with pytest.raises(ConfigError):
        PipelineConfig(split=[0, 4])


def test_probe_layout_of_every_family() -> None:
    """The contract alone names each family's parts: embeddings first, norm and output last,
    and a tied embedding's two names; an MoE block's aux loss and expert load are its extra
    outputs."""
    from parallel.pp_split import probe_layout

    for (name, family), tied in zip(FAMILIES.items(), [False, True] * 2, strict=False):
        args = family.build_args(ModelConfig(name, n_layers=3, tie_embeddings=tied))
        with torch.device("meta"):
            model = family.build_model(args)
        layout = probe_layout(model, family)
        assert layout.blocks == ["layers.0", "layers.1", "layers.2"]
        assert (layout.head, layout.tail) == (["tok_embeddings"], ["norm", "output"])
        assert layout.ties == ([["tok_embeddings.weight", "output.weight"]] if tied else [])
        if hasattr(args, "n_experts"):
            assert layout.extras[0] == (((), torch.float32), ((args.n_experts,), torch.float32))
        else:
            assert layout.extras == [None] * 3


class _Toy(nn.Module):
    """Embeddings, two blocks and an output projection; `tie` shares one weight between two
    modules: "inside" (two layers of block 0), "blocks" (block 1 uses block 0's), "nested" (the
    output uses an embedding held one module deeper than the head module), "bias" (tied
    embeddings, the output projection with a bias)."""

    def __init__(self, tie: str) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Embedding(8, 4))
        first = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.blocks = nn.ModuleList([first, nn.Linear(4, 4)])
        self.out = nn.Linear(4, 8, bias=False)
        if tie == "inside":
            first[1].weight = first[0].weight
        if tie == "blocks":
            self.blocks[1].weight = first[0].weight
        if tie == "nested":
            self.out.weight = self.head[0].weight
        if tie == "bias":  # tied embeddings, with a bias of its own beside the output's weight
            self.head, self.out = nn.Embedding(8, 4), nn.Linear(4, 8)
            self.out.weight = self.head.weight

    def init_buffers(self, rope_len: int) -> None:
        pass

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.head(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def test_a_weight_stages_cannot_hold_apart_is_one_config_line() -> None:
    """A weight shared by two blocks, tied inside a submodule of the modules outside the blocks,
    or tied to an output projection that has weights of its own besides, is refused by name;
    one shared inside a block is the block's stage's (tied embeddings of the families train:
    the runs above)."""
    from types import SimpleNamespace

    from parallel.pp_split import probe_layout

    family = SimpleNamespace(fsdp_units=lambda model: list(model.blocks))
    for tie in ("", "inside"):
        assert probe_layout(_Toy(tie), family).ties == []  # type: ignore[arg-type]
    for tie, says in (("blocks", "blocks.0.0.weight, blocks.1.weight are one weight"),
                      ("nested", "head.0.weight, out.weight are one weight"),
                      ("bias", "out holds out.bias beside the tied out.weight")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            probe_layout(_Toy(tie), family)  # type: ignore[arg-type]
        assert says in str(err.value) and "\n" not in str(err.value)


def _check_tie_split(shapes: list[tuple[int, int]]) -> str:
    """On 2 ranks, rank r holding pipeline stage r of 2 whose tied weight has shape
    `shapes[r]`: the line Pipeline's check raises before any send, or "" if none."""
    import torch.distributed as dist

    from parallel.pp import Pipeline
    from parallel.pp_split import Stage

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Module()
    model.head = nn.Linear(*shapes[rank], bias=False)
    pipeline = Pipeline.__new__(Pipeline)  # the check alone, without torch's schedule
    pipeline.stages = [Stage(rank, model, None)]
    pipeline.ties = [["head.weight", "tail.weight"]]
    pipeline.owners, pipeline.ends, pipeline.group = [0, 1], (0, 1), dist.group.WORLD
    pipeline.device = torch.device("cpu")
    try:
        pipeline._check_ties()
    except ValueError as err:
        return str(err)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return ""


def test_the_two_copies_of_a_tied_weight_must_be_split_alike() -> None:
    """The first and the last stage's copies, split alike, pass; split otherwise (a fork's
    TP_PLAN styling the embedding and the output projection differently), both ranks raise
    one line before a send could mix their shards."""
    assert run_distributed(_check_tie_split, 2, [(4, 2), (4, 2)]) == ["", ""]
    lines = run_distributed(_check_tie_split, 2, [(4, 2), (2, 4)])
    assert all("split the tied head.weight differently" in line for line in lines), lines
    assert all("\n" not in line for line in lines)


def test_planner_counts_a_tied_weights_replica() -> None:
    """Under pp with tied embeddings the last stage's rank holds a replica of the embedding: its
    parameter and gradient as the untied output projection's, no optimizer state, and the
    gradient's shard sent per step (the first stage's rank sends the weight's)."""
    from parallel.plan import plan_communication, plan_memory
    from parallel.pp_plan import plan_pipeline
    from parallel.shape import model_shape

    def memory(part: Any, last: bool) -> dict[str, float]:
        mem = plan_memory(part, 2, 1, 1024, "float32", pipelined=True)
        return mem if last else mem | {"logits": 0.0}

    family, cfg = FAMILIES[DEFAULT], PipelineConfig(schedule="gpipe", split=[2, 2])
    plans = {}
    for tied in (False, True):
        args = family.build_args(ModelConfig(DEFAULT, n_layers=4, tie_embeddings=tied))
        plans[tied] = plan_pipeline(
            model_shape(family, args), cfg, 2, 4, 1, 1024, memory,
            lambda part: plan_communication(part, 1, 2, "float32", pipelined=True), "float32",
        )  # fmt: skip
    (untied, untied_comm, where), (tied, tied_comm, tied_where) = plans[False], plans[True]
    assert where["rank"] == tied_where["rank"] == 1  # the last stage's (its logits): compared
    shard = args.vocab_size * args.dim // 2
    assert tied["params"] == untied["params"] and tied["grads"] == untied["grads"]
    assert tied["optimizer"] == untied["optimizer"] - 8 * shard - 4
    sent = tied_comm["pp"]["send_recv"] - untied_comm["pp"]["send_recv"]
    assert sent == 4 * shard


def p2p_per_step(argvs: list[list[str]], folder: str) -> list[float]:
    """Train each argv (as `train_many`) with every point-to-point send counted: the bytes
    this rank sent in the last step's schedule, for each argv."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import parallel.pp

    sent, steps, in_send = [0], [], [False]
    isend, send, step = c10d.isend, c10d.send, parallel.pp.Pipeline.step

    def counting_isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not in_send[0]:
            sent[0] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    def counting_send(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        in_send[0] = True  # some torch versions' send calls isend: counted once
        try:
            return send(tensor, *args, **kwargs)
        finally:
            in_send[0] = False

    def counted_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = sent[0]
        result = step(self, *args, **kwargs)
        steps.append(sent[0] - before)
        return result

    # P2POp checks its op against c10d's isend: the same function in both places.
    c10d.isend = dist.isend = counting_isend
    c10d.send = dist.send = counting_send  # the tied weight's shard (parallel/pp.py)
    parallel.pp.Pipeline.step = counted_step
    last = []
    for i, argv in enumerate(argvs):
        train_many([argv], str(Path(folder) / str(i)))
        last.append(float(steps[-1]))
    return last


@pytest.mark.slow
def test_planner_p2p_bytes_match_gloo(tiny_dataset: str, tmp_path: Path) -> None:
    """The bytes each pp rank sends per step (activations forward, their gradients back, none
    across the V's turn; with tied embeddings, the weight's shard one way and its gradient's the
    other, none in the V) are the planner's within 1%, for 1F1B, interleaved 1F1B and ZBV."""
    schedules = {"1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}
    argvs = [run_argv(tiny_dataset, tmp_path, DEFAULT, s, "--model.n_layers=4",
                      "--model.tie_embeddings=true", "--train.steps=2", "--parallel.pp=2",
                      f"--parallel.pipeline.schedule={s}") for s in schedules]  # fmt: skip
    for i in range(len(argvs)):
        (tmp_path / str(i)).mkdir()
    got = run_distributed(p2p_per_step, 2, argvs, str(tmp_path), timeout=600)
    hidden = 2 * 32 * 64 * 4  # micro-batch x seq_len x dim, float32
    tie = 512 * 64 * 4  # vocab x dim, float32, on one data-parallel rank
    for i, (schedule, v) in enumerate(schedules.items()):
        for rank in range(2):
            want = p2p_bytes(schedule, 2, 4, v, hidden, rank)  # type: ignore[arg-type]
            want += tie if schedule != "zbv" else 0
            assert got[rank][i] == pytest.approx(want, rel=0.01), (schedule, rank)


def test_planner_cli_and_dry_run_show_the_pipeline(
    capsys: pytest.CaptureFixture[str], tiny_dataset: str, tmp_path: Path
) -> None:
    """`python -m launch.plan --pp` adds pipeline columns with their bubble and sends; the dry
    run prints the schedule, the split and the bubble for the configured pp."""
    from launch.check import dry_run
    from launch.job import JobConfig
    from launch.plan import main
    from parallel.dims import LaunchEnv

    main(["--model", "70B", "--nodes", "8", "--pp", "4", "--tp", "8", "--ac", "full"])
    out = capsys.readouterr().out
    assert "PP4 FSDP 1x2 TP8" in out and "sent/step: pp send_recv" in out
    assert "PP4 FSDP 1x2 TP8: " in out and "bubble 8.6%" in out
    # A mixture of experts: EP groups inside each stage's GPUs, with and without tp.
    main(["--family", "qwen3_moe", "--model", "30B-A3B", "--nodes", "4", "--pp", "2", "--tp",
          "8", "--ep", "8"])  # fmt: skip
    out = capsys.readouterr().out
    assert "PP2 FSDP 1x16 EP8: " in out and "PP2 FSDP 1x2 TP8 EP8: " in out
    argv = run_argv(tiny_dataset, tmp_path, "llama3", "check", "--parallel.pp=2",
                    "--model.n_layers=4", "--model.tie_embeddings=false")  # fmt: skip
    job = parse_config(JobConfig, argv)
    plan = _check(tiny_dataset, tmp_path, 2, "--parallel.pp=2")
    dry_run(job, plan, LaunchEnv(0, 0, 2, 2, 1))
    out = capsys.readouterr().out
    assert "pipeline: pp=2 1f1b over 4 micro-batches, blocks per stage [2, 2]" in out
    assert "PP2 FSDP 1x1" in out and "pp send_recv" in out


def test_an_elastic_restart_keeps_pp(tiny_dataset: str, tmp_path: Path) -> None:
    """A world that loses a node keeps pp and the global batch: the replicas go, and the
    gradient accumulation (the pipeline's micro-batches) grows."""
    from launch.elastic import choose_mesh
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    argv = run_argv(tiny_dataset, tmp_path, "llama3", "elastic", "--parallel.pp=2",
                    "--parallel.dp_replicate=-1", "--parallel.dp_shard=1",
                    "--model.n_layers=4", "--model.tie_embeddings=false")  # fmt: skip
    job = parse_config(JobConfig, argv)
    family = FAMILIES["llama3"]
    args = family.build_args(job.model)
    before = choose_mesh(job, family, args, LaunchEnv(0, 0, 8, 4, 2))
    after = choose_mesh(job, family, args, LaunchEnv(0, 0, 4, 4, 1))
    assert (before.dp_replicate, before.dp_shard, before.grad_accum_steps) == (4, 1, 1)
    assert (after.dp_replicate, after.dp_shard, after.grad_accum_steps) == (2, 1, 2)


def train_stopped_by_the_last_stage(argv: list[str]) -> list[float]:
    """Train, with a stop request reaching only the last pp rank, during step 3."""
    import os
    import signal

    import train
    from tests.test_train import train_losses

    step = train.train_step

    def stop_on_the_last_stage(run: Any, batches: Any, log: bool, stop: Any, saved: bool) -> Any:
        if run.pipeline is not None and run.pipeline.holds_last and run.progress.step == 2:
            stop._handle(signal.SIGUSR1, None)  # as if delivered to this rank alone
        return step(run, batches, log, stop, saved)

    train.train_step = stop_on_the_last_stage
    assert os.environ["RANK"] in ("0", "1")
    return train_losses(argv)


@pytest.mark.slow
def test_a_stop_reaching_one_stage_stops_every_stage_after_the_same_step(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """The stop flag rides on the step's all-reduce over every rank: both stages end after
    step 3 and save it."""
    argv = run_argv(tiny_dataset, tmp_path, DEFAULT, "stopped", "--model.n_layers=4",
                    "--model.tie_embeddings=false", "--train.steps=6", "--parallel.pp=2",
                    "--checkpoint.interval=100")  # fmt: skip
    losses = run_distributed(train_stopped_by_the_last_stage, 2, argv, timeout=600)
    assert [len(rank) for rank in losses] == [3, 3]
    assert (tmp_path / "stopped" / "checkpoints" / "step-3").is_dir()
