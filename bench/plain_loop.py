"""A plain single-process training loop: the baseline `train.py`'s FSDP2 path is timed against.

No process group, no FSDP, no DTensor: `Transformer` built on the CPU, `init_weights`, fused
AdamW, `torch.nn.utils.clip_grad_norm_`. It takes train.py's own arguments (a TOML file and
`--section.key=value`, parsed into the trainer's config tree) so both programs run the same
model, data order, batch, loss normalization and optimizer settings. It logs the same
`step N ... tok/s X` lines, measured by the trainer's own `ThroughputMeter` and `Timer`, so one
parser reads both and both time exactly the same span of each step.

    python bench/plain_loop.py configs/debug.toml --train.steps=20 --metrics.log_interval=1

Precision follows `--parallel.param_dtype`:
- float32: everything in fp32, like FSDP2 with param_dtype=float32.
- bfloat16, `--bf16=copy` (default): a bf16 copy of the fp32 model runs forward and backward;
  after each micro-batch its bf16 gradients are added into fp32 gradients of the fp32 model,
  which is clipped and stepped. That is what FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32) does on one rank: cast parameters to bf16 when gathering, run everything
  (residual stream and norms included) in bf16, upcast gradients to fp32, keep fp32 master
  weights and optimizer state. Same numerics, so the same work: the ratio measures overhead.
- bfloat16, `--bf16=autocast`: `torch.autocast("cpu", dtype=torch.bfloat16)` on the fp32
  model, what a plain PyTorch user would write. Only matmul-like ops run in bf16 (residual
  stream and elementwise ops stay fp32), so it is a looser comparison; kept for reference.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

# So `python bench/plain_loop.py` finds the trainer's packages, as `python train.py` does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import ConfigError, HelpRequested, parse_config  # noqa: E402
from data.loader import build_dataloader  # noqa: E402
from launch.job import JobConfig, OptimizerConfig  # noqa: E402
from launch.metrics import ThroughputMeter, Timer, format_scalars  # noqa: E402
from model import count_params, get_family  # noqa: E402
from train import lr_lambda  # noqa: E402  (the schedule only)

logger = logging.getLogger("plain_loop")

Bf16Mode = Literal["copy", "autocast"]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    # The trainer's groups: decay matrices only, never the RMSNorm gains.
    groups = [
        {
            "params": [p for p in model.parameters() if p.ndim >= 2],
            "weight_decay": cfg.weight_decay,
        },
        {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True
    )


def summed_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


@torch.no_grad()
def accumulate_fp32_grads(master: list[torch.Tensor], compute: list[torch.Tensor]) -> None:
    """Add the bf16 copy's gradients into the fp32 model's, as FSDP2 accumulates unsynced
    micro-batch gradients in reduce_dtype; then free them like FSDP2 frees unsharded grads."""
    for m, c in zip(master, compute, strict=True):
        if m.grad is None:
            m.grad = c.grad.float()
        else:
            m.grad.add_(c.grad)
        c.grad = None


def clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    # clip_grad_norm_ with 0 would zero the gradients; the trainer only measures the norm.
    return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)


def train(job: JobConfig, bf16_mode: Bf16Mode) -> None:
    t = job.train
    torch.manual_seed(t.seed)
    torch.use_deterministic_algorithms(t.deterministic)
    family = get_family(job.model.name)
    model = family.build_model(family.build_args(job.model))
    model.init_weights(seed=t.seed, rope_len=job.data.seq_len)
    logger.info("model %s: %s parameters", job.model.flavor, f"{count_params(model):,}")

    bf16 = job.parallel.param_dtype == "bfloat16"
    compute = model
    if bf16 and bf16_mode == "copy":
        compute = copy.deepcopy(model).to(torch.bfloat16)
        compute.rope = model.rope  # FSDP2 casts parameters only: the RoPE table stays fp32
    master_params, compute_params = list(model.parameters()), list(compute.parameters())
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=bf16 and bf16_mode == "autocast")

    optimizer = build_optimizer(model, job.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, job.optim, t.steps)
    )
    accum = t.global_batch_size // t.micro_batch_size
    loader = build_dataloader(
        job.data,
        "train",
        dp_rank=0,
        dp_size=1,
        micro_batch_size=t.micro_batch_size,
        seed=t.seed,
    )
    batches = iter(loader)
    tokens_per_step = t.global_batch_size * job.data.seq_len
    flops = family.flops_per_token(model, job.data.seq_len)
    meter = ThroughputMeter(job.metrics.warmup_steps, 1, flops, None)
    timer = Timer(torch.device("cpu"))

    for step in range(1, t.steps + 1):
        micro_batches = [next(batches) for _ in range(accum)]
        data_time = timer.lap()
        global_tokens = sum((y != -100).sum() for _, y in micro_batches).float()
        if compute is not model:
            with torch.no_grad():  # FSDP2's cast to param_dtype when it all-gathers
                for c, m in zip(compute_params, master_params, strict=True):
                    c.copy_(m)
        loss_sum = torch.zeros(())
        for inputs, targets in micro_batches:
            with autocast:
                loss = summed_loss(compute, inputs, targets) / global_tokens
            loss.backward()
            loss_sum += loss.detach()
            if compute is not model:
                accumulate_fp32_grads(master_params, compute_params)
        grad_norm = clip(master_params, t.max_grad_norm)
        loss_value, grad_norm_value = loss_sum.item(), grad_norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm_value)):
            raise RuntimeError(f"step {step}: loss {loss_value}, grad norm {grad_norm_value}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        meter.record(step, timer.lap() + data_time, data_time, tokens_per_step)
        if step % job.metrics.log_interval == 0 or step == t.steps:
            scalars = {"loss/train": loss_value, "lr": lr, "grad_norm": grad_norm_value}
            logger.info("step %d  %s", step, format_scalars(scalars | meter.summary()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Plain single-process training loop (FSDP2 baseline).",
        epilog="All other arguments are train.py's: [CONFIG.toml] --section.key=value ...",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--bf16",
        choices=["copy", "autocast"],
        default="copy",
        help="how parallel.param_dtype=bfloat16 is run (see the module docstring)",
    )
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s [plain] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        job = parse_config(JobConfig, rest)
    except HelpRequested as help_request:
        print(help_request.text)
        return 0
    except ConfigError as err:
        logger.error("config error: %s", err)
        return 2
    if job.train.global_batch_size % job.train.micro_batch_size:
        logger.error("train.global_batch_size must be a multiple of train.micro_batch_size")
        return 2
    train(job, ours.bf16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
