"""The trainer's task scoring against lm-eval-harness's own, offline: the run's exported
checkpoint scored by lm-eval's `HFLM` (bench/lm_eval_check.py) on the same task files gives
the same summed log-likelihood for every request and the same acc and acc_norm.

lm-eval-harness is not in the [test] extra (alone it brings 59 packages): where it is not
installed, this file is skipped. Run it with `pip install -e ".[test,eval]"`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.lm_eval_check import evaluate, hf_byte_tokenizer, lm_eval_task
from data.tokenizer import ByteTokenizer
from tests.test_tasks import score

pytest.importorskip("lm_eval", reason="lm-eval-harness is not installed (.[eval])")
pytestmark = pytest.mark.slow


def test_the_byte_tokenizer_for_lm_eval_is_the_trainers() -> None:
    text = "def f(x):\n\treturn x  # héllo 😀"
    tokenizer = hf_byte_tokenizer()
    assert tokenizer.encode(text, add_special_tokens=False) == ByteTokenizer().encode(text)
    with_eos = tokenizer.encode(text)
    assert with_eos[0] == ByteTokenizer.eos_id and tokenizer.decode(with_eos[1:]) == text


def test_lm_eval_harness_scores_the_export_as_the_trainer_does(
    tiny_dataset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32, 2 steps, exported: lm-eval's summed log-likelihood of every request within 1e-5 of
    the trainer's, and the same acc and acc_norm, on contexts that end with a space, a newline
    or neither (lm-eval moves trailing whitespace onto the continuation)."""
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(offline, "1")  # restored after the test: evaluate() sets them too
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from checkpoint.export import main as export

    _, scored, tags = score(tiny_dataset, tmp_path, 1, 1, 8, "--checkpoint.interval=2")
    assert export([str(tmp_path / "eval/checkpoints/step-2"), str(tmp_path / "hf"),
                   "--dtype", "float32"]) == 0  # fmt: skip
    kinds = {"mc": "multiple_choice", "lm": "completion"}
    tasks = [lm_eval_task(f"trainer_{n}", tmp_path / f"{n}.jsonl", k) for n, k in kinds.items()]
    out = evaluate(tmp_path / "hf", tasks, batch_size=8)
    for name, logliks, _ in scored:  # the files score() wrote
        samples = sorted(out["samples"][f"trainer_{name}"], key=lambda s: s["doc_id"])
        # resps: for each request (a choice), one (loglik, is_greedy) per repeat.
        theirs = [resp[0][0] for sample in samples for resp in sample["resps"]]
        # lm-eval sums a request's token log-probs in float32, the trainer in float64.
        ours, theirs = (torch.tensor(x, dtype=torch.float64) for x in (logliks, theirs))
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    metrics = out["results"]["trainer_mc"]
    for metric in ("acc", "acc_norm"):
        assert tags[f"eval/mc/{metric}"] == [pytest.approx(metrics[f"{metric},none"], abs=1e-6)]
