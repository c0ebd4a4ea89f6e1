"""Checkpoints on real gloo ranks: saving leaves training as it is, resharding across meshes,
crashes mid-save, async saves, pruning, model-only loads, bad input rejected before any
collective, damaged checkpoints (skipped or refused, never loaded) and a full disk. An exact
resume, and init_from_hf of an export, for every family: tests/test_families.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import train
from checkpoint import COMPLETE
from checkpoint.integrity import (
    ChecksummingWriter,
    CorruptCheckpoint,
    check_files,
    read_manifest,
    verify_files,
)
from launch.check import check_config
from launch.check import main as launch_check
from launch.job import JobConfig
from parallel.dims import LaunchEnv
from parallel.objective import summed_loss
from tests.distributed import run_distributed
from tests.test_cli import run_cli
from tests.test_train import FP32, TINY, assert_close, run, train_losses

STEPS = 8
# Four global batches of 8 per checkpoint: 2 ranks x micro-batches of 2 x 2 accumulation steps.
SAVE_EVERY_4 = ["--checkpoint.interval=4", "--checkpoint.keep_last=0"]


def argv(dataset: str, out: Path, name: str, *extra: str) -> list[str]:
    return [
        f"--data.path={dataset}", f"--run.output_dir={out}", f"--run.name={name}", *TINY, *FP32,
        f"--train.steps={STEPS}", "--train.micro_batch_size=2", *extra,
    ]  # fmt: skip


def ckpt(out: Path, name: str, step: int) -> Path:
    return out / name / "checkpoints" / f"step-{step}"


@pytest.fixture(scope="module")
def sync_run(saved_runs: Callable[[str], tuple[list, Path]]) -> tuple[list, Path]:
    """llama3's run 'sync' of tests/conftest.py: 2 ranks FSDP, 8 fp32 steps, synchronous
    checkpoints at steps 4 and 8, in micro-batches of 2 (this file's `argv`)."""
    return saved_runs("llama3")


def load_everything(path: Path, tmp: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, unsharded, in this process (no process group)."""
    dcp_to_torch_save(path, tmp / "all.pt")
    return torch.load(tmp / "all.pt", weights_only=False)


def assert_same_entries(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_entries(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_saving_does_not_perturb_training(sync_run: tuple[list, Path], tiny_dataset: str) -> None:
    """A run without checkpoints gives the losses of the run that saved at steps 4 and 8,
    bitwise (resuming from them, for every family: tests/test_families.py)."""
    losses, out = sync_run
    assert run_distributed(train_losses, 2, argv(tiny_dataset, out, "plain"))[0] == losses


class _SlowWriter(ChecksummingWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        time.sleep(1.0)
        return super().write_data(plan, planner)


def train_with_slow_writer(args: list[str]) -> list[float]:
    import checkpoint.checkpointer

    checkpoint.checkpointer.ChecksummingWriter = _SlowWriter  # what it builds; only in this rank
    return train_losses(args)


@pytest.mark.slow
def test_async_save_equals_sync(
    sync_run: tuple[list, Path], tiny_dataset: str, tmp_path: Path
) -> None:
    """async_save writes what save writes (every tensor and value) and training is unchanged.

    The async run's writer sleeps 1 s first, so training runs several steps ahead while each
    save is in flight: equal checkpoints then show the saved state is a snapshot."""
    losses, out = sync_run
    args = argv(tiny_dataset, out, "async", *SAVE_EVERY_4, "--checkpoint.async_mode=async")
    assert run_distributed(train_with_slow_writer, 2, args)[0] == losses
    for step in (4, 8):
        assert (ckpt(out, "async", step) / COMPLETE).is_file()
        assert (
            read_manifest(ckpt(out, "async", step)).keys()
            == read_manifest(ckpt(out, "sync", step)).keys()
        )  # the same files, each with its size and checksum
        assert_intact(ckpt(out, "sync", step)), assert_intact(ckpt(out, "async", step))
        sync = load_everything(ckpt(out, "sync", step), tmp_path)
        other = load_everything(ckpt(out, "async", step), tmp_path)
        sync_config, async_config = sync.pop("config"), other.pop("config")
        assert_same_entries(sync, other)
        changed = set(sync_config.splitlines()) ^ set(async_config.splitlines())
        assert changed == {
            'name = "sync"', 'name = "async"', 'async_mode = "off"', 'async_mode = "async"'
        }  # fmt: skip
    # What step 8 holds: 8 steps of 8 sequences of 32 tokens, and the loader at that position.
    assert (sync["train"]["step"], sync["train"]["samples_seen"]) == (8, 64)
    assert sync["train"]["tokens_seen"] == 64 * 32
    assert pickle.loads(sync["dataloader"]["state"])["_index_sampler_state"]["consumed"] == 64
    assert sync["model"]["tok_embeddings.weight"].shape == (512, 64)  # full shapes, fp32
    assert sync["model"]["tok_embeddings.weight"].dtype == torch.float32


class _KillingWriter(ChecksummingWriter):
    """Writes this rank's data, then SIGKILLs the process when saving the step dir $KILL_AT."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        result = super().write_data(plan, planner)
        if Path(self.path).name == os.environ["KILL_AT"] and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return result


def train_and_get_killed(args: list[str]) -> list[float]:
    import checkpoint.checkpointer

    checkpoint.checkpointer.ChecksummingWriter = _KillingWriter  # only in this rank's process
    return train_losses(args)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off", "async"])
def test_kill_during_save_resumes_from_previous_checkpoint(
    sync_run: tuple[list, Path], tiny_dataset: str, mode: str, caplog
) -> None:
    """`kill -9` of rank 1 in the middle of the step-4 save; `resume=auto` then takes step 2.

    To make the kill land inside the save every time, without timing and without hooks in
    production code, rank 1 kills itself: the Checkpointer builds its writer as
    `ChecksummingWriter(path)`, which the ranks of this run replace with a subclass that
    writes its data and then sends itself SIGKILL while saving step 4. Rank 0 is then blocked
    in DCP's final gather and fails; nobody writes step 4's metadata or COMPLETE marker."""
    losses, out = sync_run
    name = f"killed-{mode}"
    args = argv(tiny_dataset, out, name, "--checkpoint.interval=2", "--parallel.timeout_s=30")
    args.append(f"--checkpoint.async_mode={mode}")
    with pytest.raises(AssertionError, match="rank 0 failed|did not finish"):
        run_distributed(train_and_get_killed, 2, args, env={"KILL_AT": "step-4"}, timeout=90)
    partial = ckpt(out, name, 4)
    assert partial.is_dir() and not (partial / COMPLETE).exists()
    assert (ckpt(out, name, 2) / COMPLETE).is_file()

    with caplog.at_level(logging.WARNING):
        plan = check_config(parse(args), LaunchEnv(0, 0, 2, 2, 1))
    assert plan.resume is not None and plan.resume.path == ckpt(out, name, 2)
    assert any(str(partial) in r.getMessage() for r in caplog.records), caplog.text
    resumed = run_distributed(train_losses, 2, args)[0]
    assert resumed == losses[2:]
    assert (partial / COMPLETE).is_file()  # saved again, over the partial directory


def parse(args: list[str]) -> JobConfig:
    from configs import parse_config

    return parse_config(JobConfig, args)


@pytest.mark.slow
def test_resharding_matrix_continues_the_same_run(tiny_dataset: str, tmp_path: Path) -> None:
    """Save on one mesh, resume on the next: HSDP 2x2 -> FSDP 1x4 -> FSDP 1x2 -> 1 process ->
    HSDP 2x2, two steps each, against a straight 2x2 run. The losses only match if weights,
    optimizer, schedule and the data position all carry over (every sample seen once)."""
    steps = ["--train.steps=10", "--train.micro_batch_size=2", "--checkpoint.interval=2"]
    steps.append("--checkpoint.keep_last=0")
    straight = run(tiny_dataset, tmp_path, 4, 2, [*FP32, *steps, "--run.name=hsdp"])
    previous, resumed = ckpt(tmp_path, "hsdp", 2), []
    for hop, (world, nodes) in enumerate([(4, 1), (2, 1), (1, 1), (4, 2)]):
        name = f"hop{hop}-{world}x{nodes}"
        extra = [*FP32, *steps, f"--run.name={name}", f"--checkpoint.resume={previous}"]
        losses = run(tiny_dataset, tmp_path, world, nodes, extra)
        first = 2 * hop + 2  # steps this hop resumed after
        # Meshes sum in different orders: ~1e-7 per step, as in test_train's parity test.
        assert_close(losses[:2], straight[first : first + 2], rtol=1e-5)
        resumed += losses[:2]
        previous = ckpt(tmp_path, name, first + 2)
    assert len(resumed) == 8
    final = load_everything(ckpt(tmp_path, "hop3-4x2", 10), tmp_path)
    assert final["train"]["samples_seen"] == 80  # 10 steps x 8: nothing skipped or repeated
    assert pickle.loads(final["dataloader"]["state"])["_index_sampler_state"]["consumed"] == 80


@pytest.mark.slow
def test_keep_last_prunes_only_older_complete_checkpoints(
    tiny_dataset: str, tmp_path: Path, caplog
) -> None:
    """keep_last=2 keeps the two newest complete checkpoints; a directory without the marker is
    never resumed from, and leftovers older than a complete checkpoint are cleaned up."""
    args = argv(tiny_dataset, tmp_path, "prune", "--train.steps=6")
    args += ["--checkpoint.interval=2", "--checkpoint.keep_last=2"]
    run_distributed(train_losses, 1, args)
    folder = tmp_path / "prune" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-6"]
    (folder / "step-6" / COMPLETE).unlink()  # as if killed between metadata and marker
    (folder / "step-5").mkdir()  # an older partial leftover

    with caplog.at_level(logging.WARNING):
        plan = check_config(parse(args), LaunchEnv(0, 0, 1, 1, 1))
    assert plan.resume is not None and plan.resume.path == folder / "step-4"
    assert "step-6" in caplog.text and "step-5" in caplog.text
    losses = run_distributed(train_losses, 1, [*args, "--train.steps=8"])[0]
    assert len(losses) == 4  # steps 5..8
    assert sorted(p.name for p in folder.iterdir()) == ["step-6", "step-8"]
    assert all((folder / s / COMPLETE).is_file() for s in ("step-6", "step-8"))


@pytest.mark.filterwarnings("ignore:.*set_vital")  # torchdata on torch 2.13, as in data/loader.py
def test_load_model_only_starts_at_step_0_with_the_weights(
    sync_run: tuple[list, Path], tiny_dataset: str
) -> None:
    """A new run (1 process) from the 2-rank checkpoint's weights: fresh steps and data."""
    from data.documents import MicroBatch
    from data.loader import build_dataloader
    from model.llama import Transformer, build_args

    _, out = sync_run
    source = ckpt(out, "sync", 4)
    args = argv(tiny_dataset, out, "finetune", "--train.steps=2", "--checkpoint.load_model_only")
    args.append(f"--checkpoint.resume={source}")
    losses = run_distributed(train_losses, 1, args)[0]
    assert len(losses) == 2

    # Expected first loss: the checkpoint's weights on the first global batch of the stream.
    job = parse(args)
    model = Transformer(build_args(job.model))
    model.init_weights(rope_len=job.data.seq_len)  # for the RoPE table; weights are replaced
    weights = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    dcp_load_model(weights, source)
    model.load_state_dict(weights)
    loader = build_dataloader(job.data, "train", dp_rank=0, dp_size=1, micro_batch_size=8, seed=0)
    inputs, targets = next(iter(loader))
    with torch.no_grad():
        batch = MicroBatch(inputs, targets)
        expected = summed_loss(model, batch).item() / targets.numel()
    assert losses[0] == pytest.approx(expected, rel=1e-5)


def dcp_load_model(weights: dict[str, torch.Tensor], path: Path) -> None:
    """What the export tool does: only the model, no process group."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--model.dim=32", "--model.n_layers=3", "--checkpoint.resume={sync4}"],
            "with a changed model.dim: 64 -> 32; model.n_layers: 2 -> 3 (parameters: 9 missing, "
            "21 with another shape): a checkpoint loads only into the model it was saved from; "
            "set the model.* keys as it has them (see its config.toml)",
        ),
        (
            ["--model.dim=32", "--checkpoint.resume={sync4}"],
            "with a changed model.dim: 64 -> 32 (parameters: 21 with another shape)",
        ),
        (
            ["--model.n_layers=1", "--checkpoint.resume={sync4}"],
            "with a changed model.n_layers: 2 -> 1 (parameters: 9 unexpected)",
        ),
        (["--checkpoint.resume={out}/nowhere/step-3"], "nowhere/step-3 does not exist"),
        (
            ["--checkpoint.resume={out}/sync/checkpoints"],
            "pass one of them, e.g. {out}/sync/checkpoints/step-8",
        ),
        (["--checkpoint.resume={out}/empty"], "empty has no COMPLETE marker (a save that"),
        (
            ["--checkpoint.resume={sync4}", "--train.global_batch_size=24"]
            + ["--train.micro_batch_size=24"],
            "consumed 32 samples of the global data stream, which dp_size x micro_batch_size "
            "= 24 does not divide",
        ),
        (["--checkpoint.interval=1", "--run.name=blocked"], "checkpoints is not writable"),
        (["--checkpoint.load_model_only"], "load_model_only needs checkpoint.resume=<path"),
        (["--checkpoint.async_mode=sometimes"], "not one of: off, async"),
    ],
    ids=[
        "more-layers-and-narrower",
        "narrower",
        "fewer-layers",
        "missing-path",
        "folder-not-step",
        "no-marker",
        "data-position",
        "unwritable",
        "model-only-without-path",
        "bad-choice",
    ],
)
def test_bad_checkpoint_input_is_one_config_error(
    sync_run: tuple[list, Path], tiny_dataset: str, extra: list[str], message: str, caplog
) -> None:
    """Each is found by check_config on every rank before any process group: exit 2, one line."""
    _, out = sync_run
    (out / "empty").mkdir(exist_ok=True)
    (out / "blocked").mkdir(exist_ok=True)
    (out / "blocked" / "checkpoints").touch()  # a file where the folder should go
    extra = [e.format(out=out, sync4=ckpt(out, "sync", 4)) for e in extra]
    message = message.format(out=out)
    os.environ.pop("WORLD_SIZE", None)  # this process is a 1-rank launch
    with caplog.at_level(logging.ERROR, logger="train"):
        assert train.main([*argv(tiny_dataset, out, "bad"), *extra]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0]
    assert message in errors[0], errors[0]
    assert not ckpt(out, "bad", 1).parent.exists()  # nothing was trained or saved


@pytest.mark.slow
def test_missing_resume_path_under_torchrun_fails_once_without_hanging(
    tiny_dataset: str, tmp_path: Path
) -> None:
    missing = tmp_path / "gone" / "step-9"
    result = run_cli([*argv(tiny_dataset, tmp_path, "x"), f"--checkpoint.resume={missing}"])
    assert result.returncode != 0
    assert result.stderr.count("config error:") == 1, result.stderr[-2000:]
    assert f"{missing} does not exist" in result.stderr


@pytest.mark.slow
def test_restart_of_a_finetune_resumes_its_own_checkpoint(
    sync_run: tuple[list, Path], tiny_dataset: str
) -> None:
    """load_model_only applies to a run's first start: restarted with the same command (after
    a preemption, say) it continues from its own checkpoint instead of starting over."""
    _, out = sync_run
    # A constant schedule, so that stopping at 4 of 4 steps and going on to 6 is one run.
    flat = ["--optim.decay=constant", "--optim.warmup_steps=0"]
    base = argv(tiny_dataset, out, "ft", "--checkpoint.load_model_only", *SAVE_EVERY_4, *flat)
    base.append(f"--checkpoint.resume={ckpt(out, 'sync', 4)}")
    first = run_distributed(train_losses, 2, [*base, "--train.steps=4"])[0]
    again = run_distributed(train_losses, 2, [*base, "--train.steps=6"])[0]
    assert len(first) == 4 and len(again) == 2  # steps 5-6 only: resumed at its own step 4
    straight = run_distributed(
        train_losses, 2, [*argv(tiny_dataset, out, "ft2", "--checkpoint.load_model_only", *flat,
                                f"--checkpoint.resume={ckpt(out, 'sync', 4)}"), "--train.steps=6"],
    )[0]  # fmt: skip
    assert first + again == straight


@pytest.mark.slow
def test_a_warmup_stable_decay_run_resumed_with_more_steps_is_the_longer_run(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """optim.decay_steps: the lr holds its peak until the run's last N steps, so a 6-step run
    resumed from its step 3 (the stable phase) with train.steps=9 is, bitwise, the 9-step run:
    its decay moves to the last 3 steps of 9. (Under the default decay, spread over the whole
    run, raising train.steps changes every step's lr.)"""
    wsd = ["--optim.warmup_steps=2", "--optim.decay_steps=3", "--optim.decay=sqrt",
           "--checkpoint.interval=3", "--checkpoint.keep_last=0"]  # fmt: skip
    short = run_distributed(train_losses, 2, [*argv(tiny_dataset, tmp_path, "six", *wsd),
                                              "--train.steps=6"])[0]  # fmt: skip
    resume = f"--checkpoint.resume={ckpt(tmp_path, 'six', 3)}"
    extended = run_distributed(train_losses, 2, [*argv(tiny_dataset, tmp_path, "more", *wsd),
                                                 "--train.steps=9", resume])[0]  # fmt: skip
    straight = run_distributed(train_losses, 2, [*argv(tiny_dataset, tmp_path, "nine", *wsd),
                                                 "--train.steps=9"])[0]  # fmt: skip
    # The decay's first step is at the peak (it ends at lr * min_lr_ratio after the last step,
    # as the default decay does), so the 6-step run's step 5 is its first with a lower lr, and
    # the loss of step 6 the first to show it.
    assert short[:5] == straight[:5] and short[5] != straight[5]
    assert extended == straight[3:]


# ---- damaged checkpoints and full disks -----------------------------------------------------


def train_py(args: list[str]) -> subprocess.CompletedProcess:
    """`python train.py ...`: one process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "train.py", *args], cwd=Path(__file__).resolve().parents[1],
        env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)


def manifest_damage(rewrite: Callable[[dict], str]) -> Callable[[Path], None]:
    """Damage to COMPLETE: `rewrite` turns its manifest into the new text. A byte of a shard is
    flipped too, which only that manifest's checksums would find: a checkpoint whose manifest
    cannot be read must not load unverified."""

    def damage(path: Path) -> None:
        path.write_text(rewrite(json.loads(path.read_text())))
        flip_a_byte(path.parent / "__0_0.distcp")

    return damage


def without(name: str) -> Callable[[dict], str]:
    """A manifest's text without the entry of file `name`."""
    return lambda m: json.dumps(m | {"files": {k: v for k, v in m["files"].items() if k != name}})


def without_crc32(manifest: dict) -> str:
    files = {name: {"bytes": entry["bytes"]} for name, entry in manifest["files"].items()}
    return json.dumps(manifest | {"files": files})


# What goes wrong, and in which file. Rank 0's file: with 2 ranks the content check hands it to
# rank 1 (files are dealt out largest first), so rank 0 reports what rank 1 found.
DAMAGE = {
    "truncated-distcp": ("__0_0.distcp", truncate),
    "missing-metadata": (".metadata", Path.unlink),
    "truncated-metadata": (".metadata", truncate),
    "flipped-byte": ("__0_0.distcp", flip_a_byte),
    "empty-manifest": (COMPLETE, manifest_damage(lambda m: "")),
    "manifest-not-json": (COMPLETE, manifest_damage(lambda m: "garbage")),
    "manifest-a-list": (COMPLETE, manifest_damage(lambda m: json.dumps(list(m["files"])))),
    "manifest-a-number": (COMPLETE, manifest_damage(lambda m: "8")),
    "manifest-entries-without-crc32": (COMPLETE, manifest_damage(without_crc32)),
    "manifest-without-a-file": (COMPLETE, manifest_damage(without("__0_0.distcp"))),
}
# What check_files says about each damaged COMPLETE, after its path.
MANIFEST_WHY = {
    "empty-manifest": "is not a valid manifest (the file is empty)",
    "manifest-not-json": "is not a valid manifest (not JSON: Expecting value: line 1 column 1 "
    "(char 0))",
    "manifest-a-list": "is not a valid manifest (a JSON array, not an object)",
    "manifest-a-number": "is not a valid manifest (a JSON number, not an object)",
    "manifest-entries-without-crc32": "is not a valid manifest (the entry of .metadata is "
    '{"bytes": ',
    "manifest-without-a-file": "lists no size and checksum for __0_0.distcp, a data file of the "
    "checkpoint",
}
# Trainer runs on a damaged newest checkpoint: the COMPLETE that is not JSON here, the
# damage only the content check finds (a flipped byte: its size is right) in
# test_a_fallback_resumes_the_previous_step_and_compares_changes_with_it, a truncated shard in
# the drills. Every other kind is found by the same file checks before any process group
# (check_files), which the launcher's check below runs in this process for every kind: a
# trainer run per kind would add minutes and test nothing those runs do not.
RUN_KINDS = ["manifest-not-json", pytest.param("truncated-distcp", marks=pytest.mark.drill)]


def copy_checkpoints(out: Path, name: str) -> Path:
    """The sync run's checkpoints (steps 4 and 8) as run `name`'s own; returns the folder."""
    folder = out / name / "checkpoints"
    shutil.copytree(ckpt(out, "sync", 4).parent, folder)
    return folder


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def assert_fell_back_to_step_4(result: Any, folder: Path, file: str) -> None:
    """The run went on from step 4: one warning naming the damaged file of step 8 first, then
    the line that resumes step 4; no traceback, and saving over step 8 drew no torch warning."""
    assert result.returncode == 0, result.stderr[-3000:]
    [warning] = lines_with(result.stderr, "] WARNING ")
    assert f"skipping damaged {folder / 'step-8'}: {folder / 'step-8' / file} " in warning
    [resuming] = lines_with(result.stderr, "resuming ")
    assert f"resuming {folder / 'step-4'} at step 4 of {STEPS} (all state, " in resuming
    assert result.stderr.index(warning) < result.stderr.index(resuming)
    assert "Traceback" not in result.stderr and "Detected an existing checkpoint" not in (
        result.stderr
    )


def assert_intact(path: Path) -> None:
    """Every file of the manifest is there with its size and checksum."""
    check_files(path)
    assert verify_files(path, list(read_manifest(path))) == []


@pytest.mark.parametrize("kind", MANIFEST_WHY)
def test_a_manifest_that_cannot_be_read_is_damage(
    sync_run: tuple[list, Path], tmp_path: Path, kind: str
) -> None:
    """Whatever is wrong with COMPLETE, the checks before any process group find it and name
    COMPLETE with what is wrong (in this process; the runs below show what a resume does)."""
    _, out = sync_run
    step = tmp_path / "step-8"
    shutil.copytree(ckpt(out, "sync", 8), step)
    file, damage = DAMAGE[kind]
    damage(step / file)
    with pytest.raises(CorruptCheckpoint) as bad:
        check_files(step)
    assert str(bad.value).startswith(f"{step / COMPLETE} {MANIFEST_WHY[kind]}"), bad.value
    assert "\n" not in str(bad.value)


def test_a_file_gone_with_its_manifest_entry_is_missing(
    sync_run: tuple[list, Path], tmp_path: Path
) -> None:
    """The manifest lists every data file on disk; .metadata names the ones that must be."""
    _, out = sync_run
    step = tmp_path / "step-8"
    shutil.copytree(ckpt(out, "sync", 8), step)
    (step / COMPLETE).write_text(without("__1_0.distcp")(json.loads((step / COMPLETE).read_text())))
    (step / "__1_0.distcp").unlink()
    with pytest.raises(CorruptCheckpoint, match=f"^{step / '__1_0.distcp'} is missing$"):
        check_files(step)


@pytest.mark.parametrize("kind", [k for k in DAMAGE if k != "flipped-byte"])
def test_the_checks_skip_a_damaged_newest_checkpoint_by_name(
    sync_run: tuple[list, Path], tiny_dataset: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """resume=auto, checked as every rank checks it before any collective: each kind of damage
    the file checks find is skipped with one warning that names the file, and the run resumes
    step 4. The flipped byte is found only by the checksums, after the process group (the
    trainer runs below)."""
    _, out = sync_run
    name = f"checked-{kind}"
    folder = copy_checkpoints(out, name)
    file, damage = DAMAGE[kind]
    damage(folder / "step-8" / file)
    with caplog.at_level(logging.WARNING):
        plan = check_config(
            parse(argv(tiny_dataset, out, name, *SAVE_EVERY_4)), LaunchEnv(0, 0, 2, 2, 1)
        )
    assert plan.resume is not None and plan.resume.path == folder / "step-4"
    [warning] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert warning.startswith(
        f"checkpoint: skipping damaged {folder / 'step-8'}: {folder / 'step-8' / file} "
    ), warning


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    sync_run: tuple[list, Path], tiny_dataset: str, tmp_path: Path, kind: str
) -> None:
    """resume=auto skips a damaged step 8 with one warning naming the file, resumes step 4 and
    trains on exactly: the step-8 checkpoint it saves anew equals the straight run's (weights,
    optimizer, schedule, data position, counters). Truncations, a missing file and a COMPLETE
    that is not a manifest of every file are found before the process group; a flipped byte
    only by the checksums, after it (the test after this one). No line says it resumes step
    8, and saving over the damaged step 8 (deliberate) draws no torch warning."""
    _, out = sync_run
    name = f"damaged-{kind}"
    folder = copy_checkpoints(out, name)
    file, damage = DAMAGE[kind]
    damage(folder / "step-8" / file)

    result = run_cli(argv(tiny_dataset, out, name, *SAVE_EVERY_4))
    assert_fell_back_to_step_4(result, folder, file)
    again = load_everything(folder / "step-8", tmp_path)
    straight = load_everything(ckpt(out, "sync", 8), tmp_path)
    # Not the CPU RNG state: a resumed run draws once more from it (iter(loader) takes a base
    # seed after the restore), which no computation of the trainer reads.
    for entries in (again, straight):
        entries.pop("config"), entries["train"].pop("rng")
    assert_same_entries(straight, again)
    assert_intact(folder / "step-8")


def test_a_fallback_resumes_the_previous_step_and_compares_changes_with_it(
    sync_run: tuple[list, Path], tiny_dataset: str, tmp_path: Path
) -> None:
    """Step 8 saved by a resume at another lr, then damaged by a flipped byte (the damage only
    the checksums find, after the process group, where check_config had read step 8's config
    fine): resume=auto skips it with one warning naming the file, resumes step 4, and its
    'changed since the checkpoint' line compares with step 4's lr, not step 8's. It trains on
    exactly: the step 8 it saves anew equals the one that was damaged, entry for entry (no
    line says it resumes step 8; saving over it, deliberately, draws no torch warning)."""
    _, out = sync_run
    name = "fallback-changes"
    folder = out / name / "checkpoints"
    shutil.copytree(ckpt(out, "sync", 4), folder / "step-4")
    first = run_cli(argv(tiny_dataset, out, name, *SAVE_EVERY_4, "--optim.lr=0.02"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert lines_with(
        first.stderr, "changed since the checkpoint, applied: optim.lr: 0.003 -> 0.02"
    )
    before = load_everything(folder / "step-8", tmp_path)
    file, damage = DAMAGE["flipped-byte"]
    damage(folder / "step-8" / file)
    again = run_cli(argv(tiny_dataset, out, name, *SAVE_EVERY_4, "--optim.lr=0.02"))
    assert_fell_back_to_step_4(again, folder, file)
    changes = lines_with(again.stderr, "changed since the checkpoint")
    assert changes and changes[0].endswith("applied: optim.lr: 0.003 -> 0.02"), again.stderr
    assert_same_entries(before, load_everything(folder / "step-8", tmp_path))
    assert_intact(folder / "step-8")


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_explicit_checkpoint_is_one_config_error(
    sync_run: tuple[list, Path], tiny_dataset: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """checkpoint.resume=<damaged path> is never replaced by another: exit 2, one line naming
    the file, no traceback (train.py run for a damage found after the process group exists,
    the flipped byte, and one found before it). The launchers' check (launch.check) finds every
    kind first, before any rank exists, so torchrun never restarts a job for it."""
    _, out = sync_run
    damaged = out / f"explicit-{kind}" / "step-8"
    shutil.copytree(ckpt(out, "sync", 8), damaged)
    file, damage = DAMAGE[kind]
    damage(damaged / file)

    args = argv(tiny_dataset, out, f"explicit-{kind}-run", "--train.steps=9",
                "--checkpoint.interval=3")  # fmt: skip
    if kind in ("flipped-byte", "truncated-distcp"):  # after and before the process group
        result = train_py([*args, f"--checkpoint.resume={damaged}"])
        assert result.returncode == 2, result.stderr[-3000:]
        [error] = lines_with(result.stderr, "ERROR")
        assert f"config error: checkpoint.resume: {damaged / file} " in error
        assert "the checkpoint is damaged" in error
        assert "Traceback" not in result.stderr

    # The launchers' check (one process, before any rank): the same line, for every kind.
    caplog.clear()
    assert launch_check(["--world-size=2", *args, f"--checkpoint.resume={damaged}"]) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith(f"config error: checkpoint.resume: {damaged / file} "), error
    # A refused start leaves no empty checkpoint folder (nor, refused before the ranks, a run
    # folder): the first save creates it.
    run = out / f"explicit-{kind}-run"
    assert not (run / "checkpoints").exists()
    assert run.exists() == (kind == "flipped-byte")  # found by the ranks, which log to it


@pytest.mark.slow
def test_all_checkpoints_damaged_is_an_error_not_a_fresh_start(
    sync_run: tuple[list, Path], tiny_dataset: str
) -> None:
    """Starting over would prune the damaged checkpoints once it saved its own: refuse, in one
    line that lists them, and leave them as they are. Step 8 passes the checks before the
    process group (a flipped byte), so the fallback to step 4 happens after it."""
    _, out = sync_run
    folder = copy_checkpoints(out, "all-damaged")
    flip_a_byte(folder / "step-8" / "__0_0.distcp")
    truncate(folder / "step-4" / "__1_0.distcp")

    result = train_py(argv(tiny_dataset, out, "all-damaged", *SAVE_EVERY_4))
    assert result.returncode == 2, result.stderr[-3000:]
    [error] = lines_with(result.stderr, "ERROR")
    assert "every complete checkpoint of this run is damaged" in error
    for file in (folder / "step-8" / "__0_0.distcp", folder / "step-4" / "__1_0.distcp"):
        assert str(file) in error
    assert sorted(p.name for p in folder.iterdir()) == ["step-4", "step-8"]
    assert all((folder / step / COMPLETE).is_file() for step in ("step-4", "step-8"))


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int, read_only: bool = False) -> Iterator[Path]:
    """A file system of `size_bytes` at `path`, to fill up for real (or a read-only one)."""
    path.mkdir()
    size = f"size={size_bytes // 1024}k" + (",ro" if read_only else "")
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", size, "tmpfs", str(path)], capture_output=True
        )
    except FileNotFoundError:
        pytest.skip("no mount command to make a small tmpfs with")
    if mounted.returncode != 0:
        why = mounted.stderr.decode().strip()
        pytest.skip(f"mounting a small tmpfs needs root (CAP_SYS_ADMIN): {why}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [pytest.param("off", marks=pytest.mark.drill), "async"])
def test_full_disk_fails_the_save_in_one_line_and_keeps_the_previous_checkpoint(
    sync_run: tuple[list, Path], tiny_dataset: str, tmp_path: Path, mode: str
) -> None:
    """Checkpoints to a tmpfs with room for one and a half: step 2 saves, step 4 runs out of
    space. The error says so, with the path, in one line (not torch's `unexpected pos`); step 2
    stays complete and intact, the partial step 4 is gone, and a restart resumes step 2
    exactly (the losses of the straight run)."""
    losses, out = sync_run
    one = sum(f.stat().st_size for f in ckpt(out, "sync", 4).iterdir())
    with small_tmpfs(tmp_path / "disk", one * 3 // 2) as disk:
        args = argv(tiny_dataset, tmp_path, "full", f"--checkpoint.folder={disk}")
        args += ["--checkpoint.keep_last=0", f"--checkpoint.async_mode={mode}"]
        result = run_cli([*args, "--checkpoint.interval=2"])
        assert result.returncode == 1, result.stderr[-3000:]
        [full] = lines_with(result.stderr, "] ERROR")  # one line, on rank 0
        assert f"checkpoint step 4: no space left on device writing {disk / 'step-4'}" in full
        assert "step-2 and older are intact" in full
        # No rank's traceback (torchrun still prints its ChildFailedError summary of exit 1).
        assert 'train.py", line' not in result.stderr and "unexpected pos" not in result.stderr
        assert sorted(p.name for p in disk.iterdir()) == ["step-2"]
        assert_intact(disk / "step-2")

        resumed = run_distributed(train_losses, 2, [*args, "--checkpoint.interval=0"])[0]
        assert resumed == losses[2:]


@pytest.mark.slow
def test_a_disk_too_small_for_one_checkpoint_is_warned_about_and_the_failure_says_so(
    sync_run: tuple[list, Path], tiny_dataset: str, tmp_path: Path
) -> None:
    """Room for half a checkpoint: rank 0 warns at startup (the first save would fail much
    later), and when it does fail, the line does not promise earlier checkpoints that the run
    never saved."""
    _, out = sync_run
    one = sum(f.stat().st_size for f in ckpt(out, "sync", 4).iterdir())
    with small_tmpfs(tmp_path / "disk", one // 2) as disk:
        args = argv(tiny_dataset, tmp_path, "tiny-disk", f"--checkpoint.folder={disk}",
                    "--checkpoint.interval=2")  # fmt: skip
        result = train_py(args)
        assert result.returncode == 1, result.stderr[-3000:]
        [warning] = lines_with(result.stderr, "WARNING")
        assert f"checkpoint: {disk} has 0.00 GB free, less than one checkpoint" in warning
        [full] = lines_with(result.stderr, "ERROR")
        assert f"checkpoint step 2: no space left on device writing {disk / 'step-2'}" in full
        assert "this run has no earlier checkpoint: a restart starts over" in full
        assert "intact" not in full
        assert list(disk.iterdir()) == []
