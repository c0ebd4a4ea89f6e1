"""The command line as users run it: bad input fails fast with one line, good input trains."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import train
from tests.distributed import run_distributed
from tests.test_train import TINY, train_losses

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def base_argv(dataset: str, tmp_path: Path) -> list[str]:
    return [f"--data.path={dataset}", f"--run.output_dir={tmp_path}", *TINY]


def run_cli(args: list[str], nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run train.py under torchrun, as a user would; a hang fails via the timeout."""
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", "train.py", *args]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--parallel.dp_replicate=3", "dp_replicate (3) x dp_shard (-1 -> 1) = 3 does not equal"),
        ("--parallel.dp_shard=3", "dp_replicate (1) x dp_shard (3) = 3 does not equal"),
        ("--train.stpes=5", "did you mean 'train.steps'"),
        ("--train.steps=abc", "train.steps: expected int, got 'abc'"),
        ("--parallel.param_dtype=fp16", "bfloat16, float32"),
        ("--train.global_batch_size=7", "global_batch_size (7) must be a multiple of"),
        ("--model.vocab_size=100", "smaller than the dataset's tokenizer vocabulary (258"),
        ("--model.n_heads=5", "not divisible by n_heads=5"),
        ("--data.path=/nonexistent/ds", "python -m data.prepare --out /nonexistent/ds"),
        # Numbers torch would refuse inside every rank, or train with into a nan loss.
        ("--optim.lr=nan", "optim.lr: expected a finite number, got nan (from --optim.lr)"),
        ("--optim.lr=inf", "optim.lr: expected a finite number, got inf"),
        ("--optim.beta1=1.5", "optim.beta1 must be in [0, 1), got 1.5"),
        ("--optim.eps=-1", "optim.eps must be > 0, got -1.0"),
        ("--optim.weight_decay=-0.1", "optim.weight_decay must be >= 0, got -0.1"),
        ("--optim.decay_steps=-1", "optim.decay_steps must be >= 0, got -1"),
        (
            "--optim.decay_steps=5 --optim.decay=constant",
            "optim.decay_steps=5 with optim.decay='constant': nothing decays; set optim.decay to",
        ),
        ("--model.rope_theta=0", "model.rope_theta must be > 0, got 0.0"),
        ("--metrics.peak_tflops=-5", "metrics.peak_tflops must be > 0, got -5.0"),
        # Folders stay inside their parent, and an empty one is not the parent itself.
        ("--run.name=../escape", "run.name='../escape' leaves its parent folder"),
        ("--run.name=", "run.name='' names no folder of its own"),
        ("--run.output_dir=", "run.output_dir is empty"),
        ("--checkpoint.folder=", "checkpoint.folder='' names no folder of its own"),
        ("--checkpoint.folder=a/../../b", "checkpoint.folder='a/../../b' leaves its parent"),
        ("--checkpoint.init_from_hf=", "checkpoint.init_from_hf='' names no folder"),
        (
            "--checkpoint.init_from_hf=/some/hf --checkpoint.resume=/some/run/step-4",
            "checkpoint.init_from_hf and checkpoint.resume='/some/run/step-4' both give",
        ),
        ("--parallel.mesh=auto", None),  # valid: shown here as the control case
    ],
)
def test_config_errors_are_one_line_before_any_collective(
    tiny_dataset: str, tmp_path: Path, override: str, message: str | None, caplog
) -> None:
    """check_config runs on every rank before the process group: same input, same error."""
    argv = [*base_argv(tiny_dataset, tmp_path), "--train.micro_batch_size=2", *override.split()]
    os.environ.pop("WORLD_SIZE", None)  # this process is a 1-rank launch
    with caplog.at_level(logging.ERROR, logger="train"):
        if message is None:
            assert train.main([*argv, "--dry-run"]) == 0
            return
        assert train.main(argv) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0]
    assert message in errors[0], errors[0]


def test_an_empty_path_in_a_config_file_is_one_config_error(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`init_from_hf = ""` is no Hugging Face folder: one line naming the key, not a run that
    trains from random weights and writes "" into its config."""
    config = tmp_path / "run.toml"
    config.write_text('[checkpoint]\ninit_from_hf = ""\n')
    os.environ.pop("WORLD_SIZE", None)
    with caplog.at_level(logging.ERROR, logger="train"):
        assert train.main([str(config), *base_argv(tiny_dataset, tmp_path)]) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith("config error: checkpoint.init_from_hf='' names no folder"), error
    assert not (tmp_path / "debug").exists()


def test_settings_that_are_valid_but_likely_unintended_are_warned_about(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A warm-up longer than the run never reaches the peak lr, a warm-up and decay longer
    than the run leave no stable phase, a profile step past the end profiles nothing: rank 0
    says so, and the run goes on (a short test of a long config)."""
    argv = [*base_argv(tiny_dataset, tmp_path), "--train.micro_batch_size=2", "--dry-run"]
    os.environ.pop("WORLD_SIZE", None)
    with caplog.at_level(logging.WARNING, logger="train"):
        assert train.main([*argv, "--train.steps=10", "--optim.warmup_steps=20",
                           "--metrics.profile_step=11"]) == 0  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "optim.warmup_steps (20) > train.steps (10): the learning rate never reaches optim.lr "
        "(0.003) and never decays",
        "metrics.profile_step (11) > train.steps (10): nothing will be profiled",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train"):
        assert train.main([*argv, "--train.steps=10", "--optim.warmup_steps=4",
                           "--optim.decay_steps=8"]) == 0  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "optim.warmup_steps (4) + optim.decay_steps (8) > train.steps (10): no stable phase, "
        "the decay takes the 6 steps after warm-up"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="train"):
        assert train.main([*argv, "--train.steps=20", "--optim.warmup_steps=20"]) == 0
        assert train.main([*argv, "--train.steps=20", "--optim.warmup_steps=4",
                           "--optim.decay_steps=16"]) == 0  # fmt: skip
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_settings_that_have_no_effect_in_a_config_file_are_warned_about(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys another mode reads (ac.every outside 'selective', fp8.* with FP8 off), changed from
    their defaults: one warning each on rank 0, and the run goes on. At their defaults, or with
    the mode that reads them, nothing is said."""
    config = tmp_path / "run.toml"
    config.write_text(
        '[ac]\nmode = "full"\nevery = 2\n[fp8]\nrecipe = "rowwise"\nskip = ["output", "wo"]\n'
    )
    argv = [*base_argv(tiny_dataset, tmp_path), "--train.micro_batch_size=2", "--dry-run"]
    os.environ.pop("WORLD_SIZE", None)

    def warnings(*extra: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="train"):
            assert train.main([str(config), *argv, "--train.steps=20", *extra]) == 0
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    assert warnings() == [
        "ac.every=2 has no effect with ac.mode='full': it picks the recomputed blocks of "
        "ac.mode='selective' only",
        "fp8.recipe='rowwise', fp8.skip=['output', 'wo'] have no effect with fp8.enabled=false",
    ]
    assert warnings("--ac.mode=none", "--fp8.skip=output")[1:] == [
        "fp8.recipe='rowwise' has no effect with fp8.enabled=false"
    ]
    assert warnings("--ac.mode=selective", "--fp8.recipe=tensorwise", "--fp8.skip=output") == []


def test_graph_buckets_without_graph_and_pipeline_settings_at_pp_1_are_warned_about(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """compile.bucket_mb sizes compile.fsdp='graph''s buckets (Inductor's), [parallel.pipeline]
    how pp > 1 runs its stages: changed from their defaults without those, one warning each
    among a dry run's first lines, naming what would read them. With them, nothing is said."""
    from configs import parse_config
    from launch.check import unintended_settings
    from launch.job import JobConfig

    argv = [*base_argv(tiny_dataset, tmp_path), "--train.micro_batch_size=2", "--dry-run",
            "--train.steps=20", "--compile.enabled=true", "--compile.bucket_mb=64",
            "--parallel.pipeline.schedule=gpipe", "--parallel.pipeline.split=1,1"]  # fmt: skip
    os.environ.pop("WORLD_SIZE", None)
    with caplog.at_level(logging.WARNING, logger="train"):
        assert train.main(argv) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "compile.bucket_mb=64.0 has no effect with compile.fsdp='hooks': it sizes the collective "
        "buckets Inductor makes under compile.fsdp='graph' only (FSDP2's hooks gather a whole "
        "unit at once)",
        "parallel.pipeline.schedule='gpipe', parallel.pipeline.split=[1, 1] have no effect with "
        "parallel.pp=1: [parallel.pipeline] sets how parallel.pp > 1 runs its stages",
    ]
    job = parse_config(JobConfig, [*argv, "--compile.fsdp=graph", "--parallel.pp=2"])
    assert unintended_settings(job) == []
    job = parse_config(JobConfig, [*argv, "--compile.fsdp=graph", "--parallel.pp=2",
                                   "--compile.backend=aot_eager"])  # fmt: skip
    assert [w.split(":")[0] for w in unintended_settings(job)] == [
        "compile.bucket_mb=64.0 has no effect with compile.backend='aot_eager'"
    ]


@pytest.mark.slow
@pytest.mark.drill  # plain torchrun's rank-side one-line error runs by default in
# test_launch.py (a missing interface); the mesh error by default under python and torchrun.sh
def test_bad_mesh_under_torchrun_exits_fast_and_reports_once(
    tiny_dataset: str, tmp_path: Path
) -> None:
    result = run_cli([*base_argv(tiny_dataset, tmp_path), "--parallel.dp_replicate=3"])
    assert result.returncode != 0
    assert result.stderr.count("config error:") == 1, result.stderr[-2000:]
    assert "does not equal the world size (2 ranks" in result.stderr


@pytest.mark.slow
def test_two_ranks_train_log_and_write_tensorboard(tiny_dataset: str, tmp_path: Path) -> None:
    args = [
        *base_argv(tiny_dataset, tmp_path), "--run.name=e2e", "--metrics.tensorboard=true",
        "--train.steps=6", "--train.micro_batch_size=2", "--metrics.log_interval=2",
        "--metrics.warmup_steps=1", "--train.eval_interval=3",
    ]  # fmt: skip
    result = run_cli(args)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = result.stderr
    assert "[rank0]" in logs and "[rank1]" not in logs  # one voice
    assert "step 6/6  loss" in logs and "tok/s" in logs and "val_loss" in logs
    assert "TensorBoard: tensorboard --logdir" in logs and "done: step 6/6" in logs
    assert "optim: adamw, lr 0.003: warm-up 2 steps, then cosine decay to 0.1x the peak by " \
        "step 6" in logs, logs[:3000]  # fmt: skip

    run_dir = tmp_path / "e2e"
    written = tomllib.loads((run_dir / "config.toml").read_text())
    assert written["train"]["steps"] == 6 and written["data"]["path"] == tiny_dataset

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ["loss/train", "loss/val", "lr", "grad_norm", "throughput/tokens_per_second",
                "throughput/tokens_per_second_per_device", "throughput/tflops_per_device",
                "memory/max_rss_gib", "time/data_fraction"]:  # fmt: skip
        assert tag in tags, f"{tag} missing from {sorted(tags)}"
    assert "throughput/mfu_percent" not in tags  # no peak FLOPs on CPU unless configured
    losses = [e.value for e in events.Scalars("loss/train")]
    assert [e.step for e in events.Scalars("loss/train")] == [2, 4, 6]
    assert all(math.isfinite(v) for v in losses)


def test_dry_run_prints_plan_and_trains_nothing(tiny_dataset: str, tmp_path: Path) -> None:
    args = [
        *base_argv(tiny_dataset, tmp_path),
        "--run.name=dry",
        "--dry-run",
        "--train.micro_batch_size=1",
    ]
    env = os.environ | {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"}
    result = subprocess.run(
        [sys.executable, "train.py", *args, "--parallel.mesh=auto", "--metrics.peak_tflops=100"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "dp_replicate=2 x dp_shard=4 (world size 8)" in out
    assert "# parameters:" in out and "estimated memory per rank" in out
    assert tomllib.loads(out)["parallel"]["mesh"] == "auto"  # the resolved config is TOML
    assert not (tmp_path / "dry").exists()


def test_help_lists_every_section(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0
    for key in ["--parallel.dp_shard", "--train.global_batch_size", "--data.seq_len",
                "--model.flavor", "--optim.lr", "--metrics.peak_tflops",
                "--data.sources.NAME.weight"]:  # fmt: skip
        assert key in result.stdout


@pytest.mark.slow
def test_nonfinite_loss_stops_with_the_step_or_is_skipped(
    tiny_dataset: str, tmp_path: Path
) -> None:
    # A huge lr without clipping blows the weights up in the first update; the second step's
    # gradient norm is then non-finite (its loss saturates at ln(vocab)).
    argv = [
        *base_argv(tiny_dataset, tmp_path), "--train.micro_batch_size=4", "--train.steps=4",
        "--optim.lr=1e30", "--optim.warmup_steps=0", "--train.max_grad_norm=0",
    ]  # fmt: skip
    with pytest.raises(
        AssertionError, match=r"NonFiniteError: step 2: loss .* grad norm (nan|inf)"
    ):
        run_distributed(train_losses, 2, argv)
    losses = run_distributed(train_losses, 2, [*argv, "--train.on_nonfinite=skip"])[0]
    # Skipped updates leave the weights as they were, so the later losses cannot move.
    assert len(losses) == 4 and losses[1] == losses[2] == losses[3] != losses[0]
    # ...but a run that skips every step is not recovering: it stops, naming the streak.
    with pytest.raises(AssertionError, match=r"step 3: 2 steps in a row had a non-finite"):
        run_distributed(
            train_losses, 2, [*argv, "--train.on_nonfinite=skip", "--train.max_skipped_steps=2"]
        )


def shipped_dry_run(config: str, nodes: int, per_node: int, cwd: Path) -> str:
    """What `train.py <config> --dry-run` prints on `nodes` x `per_node` ranks, from `cwd` (a
    folder of its own: the checkout's outputs/ may hold a run of the same name, whose
    checkpoint the dry run would read). The debug configs run the command itself; the others
    run its two steps, check and dry run, in this process (the same functions, without the
    3-7 s of starting and importing a process for each)."""
    import contextlib
    import io

    from configs import parse_config
    from launch.check import check_config, dry_run
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    if "debug" in config:
        env = os.environ | {
            "WORLD_SIZE": str(nodes * per_node), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_WORLD_SIZE": str(nodes),
        }  # fmt: skip
        result = subprocess.run(
            # The documented form (docs/configuration.md): a dry run needs no data, so the
            # shipped data paths may be absent.
            [sys.executable, str(ROOT / "train.py"), str(ROOT / config), "--dry-run"],
            cwd=cwd, capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout
    env = LaunchEnv(rank=0, local_rank=0, world_size=nodes * per_node,
                    local_world_size=per_node, num_nodes=nodes)  # fmt: skip
    out = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out):
        job = parse_config(JobConfig, [str(ROOT / config), "--dry-run"])
        dry_run(job, check_config(job, env), env)
    return out.getvalue()


@pytest.mark.parametrize(
    ("config", "nodes", "per_node", "mesh"),
    [
        ("configs/debug.toml", 1, 4, "dp_replicate=1 x dp_shard=4"),
        ("configs/llama3_8b.toml", 2, 8, "dp_replicate=2 x dp_shard=8"),
        ("configs/llama3_70b.toml", 16, 8, "dp_replicate=4 x dp_shard=32"),
        ("configs/llama3_8b_long.toml", 2, 8, "dp_replicate=2 x dp_shard=1 x cp=8"),
    ],
)
def test_shipped_configs_resolve_on_their_intended_clusters(
    tmp_path: Path, config: str, nodes: int, per_node: int, mesh: str
) -> None:
    assert mesh in shipped_dry_run(config, nodes, per_node, tmp_path)
