"""Throughput, MFU and memory, logged on rank 0 and to TensorBoard (and W&B, if asked)."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from launch.wandb_run import start_info, start_wandb
from parallel.dims import LaunchEnv

logger = logging.getLogger(__name__)

# Dense peak TFLOP/s per device (no sparsity), from the vendors' data sheets.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0},
    "H100 PCIe": {"bf16": 756.0, "fp8": 1513.0},
    "H100": {"bf16": 989.0, "fp8": 1979.0},  # SXM / HBM3
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0},
}


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Log a line on rank 0 (and TensorBoard scalars) every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run dir>/tensorboard."""
    warmup_steps: int = 3
    """First steps left out of throughput averages (lazy init, allocator warm-up, compile)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per device for MFU; default: looked up for known GPUs, none on CPU."""
    profile_step: int = 0
    """Profile this step (0 = never) with torch.profiler on every rank: a Chrome trace and a
    table of the costliest ops per rank under <run dir>/profile/."""
    memory_snapshot_step: int = 0
    """Snapshot the CUDA caching allocator after this step (0 = never), its history of the
    step recorded, on every rank: <run dir>/memory/, and where the memory reserved but not
    allocated sits, logged (launch/memory.py). CUDA only."""
    wandb: bool = False
    """Also send every scalar to Weights & Biases (rank 0; `pip install -e .[wandb]`): a W&B
    run per start of the trainer, in a group named run.name (launch/wandb_run.py)."""
    wandb_project: str | None = None
    """The W&B project; unset: WANDB_PROJECT, else W&B's settings files, else fsdp2-trainer."""
    wandb_mode: Literal["online", "offline"] | None = None
    """'offline': to disk only, for nodes without internet (`wandb sync` uploads it later);
    unset: WANDB_MODE, else W&B's settings files (`wandb offline`), else 'online'."""
    wandb_entity: str | None = None
    """The W&B team or user; unset: WANDB_ENTITY, else W&B's settings files, else yours."""
    wandb_group: str | None = None
    """The W&B group of this run's starts; unset: WANDB_RUN_GROUP, else run.name."""

    def __post_init__(self) -> None:
        from configs import ConfigError

        # Whether W&B imports and has a login is checked once the run is (launch/wandb_run.py's
        # check_wandb): a dry run needs neither.
        for key in ("wandb_project", "wandb_entity", "wandb_group"):
            if (value := getattr(self, key)) is not None and not value.strip():
                raise ConfigError(f"metrics.{key} is empty: name it, or leave it out")

        if self.log_interval < 1 or self.warmup_steps < 0 or self.profile_step < 0:
            raise ConfigError(
                "metrics: log_interval must be >= 1, warmup_steps and profile_step >= 0"
            )
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"metrics.peak_tflops must be > 0, got {self.peak_tflops}")


def peak_tflops(
    device: torch.device, precision: str | None, override: float | None
) -> float | None:
    """Peak dense TFLOP/s of one device, or None when unknown (CPU, unlisted GPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # Longest match first so "H100 PCIe" wins over "H100".
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key].get(precision or "")
    logger.warning("no peak FLOPs known for %r: set metrics.peak_tflops for MFU", name)
    return None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory of this process in GiB. On a GPU, the CUDA allocator's peaks over the steps
    since the previous call, which then starts a new interval: torchtitan's rule, so that
    after warm-up the two trainers' figures read alike, and the compile's and first step's
    transient peaks do not hide the steady state. On CPU, the resident set's peak since the
    process started (the kernel keeps no other)."""
    gib = 1024**3
    if device.type == "cuda":
        stats = {
            "memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    # ru_maxrss is in KiB on Linux.
    return {"memory/max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


@dataclass
class ThroughputMeter:
    """Accumulates step times and tokens between log lines, skipping warm-up steps."""

    warmup_steps: int
    world_size: int
    flops_per_token: int
    peak_tflops: float | None
    _time: float = 0.0
    _data_time: float = 0.0
    _tokens: int = 0
    _window: list[int] = field(default_factory=list)

    def record(self, step: int, step_time: float, data_time: float, global_tokens: int) -> None:
        if step <= self.warmup_steps:
            return
        self._time += step_time
        self._data_time += data_time
        self._tokens += global_tokens
        self._window.append(step)

    def summary(self) -> dict[str, float]:
        """Averages over the steps since the last call; empty during warm-up."""
        if not self._window or self._time <= 0:
            return {}
        tps = self._tokens / self._time
        out = {
            "throughput/tokens_per_second": tps,
            "throughput/tokens_per_second_per_device": tps / self.world_size,
            "throughput/tflops_per_device": self.flops_per_token * tps / self.world_size / 1e12,
            "time/step_seconds": self._time / len(self._window),
            "time/data_fraction": self._data_time / self._time,
        }
        if self.peak_tflops:
            out["throughput/mfu_percent"] = (
                100 * out["throughput/tflops_per_device"] / self.peak_tflops
            )
        self._time = self._data_time = 0.0
        self._tokens = 0
        self._window.clear()
        return out


class MetricsLogger:
    """Rank-0 log lines, TensorBoard and W&B scalars. On other ranks every call is a no-op."""

    def __init__(
        self,
        cfg: MetricsConfig,
        run_name: str,
        run_dir: Path,
        env: LaunchEnv,
        total_steps: int,
        start_step: int,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`start_step`: the step this start resumes from (0: a fresh start)."""
        self.writer = None
        self.wandb_run = None
        self.is_rank0 = is_rank0 = env.rank == 0
        self.total_steps = total_steps
        if is_rank0 and cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: after a resume at step N, TensorBoard hides what an earlier attempt
            # logged from step N+1 on, so the curves do not overlap.
            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                        purge_step=start_step + 1)  # fmt: skip
        if is_rank0 and cfg.wandb:
            start = start_info(start_step, env.world_size, env.num_nodes, os.environ)
            self.wandb_run = start_wandb(cfg, run_name, run_dir, config or {}, start)

    def log(self, step: int, scalars: dict[str, float], eta_s: float | None = None) -> None:
        if not self.is_rank0:
            return
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        eta = (
            f"  eta {format_duration(eta_s)}"
            if eta_s is not None and step < self.total_steps
            else ""
        )
        logger.info("step %d/%d  %s%s", step, self.total_steps, format_scalars(scalars), eta)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()  # ends W&B's service process too


def format_duration(seconds: float) -> str:
    """3h05m, 4m12s, 9s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass
class RunSummary:
    """What rank 0 says when the loop ends: where the run got to and what it left behind."""

    step: int
    total_steps: int
    losses: list[float]
    val_loss: float | None
    tokens_seen: int
    wall_s: float
    checkpoint: Path | None
    val_step: int | None = None
    """The step val_loss was computed at."""
    scores: dict[str, float] = field(default_factory=dict)
    """The eval tasks' metrics at val_step (eval/<task>/<metric>)."""

    def lines(self, stop_signal: str | None, checkpoint_interval: int) -> list[str]:
        if stop_signal:
            head = f"stopped by {stop_signal} after step {self.step}/{self.total_steps}"
        else:
            head = f"done: step {self.step}/{self.total_steps}"
        parts = [head, f"{len(self.losses)} steps in {format_duration(self.wall_s)}"]
        if self.losses:
            parts.append(f"final loss {self.losses[-1]:.4f}")
        if self.val_loss is not None:
            # A stop between evaluations leaves an older one: say which step it is from.
            stale = self.val_step is not None and self.val_step != self.step
            parts.append(f"val_loss {self.val_loss:.4f}" + (f" (step {self.val_step})" * stale))
        parts.append(f"{self.tokens_seen:,} tokens seen")
        lines = [", ".join(parts)]
        if self.scores:
            lines.append("eval: " + format_scores(self.scores, ", "))
        if self.checkpoint is not None:
            lines.append(f"last checkpoint: {self.checkpoint}")
        elif checkpoint_interval == 0:
            lines.append("no checkpoint saved (checkpoint.interval=0)")
        if stop_signal and self.checkpoint is not None:
            lines.append("the same command resumes from it")
        return lines


_SHORT = {
    "loss/train": ("loss", "{:.4f}"),
    "loss/val": ("val_loss", "{:.4f}"),
    "loss/aux": ("aux", "{:.4f}"),
    "expert_load/max_over_mean": ("load_max/mean", "{:.2f}"),
    "lr": ("lr", "{:.2e}"),
    "grad_norm": ("grad_norm", "{:.3f}"),
    "rewards/accuracies": ("reward_acc", "{:.2f}"),  # DPO (parallel/dpo.py)
    "rewards/margins": ("reward_margin", "{:.4f}"),
    "rewards/accuracies/val": ("val_reward_acc", "{:.2f}"),  # DPO's evaluation
    "rewards/margins/val": ("val_reward_margin", "{:.4f}"),
    "throughput/tokens_per_second": ("tok/s", "{:,.0f}"),
    "throughput/tokens_per_second_per_device": ("tok/s/dev", "{:,.0f}"),
    "throughput/tflops_per_device": ("tflops/dev", "{:.2f}"),
    "throughput/mfu_percent": ("mfu", "{:.1f}%"),
    "time/data_fraction": ("data_wait", "{:.1%}"),
    "memory/max_allocated_gib": ("mem", "{:.2f}GiB"),
    "memory/max_rss_gib": ("rss", "{:.2f}GiB"),
    "straggler/slowest_rank": ("slowest rank", "{:.0f}"),
    "straggler/lag_s": ("lag", "{:.3f}s"),
}


def format_scalars(scalars: dict[str, float]) -> str:
    parts = []
    for name, (short, fmt) in _SHORT.items():
        if name in scalars:
            parts.append(f"{short} {fmt.format(scalars[name])}")
    # A mixture's validation loss per source (loss/val/<source>), after the overall one.
    parts += [f"val_loss/{k[9:]} {v:.4f}" for k, v in scalars.items() if k.startswith("loss/val/")]
    if scores := {k: v for k, v in scalars.items() if k.startswith("eval/")}:
        parts.append(format_scores(scores, "  "))
    if "time/eval_s" in scalars:
        parts.append(f"eval_time {scalars['time/eval_s']:.1f}s")
    return "  ".join(parts)


def format_scores(scores: dict[str, float], sep: str) -> str:
    """'next_line/acc 0.412' for each eval/next_line/acc."""
    return sep.join(f"{name[5:]} {value:.4f}" for name, value in scores.items())


@contextlib.contextmanager
def profile_step(cfg: MetricsConfig, step: int, run_dir: Path, rank: int) -> Iterator[None]:
    """Run the body under torch.profiler when `step` is `cfg.profile_step`, else do nothing.

    Every rank writes its own files: on a slow step the rank that waits in a collective and
    the rank that is late tell different stories.
    """
    if step != cfg.profile_step:
        yield
        return
    on_gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        yield
    out = run_dir / "profile"
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"step{step}_rank{rank}.json"))
    sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40)
    (out / f"step{step}_rank{rank}.txt").write_text(table + "\n")
    if rank == 0:
        logger.info("profile of step %d written to %s", step, out)


@contextlib.contextmanager
def step_instruments(cfg: MetricsConfig, step: int, run_dir: Path, rank: int) -> Iterator[None]:
    """The body (step `step`) under what the config asks of that step: torch.profiler
    (`profile_step`), the CUDA allocator's history and snapshot (launch/memory.py)."""
    from launch.memory import memory_snapshot

    with (
        profile_step(cfg, step, run_dir, rank),
        memory_snapshot(cfg.memory_snapshot_step, step, run_dir, rank),
    ):
        yield


class Timer:
    """Wall-clock seconds; synchronizes CUDA so GPU work is counted where it happens."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        elapsed, self.start = now - self.start, now
        return elapsed
