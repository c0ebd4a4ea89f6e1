"""DPO (`[dpo]`, parallel/dpo.py): TRL's numbers, on every mesh, with each reference.

The model and pairs are docs/examples/preferences.py's; TRL's numbers are
tests/golden/dpo_trl.json (tests/golden/dpo_trl.py), or TRL itself where it is installed
(`pip install -e ".[trl]"`)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import _free_port, run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "golden"))
import dpo_trl  # noqa: E402

METRICS = ("loss/train", "grad_norm", *dpo_trl.METRICS)
# What the evaluation after the last step logs (TRL's eval_loss and eval_ metrics).
VAL = {"loss/val": "loss"} | {f"{name}/val": name for name in dpo_trl.METRICS}


def dpo_argv(prefs: dict[str, Path], out: Path, case: str, *extra: str) -> list[str]:
    """The trainer's settings of the golden's `case` (tests/golden/dpo_trl.py)."""
    s, c = dpo_trl.SETTINGS, dpo_trl.CASES[case]
    return [
        f"--data.path={prefs['data']}", f"--run.output_dir={out}", f"--run.name={case}",
        f"--checkpoint.init_from_hf={prefs['model']}", "--model.dim=64", "--model.n_layers=2",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.vocab_size=258",
        "--parallel.param_dtype=float32", f"--data.seq_len={s['seq_len']}", "--data.shuffle=false",
        f"--train.global_batch_size={s['batch']}", f"--train.steps={s['steps']}",
        f"--optim.lr={s['lr']}", "--optim.warmup_steps=0", "--optim.decay=constant",
        "--optim.weight_decay=0", "--optim.beta2=0.999", "--optim.eps=1e-8",
        f"--train.max_grad_norm={s['max_grad_norm']}", f"--train.eval_interval={s['steps']}",
        "--train.eval_batches=1",
        "--metrics.tensorboard=true", "--metrics.log_interval=1", "--checkpoint.interval=0",
        "--dpo.enabled=true", f"--dpo.loss_type={c['loss_type']}", f"--dpo.beta={c['beta']}",
        f"--dpo.label_smoothing={c['label_smoothing']}", *extra,
    ]  # fmt: skip


def logged_run(argv: list[str]) -> list[dict[str, float]]:
    """Train `argv` in this process (a rank); its logged scalars (METRICS) per step, and on its
    last step the last evaluation's (VAL), read back from TensorBoard (rank 0 writes them;
    every rank returns them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from configs import parse_config
    from launch.job import JobConfig
    from parallel.ft_config import group_folder
    from tests.test_train import train_losses

    losses = train_losses(argv)
    job = parse_config(JobConfig, argv)
    run_dir = group_folder(Path(job.run.output_dir) / job.run.name, job.ft)  # ft: the group's
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = [{"loss/train": loss} for loss in losses]
    for name in METRICS[1:]:  # after a resume, the steps this run took are the last ones
        for step, event in zip(steps, events.Scalars(name)[-len(steps) :], strict=True):
            step[name] = event.value
    steps[-1] |= {name: events.Scalars(name)[-1].value for name in VAL}
    return steps


def train_runs(runs: list[list[str]], ports: list[int]) -> list[list[dict[str, float]]]:
    """`logged_run` of each run in turn, each its own process group on its own port of `ports`
    (the last run's store may live on in DTensor's caches)."""
    results = []
    for argv, port in zip(runs, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        results.append(logged_run(argv))
    return results


def spawn(world: int, runs: list[list[str]], nodes: int = 1) -> list[list[dict[str, float]]]:
    """`train_runs` on `world` ranks; rank 0's results."""
    ports = [_free_port() for _ in runs]
    return run_distributed(train_runs, world, runs, ports, nodes=nodes)[0]


def trl_steps(prefs: dict[str, Path], case: str) -> dict:
    """TRL's numbers for `case` (each step's, "steps", and the evaluation's after the last,
    "eval"): TRL itself where it is installed, else the golden file."""
    try:
        import trl  # noqa: F401
    except ImportError:
        golden = json.loads(dpo_trl.GOLDEN.read_text())
        return {"steps": golden["steps"][case], "eval": golden["eval"][case]}
    return dpo_trl.run_trl(prefs["model"], prefs["pairs"], dpo_trl.CASES[case],
                           prefs["out"] / f"trl-{case}")  # fmt: skip


def assert_trl(ours: list[dict[str, float]], theirs: dict) -> None:
    """Each step's loss, gradient norm and metrics, and the evaluation after the last: TRL's."""
    assert len(ours) == len(theirs["steps"]) == dpo_trl.SETTINGS["steps"]
    for step, (mine, trl) in enumerate(zip(ours, theirs["steps"], strict=True), start=1):
        for name in METRICS:
            expected = trl["loss" if name == "loss/train" else name]
            assert mine[name] == pytest.approx(expected, rel=1e-5, abs=1e-5), (step, name)
    for name, theirs_name in VAL.items():
        expected = theirs["eval"][theirs_name]
        assert ours[-1][name] == pytest.approx(expected, rel=1e-5, abs=1e-5), name


def test_first_steps_match_trl(prefs: dict[str, Path], tmp_path: Path) -> None:
    """Two steps' loss, gradient norm and TRL's six metrics equal TRL's DPOTrainer on the same
    model and pairs (fp32, 1e-5), for the sigmoid, IPO and robust (label smoothing) losses."""
    cases = list(dpo_trl.CASES)
    runs = [dpo_argv(prefs, tmp_path, case) for case in cases]
    ours = spawn(1, runs)
    for case, mine in zip(cases, ours, strict=True):
        assert_trl(mine, trl_steps(prefs, case))


@pytest.mark.slow
def test_meshes_and_references_agree(prefs: dict[str, Path], tmp_path: Path) -> None:
    """FSDP over 2 ranks with 2 micro-batches each gives TRL's numbers (the copy reference and
    the precomputed one); with LoRA, the three references give the same losses (fp32, 1e-5)."""
    lora = ["--lora.enabled=true", "--lora.targets=*.attention.*,*.feed_forward.*"]
    accum = "--train.micro_batch_size=2"
    runs = [
        dpo_argv(prefs, tmp_path / "copy", "sigmoid", accum),
        dpo_argv(prefs, tmp_path / "pre", "sigmoid", accum, "--dpo.reference=precomputed"),
        *(dpo_argv(prefs, tmp_path / ref, "sigmoid", accum, *lora, f"--dpo.reference={ref}")
          for ref in ("lora", "copy", "precomputed")),
    ]  # fmt: skip
    copy, pre, *with_lora = spawn(2, runs)
    theirs = trl_steps(prefs, "sigmoid")
    assert_trl(copy, theirs)
    assert_trl(pre, theirs)
    assert (tmp_path / "pre" / "sigmoid" / "reference_logps.npy").is_file()
    losses = [[step["loss/train"] for step in run] + [run[-1][name] for name in VAL]
              for run in with_lora]  # fmt: skip
    assert losses[0][1] != losses[0][0]  # the adapters trained
    for other in losses[1:]:
        torch.testing.assert_close(torch.tensor(other), torch.tensor(losses[0]), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "nodes", "mesh"),
    [
        pytest.param(4, 1, [], id="fsdp-1x4", marks=pytest.mark.drill),
        pytest.param(4, 2, ["--parallel.dp_replicate=2"], id="hsdp-2x2"),
        pytest.param(2, 1, ["--parallel.tp=2"], id="tp-2", marks=pytest.mark.drill),
        pytest.param(2, 1, ["--parallel.cp=2", "--train.micro_batch_size=4"], id="cp-2"),
        # The log-probs from chunks of 24 tokens: chunks that cross rows, a row in two chunks.
        pytest.param(
            2,
            1,
            ["--train.loss_chunk_tokens=24", "--train.micro_batch_size=2"],
            id="fsdp-2-chunked",
        ),
    ],
)
def test_every_mesh_matches_trl(
    prefs: dict[str, Path], tmp_path: Path, world: int, nodes: int, mesh: list[str]
) -> None:
    """FSDP 1x4 and HSDP 2x2 with 2 micro-batches each, and tp 2: TRL's numbers (fp32, 1e-5),
    with the frozen copy and the precomputed reference."""
    accum = ["--train.micro_batch_size=1"] if world == 4 else []
    runs = [dpo_argv(prefs, tmp_path / ref, "sigmoid", *mesh, *accum, f"--dpo.reference={ref}")
            for ref in ("copy", "precomputed")]  # fmt: skip
    for run in spawn(world, runs, nodes):
        assert_trl(run, trl_steps(prefs, "sigmoid"))


@pytest.mark.slow
def test_pipeline_matches_trl_with_every_reference(prefs: dict[str, Path], tmp_path: Path) -> None:
    """pp 2 (one block a stage) with 4 micro-batches: TRL's numbers (fp32, 1e-5) with the
    frozen copy (a pipeline of its own) and the precomputed reference (one pass through the
    pipeline); with LoRA and the log-probs in chunks, the adapters-off reference gives the
    copy's losses (the first the reference's own: log 2)."""
    pp = ["--parallel.pp=2", "--train.micro_batch_size=2"]
    lora = ["--lora.enabled=true", "--lora.targets=*.attention.*,*.feed_forward.*",
            "--train.loss_chunk_tokens=24"]  # fmt: skip
    runs = [
        *(dpo_argv(prefs, tmp_path / ref, "sigmoid", *pp, f"--dpo.reference={ref}")
          for ref in ("copy", "precomputed")),
        *(dpo_argv(prefs, tmp_path / f"lora-{ref}", "sigmoid", *pp, *lora,
                   f"--dpo.reference={ref}") for ref in ("lora", "copy")),
    ]  # fmt: skip
    copy, pre, *with_lora = spawn(2, runs)
    theirs = trl_steps(prefs, "sigmoid")
    assert_trl(copy, theirs)
    assert_trl(pre, theirs)
    losses = [[step["loss/train"] for step in run] + [run[-1][name] for name in VAL]
              for run in with_lora]  # fmt: skip
    assert losses[0][0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[0][1] != losses[0][0]  # the adapters trained
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


@pytest.mark.slow
def test_a_mixture_of_experts_trains_dpo_alike_on_expert_parallel(
    prefs: dict[str, Path], tmp_path: Path
) -> None:
    """tests/test_families.py's tiny qwen3_moe (both aux losses on), from the seed, on the
    pairs: 1 process and FSDP 2 x ep 2 with 2 micro-batches log the same DPO loss, metrics,
    gradient norm and aux loss (fp32, 1e-5): the family's step terms and the objective's ride
    the same all-reduce, the aux loss a mean over the step's rows (two a pair)."""
    from configs import parse_config
    from data.loader import open_dataset
    from data.pairs import PreferencePairs
    from launch.job import JobConfig
    from model import get_family
    from tests.test_families import RUN_SHAPE, scalars

    def moe(name: str, *extra: str) -> list[str]:
        return [f"--data.path={prefs['data']}", f"--run.output_dir={tmp_path}",
                f"--run.name={name}", "--model.name=qwen3_moe", "--model.dim=64",
                "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                "--model.vocab_size=258", *RUN_SHAPE["qwen3_moe"], "--parallel.param_dtype=float32",
                "--data.seq_len=32", "--data.shuffle=false", "--train.global_batch_size=8",
                "--train.steps=3", "--optim.lr=5e-3", "--train.eval_interval=0",
                "--metrics.tensorboard=true", "--metrics.log_interval=1",
                "--checkpoint.interval=0", "--dpo.enabled=true", *extra]  # fmt: skip

    from tests.test_train import train_losses

    run_distributed(train_losses, 1, moe("one"))
    run_distributed(train_losses, 2, moe("ep", "--parallel.ep=2", "--train.micro_batch_size=2"))
    one, ep = scalars(tmp_path / "one"), scalars(tmp_path / "ep")
    assert one["loss/train"][0] == pytest.approx(math.log(2), abs=1e-6)  # the reference's own
    # Step 1's aux loss: the model's on the first 8 pairs' 16 rows, over 16.
    job = parse_config(JobConfig, moe("direct"))
    family = get_family("qwen3_moe")
    model = family.build_model(family.build_args(job.model))
    model.init_weights(seed=job.train.seed, rope_len=job.data.seq_len)
    pairs = PreferencePairs(open_dataset(prefs["data"]), "train", job.data.seq_len)
    with torch.no_grad():
        model(torch.cat([pairs[i][0] for i in range(8)]))
    assert one["loss/aux"][0] == pytest.approx(model.last_aux_loss.item() / 16, rel=1e-5)
    for name in ("loss/train", "grad_norm", "loss/aux", *dpo_trl.METRICS):
        torch.testing.assert_close(torch.tensor(ep[name]), torch.tensor(one[name]), rtol=1e-5,
                                   atol=1e-5, msg=name)  # fmt: skip


def gathered_after_forward(argvs: list[list[str]]) -> list[list[str]]:
    """For each run's settings: the frozen copy built as train.py builds it, and DPO's
    reference log-probs taken from it once; the names of its parameters left gathered (not
    FSDP's sharded DTensors)."""
    from torch.distributed.tensor import DTensor

    from configs import parse_config
    from data.documents import MicroBatch
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv
    from parallel.dpo import DPOLoss
    from parallel.loss import ChunkedLoss
    from parallel.objective import cross_entropy_sum
    from parallel.runtime import build_mesh, init_distributed
    from train import build_reference

    env, device = LaunchEnv.from_env(), torch.device("cpu")
    init_distributed(device, env, timeout_s=60)
    left = []
    for argv in argvs:
        job = parse_config(JobConfig, argv)
        plan = check_config(job, env)
        mesh = build_mesh(device, plan.dp_replicate, plan.dp_shard, plan.tp, plan.cp, plan.pp)
        reference, output = build_reference(job, plan, env, mesh, None, device)
        chunk = job.train.loss_chunk_tokens
        chunked = ChunkedLoss(output, chunk, cross_entropy_sum) if chunk else None
        dpo = DPOLoss(job.dpo, reference, chunked=chunked, reference_output=output)
        tokens = torch.randint(0, 258, (2, 16))
        dpo.reference_logps(None, None, MicroBatch(tokens, tokens))  # type: ignore[arg-type]
        parts = getattr(reference, "parts", [reference])  # a Pipeline's stages
        left.append([n for part in parts for n, p in part.named_parameters()
                     if not isinstance(p, DTensor)])  # fmt: skip
    return left


def test_the_frozen_copy_holds_only_its_shards(tmp_path: Path) -> None:
    """FSDP 2 and pp 2 on 2 ranks, the log-probs from the logits or in chunks: after the
    reference's forward the copy holds its shards only. FSDP leaves a unit that is not
    resharded after forward (the root, the last block; under pp every unit) gathered until its
    backward, which a frozen copy never runs."""
    tiny = [f"--run.output_dir={tmp_path}", "--model.dim=64", "--model.n_layers=2",
            "--model.n_heads=4", "--model.n_kv_heads=2", "--model.vocab_size=258",
            "--data.seq_len=16", "--train.global_batch_size=4", "--train.micro_batch_size=1",
            "--train.eval_interval=0", "--dry-run"]  # fmt: skip
    chunked = "--train.loss_chunk_tokens=12"
    runs = [tiny, [*tiny, "--parallel.pp=2"], [*tiny, chunked], [*tiny, "--parallel.pp=2", chunked]]
    assert run_distributed(gathered_after_forward, 2, runs)[0] == [[]] * 4


@pytest.mark.slow
def test_resume_is_exact_and_exports_merged_and_as_peft(
    prefs: dict[str, Path], tmp_path: Path
) -> None:
    """LoRA with the precomputed reference on 2 ranks: stopped at step 2 and resumed, the
    losses are the straight run's, bitwise (the reference read back, checked by its
    fingerprint); the export, merged or as PEFT adapters, gives transformers the trained
    model's logits (fp32, 1e-5)."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.export import load_checkpoint_model, main

    lora = ["--lora.enabled=true", "--lora.targets=*.attention.*,*.feed_forward.*",
            "--dpo.reference=precomputed", "--train.micro_batch_size=2"]  # fmt: skip
    straight = dpo_argv(prefs, tmp_path / "straight", "sigmoid", *lora, "--train.steps=4")
    half = dpo_argv(prefs, tmp_path / "half", "sigmoid", *lora, "--checkpoint.interval=2")
    resumed = [*half, "--train.steps=4"]
    runs = spawn(2, [straight, half, resumed])
    losses = [[step["loss/train"] for step in run] for run in runs]
    assert losses[1] + losses[2] == losses[0]
    assert {name: runs[2][-1][name] for name in VAL} == {name: runs[0][-1][name] for name in VAL}
    step = tmp_path / "half" / "sigmoid" / "checkpoints" / "step-4"
    ours = load_checkpoint_model(step, rope_len=32)
    ids = torch.tensor([list(b"12+34=46") + [257], list(b"99+10=109")])
    with torch.no_grad():
        expected = ours(ids)
    assert main([str(step), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert main([str(step), str(tmp_path / "adapters"), "--adapters-only"]) == 0
    peft = pytest.importorskip("peft")
    base = transformers.LlamaForCausalLM.from_pretrained(prefs["model"], dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapted(ids).logits, expected, rtol=1e-5, atol=1e-5)
