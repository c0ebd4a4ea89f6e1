"""Data mixtures in the trainer: bad input is one config error line before any process group;
a two-source run on real gloo ranks resumes exactly on another world size, anneals its weights
on resume, logs a source running out, and writes per-source metrics to TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from data.stream import GlobalStream
from launch.check import validate
from parallel.dims import LaunchEnv
from tests.distributed import run_distributed
from tests.test_train import FP32, TINY, assert_close, train_losses

SEQ = 32  # TINY's data.seq_len
BYTES = {"kind": "byte", "path": None, "vocab_size": 258, "eos_id": 257, "bos_id": 256}


def make_dataset(
    path: Path, train_windows: int, val_windows: int, seed: int, dtype: str = "uint16"
) -> str:
    """A prepared dataset of random byte tokens: `train_windows` sequences of SEQ tokens (+1
    target) in the train split, `val_windows` in val; index.json as data.prepare writes it."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    splits = {}
    for split, windows in (("train", train_windows), ("val", val_windows)):
        tokens = rng.integers(0, 256, windows * SEQ + 1).astype(dtype)
        tokens.tofile(path / f"{split}-00000.bin")
        splits[split] = [{"file": f"{split}-00000.bin", "num_tokens": len(tokens)}]
    index = {"version": 1, "dtype": dtype, "vocab_size": 258, "eos_id": 257, "bos_id": 256,
             "tokenizer": BYTES, "splits": splits}  # fmt: skip
    (path / "index.json").write_text(json.dumps(index))
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """'a': 400 train windows; 'b': 6, so it runs out within a few steps at weight 0.25."""
    root = tmp_path_factory.mktemp("sources")
    return {"a": make_dataset(root / "a", 400, 16, seed=0),
            "b": make_dataset(root / "b", 6, 16, seed=1)}  # fmt: skip


def mixture(paths: dict[str, str], weights: dict[str, float]) -> list[str]:
    return [f"--data.sources.{name}.{key}={value}" for name in weights
            for key, value in (("path", paths[name]), ("weight", weights[name]))]  # fmt: skip


def config_error(argv: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """The one error line `python -m launch.check` / train.py would print, checked to be one."""
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, num_nodes=1)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="train"):
        assert validate(argv, env) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith("config error: ")
    return errors[0]


def test_bad_sources_are_one_config_error_line(
    sources: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = [f"--run.output_dir={tmp_path}", *TINY, "--train.micro_batch_size=8"]
    good = mixture(sources, {"a": 0.75, "b": 0.25})
    assert validate([*base, *good], LaunchEnv(0, 0, 1, 1, 1)) == 0
    other_tokenizer = Path(shutil.copytree(sources["b"], tmp_path / "hf"))
    index = json.loads((other_tokenizer / "index.json").read_text())
    hf = {"kind": "hf", "path": "/models/x/tokenizer.json", "vocab_size": 258, "eos_id": 0,
          "bos_id": None, "sha256": "0" * 64}  # fmt: skip
    (other_tokenizer / "index.json").write_text(json.dumps(index | {"tokenizer": hf}))
    # Two Hugging Face tokenizers alike in size and special ids, but not in their merges.
    merges = {}
    for name, digest in (("m1", "1" * 64), ("m2", "2" * 64)):
        merges[name] = Path(shutil.copytree(sources["b"], tmp_path / name))
        tok = hf | {"sha256": digest}
        (merges[name] / "index.json").write_text(json.dumps(index | {"tokenizer": tok}))
    unhashed = Path(shutil.copytree(sources["b"], tmp_path / "unhashed"))
    no_hash = {k: v for k, v in hf.items() if k != "sha256"}
    (unhashed / "index.json").write_text(json.dumps(index | {"tokenizer": no_hash}))
    wide = make_dataset(tmp_path / "wide", 10, 16, seed=1, dtype="uint32")
    (tmp_path / "names.toml").write_text(f'[data.sources."we b"]\npath = "{sources["a"]}"\n')
    (tmp_path / "twice.toml").write_text("[data.sources.a]\npath = 'x'\n[data.sources.a]\n")
    cases = {
        "missing": (mixture({"a": sources["a"], "b": str(tmp_path / "nothing")}, {"a": 1, "b": 1}),
                    f"data.sources.b: no prepared dataset at '{tmp_path / 'nothing'}'"),
        "zero": (mixture(sources, {"a": 1, "b": 0}),
                 "data.sources.b: weight must be a number > 0, got 0.0"),
        "negative": (mixture(sources, {"a": -1, "b": 1}),
                     "data.sources.a: weight must be a number > 0, got -1.0"),
        "all zero": (mixture(sources, {"a": 0, "b": 0}), "data.sources.a: weight must be"),
        "not a number": (mixture(sources, {"a": 1, "b": "nan"}), "got nan"),
        "too small": (mixture(sources, {"a": 1, "b": 1e-9}), "weight below 1/65536 of their"),
        "tokenizers": (mixture({"a": sources["a"], "b": str(other_tokenizer)}, {"a": 1, "b": 1}),
                       "a and b were prepared with different tokenizers"),
        "merges": (mixture({"a": str(merges["m1"]), "b": str(merges["m2"])}, {"a": 1, "b": 1}),
                   "a and b were prepared with different tokenizers"),
        "no hash": (mixture({"a": str(merges["m1"]), "b": str(unhashed)}, {"a": 1, "b": 1}),
                    f"data.sources.b: '{unhashed / 'index.json'}' has no tokenizer.sha256; "
                    f"re-create it with: python -m data.prepare --out {unhashed}"),
        "dtypes": (mixture({"a": sources["a"], "b": wide}, {"a": 1, "b": 1}),
                   "'dtype': 'uint32'}); a mixture needs one"),
        "same dataset": (mixture({"a": sources["a"], "b": sources["a"]}, {"a": 1, "b": 1}),
                         "a and b are the same dataset"),
        "both": ([f"--data.path={sources['a']}", *good], "data.path ('"),
        "neither": (["--data.path=none"], "data: no training data: set data.path=DIR"),
        "name": ([str(tmp_path / "names.toml")], "data.sources: the name 'we b' may hold"),
        "duplicate": ([str(tmp_path / "twice.toml")], "invalid TOML"),
        "unknown key": ([*good, "--data.sources.b.wieght=1"],
                        "did you mean 'data.sources.b.weight'?"),
    }  # fmt: skip
    for what, (args, message) in cases.items():
        error = config_error([*args, *base], caplog)
        assert message in error, (what, error)


def train_and_log(argv: list[str]) -> tuple[list[float], list[str]]:
    """train_losses in a rank, with the lines its loggers wrote."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        return train_losses(argv), lines
    finally:
        root.removeHandler(handler)


@pytest.mark.slow
def test_mixture_resumes_on_another_world_size_anneals_and_logs(
    sources: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    weights = {"a": 0.75, "b": 0.25}
    common = [f"--run.output_dir={tmp_path}", *TINY, *FP32, "--train.steps=6",
              "--train.eval_interval=3", "--train.eval_batches=1"]  # fmt: skip
    argv = [*common, *mixture(sources, weights), "--train.micro_batch_size=2",
            "--checkpoint.interval=3", "--metrics.tensorboard=true",
            "--metrics.log_interval=1"]  # fmt: skip
    full, log = run_distributed(train_and_log, 2, [*argv, "--run.name=full"])[0]
    step3 = tmp_path / "full" / "checkpoints" / "step-3"
    written = tomllib.loads((tmp_path / "full" / "config.toml").read_text())["data"]
    assert written["sources"] == {n: {"path": sources[n], "weight": w} for n, w in weights.items()}

    # 2 ranks x micro-batch 2 saved at position 24; 1 rank x micro-batch 4 continues it.
    resume = [f"--checkpoint.resume={step3}", "--train.micro_batch_size=4"]
    resumed = run_distributed(
        train_losses, 1, [*common, *mixture(sources, weights), *resume, "--run.name=resumed"]
    )[0]
    assert_close(resumed, full[3:], rtol=1e-5)

    # Source b has 6 samples and serves about 2 of every 8 positions: it runs out mid-run.
    stream = GlobalStream({"a": 400, "b": 6}, weights, seed=0, shuffle=True)
    step = next(s for s in range(1, 7) if stream.consumed(8 * s)[1] > 6)
    assert (f"data: source b ran out of samples (6 per epoch); it is in epoch 1 after step "
            f"{step}, reading in a fresh order") in log  # fmt: skip
    assert not any("source a ran out" in line for line in log)
    assert any(line.startswith("step 6/6  val_loss") and "val_loss/a" in line for line in log)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "full" / "tensorboard"))
    events.Reload()
    tokens = {n: [e.value for e in events.Scalars(f"data/tokens/{n}")] for n in weights}
    for s, name in enumerate(stream.names):  # rank 0's count: the stream's, step by step
        assert tokens[name] == [stream.consumed(8 * step)[s] * SEQ for step in range(1, 7)]
    val = {tag: [e.value for e in events.Scalars(tag)] for tag in
           ("loss/val", "loss/val/a", "loss/val/b")}  # fmt: skip
    assert all(len(v) == 2 and all(map(math.isfinite, v)) for v in val.values())
    means = [(a + b) / 2 for a, b in zip(val["loss/val/a"], val["loss/val/b"], strict=True)]
    assert val["loss/val"] == pytest.approx(means)

    # Annealing: other weights on resume are applied from the resumed position, and said so.
    annealed = {"a": 0.25, "b": 0.75}
    annealed_argv = [*common, *mixture(sources, annealed), *resume, "--run.name=annealed",
                     "--metrics.tensorboard=true", "--metrics.log_interval=1"]  # fmt: skip
    losses, log = run_distributed(train_and_log, 1, annealed_argv)[0]
    assert "changed since the checkpoint, applied: data.sources.a.weight: 0.75 -> 0.25" in log
    assert any(line.startswith("data: mixture weights change at stream position 24: a 0.75 -> "
                               "0.25, b 0.25 -> 0.75") for line in log), log  # fmt: skip
    assert len(losses) == 3 and losses != resumed
    # Rank 0's tokens per source follow the annealed stream: the old weights up to position 24.
    stream.set_weights(24, annealed)
    events = EventAccumulator(str(tmp_path / "annealed" / "tensorboard"))
    events.Reload()
    for s, name in enumerate(stream.names):
        tokens = [e.value for e in events.Scalars(f"data/tokens/{name}")]
        assert tokens == [stream.consumed(8 * step)[s] * SEQ for step in (4, 5, 6)]
    # Which sources a mixture reads, and where, is fixed like data.path.
    renamed = mixture({"a": sources["a"], "c": sources["b"]}, {"a": 0.75, "c": 0.25})
    error = config_error([*common, *renamed, *resume, "--run.name=other"], caplog)
    assert "a resume cannot change the model, what trains, the optimizer or the data" in error
    assert f"data.sources.b.path: '{sources['b']}' -> None" in error
    assert f"data.sources.c.path: None -> '{sources['b']}'" in error
