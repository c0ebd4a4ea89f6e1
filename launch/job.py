"""The job's config tree: every section a run reads, nested into one `JobConfig`, and the
sections that belong to the job as a whole (`[run]`, `[train]`, `[optim]`).

    job = parse_config(JobConfig, argv)   # defaults < TOML file < --section.key=value

Each other section is owned by the module that uses it (`ModelConfig` in `model/`,
`ParallelConfig` in `parallel/dims.py`, ...). `train.py` runs the job and `launch/check.py`
checks it; both import the tree from here, and nothing here imports either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from checkpoint import CheckpointConfig
from configs import ConfigError, check_folder_name
from data.loader import DataConfig
from data.tasks import EvalConfig
from launch.health import HealthConfig
from launch.metrics import MetricsConfig
from model import ModelConfig
from parallel.ac import ActivationCheckpointConfig
from parallel.build import BuildSettings
from parallel.compile import CompileConfig
from parallel.dims import ParallelConfig
from parallel.dpo import DPOConfig
from parallel.float8 import Float8Config
from parallel.ft_config import FaultToleranceConfig
from parallel.lora import LoRAConfig
from parallel.muon import MuonConfig


@dataclass
class RunConfig:
    name: str = "debug"
    """Run name: outputs go to <output_dir>/<name>/."""
    output_dir: str = "outputs"
    """Parent directory of run directories."""

    def __post_init__(self) -> None:
        if not self.output_dir.strip():
            raise ConfigError("run.output_dir is empty: name the parent folder of run folders")
        check_folder_name("run.name", self.name, absolute=False)


# AdamW (or Muon and AdamW) and the schedule: train.py builds them (build_optimizer, lr_lambda).
@dataclass
class OptimizerConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """'adamw' for every parameter, or 'muon': Muon for the blocks' matrices ([optim.muon],
    parallel/muon.py) and AdamW (lr, betas, eps, weight_decay below) for the embeddings, output
    projection, norms and LoRA adapters. A resume cannot switch it."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warm-up."""
    min_lr_ratio: float = 0.1
    """The schedule decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 20
    """Steps of linear warm-up from lr / warmup_steps to lr."""
    decay: Literal["cosine", "linear", "sqrt", "constant"] = "cosine"
    """Shape of the decay: 'cosine', 'linear', 'sqrt' (1 - sqrt of the decay's progress, the
    usual cool-down of warmup-stable-decay) or 'constant' (no decay)."""
    decay_steps: int = 0
    """0: the decay spans every step after warm-up. N > 0: warmup-stable-decay; the lr holds
    at its peak until the last N steps of train.steps and decays over them (from the peak at
    the first to lr * min_lr_ratio after the last, as the default decay does). A resume that
    raises train.steps from a checkpoint of the stable phase is then the run planned longer."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, for matrices only (norm gains are never decayed)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """AdamW kernel: 'auto' = fused (one kernel for all parameters), the fastest everywhere."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon's settings, read with name='muon'; its lr follows the same schedule."""

    def __post_init__(self) -> None:
        # torch.optim.AdamW would refuse some of these, but only inside every rank after the
        # process group exists; the rest (a negative weight decay) it would silently train with.
        rules = (
            ("lr", self.lr > 0, "> 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("decay_steps", self.decay_steps >= 0, ">= 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
            ("eps", self.eps > 0, "> 0"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise ConfigError(f"optim.{name} must be {rule}, got {getattr(self, name)}")
        if self.decay_steps > 0 and self.decay == "constant":
            raise ConfigError(
                f"optim.decay_steps={self.decay_steps} with optim.decay='constant': nothing "
                "decays; set optim.decay to 'cosine', 'linear' or 'sqrt', or decay_steps to 0"
            )


# The loop's own settings (train.py); launch/check.py checks the batch arithmetic.
@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps to run."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks. Fixed across meshes, so a run's math does
    not change with the number of GPUs."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward; gradient accumulation makes up the rest."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (float64) to this (0 = no clipping; it is still logged)."""
    seed: int = 0
    """Seeds weights and data order: the same seed gives the same run on any mesh."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """A NaN/inf loss or gradient norm stops the run ('error') or skips that update ('skip')."""
    eval_interval: int = 100
    """Compute the validation loss, and score the eval.tasks, every this many steps and at the
    end (0 = never)."""
    eval_batches: int = 4
    """Global batches of the validation split per evaluation (at most what the split holds)."""
    max_skipped_steps: int = 10
    """With on_nonfinite='skip': stop with an error after this many skipped steps in a row."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms: bitwise repeatable kernels, somewhat slower."""
    loss_chunk_tokens: int = 0
    """Compute the output projection and the cross-entropy this many tokens at a time,
    recomputed in backward, so that no rank holds more than one chunk's logits (0 = all at
    once; parallel/loss.py). For long sequences at a large vocabulary: e.g. 4096."""
    freeze: list[str] = field(default_factory=list)
    """Parameters that do not train: glob patterns over their names ('tok_embeddings.*',
    'layers.[0-7].*'; parallel/freeze.py)."""

    def __post_init__(self) -> None:
        names = ("steps", "global_batch_size", "micro_batch_size", "eval_batches")
        for name in (*names, "max_skipped_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_interval < 0 or self.max_grad_norm < 0 or self.loss_chunk_tokens < 0:
            raise ConfigError(
                "train: eval_interval, max_grad_norm and loss_chunk_tokens must be >= 0"
            )


@dataclass
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fp8: Float8Config = field(default_factory=Float8Config)
    ac: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ft: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    dry_run: bool = False
    """Print the resolved config, mesh, parameter count, memory and communication plan, then
    exit."""

    def build_settings(self) -> BuildSettings:
        """The sections parallel/build.py reads to build the model as this job trains it."""
        return BuildSettings(
            parallel=self.parallel,
            fp8=self.fp8,
            ac=self.ac,
            compile=self.compile,
            lora=self.lora,
            freeze=self.train.freeze,
        )
