"""The family contract, tested once for every family in `model.FAMILIES`.

A fork that adds one line to FAMILIES (and a golden file) gets these tests; a family's own file
(tests/test_qwen3.py, ...) keeps only what is specific to it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from model import FAMILIES
from tests.distributed import run_distributed
from tests.test_train import FP32, assert_close, train_losses

GOLDEN_DIR = Path(__file__).parent / "golden"
# llama3 is the default family: its file predates the others and its argv names no family.
GOLDEN_FILE = {"llama3": "debug_losses.json"}


def golden_path(family: str) -> Path:
    return GOLDEN_DIR / GOLDEN_FILE.get(family, f"{family}_debug_losses.json")


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=[] if f == "llama3" else pytest.mark.slow) for f in FAMILIES]
)
def test_golden_losses_of_the_debug_flavor(family: str, tiny_dataset: str, tmp_path: Path) -> None:
    """Each family's debug flavor's first 20 losses match its golden file (fp32, 1 process).

    After an intended numerics change, regenerate with UPDATE_GOLDEN=1 and review the diff.
    """
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}",
        *([] if family == "llama3" else [f"--model.name={family}"]),
        "--model.flavor=debug", "--model.vocab_size=512", "--data.seq_len=64",
        "--train.global_batch_size=4", "--train.micro_batch_size=4", "--train.steps=20",
        "--optim.warmup_steps=5", "--optim.lr=1e-3", "--train.eval_interval=0",
        "--metrics.tensorboard=false", *FP32,
    ]  # fmt: skip
    losses = run_distributed(train_losses, 1, argv)[0]
    golden = golden_path(family)
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(json.dumps({"argv": argv[2:], "losses": losses}, indent=1) + "\n")
    expected = json.loads(golden.read_text())
    assert expected["argv"] == argv[2:], "the golden file was made with other settings"
    # Different CPUs sum matmuls in different orders; 20 steps amplify that to ~1e-5.
    assert_close(losses, expected["losses"], rtol=1e-4)
