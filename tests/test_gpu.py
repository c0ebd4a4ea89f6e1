"""GPU checks (NCCL, bf16, MFU). Skipped where no CUDA device is visible, as in CI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.test_train import TINY, train_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]


def test_trains_on_one_gpu_with_nccl_in_bf16(tiny_dataset: str, tmp_path: Path) -> None:
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.device=cuda", "--parallel.param_dtype=bfloat16", "--train.steps=8",
        "--train.micro_batch_size=8",
    ]  # fmt: skip
    losses = run_distributed(train_losses, 1, argv)[0]
    assert losses[-1] < losses[0]


def test_gpu_fp32_matches_cpu_fp32(tiny_dataset: str, tmp_path: Path) -> None:
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
        "--parallel.param_dtype=float32", "--train.steps=4", "--train.micro_batch_size=8",
    ]  # fmt: skip
    cpu = run_distributed(train_losses, 1, [*argv, "--parallel.device=cpu"])[0]
    gpu = run_distributed(train_losses, 1, [*argv, "--parallel.device=cuda"])[0]
    # TF32 is off by default for matmuls in PyTorch; remaining differences are summation order.
    torch.testing.assert_close(torch.tensor(gpu), torch.tensor(cpu), rtol=1e-4, atol=0)
