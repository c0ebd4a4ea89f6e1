"""Downstream tasks scored during training (data/tasks.py, train.py `score_tasks`): the same
log-likelihoods on 1 process, FSDP and HSDP, each equal to the request scored alone; every bad
task file one config error naming its file and line; the debug task, deterministic."""

from __future__ import annotations

import functools
import json
import logging
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from configs import ConfigError
from data.tasks import Request, TaskConfig, load_task
from data.tokenizer import ByteTokenizer
from tests.conftest import WORDS
from tests.distributed import run_distributed
from tests.test_families import scalars
from tests.test_train import FP32, TINY

EOS = ByteTokenizer.eos_id


def write_tasks(folder: Path) -> tuple[Path, Path]:
    """A multiple-choice task of 13 examples x 3 choices (39 requests: no mesh divides them
    evenly) and a completion task of 5, short enough for TINY's seq_len of 32."""
    rng = random.Random(0)
    mc, lm = folder / "mc.jsonl", folder / "lm.jsonl"
    lines = []
    for i in range(13):
        # A context's trailing whitespace moves to the continuation, as lm-eval-harness does.
        context = " ".join(rng.choice(WORDS) for _ in range(2)) + (" ", "\n", "")[i % 3]
        lines.append(
            {"context": context, "choices": rng.sample(WORDS, 3), "gold": rng.randrange(3)}
        )
    mc.write_text("".join(json.dumps(line) + "\n" for line in lines))
    words = [(rng.choice(WORDS), " " + rng.choice(WORDS)) for _ in range(5)]
    lm.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in words))
    return mc, lm


def train_and_score(argv: list[str]) -> tuple[list[float], list[Any]]:
    """Train in this rank; the losses, and each scoring's (task, logliks, logliks of each
    request scored alone by an unpadded forward of its own: one process only). Under document
    masking the request is scored alone without its EOS: the EOS ends the document before (as
    in training), so the context cannot attend to it, unlike lm-eval-harness's BOS."""
    import train
    from tests.test_train import train_losses

    scored, batched = [], train.task_logliks

    def recording(run: Any, task: Any) -> torch.Tensor:
        logliks = batched(run, task)
        alone, skip = None, int(run.job.data.attention_mask == "document")
        if run.env.world_size == 1:
            alone = [loglik_alone(run.model, Request(r.tokens[skip:], r.n_scored))
                     for r in task.requests]  # fmt: skip
        scored.append((task.name, logliks.tolist(), alone))
        return logliks

    train.task_logliks = recording
    return train_losses(argv), scored


@torch.no_grad()
def loglik_alone(model: Any, request: Any) -> float:
    tokens, n = torch.tensor(request.tokens), request.n_scored
    logprobs = model(tokens[None, :-1]).float().log_softmax(-1)[0]
    # Position p predicts token p + 1: the continuation is the last n tokens.
    return sum(
        logprobs[p, tokens[p + 1]].item() for p in range(len(tokens) - 1 - n, len(tokens) - 1)
    )


_REFERENCE: dict[str, Any] = {}


def score(dataset: str, out: Path, world: int, nodes: int, micro: int, *extra: str) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    mc, lm = write_tasks(out)
    argv = [
        f"--data.path={dataset}", f"--run.output_dir={out}", *TINY, *FP32, *extra,
        "--train.steps=2", "--train.eval_interval=2", "--train.eval_batches=1",
        f"--train.micro_batch_size={micro}", "--metrics.tensorboard=true", "--run.name=eval",
        f"--eval.tasks.mc.path={mc}", f"--eval.tasks.lm.path={lm}",
        "--eval.tasks.lm.kind=completion", f"--parallel.dp_replicate={nodes}",
    ]  # fmt: skip
    losses, scored = run_distributed(train_and_score, world, argv, nodes=nodes)[0]
    return losses, scored, scalars(out / "eval")


@pytest.mark.parametrize(
    ("world", "nodes", "micro", "mask", "tp", "cp"),
    [
        pytest.param(2, 1, 4, "causal", 1, 1, id="fsdp"),
        pytest.param(4, 2, 2, "document", 1, 1, id="hsdp-document", marks=pytest.mark.slow),
        pytest.param(2, 1, 8, "causal", 2, 1, id="tp", marks=pytest.mark.slow),
        pytest.param(2, 1, 8, "document", 1, 2, id="cp-document", marks=pytest.mark.slow),
    ],
)
def test_same_logliks_on_one_process_fsdp_and_hsdp(
    tiny_dataset: str,
    tmp_path: Path,
    world: int,
    nodes: int,
    micro: int,
    mask: str,
    tp: int,
    cp: int,
) -> None:
    """fp32, after 2 steps: the summed log-likelihood of every request within 1e-5 of one
    process (whose each value is that request scored alone, unpadded), the same accuracies;
    under document masking too (the context starts after an EOS: its own document, so one
    process's value is the request scored alone without the EOS), at tp = 2
    (the logits split over the vocabulary, under loss_parallel), and at cp = 2 (each request's
    tokens split over two ranks, each summing its part)."""
    extra = [f"--data.attention_mask={mask}", "--data.document_positions=true"] * (mask != "causal")
    if mask not in _REFERENCE:
        _REFERENCE[mask] = score(tiny_dataset, tmp_path / "one", 1, 1, 8, *extra)
    losses, scored, tags = _REFERENCE[mask]
    got_losses, got_scored, got_tags = score(
        tiny_dataset, tmp_path / "dp", world, nodes, micro, *extra, f"--parallel.tp={tp}",
        f"--parallel.cp={cp}",
    )  # fmt: skip
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert [name for name, *_ in scored] == ["lm", "mc"] == [name for name, *_ in got_scored]
    for (_, logliks, alone), (_, got, _) in zip(scored, got_scored, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(logliks), rtol=1e-5, atol=0)
        if alone is not None:
            torch.testing.assert_close(
                torch.tensor(alone), torch.tensor(logliks), rtol=1e-5, atol=1e-6
            )
    for tag in ("eval/mc/acc", "eval/mc/acc_norm"):
        assert got_tags[tag] == tags[tag] and len(tags[tag]) == 1, tag
    assert math.isfinite(tags["eval/lm/nll"][0]) and tags["eval/lm/ppl"][0] == pytest.approx(
        math.exp(tags["eval/lm/nll"][0]), rel=1e-5
    )
    assert "time/eval_s" in tags


BAD = [
    ("not json\n", "line 1: not JSON"),
    ('{"context": "a", "choices": ["b"], "gold": 1}\n', "line 1: gold must be an index"),
    ('\n{"context": "a", "choices": [], "gold": 0}\n', "line 2: the choice list is empty"),
    ('{"context": "a", "gold": 0}\n', "line 1: no choices"),
    ('{"context": "a", "choices": ["b", ""], "gold": 0}\n', "line 1: choice 1 is empty"),
    # The same rule after a context ending in whitespace, which moves onto the choice and
    # would give it a token: acc_norm would divide by its 0 bytes.
    ('{"context": "a ", "choices": ["b", ""], "gold": 0}\n', "line 1: choice 1 is empty"),
    (json.dumps({"context": "x" * 40, "choices": ["b"], "gold": 0}), "line 1: EOS \\+ context"),
]


@pytest.mark.parametrize(("text", "error"), BAD)
def test_bad_task_file_is_one_error_naming_file_and_line(
    tmp_path: Path, text: str, error: str
) -> None:
    file = tmp_path / "bad.jsonl"
    file.write_text(text)
    with pytest.raises(ConfigError, match=f"eval.tasks.t: '{file}' {error}"):
        load_task("t", TaskConfig(str(file)), ByteTokenizer(), EOS, seq_len=32)


def test_an_empty_target_is_refused_whatever_the_context_ends_with(tmp_path: Path) -> None:
    file = tmp_path / "lm.jsonl"
    for context in ("a", "a\n"):
        file.write_text(json.dumps({"context": context, "target": ""}) + "\n")
        with pytest.raises(ConfigError, match=f"'{file}' line 1: target is empty"):
            load_task("t", TaskConfig(str(file), kind="completion"), ByteTokenizer(), EOS, 32)


def test_a_task_file_that_is_not_utf8_is_one_line_before_any_rank(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Latin-1 file (a benchmark saved by another tool): the launchers' check (what
    launch/torchrun.sh runs before torchrun) ends with one config error naming the task, the
    file, the line and the byte, instead of a UnicodeDecodeError traceback."""
    from launch.check import main as launch_check

    file = tmp_path / "latin1.jsonl"
    good = json.dumps({"context": "the cafe", "choices": [" is", " was"], "gold": 0})
    file.write_bytes((good + "\n" + good.replace("cafe", "caf\u00e9") + "\n").encode("latin-1"))
    args = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.eval_interval=1", f"--eval.tasks.cafe.path={file}"]  # fmt: skip
    caplog.clear()
    assert launch_check(["--world-size=1", *args]) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error == (
        f"config error: eval.tasks.cafe: '{file}' line 2: not UTF-8 (byte 0xe9 at column 21): a "
        "task file is UTF-8 text; convert it, e.g. with iconv -t UTF-8"
    )


def test_identical_choices_and_tasks_never_scored_are_warnings(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Examples whose choices are all the same score right exactly when gold is 0: valid, but
    one warning naming their lines (or saying that every example is so). Tasks configured with
    train.eval_interval=0 are neither scored nor read: one warning says so."""
    from configs import parse_config
    from data.tasks import task_warnings
    from launch.check import check_config, unintended_settings
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    same = {"context": "x", "choices": [" a", " a", " a"], "gold": 1}
    differ = {"context": "x", "choices": [" a", " b"], "gold": 1}
    (tmp_path / "some.jsonl").write_text("".join(json.dumps(e) + "\n" for e in
                                                 [differ, same, differ, same]))  # fmt: skip
    (tmp_path / "all.jsonl").write_text(json.dumps(same) + "\n\n" + json.dumps(same) + "\n")
    base = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            f"--eval.tasks.some.path={tmp_path / 'some.jsonl'}",
            f"--eval.tasks.all.path={tmp_path / 'all.jsonl'}"]  # fmt: skip
    job = parse_config(JobConfig, [*base, "--train.eval_interval=5"])
    assert task_warnings(check_config(job, LaunchEnv(0, 0, 1, 1, 1)).tasks) == [
        f"eval.tasks.all: '{tmp_path / 'all.jsonl'}': every example has identical choices, "
        "scored right exactly when gold is 0 (ties go to the first choice): their acc and "
        "acc_norm measure the file, not the model",
        f"eval.tasks.some: '{tmp_path / 'some.jsonl'}': 2 of 4 examples (lines 2, 4) have "
        "identical choices, scored right exactly when gold is 0 (ties go to the first choice): "
        "their acc and acc_norm measure the file, not the model",
    ]
    assert unintended_settings(job) == []
    off = parse_config(JobConfig, [*base, "--train.eval_interval=0"])
    assert check_config(off, LaunchEnv(0, 0, 1, 1, 1)).tasks == ()
    assert unintended_settings(off) == [
        "eval.tasks (all, some) will not be scored with train.eval_interval=0, and their files "
        "are not read (nor checked): set train.eval_interval to score them"
    ]


def test_missing_task_file_stops_the_run_at_startup(tiny_dataset: str, tmp_path: Path) -> None:
    from configs import parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.eval_interval=5",
            f"--eval.tasks.t.path={tmp_path / 'none.jsonl'}"]  # fmt: skip
    with pytest.raises(ConfigError, match="eval.tasks.t.path: no task file"):
        check_config(parse_config(JobConfig, argv), LaunchEnv(0, 0, 1, 1, 1))


def test_tokens_and_targets_of_a_request(tmp_path: Path) -> None:
    """EOS + context + continuation; the targets are the continuation's bytes exactly, at the
    positions that predict them; limit keeps the first examples."""
    from data.tasks import encode_request, task_batches

    file = tmp_path / "t.jsonl"
    file.write_text('{"context": "ab ", "choices": ["c", "de"], "gold": 1}\n' * 3)
    task = load_task("t", TaskConfig(str(file), limit=2), ByteTokenizer(), EOS, seq_len=8)
    assert task.choices == (2, 2) and task.choice_bytes == (1, 2, 1, 2)
    assert task.requests[1] == ([EOS, *b"ab de"], 3)  # " de": the space moved over
    [(inputs, targets, ids)] = list(task_batches(task, 1, 2, batch_size=2, seq_len=8))
    assert ids.tolist() == [1, 3]
    assert inputs[0].tolist() == [EOS, *b"ab d", 0, 0, 0]
    assert targets[0].tolist() == [-100, -100, *b" de", -100, -100, -100]
    # 4 requests over 3 ranks: 2, 1 and 1, but every rank runs 2 batches of 1.
    assert [len(list(task_batches(task, r, 3, 1, 8))) for r in range(3)] == [2, 2, 2]
    # Any trailing whitespace moves over and is scored, as lm-eval-harness's rstrip() does.
    assert encode_request(ByteTokenizer(), EOS, "ab\n\t", "c") == ([EOS, *b"ab\n\tc"], 3)


def test_the_debug_task_is_deterministic_and_real(tmp_path: Path) -> None:
    """python -m data.make_eval_task: the same file for the same seed; each gold choice is
    the line of the held-out file after the context; it fits configs/debug.toml's seq_len."""
    from data.make_eval_task import held_out_files, write_task

    first = write_task(tmp_path / "a.jsonl", n_examples=20)
    assert first.read_bytes() == write_task(tmp_path / "b.jsonl", n_examples=20).read_bytes()
    assert (
        first.read_bytes() != write_task(tmp_path / "c.jsonl", n_examples=20, seed=1).read_bytes()
    )
    files = {key: path for path, key in held_out_files(0.005)}
    for line in first.read_text().splitlines():
        example = json.loads(line)
        key, number = example["source"].rsplit(":", 1)
        lines = files[key].read_text().splitlines()
        gold = example["choices"][example["gold"]]
        assert gold == lines[int(number) - 1]
        assert example["context"].endswith(lines[int(number) - 2] + "\n")
        # Each distractor swaps two of the line's pieces: same bytes, other order, all distinct.
        wrong = [c for i, c in enumerate(example["choices"]) if i != example["gold"]]
        assert len(set(wrong)) == 3 and gold not in wrong
        assert all(sorted(c.encode()) == sorted(gold.encode()) for c in wrong)
        assert all(sum(a != b for a, b in zip(c, gold, strict=True)) >= 2 for c in wrong)
    other = write_task(tmp_path / "d.jsonl", n_examples=20, distractors="other-files")
    lines_of = functools.cache(lambda path: path.read_text(errors="replace").splitlines())
    for line in other.read_text().splitlines():
        example = json.loads(line)
        key = example["source"].rsplit(":", 1)[0]
        wrong = [c for i, c in enumerate(example["choices"]) if i != example["gold"]]
        others = {line for k, path in files.items() if k != key for line in lines_of(path)}
        assert all(c in others for c in wrong)
    task = load_task("next_line", TaskConfig(str(first)), ByteTokenizer(), EOS, seq_len=256)
    assert len(task.gold) == 20 and set(task.choices) == {4}
    # configs/debug.toml scores the file python -m data.prepare writes beside the stdlib data.
    from configs import parse_config
    from data.prepare import DEFAULT_OUT, NEXT_LINE_TASK
    from launch.job import JobConfig

    job = parse_config(JobConfig, [str(Path(__file__).parents[1] / "configs" / "debug.toml")])
    assert job.eval.tasks["next_line"].path == f"{DEFAULT_OUT}/{NEXT_LINE_TASK}"
    assert job.data.seq_len == 256 and job.data.path == DEFAULT_OUT


@pytest.mark.slow
def test_exported_checkpoint_scores_the_same_in_transformers(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """The trainer's summed log-likelihoods equal those transformers computes from the run's
    last checkpoint, exported to Hugging Face files (fp32), within 1e-4."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.export import main as export

    _, scored, _ = score(tiny_dataset, tmp_path, 1, 1, 8, "--checkpoint.interval=2")
    assert export([str(tmp_path / "eval/checkpoints/step-2"), str(tmp_path / "hf"),
                   "--dtype", "float32"]) == 0  # fmt: skip
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, local_files_only=True
    ).eval()
    for name, logliks, _ in scored:  # the files score() wrote
        kind = "completion" if name == "lm" else "multiple_choice"
        file = str(tmp_path / f"{name}.jsonl")
        task = load_task(name, TaskConfig(file, kind), ByteTokenizer(), EOS, seq_len=32)
        with torch.no_grad():
            hf = [loglik_alone(lambda x: theirs(x).logits, r) for r in task.requests]
        torch.testing.assert_close(torch.tensor(hf), torch.tensor(logliks), rtol=1e-4, atol=1e-4)


ROWS = {
    "hellaswag": {"activity_label": "Cooking", "ctx_a": "A man cracks an egg.",
                  "ctx_b": "he", "endings": ["stirs it [title] well.", "sings."], "label": "1"},
    "arc": {"question": "What melts ice?", "answerKey": "B",
            "choices": {"text": ["cold", "heat", "dark"], "label": ["A", "B", "C"]}},
    "piqa": {"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0},
}  # fmt: skip
CONVERTED = {
    "hellaswag": {"context": "Cooking: A man cracks an egg. He",
                  "choices": [" stirs it. well.", " sings."], "gold": 1},
    "arc": {"context": "Question: What melts ice?\nAnswer:",
            "choices": [" cold", " heat", " dark"], "gold": 1},
    "piqa": {"context": "Question: Open a jar\nAnswer:",
             "choices": [" twist the lid", " eat the lid"], "gold": 0},
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(ROWS))
def test_benchmark_layouts_convert_to_task_files(tmp_path: Path, layout: str) -> None:
    """HellaSwag, ARC and PIQA rows (JSONL; ARC as parquet too) become lm-eval-harness's
    prompts and continuations, in a file the trainer loads; a row of another layout is one
    error naming the file and line."""
    from data.convert_task import convert

    source = tmp_path / f"{layout}.jsonl"
    source.write_text(json.dumps(ROWS[layout]) + "\n")
    assert convert(layout, source, tmp_path / "task.jsonl") == 1
    assert json.loads((tmp_path / "task.jsonl").read_text()) == CONVERTED[layout]
    task = load_task(layout, TaskConfig(str(tmp_path / "task.jsonl")), ByteTokenizer(), EOS, 64)
    assert task.gold == (CONVERTED[layout]["gold"],)
    if layout == "arc":
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa

        pq.write_table(pa.Table.from_pylist([ROWS[layout]]), tmp_path / "arc.parquet")
        assert convert(layout, tmp_path / "arc.parquet", tmp_path / "parquet.jsonl") == 1
        assert (tmp_path / "parquet.jsonl").read_text() == (tmp_path / "task.jsonl").read_text()
    source.write_text("\n" + json.dumps({"text": "not a benchmark row"}) + "\n")
    with pytest.raises(ConfigError, match=f"'{source}' line 2: not a {layout} row"):
        convert(layout, source, tmp_path / "bad.jsonl")
