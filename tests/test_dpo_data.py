"""Preference pairs (data/preference.py, data/pairs.py), DPO's loss math (parallel/dpo.py) and
every bad input DPO refuses before any rank starts. No process group: cheap."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from configs import ConfigError, parse_config
from data.loader import NO_TARGET, open_dataset
from data.pairs import PreferencePairs
from data.prepare import prepare
from launch.job import JobConfig
from parallel.dpo import DPOConfig, dpo_losses

EOS = 257


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def prepared(tmp_path: Path, rows: list, **kw) -> Path:
    return prepare([str(write(tmp_path / "pairs.jsonl", rows))], tmp_path / "data",
                   val_fraction=0.0, format="preference", **kw)  # fmt: skip


def test_a_pair_is_two_rows_that_share_the_prompt(tmp_path: Path) -> None:
    """Standard layout: chosen and rejected rows, prompt + completion + EOS, the completion and
    EOS the targets, padded with EOS; longer sequences keep their start (TRL's keep_start)."""
    data = prepared(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "three"}])
    pairs = PreferencePairs(open_dataset(data), "train", 8)
    inputs, targets = pairs[0]
    assert inputs.tolist() == [
        [*b"1+1=2", EOS, EOS, EOS],
        [*b"1+1=thr", EOS],  # 10 tokens cut to 8, the last of them only a target
    ]
    assert targets.tolist() == [
        [NO_TARGET] * 3 + [ord("2"), EOS] + [NO_TARGET] * 3,
        [NO_TARGET] * 3 + [*b"thre", NO_TARGET],
    ]


def test_conversational_pairs_render_with_the_chat_template(tmp_path: Path) -> None:
    """Conversational layout: the prompt's messages with the generation prompt (the plain
    template without a tokenizer), each completion as what the template adds after it."""
    user = [{"role": "user", "content": "hi"}]
    row = {"prompt": user, "chosen": [{"role": "assistant", "content": "hello"}],
           "rejected": [{"role": "assistant", "content": "no"}]}  # fmt: skip
    data = prepared(tmp_path, [row])
    inputs, targets = PreferencePairs(open_dataset(data), "train", 40)[0]
    prompt = b"user: hi\nassistant: "
    chosen = [t for t in targets[0].tolist() if t != NO_TARGET]
    assert bytes(inputs[0, : len(prompt)].tolist()) == prompt
    assert chosen == [*b"hello\n", EOS]
    assert [t for t in targets[1].tolist() if t != NO_TARGET] == [*b"no\n", EOS]
    assert open_dataset(data).examples["layouts"] == ["conversational"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "pairs.jsonl:2: invalid JSON"),
        ({"prompt": "a", "chosen": "b"}, "pairs.jsonl:2: no field 'rejected'"),
        ({"prompt": "a", "chosen": "", "rejected": "c"}, "2: the chosen completion is empty"),
        ({"prompt": "a", "chosen": [], "rejected": "c"}, "2: prompt, chosen and rejected must"),
    ],
)
def test_a_bad_line_is_one_error_naming_it(tmp_path: Path, line: object, message: str) -> None:
    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    with pytest.raises(ConfigError, match=message):
        prepared(tmp_path, [good, line])
    assert not (tmp_path / "data").exists()


def test_loss_math_is_trls() -> None:
    """sigmoid at label smoothing 0 is -log sigmoid(beta d); conservative DPO mixes in the
    flipped label; IPO divides each log-ratio by its completion's tokens; the metrics."""
    logps = torch.tensor([-3.0, -5.0, -4.0, -2.0])
    ref = torch.tensor([-3.5, -4.0, -4.0, -3.0])
    lengths = torch.tensor([2, 4, 3, 1])
    delta = torch.tensor([0.5 - (-1.0), 0.0 - 1.0])
    losses, stats = dpo_losses(logps, ref, lengths, DPOConfig(beta=0.2))
    torch.testing.assert_close(losses, -F.logsigmoid(0.2 * delta))
    smooth, _ = dpo_losses(logps, ref, lengths, DPOConfig(beta=0.2, label_smoothing=0.1))
    expected = -0.9 * F.logsigmoid(0.2 * delta) - 0.1 * F.logsigmoid(-0.2 * delta)
    torch.testing.assert_close(smooth, expected)
    ipo, _ = dpo_losses(logps, ref, lengths, DPOConfig(beta=0.2, loss_type="ipo"))
    per_token = torch.tensor([0.5 / 2 - (-1.0) / 4, 0.0 / 3 - 1.0 / 1])
    torch.testing.assert_close(ipo, (per_token - 1 / 0.4) ** 2)
    chosen, rejected = 0.2 * torch.tensor([0.5, 0.0]), 0.2 * torch.tensor([-1.0, 1.0])
    margins = (chosen - rejected).sum()
    expected = torch.tensor([chosen.sum(), rejected.sum(), 1.0, margins, -7.0, -7.0, 2.0])
    torch.testing.assert_close(stats, expected)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("--dpo.beta=0", "dpo.beta must be > 0"),
        ("--dpo.label_smoothing=0.5", r"dpo.label_smoothing must be in \[0, 0.5\)"),
        ("--dpo.reference=lora", "dpo.reference='lora' is the model with its adapters off"),
        ("--data.seq_len=4", r"the prompt of train pair 0 \(pairs.jsonl:1\) has 4 tokens"),
    ],
)
def test_bad_settings_are_one_line(tmp_path: Path, setting: str, message: str) -> None:
    data = prepared(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    argv = [f"--data.path={data}", *base(tmp_path), "--dpo.enabled=true", setting]
    with pytest.raises(ConfigError, match=message):
        check(argv)


def base(tmp_path: Path) -> list[str]:
    return [f"--run.output_dir={tmp_path}", "--model.vocab_size=258", "--data.seq_len=16",
            "--train.eval_interval=0"]  # fmt: skip


def check(argv: list[str]) -> object:
    from launch.check import check_config
    from parallel.dims import LaunchEnv

    world = 2 if "--parallel.cp=2" in argv else 1
    env = LaunchEnv(rank=0, local_rank=0, world_size=world, local_world_size=world, num_nodes=1)
    return check_config(parse_config(JobConfig, argv), env)


def test_dpo_needs_pairs_and_pairs_need_dpo(tmp_path: Path) -> None:
    pairs = prepared(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    text = prepare([str(write(tmp_path / "t.jsonl", [{"text": "hello world " * 20}]))],
                   tmp_path / "text", val_fraction=0.0)  # fmt: skip
    base_argv = base(tmp_path)
    sft = prepare([str(write(tmp_path / "e.jsonl", [{"prompt": "1+1=", "response": "2"}]))],
                  tmp_path / "sft", val_fraction=0.0, format="prompt_response")  # fmt: skip
    for data, what in ((text, "holds documents"), (sft, "holds prompt_response")):
        with pytest.raises(ConfigError, match=f"needs one dataset of preference pairs .* {what}"):
            check([*base_argv, f"--data.path={data}", "--dpo.enabled=true"])
    with pytest.raises(ConfigError, match="holds preference pairs: train on them with dpo"):
        check([*base_argv, f"--data.path={pairs}"])


def test_precomputed_reference_of_another_model_or_dataset_is_refused(tmp_path: Path) -> None:
    """The fingerprint beside the file names what differs: the dataset, or the model."""
    from parallel.dpo_reference import fingerprint

    data = prepared(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    file = tmp_path / "ref.npy"
    argv = [f"--data.path={data}", *base(tmp_path), "--dpo.enabled=true",
            "--dpo.reference=precomputed", f"--dpo.reference_path={file}"]  # fmt: skip
    job = parse_config(JobConfig, argv)
    np.save(file, np.zeros((1, 2)))
    mine = fingerprint(job, open_dataset(data))
    file.with_suffix(".json").write_text(json.dumps(mine))
    check(argv)  # its own: accepted
    for key, other in (("dataset", "0" * 64), ("start", {"seed": 1})):
        file.with_suffix(".json").write_text(json.dumps(mine | {key: other}))
        with pytest.raises(ConfigError, match=f"reference log-probs of another {key}"):
            check(argv)
