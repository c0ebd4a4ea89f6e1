"""Train a model of any family in model/ with FSDP2 on a (dp_replicate, dp_shard) mesh.

    torchrun --standalone --nproc-per-node=4 train.py configs/debug.toml --train.steps=100

The whole run reads top to bottom in `train()`: process group -> mesh -> model on meta ->
shard -> materialize and init -> optimizer and schedule -> data -> resume -> loop and save.
The config tree (`JobConfig`) is `launch/job.py`. It is checked by `launch.check.check_config()`
on every rank before any process group exists, so a bad config is one error line on rank 0,
never a hang.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from checkpoint import (
    Checkpointer,
    CheckpointError,
    ResumePoint,
    TrainState,
    build_states,
    checkpoint_folder,
    step_dir,
    warn_if_low_space,
)
from checkpoint.hf import load_hf_weights
from checkpoint.state import read_mesh
from configs import ConfigError, HelpRequested, config_to_toml, parse_config
from data.documents import MicroBatch, batch_on_device
from data.loader import DataSource, StepBatches, build_dataloader
from data.stream import SourceMeter
from data.tasks import Task, task_batches, task_scores, task_warnings
from launch.check import Plan, check_config, dry_run, replica_settings, unintended_settings
from launch.elastic import (
    NODE_LOST_EXIT,
    Mesh,
    NodeLost,
    restart_line,
    shared_store_problem,
    shared_store_warning,
)
from launch.health import (
    Heartbeat,
    StragglerMeter,
    collective_failure,
    dump_flight_recorder,
    hang_line,
)
from launch.job import JobConfig, OptimizerConfig
from launch.lifecycle import (
    RunLock,
    StopRequest,
    exit_process,
    exit_with_launcher,
    set_aside_earlier_attempt,
    setup_logging,
)
from launch.metrics import (
    MetricsLogger,
    RunSummary,
    ThroughputMeter,
    Timer,
    memory_stats,
    peak_tflops,
    step_instruments,
)
from launch.preflight import network_problem
from launch.resume_rules import resume_changes
from launch.wandb_run import resolve_wandb
from model import count_params, get_hf_mapping, output_layer
from parallel.build import BuiltModel, build_model
from parallel.compile import compile_loss
from parallel.cp import split_after
from parallel.dims import LaunchEnv
from parallel.dpo_reference import build_objective, reference_for_loader
from parallel.ep import build_expert_mesh
from parallel.fsdp import assign_local_shard, reshard_plan
from parallel.ft import Replicas, ReplicasDiverged
from parallel.ft_config import group_folder
from parallel.lora import adapter_names, init_lora
from parallel.loss import ChunkedLoss
from parallel.muon import Muon, muon_groups
from parallel.objective import (
    Objective,
    TokenLoss,
    cross_entropy_sum,
    objective_loss,
)
from parallel.pp import Pipeline
from parallel.replicas import build_replicas
from parallel.runtime import (
    build_mesh,
    dp_rank_and_size,
    init_distributed,
    launched_by_torchrun,
    pick_device,
    set_timeout,
)
from parallel.tp import loss_context

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger("train")


def build_optimizer(
    model: torch.nn.Module, cfg: OptimizerConfig, blocks: list[torch.nn.Module]
) -> torch.optim.Optimizer:
    """AdamW, or Muon on the `blocks`' matrices and AdamW on the rest (optim.name)."""
    impl = "fused" if cfg.implementation == "auto" else cfg.implementation
    adamw = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
             "weight_decay": cfg.weight_decay}  # fmt: skip
    if cfg.name == "muon":
        return Muon(muon_groups(model, blocks, cfg.muon, adamw), kernel=impl)
    # Trainable parameters only: frozen ones (train.freeze, LoRA's base) get no state.
    # Decay matrices only: decaying RMSNorm gains toward 0 fights the normalization.
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(impl, {"foreach": False})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


def decay_start(cfg: OptimizerConfig, total_steps: int) -> int:
    """The step the decay starts from: warm-up's end, or with warmup-stable-decay the last
    decay_steps steps (never before warm-up's end). The stable phase before it does not depend
    on total_steps, so a longer run shares it."""
    if cfg.decay_steps == 0:
        return cfg.warmup_steps
    return max(cfg.warmup_steps, total_steps - cfg.decay_steps)


def lr_lambda(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Multiplier of the peak lr after `step` optimizer steps (LambdaLR convention)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    start = decay_start(cfg, total_steps)
    if cfg.decay == "constant" or step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, total_steps - start))
    shape = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress,
             "sqrt": 1 - math.sqrt(progress)}[cfg.decay]  # fmt: skip
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def schedule_line(cfg: OptimizerConfig, total_steps: int) -> str:
    """The optimizer and its lr schedule in words, for the run's first lines."""
    lr = f"lr {cfg.lr:g}" + (f", muon lr {cfg.muon.lr:g}" if cfg.name == "muon" else "")
    warmup = f"warm-up {cfg.warmup_steps} steps" if cfg.warmup_steps else "no warm-up"
    if cfg.decay == "constant":
        return f"optim: {cfg.name}, {lr}: {warmup}, then constant"
    start = decay_start(cfg, total_steps)
    stable = f", the peak to step {start}" if start > cfg.warmup_steps else ""
    return (f"optim: {cfg.name}, {lr}: {warmup}{stable}, then {cfg.decay} decay to "
            f"{cfg.min_lr_ratio:g}x the peak by step {total_steps}")  # fmt: skip


def apply_optimizer_config(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: OptimizerConfig,
    step: int,
    total_steps: int,
) -> None:
    """Set the config's hyperparameters on a (possibly just resumed) optimizer and schedule.

    A checkpoint's optimizer and schedule state carry the lr, betas, eps and weight decay they
    were saved with; a resume that changes them in the config means to change them. The lr is
    the schedule's value after `step` steps, as LambdaLR would set it.
    """
    # Muon's matrices (optim.name="muon") have their own peak lr; the schedule scales both.
    muon = [group.get("algorithm") == "muon" for group in optimizer.param_groups]
    scheduler.base_lrs = [cfg.muon.lr if is_muon else cfg.lr for is_muon in muon]
    for group, peak, is_muon in zip(optimizer.param_groups, scheduler.base_lrs, muon, strict=True):
        group.update(lr=peak * lr_lambda(step, cfg, total_steps), initial_lr=peak)
        if is_muon:
            m = cfg.muon
            group.update(weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                         ns_steps=m.ns_steps, ns_coefficients=list(m.ns_coefficients),
                         adjust_lr_fn=m.adjust_lr_fn, ns_dtype=m.ns_dtype)  # fmt: skip
        else:
            group.update(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    # AdamW's first group holds its matrices (build_optimizer, muon_groups): decayed.
    optimizer.param_groups[muon.count(True)]["weight_decay"] = cfg.weight_decay


class NonFiniteError(RuntimeError):
    pass


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message is the rank's one line about it."""


class LaunchError(RuntimeError):
    """This node's launch cannot work (its network interface, torchrun's restart store): the
    message is the line each node says once, before any process group exists."""


def train(
    job: JobConfig, plan: Plan, env: LaunchEnv, stop: StopRequest | None = None
) -> list[float]:
    """Run training; returns the global training loss of every step it ran (after a resume,
    only those after the checkpoint's step). `stop`: the installed signal handler, if any.
    NodeLost: a rank's launcher died, and every rank saved the step in flight."""
    stop = stop or StopRequest()
    device = pick_device(job.parallel.device, env)
    run_dir = group_folder(Path(job.run.output_dir) / job.run.name, job.ft)
    health = job.health
    init_distributed(device, env, job.parallel.timeout_s, health.flight_recorder_entries,
                     run_dir / "comm_traces")  # fmt: skip
    lock = RunLock(run_dir)
    heartbeat, ended = Heartbeat(run_dir, env.rank, health.heartbeat_interval_s), "failed"
    heartbeat.timeout_s = job.parallel.timeout_s
    try:
        # One trainer per run folder: rank 0 holds the lock, and every rank learns the answer
        # (all of them are in this collective, so it cannot hang).
        refused = [lock.acquire() if env.rank == 0 else None]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] is not None:
            raise ConfigError(refused[0])
        heartbeat.start()  # after the lock: a refused second trainer must not overwrite them
        losses, lost = _train(job, plan, env, device, stop, heartbeat)
        ended = "finished" if lost is None else "stopped: its launcher died"
    except RuntimeError as err:
        # Each says its own line.
        ours = (CollectiveFailure, NonFiniteError, CheckpointError, ReplicasDiverged)
        if isinstance(err, ours) or collective_failure(err) is None:
            raise
        # One line instead of a traceback from inside FSDP, and the evidence kept on disk.
        dump = dump_flight_recorder(run_dir, env.rank, nccl=device.type == "cuda")
        line = hang_line(err, heartbeat, env.world_size, heartbeat.timeout_s, dump)
        ended = "failed: " + line
        raise CollectiveFailure(line) from None
    finally:
        heartbeat.stop(ended)
        lock.release()
        dist.destroy_process_group()
        # The model, optimizer and checkpointer form reference cycles: freed now, while the
        # interpreter is whole. DTensor's caches still hold the process groups (and their
        # threads) after this: `python train.py` leaves through launch.lifecycle.exit_process.
        gc.collect()
    if lost is not None:  # raised only now: a traceback through _train would keep it all alive
        raise lost
    return losses


@dataclass
class Run:
    """What a run holds from setup to its last step: the model as it trains, its optimizer and
    data, where it saves and logs, and the step's progress."""

    job: JobConfig
    plan: Plan
    env: LaunchEnv
    built: BuiltModel
    objective: Objective
    """What the step minimizes: the cross-entropy (its loss function possibly compiled or
    chunked), or DPO (parallel/objective.py)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: torch.device
    dp_rank: int
    dp_size: int
    to_batch: Callable[..., MicroBatch]
    progress: TrainState = field(default_factory=TrainState)
    keep_gathered: bool = False
    """Every block stays gathered between micro-batches (see `setup`)."""
    skipped_in_a_row: int = 0
    """Steps in a row whose update the non-finite policy skipped."""
    heartbeat: Heartbeat = field(default_factory=lambda: Heartbeat(Path(), 0, 0))
    """Where this rank is (step, phase), for the others to read (launch/health.py)."""
    pipeline: Pipeline | None = None
    """Under pipeline parallel (parallel.pp > 1): this rank's stages on their schedule."""
    replicas: Replicas = field(default_factory=Replicas)
    """The replica groups beyond this job (ft.enabled, parallel/ft.py), or none."""
    references: dict[str, Any] = field(default_factory=dict)
    """What the objective reads with each batch, per split (DPO's precomputed reference)."""

    @property
    def model(self) -> torch.nn.Module:
        return self.built.model


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    stop: bool
    """Some rank was asked to stop: every rank stops after this step."""
    node_lost: bool
    """Some rank's launcher died (its node is lost): the stop must end in a restart."""
    saved: bool
    """Some rank's async save finished: every rank finishes it after this step."""
    scalars: dict[str, float]
    """The model's own scalars to log (the family's step terms), at a log step."""
    wait_s: float = 0.0
    """Seconds this rank waited in the step's first all-reduce: for the others to arrive."""
    committed: bool = True
    """False: a replica group failed during the step (ft.enabled); nothing of it was applied."""


def _train(
    job: JobConfig,
    plan: Plan,
    env: LaunchEnv,
    device: torch.device,
    stop: StopRequest,
    heartbeat: Heartbeat,
) -> tuple[list[float], NodeLost | None]:
    """The run; returns its losses, and what to raise once the process group is gone when a
    node was lost (the step in flight saved)."""
    torch.manual_seed(job.train.seed)
    torch.use_deterministic_algorithms(job.train.deterministic)
    mesh = build_mesh(device, plan.dp_replicate, plan.dp_shard, plan.tp, plan.cp, plan.pp)
    # Under ft.enabled each replica group logs in a folder of its own; checkpoints are shared.
    ckpt_folder = checkpoint_folder(job.checkpoint, Path(job.run.output_dir) / job.run.name)
    run_dir = group_folder(Path(job.run.output_dir) / job.run.name, job.ft)
    config_toml = config_to_toml(job)
    if env.rank == 0:
        if plan.resume is None or plan.resume.model_only:
            set_aside_earlier_attempt(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_toml)
        log_orientation(job, plan, run_dir, ckpt_folder)
        logger.info("mesh %s on %s, grad accumulation %d", mesh, device, plan.grad_accum_steps)
    run = setup(job, plan, env, mesh, device)
    run.heartbeat = heartbeat
    # The replica groups beyond this job (ft.enabled: parallel/ft.py): each reads its part of
    # the stream, as HSDP's replicas do, and the checkpoint records the mesh they make up.
    run.replicas = replicas = build_replicas(job.ft, env.rank, env.world_size, device,
                                             replica_settings(job, env))  # fmt: skip
    # What the objective reads with each batch (DPO's precomputed reference, written by one
    # pass over the pairs at the first start): parallel/dpo_reference.py.
    run.references = reference_for_loader(run, run_dir)
    loader = build_loader(job, plan, "train", *replicas.data_slice(run.dp_rank, run.dp_size),
                          reference=run.references.get("train"))  # fmt: skip
    # Resume: everything that changes during training is a Stateful in one dict, loaded in
    # place before the loader is iterated (DCP reshards it onto this mesh).
    groups = replicas.groups
    mesh_now = Mesh(env.world_size * groups, env.num_nodes * groups, plan.dp_replicate * groups,
                    plan.dp_shard, plan.grad_accum_steps)  # fmt: skip
    states = build_states(
        run.model, run.optimizer, run.scheduler, loader, run.progress, config_toml,
        mesh_now.as_dict(),
    )  # fmt: skip
    checkpointer = Checkpointer(job.checkpoint, ckpt_folder, env.rank == 0)
    if env.rank == 0 and job.checkpoint.interval > 0:
        warn_if_low_space(ckpt_folder, checkpoint_bytes(run))
    heartbeat.beat(0, "resume")
    # Now, or under ft.enabled at the first quorum, unless the group heals from a peer instead.
    load = partial(resume, run, checkpointer, states, mesh_now)
    resumed = replicas.attach(run.built.parts, states, load)
    end = loop(run, loader, checkpointer, states, run_dir, stop)
    checkpointer.wait()  # an async save still in flight must finish before the group goes
    # No rank exits before rank 0 has marked the last save complete: under srun
    # --kill-on-bad-exit the first node whose launcher exits ends the others' processes.
    dist.barrier()
    replicas.close(None if end.stopped else run.progress.step)
    if env.rank == 0:
        summary = RunSummary(
            run.progress.step, job.train.steps, end.losses, end.val_loss,
            run.progress.tokens_seen, time.perf_counter() - end.started,
            end.saved or (resumed and resumed.path), end.val_step, end.scores,
        )  # fmt: skip
        reason = (stop.signal_name or "a signal to another rank") if end.stopped else None
        for line in summary.lines(reason, job.checkpoint.interval):
            logger.info("%s", line)
    if end.node_lost:  # not 0: torchrun restarts the workers on the nodes that remain
        # Under ft.enabled one replica group saves (parallel/ft.py): maybe another.
        saved = f"step {run.progress.step} saved" if end.saved else "nothing saved"
        then = (
            "the other replica groups go on, and this one heals from them when started again "
            "(docs/launch.md)"
            if job.ft.enabled
            else f"exit status {NODE_LOST_EXIT} so that torchrun restarts the workers on the "
            "nodes that remain (--nnodes=MIN:MAX, --max-restarts; docs/launch.md)"
        )
        return end.losses, NodeLost(f"a node's launcher died: {saved}; {then}")
    return end.losses, None


def resume(
    run: Run, checkpointer: Checkpointer, states: dict[str, Any], mesh_now: Mesh
) -> ResumePoint | None:
    """Load the run's checkpoint (if any) into `states`; returns the one loaded."""
    job, plan, env = run.job, run.plan, run.env
    # An older one if plan.resume is damaged; logs the resume, once verified.
    resumed = checkpointer.load(states, plan.resume, job.train.steps)
    if env.rank == 0 and resumed is not None and not resumed.model_only:
        log_resume_changes(job, plan, resumed.path, resumed.step, mesh_now)
    # The checkpoint brought its own lr, betas, ...: what this run's config says wins (the
    # changes were checked and listed by check_config).
    apply_optimizer_config(
        run.optimizer, run.scheduler, job.optim, run.progress.step, job.train.steps
    )
    if env.rank == 0 and run.progress.step >= job.train.steps:
        logger.info("resumed at step %d of train.steps=%d: nothing to do", run.progress.step,
                    job.train.steps)  # fmt: skip
    return resumed


def checkpoint_bytes(run: Run) -> int:
    """A lower bound of one checkpoint's size: fp32 weights, plus AdamW's two fp32 moments of
    what trains, Muon's one (the data position, RNG and config are small)."""
    params = list(run.model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    muon = sum(p.numel() for g in run.optimizer.param_groups
               if g.get("algorithm") == "muon" for p in g["params"])  # fmt: skip
    return 4 * sum(p.numel() for p in params) + 8 * trainable - 4 * muon


def log_resume_changes(job: JobConfig, plan: Plan, path: Path, step: int, mesh_now: Mesh) -> None:
    """What differs from the checkpoint resumed: the settings (against the checkpoint loaded:
    after a fallback, an older one than check_config read) and, on a world other than the
    checkpoint's (an elastic restart after a lost node), the mesh, in one line."""
    same = plan.resume is not None and path == plan.resume.path
    for change in plan.resume_changes if same else resume_changes(job, path):
        logger.info("changed since the checkpoint, applied: %s", change)
    before = read_mesh(path)
    if line := restart_line(Mesh(**before) if before else None, mesh_now, step):
        logger.info("%s", line)  # the global batch did not change


def setup(
    job: JobConfig, plan: Plan, env: LaunchEnv, mesh: DeviceMesh, device: torch.device
) -> Run:
    """The model as it will train (parallel/build.py), materialized and initialized on this
    rank's shards, and its optimizer and schedule."""
    expert_mesh = None
    if plan.ep > 1:  # the experts split over groups of ep ranks of a replica's dp_shard x cp x tp
        ranks = plan.dp_shard * plan.cp * plan.tp
        expert_mesh = build_expert_mesh(device, plan.dp_replicate, ranks, plan.ep, plan.pp)
    sizes = list(plan.stage_sizes)
    built = build_model(plan.family, plan.args, job.build_settings(), mesh, expert_mesh, sizes)
    model = built.model
    if env.rank == 0 and job.lora.enabled:
        logger.info("lora: rank %d, alpha %g on %d Linear layers (%s)", job.lora.rank,
                    job.lora.alpha, len(built.adapted), ", ".join(job.lora.targets))  # fmt: skip
    initialize(built, job, plan, env, device)
    t = job.train
    if env.rank == 0:
        n_params = count_params(model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = f" ({trainable:,} trainable, {n_params - trainable:,} frozen)"
        logger.info("model %s: %s parameters%s", job.model.flavor, f"{n_params:,}",
                    frozen if trainable < n_params else "")  # fmt: skip
    optimizer = build_optimizer(model, job.optim, plan.family.fsdp_units(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, job.optim, t.steps)
    )
    # At tp > 1 loss parallel (loss_context) keeps the logits split instead: no compiled loss.
    loss_fn = compile_loss(cross_entropy_sum, job.compile) if plan.tp == 1 else cross_entropy_sum
    if t.loss_chunk_tokens:  # the logits a chunk at a time (parallel/loss.py)
        # The module that runs: under pp the last stage's (the merged view may hold a
        # stand-in where a tied weight's replica is).
        layer = output_layer(plan.family, built.parts[-1])
        loss_fn = ChunkedLoss(layer, t.loss_chunk_tokens, loss_fn)
    # The cross-entropy, or DPO with its reference (a frozen copy built like the model).
    copy = partial(build_reference, job, plan, env, mesh, expert_mesh, device)
    objective = build_objective(job.dpo, loss_fn, copy,
                                mesh["cp"].get_group() if plan.cp > 1 else None)  # fmt: skip
    dp_rank, dp_size = dp_rank_and_size(mesh)
    # A loader's (inputs, targets) on the device, with their document ids and targets under
    # data.attention_mask="document" (data/documents.py): derived per micro-batch, on the device.
    to_batch = partial(batch_on_device, cfg=job.data, eos_id=plan.dataset.eos_id, device=device)
    if plan.cp > 1:  # each cp rank keeps its two chunks of the window (parallel/cp.py)
        to_batch = split_after(to_batch, mesh["cp"])
    # No block freed after forward ('never', or 'default' at dp_shard = 1): keep them gathered
    # between micro-batches too, saving an all-gather (a copy at dp_shard = 1) per block.
    units = len(plan.family.fsdp_units(model))
    p = job.parallel
    resharded = reshard_plan(units, p.reshard_after_forward, plan.dp_shard * plan.cp,
                             p.cpu_offload)  # fmt: skip
    keep_gathered = plan.grad_accum_steps > 1 and not any(resharded)
    pipeline = None
    if built.stages:  # the step's micro-batches through this rank's stages (parallel/pp.py)
        pipeline = Pipeline(built.stages, mesh["pp"], device, p.pipeline, plan.grad_accum_steps)
    return Run(job, plan, env, built, objective, optimizer, scheduler, device, dp_rank, dp_size,
               to_batch, keep_gathered=keep_gathered, pipeline=pipeline)  # fmt: skip


def initialize(
    built: BuiltModel,
    job: JobConfig,
    plan: Plan,
    env: LaunchEnv,
    device: torch.device,
    log: bool = True,
) -> None:
    """Materialize `built` on `device` and give it its starting weights: the Hugging Face
    files' (checkpoint.init_from_hf, unless resuming) or the seed's, then LoRA's adapters."""
    model, t = built.model, job.train
    for part in built.parts:  # the model, or each pipeline stage (each its own FSDP root)
        part.to_empty(device=device)
    if job.checkpoint.init_from_hf and plan.resume is None:
        mapping = get_hf_mapping(job.model.name)  # checked by check_config
        hf_dir, adapters = job.checkpoint.init_from_hf, adapter_names(model)
        loaded = load_hf_weights(model, mapping, hf_dir, job.data.seq_len, exclude=adapters,
                                 partial=bool(built.stages))  # fmt: skip
        for stage in built.stages:  # each stage's own RoPE table (`model` gathers no buffers)
            stage.model.init_buffers(job.data.seq_len)
        if env.rank == 0 and log:  # log_orientation leaves it to here, where the count is known
            logger.info("starting at step 0 of %d from the Hugging Face weights in %s: %d "
                        "tensors loaded", t.steps, hf_dir, loaded)  # fmt: skip
    else:  # random init, also when a checkpoint is about to overwrite it (it sets the RoPE table)
        for part in built.parts:
            part.init_weights(seed=t.seed, rope_len=job.data.seq_len, assign=assign_local_shard)
    # LoRA's adapters by their own rule, on the base weights from either: B = 0, so the model
    # starts as the base model, exactly.
    init_lora(model, t.seed, assign_local_shard)


def build_reference(
    job: JobConfig,
    plan: Plan,
    env: LaunchEnv,
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None,
    device: torch.device,
) -> tuple[torch.nn.Module | Pipeline, torch.nn.Module | None]:
    """A frozen copy of the model's starting weights, sharded as the model is (no LoRA, nothing
    trains, so no gradient and no optimizer state): DPO's reference (dpo.reference='copy'); under
    pp split into the same stages, on a `Pipeline` that runs its forward. Returns what runs it,
    and its output projection (for the chunked loss).
    From the same files or seed as the model, also on a resume (check_config refuses a start
    from a checkpoint's weights, which the copy would not have)."""
    # Every unit resharded after its forward: with no backward to come, a unit left gathered
    # (FSDP's root, the last block; under pp every unit) would stay gathered for the whole run.
    parallel = replace(job.parallel, reshard_after_forward="always")
    settings = replace(job.build_settings(), lora=replace(job.lora, enabled=False), freeze=[],
                       parallel=parallel)  # fmt: skip
    built = build_model(plan.family, plan.args, settings, mesh, expert_mesh,
                        list(plan.stage_sizes))  # fmt: skip
    start = replace(plan, resume=None)  # its weights are the start's, whatever the run resumes
    initialize(built, job, start, env, device, log=False)
    for part in built.parts:  # each stage: a tied weight's replica is in no merged view
        part.requires_grad_(False)
        if job.train.loss_chunk_tokens and isinstance(part, FSDPModule):
            # The chunks use the projection after forward; DPOLoss frees it after them.
            part.set_reshard_after_forward(False, recurse=False)
    output = output_layer(plan.family, built.parts[-1])
    if not built.stages:
        return built.model, output
    pipeline = Pipeline(built.stages, mesh["pp"], device, job.parallel.pipeline,
                        plan.grad_accum_steps)  # fmt: skip
    return pipeline, output


def train_step(
    run: Run, micro_batches: list[MicroBatch], log: bool, stop: StopRequest, saved: bool
) -> StepResult:
    """One optimizer step over the step's micro-batches: the loss normalized by the step's
    target tokens over all ranks, gradients accumulated and clipped, one all-reduce for the
    loss, the stop flags, whether an async save finished (`saved`, on this rank) and the
    model's statistics, then the update (unless non-finite)."""
    model, t, tp, cp, dp_size = run.model, run.job.train, run.plan.tp, run.plan.cp, run.dp_size
    # Normalize by the *global* number of target tokens of the step (pairs, for DPO: the
    # objective's units), so the loss and the gradients are the same for any micro-batching
    # and any mesh shape.
    global_tokens = sum(run.objective.units(b) for b in micro_batches).float()
    # Timed (so synchronized, on a GPU) for the straggler meter: how long this rank waits here
    # is how much later the last rank arrived. One rank has no one to wait for: no sync.
    step, timed = run.progress.step + 1, run.job.health.stragglers and run.env.world_size > 1
    run.heartbeat.beat(step, "forward")
    started = synchronized_time(global_tokens.device) if timed else 0.0
    dist.all_reduce(global_tokens)
    run.replicas.sum(global_tokens)  # and the other replica groups' (ft.enabled)
    wait_s = synchronized_time(global_tokens.device) - started if timed else 0.0
    if run.pipeline is not None:  # the schedule runs every micro-batch's forward and backward
        with loss_context(tp):
            loss_sum, stats = run.pipeline.step(
                micro_batches, run.objective, global_tokens, dp_size * cp * tp, dp_size * cp,
                t.global_batch_size * run.objective.rows_per_sample,
                partial(run.heartbeat.beat, step),
            )  # fmt: skip
        run.heartbeat.beat(step, "optimizer")
    else:
        loss_sum, stats = accumulate(run, micro_batches, global_tokens, step)
    grad_norm = clip_grad_norm(model, t.max_grad_norm, run.pipeline)
    # The stop flags (asked to stop; a launcher died), the async save's and the model's
    # statistics ride on the loss all-reduce: every rank stops after the same step, also one
    # that the signal did not reach, and finishes a save (raising its error) after the same
    # step, also one whose part of it is not done yet, with no extra collective. Read now, not
    # when the step began: a signal during this step stops the run after it, as its line says.
    flags = torch.tensor([*stop.read(), saved], dtype=torch.float32, device=loss_sum.device)
    summed = torch.cat([loss_sum.view(1), stats, flags])
    dist.all_reduce(summed)
    # The loss and statistics of every replica group; the flags stay this group's (ft.enabled).
    run.replicas.sum(summed[: 1 + stats.numel()])
    # One device-to-host copy for the five values every rank needs now.
    needed = torch.cat([summed[:1], summed[-3:], grad_norm.view(1)]).tolist()
    loss_value, stop_value, lost_value, saved_value, norm_value = needed
    stop.decided(step, stop_value > 0)
    if not run.replicas.commit(step):  # a replica group failed in the step: none of it applies
        run.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_value, norm_value, 0.0, stop_value > 0, lost_value > 0,
                          saved_value > 0, {}, wait_s, committed=False)  # fmt: skip
    if math.isfinite(loss_value) and math.isfinite(norm_value):
        run.optimizer.step()
        run.skipped_in_a_row = 0
    else:
        non_finite(run, loss_value, norm_value)
    # Every tp rank added the same statistics: / tp. The family's come first, the objective's
    # last.
    terms, ours = (summed[1:-3] / tp).split([stats.numel() - run.objective.stats_size,
                                             run.objective.stats_size])  # fmt: skip
    scalars = run.built.after_step(terms if terms.numel() else None, log)
    scalars |= run.objective.after_step(ours, log)
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.optimizer.param_groups[0]["lr"]
    run.scheduler.step()
    return StepResult(
        loss_value, norm_value, lr, stop_value > 0, lost_value > 0, saved_value > 0, scalars, wait_s
    )


def accumulate(
    run: Run, micro_batches: list[MicroBatch], global_tokens: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of each micro-batch in turn, gradients accumulated; returns this
    rank's share of the step's loss and the statistics (summed): the model's step terms', then
    the objective's."""
    model, t, tp, cp, dp_size = run.model, run.job.train, run.plan.tp, run.plan.cp, run.dp_size
    loss_sum = torch.zeros((), device=global_tokens.device)
    stats = None  # the model's step statistics, summed over micro-batches
    ours = torch.zeros(run.objective.stats_size, device=global_tokens.device)  # the objective's
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # Reduce-scatter (and the HSDP all-reduce) only after the last micro-batch; earlier
        # ones accumulate unsharded gradients locally, with no communication.
        model.set_requires_gradient_sync(last)
        if run.keep_gathered:
            # Every block is still gathered at the end of forward anyway: keeping them through
            # backward adds nothing to the peak.
            model.set_reshard_after_backward(last)
        with loss_context(tp):
            result = objective_loss(run.objective, model, batch)
            assert result is not None  # a pipeline's step runs through Pipeline.step instead
            summed, batch_stats = result
            loss = summed / global_tokens
            ours += batch_stats
            # FSDP averages gradients over the dp x cp ranks; our loss is already a global
            # mean, so scale by their number to turn that average into the sum we want. Each
            # of the tp ranks of a dp rank counted the same targets into global_tokens: x tp
            # undoes it. (cp ranks count different targets: each its own part of a sequence.)
            objective = loss * dp_size * cp * tp
            # The family's extra terms (an MoE's aux loss) are global means too, the same on
            # every tp rank, each cp rank's its part of its sequences' terms: x dp_size x cp.
            # Over the step's sequences: rows (a DPO pair is two).
            rows = t.global_batch_size * run.objective.rows_per_sample
            extra, extra_stats = run.built.collect(rows)
            if extra is not None:
                objective = objective + extra * dp_size * cp
            if extra_stats is not None:
                stats = extra_stats if stats is None else stats + extra_stats
            run.heartbeat.beat(step, "backward")
            objective.backward()
        loss_sum += loss.detach()
        run.heartbeat.beat(step, "forward" if not last else "optimizer")
    return loss_sum, ours if stats is None else torch.cat([stats, ours])


def synchronized_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def non_finite(run: Run, loss: float, grad_norm: float) -> None:
    """train.on_nonfinite: stop with an error, or skip the update until too many in a row."""
    t, step = run.job.train, run.progress.step + 1
    if t.on_nonfinite == "error":
        raise NonFiniteError(
            f"step {step}: loss {loss}, grad norm {grad_norm}; stopping "
            "(set train.on_nonfinite='skip' to skip such steps instead)"
        )
    run.skipped_in_a_row += 1
    if run.env.rank == 0:
        logger.warning("step %d: non-finite loss/grad norm, update skipped", step)
    if run.skipped_in_a_row >= t.max_skipped_steps:
        raise NonFiniteError(
            f"step {step}: {run.skipped_in_a_row} steps in a row had a non-finite loss "
            f"or grad norm (train.max_skipped_steps={t.max_skipped_steps}); the run "
            "is not recovering, stopping (its checkpoints hold the last good weights)"
        )


@dataclass
class LoopEnd:
    """How the loop ended: for the run's summary."""

    losses: list[float] = field(default_factory=list)
    """The global training loss of every step this process ran."""
    val_loss: float | None = None
    val_step: int | None = None
    scores: dict[str, float] = field(default_factory=dict)
    """The eval tasks' metrics at val_step (eval/<task>/<metric>)."""
    saved: Path | None = None
    stopped: bool = False
    """A signal stopped the run before train.steps."""
    node_lost: bool = False
    """It was a lost node's: the step was saved, and the workers must restart without it."""
    started: float = field(default_factory=time.perf_counter)


def loop(
    run: Run,
    loader: Any,
    checkpointer: Checkpointer,
    states: dict[str, Any],
    run_dir: Path,
    stop: StopRequest,
) -> LoopEnd:
    """Step after step until train.steps or a stop: each step logged, evaluated and saved at
    its intervals. A stop request saves after the step in flight (the next start redoes no
    finished step)."""
    job, t, progress, is_rank0 = run.job, run.job.train, run.progress, run.env.rank == 0
    # Iterating loads the checkpoint's data position (and any new mixture weights).
    batches = StepBatches(loader, run.plan.grad_accum_steps, rewind=run.replicas.groups > 1)
    # What each source has served is a function of the stream position: rank 0 counts tokens
    # per source and sees a source run out without asking the other ranks or the workers.
    sources_seen = SourceMeter(loader.batch_sampler.stream, job.data.seq_len, progress.samples_seen)
    # After a resume, TensorBoard drops what an earlier attempt logged past the checkpoint;
    # W&B starts a new run in the run's group.
    metrics = MetricsLogger(job.metrics, job.run.name, run_dir, run.env, t.steps,
                            start_step=progress.step, config=asdict(job))  # fmt: skip
    # Each sample of the stream is `rows` sequences (a preference pair: two).
    rows = t.global_batch_size * run.objective.rows_per_sample
    meter, tokens_per_step = throughput_meter(run), rows * job.data.seq_len
    timer, end = Timer(run.device), LoopEnd()
    stragglers = StragglerMeter(job.health, run.device, run.env.rank, run.env.world_size)
    beat = run.heartbeat.beat
    stop.start(progress.step + 1, t.steps)  # a signal's line names the step it stops after
    while progress.step < t.steps:
        if run.replicas.start_step():  # state loaded (ft.enabled): a peer's, or a checkpoint's
            batches.restart()
            if progress.step >= t.steps:
                break
        step = progress.step + 1
        beat(step, "data")
        # All micro-batches up front: their target count fixes the loss normalization.
        micro_batches = [run.to_batch(*batch) for batch in batches.next_step()]
        data_time = timer.lap()
        log = step % job.metrics.log_interval == 0 or step == t.steps
        # One step (by default none) under torch.profiler, one with the allocator's history:
        # see metrics.profile_step and metrics.memory_snapshot_step.
        with step_instruments(job.metrics, step, run_dir, run.env.rank):
            result = train_step(run, micro_batches, log, stop, checkpointer.save_done)
        if not result.committed:  # a replica group failed in it: the groups left run it again
            batches.again()
            continue
        end.losses.append(result.loss)
        # +1, not = step: under DiLoCo a group that healed in the step's update took a peer's.
        progress.step += 1
        step = progress.step
        progress.samples_seen += t.global_batch_size
        progress.tokens_seen += tokens_per_step
        source_scalars = sources_seen.update(progress.samples_seen, step) if is_rank0 else {}
        # Steps since this process started: the first ones after a resume warm up too.
        step_time = timer.lap() + data_time
        meter.record(len(end.losses), step_time, data_time, tokens_per_step)
        stragglers.record(step_time, data_time, result.wait_s)
        if len(end.losses) == 1 and job.parallel.steady_timeout_s < job.parallel.timeout_s:
            # Warmed up: compile, resume, the first step are behind.
            run.heartbeat.timeout_s = set_timeout(job.parallel.steady_timeout_s)
        if log:
            beat(step, "log")
            eta = (time.perf_counter() - end.started) / len(end.losses) * (t.steps - step)
            log_step(run, metrics, step, result, stragglers, source_scalars | meter.summary(), eta)
        if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
            beat(step, "eval")
            (end.val_loss, end.scores), end.val_step = validate(run, metrics, step), step
            timer.lap()  # evaluation time is not training throughput
        # After the optimizer step, so the checkpoint of step N holds N updates.
        beat(step, "checkpoint")
        last = step == t.steps or result.stop
        saves = run.replicas.writes_checkpoints  # one replica group writes (ft.enabled)
        if saves and checkpointer.maybe_save(step, states, last=last, finish=result.saved):
            end.saved = step_dir(checkpointer.folder, step)
            timer.lap()  # nor is saving: its time is logged on its own line
        if result.stop:
            end.stopped, end.node_lost = True, result.node_lost
            break
    metrics.close()
    return end


def log_step(
    run: Run,
    metrics: MetricsLogger,
    step: int,
    result: StepResult,
    stragglers: StragglerMeter,
    scalars: dict[str, float],
    eta_s: float,
) -> None:
    """A log step's line and TensorBoard scalars: the step's, the stragglers' (3 numbers from
    each rank), the family's, memory and the replica groups', beside `scalars`."""
    logged = {"loss/train": result.loss, "lr": result.lr, "grad_norm": result.grad_norm}
    if run.job.health.stragglers and run.env.world_size > 1:
        logged |= stragglers.gather()
    logged |= result.scalars | scalars | memory_stats(run.device) | run.replicas.scalars()
    metrics.log(step, logged, eta_s=eta_s)


def throughput_meter(run: Run) -> ThroughputMeter:
    job = run.job
    model = run.model
    if run.pipeline is not None:  # the whole model's FLOPs per token, not this rank's stages'
        with torch.device("meta"):
            model = run.plan.family.build_model(run.plan.args)
    flops = run.plan.family.flops_per_token(model, job.data.seq_len)
    # The peak MFU is measured against (none is listed for fp32: set metrics.peak_tflops).
    precision = "fp8" if job.fp8.enabled else {"bfloat16": "bf16"}.get(job.parallel.param_dtype)
    peak = peak_tflops(run.device, precision, job.metrics.peak_tflops)
    # Under ft.enabled the replica groups are more devices of the run, as HSDP's replicas are.
    devices = run.env.world_size * run.replicas.groups
    return ThroughputMeter(job.metrics.warmup_steps, devices, flops, peak)


def validate(run: Run, metrics: MetricsLogger, step: int) -> tuple[float, dict[str, float]]:
    """Each source on its own validation split; loss/val is their mean (docs/data.md). Then
    the eval tasks (docs/evaluation.md); returns loss/val and their scores."""
    job, plan, started = run.job, run.plan, time.perf_counter()
    val_losses, stats = {}, {}
    for source in plan.sources:
        val = build_loader(job, plan, "val", run.dp_rank, run.dp_size, source,
                           reference=run.references.get("val"))  # fmt: skip
        # eval_batches global batches. A replica group (ft.enabled) evaluates all of them on
        # its own: no collective across groups, the same loss/val in each.
        n_val = job.train.eval_batches * plan.grad_accum_steps * run.replicas.groups
        with loss_context(plan.tp):
            loss, summed = evaluate(run.pipeline or run.model, val, n_val, run.to_batch,
                                    run.objective)  # fmt: skip
        val_losses[f"loss/val/{source.name}"] = loss
        # The objective's own (DPO's: one source): rewards/accuracies/val, ...
        stats |= {f"{name}/val": value for name, value in run.objective.scalars(summed).items()}
    val_loss = sum(val_losses.values()) / len(val_losses)
    scores = score_tasks(run)
    # Both end in a device-to-host copy: the time is the device's too.
    elapsed = {"time/eval_s": time.perf_counter() - started}
    per_source = val_losses if len(val_losses) > 1 else {}
    metrics.log(step, {"loss/val": val_loss} | per_source | stats | scores | elapsed)
    return val_loss, scores


def score_tasks(run: Run) -> dict[str, float]:
    """Every eval task's metrics, as eval/<task>/<metric> (data/tasks.py)."""
    scores = {}
    for task in run.plan.tasks:
        metrics = task_scores(task, task_logliks(run, task))
        scores |= {f"eval/{task.name}/{name}": value for name, value in metrics.items()}
    return scores


@torch.no_grad()
def task_logliks(run: Run, task: Task) -> torch.Tensor:
    """The summed log-likelihood of each request of `task` (float64, the same on every rank):
    each data-parallel rank scores its share, in as many forwards as every other rank. Under
    context parallel each cp rank scores its chunks of every row (`to_batch` splits them)."""
    plan, rows = run.plan, run.job.eval.batch_size or run.job.train.micro_batch_size
    logliks = torch.zeros(len(task.requests), dtype=torch.float64, device=run.device)
    compiled, multiple = run.job.compile.enabled, math.lcm(16, 2 * plan.cp)
    batches = task_batches(task, run.dp_rank, run.dp_size, rows, run.job.data.seq_len,
                           trim=not compiled, multiple=multiple)  # fmt: skip
    for inputs, targets, ids in batches:
        # As training sees a window: on the device, with document ids and positions under
        # document masking (each request starts after an EOS, as a document does).
        batch = run.to_batch(inputs, targets)
        with loss_context(plan.tp):
            logits = (run.pipeline or run.model)(batch.inputs, document_ids=batch.document_ids,
                                                 positions=batch.positions)  # fmt: skip
            if logits is None:  # under pp, a rank without the last stage: it adds nothing
                continue
            nll = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(),
                                  reduction="none")  # fmt: skip
        nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
        per_row = -nll.view(batch.targets.shape).double().sum(dim=1)
        ids = ids.to(run.device)
        logliks.index_add_(0, ids[ids >= 0], per_row[ids >= 0])
    # Every request was scored on one dp rank, the others adding 0, and its cp ranks each
    # added their part of its tokens: the sum is exact. Its tp ranks computed the same: / tp.
    dist.all_reduce(logliks)
    return (logliks / plan.tp).cpu()


def clip_grad_norm(
    model: torch.nn.Module, max_norm: float, pipeline: Pipeline | None = None
) -> torch.Tensor:
    """Clip by the true global norm (float64): the norm of DTensor gradients reduces over all
    shards (and is the same on every replica), unlike a norm of the local shard. Frozen
    parameters have no gradient: the norm is over the trainable ones. Gradients on different
    meshes (the experts under expert parallel) are reduced per mesh, then combined; under
    pipeline parallel, over every stage."""
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in by_mesh.values():
        # Each gradient's norm in float64 (its values cast: a temporary copy of one gradient
        # at a time). get_total_norm has no dtype, and _foreach_norm's fused CUDA kernel sums
        # float32 inputs in float32 whatever its dtype. Summed in float32, the norm depended on
        # the mesh: one sum over a whole gradient against several partial ones (1.4e-5
        # relative between 1 and 4 ranks, the debug model's step 1); in float64 the sums'
        # own error is ~1e-15.
        per_grad = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in group]
        norm = torch.linalg.vector_norm(torch.stack(per_grad))
        # A DTensor: materialize the reduced value.
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if norms:
        norm = torch.linalg.vector_norm(torch.stack(norms))
    else:  # a pipeline stage (or a model) with nothing to train
        norm = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)
    norm = pipeline.total_norm(norm) if pipeline is not None else norm
    if max_norm > 0:
        for group in by_mesh.values():  # one foreach kernel per mesh, as for the norm
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def build_loader(
    job: JobConfig,
    plan: Plan,
    split: str,
    dp_rank: int,
    dp_size: int,
    source: DataSource | None = None,
    reference: Any = None,
):
    """This rank's loader of `split`: its slice of the global stream (see data/loader.py), of
    every source for training, of one `source` for validation; `reference`: what the objective
    reads with each batch (parallel/dpo_reference.py)."""
    return build_dataloader(
        job.data,
        split,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batch_size=job.train.micro_batch_size,
        seed=job.train.seed,
        sources=plan.sources if source is None else [source],
        reference=reference,
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module | Pipeline,
    loader: Iterable,
    micro_batches: int,
    to_batch: Callable[[torch.Tensor, torch.Tensor], MicroBatch],
    objective: Objective | None = None,
) -> tuple[float, torch.Tensor]:
    """The objective's mean loss per unit (per target token, the default; per pair for DPO)
    over the first `micro_batches` of a validation loader, over all data-parallel ranks, and
    its statistics summed over them (`objective.scalars`). `to_batch`: as in training
    (device, document masking). Under pp (`model` a Pipeline) the ranks of the last stage
    count the losses and units. At tp > 1 call it under `loss_context`."""
    objective = objective or TokenLoss(cross_entropy_sum)
    batches, totals = iter(loader), []
    for _ in range(micro_batches):
        batch = to_batch(*next(batches))
        result = objective_loss(objective, model, batch)
        if result is None:  # under pp, a rank without the last stage: it adds nothing
            continue
        loss, stats = result
        units = objective.units(batch).view(1)
        totals.append(torch.cat([loss.view(1), units, stats]).float())
    device = batch.targets.device
    total = sum(totals) if totals else torch.zeros(2 + objective.stats_size, device=device)
    # Every tp rank adds the same values: the ratios below are the same.
    dist.all_reduce(total)
    return (total[0] / total[1]).item(), total[2:]


def log_orientation(job: JobConfig, plan: Plan, run_dir: Path, ckpt_folder: Path) -> None:
    """The first lines of a run: where everything goes, and what it starts from."""
    logger.info("run folder %s (config.toml, logs)", run_dir)
    if job.metrics.tensorboard:
        logger.info("TensorBoard: tensorboard --logdir %s", run_dir / "tensorboard")
    every = job.checkpoint.interval
    where = f"every {every} steps and at the end, to {ckpt_folder}" if every else "never"
    logger.info("checkpoints: %s", where + (" (checkpoint.interval=0)" if not every else ""))
    d = job.data
    sources = ", ".join(f"{n} {s.weight:g} ({s.path})" for n, s in d.sources.items()) or d.path
    mask = d.attention_mask + (", positions per document" if d.document_positions else "")
    logger.info("data: %s; seq_len %d, %s attention", sources, d.seq_len, mask)
    logger.info("%s", schedule_line(job.optim, job.train.steps))
    if job.metrics.wandb:  # its project, mode, entity and group, and what set each
        logger.info("%s", resolve_wandb(job.metrics, job.run.name, run_dir, os.environ).line())
    # The start from a checkpoint is logged by Checkpointer.load once its checksums match (a
    # damaged newest one falls back to an older one), from Hugging Face weights by setup.
    if plan.resume is None and not job.checkpoint.init_from_hf:
        logger.info("starting at step 0 of %d from random weights (train.seed=%d)",
                    job.train.steps, job.train.seed)  # fmt: skip


# Seconds the other ranks wait before exiting on an error that rank 0 reports.
REPORT_GRACE_S = 2.0


def main(argv: list[str] | None = None) -> int:
    env = LaunchEnv.from_env()
    setup_logging(env.rank)
    exit_with_launcher()  # a rank never outlives its torchrun agent
    stop = StopRequest()
    stop.install()  # SIGTERM, SIGINT, SIGUSR1, SIGHUP, SIGQUIT: finish the step, save, exit 0
    try:
        if problem := shared_store_problem(os.environ):  # plain torchrun, restarted: it would hang
            raise LaunchError(f"restart error: {problem}")
        job = parse_config(JobConfig, sys.argv[1:] if argv is None else argv)
        plan = check_config(job, env)
        if env.rank == 0:
            store = shared_store_warning(os.environ)
            warnings = unintended_settings(job) + task_warnings(plan.tasks)
            for warning in warnings + ([store] if store else []):
                logger.warning("%s", warning)
        if job.dry_run:
            if env.rank == 0:
                dry_run(job, plan, env)
            return 0
        if launched_by_torchrun() and (problem := network_problem(dict(os.environ))):
            # Under a plain torchrun nothing checked this yet (the launch scripts do): gloo and
            # NCCL would fail inside init_process_group, with a traceback from every rank.
            raise LaunchError(f"network error: {problem}")
        train(job, plan, env, stop)
    except HelpRequested as help_request:
        if env.rank == 0:
            print(help_request.text)
        return 0
    except ConfigError as err:
        return report(env, f"config error: {err}", 2)
    except LaunchError as err:  # each node once: another node's may differ from rank 0's
        return report(env, str(err), 2, everywhere=env.local_rank == 0)
    except (NonFiniteError, CheckpointError, ReplicasDiverged) as err:  # one line each
        return report(env, str(err), 1)
    except NodeLost as err:  # one line per node left: each agent restarts its own workers
        return report(env, str(err), NODE_LOST_EXIT, everywhere=env.local_rank == 0)
    except CollectiveFailure as err:  # every rank that saw it says what it waited for
        return report(env, str(err), 1, everywhere=True)
    return 0


def report(env: LaunchEnv, message: str, status: int, everywhere: bool = False) -> int:
    """One line on rank 0 (and on each rank given `everywhere`) for an error every rank hit;
    returns the exit status."""
    if env.rank == 0 or everywhere:
        logger.error("%s", message)
    if env.world_size > 1:
        # torchrun stops every rank when the first one exits: the others wait, so that rank 0
        # reports first; rank 0 waits too, so that a rank still on its way to the same error
        # (slower to start) reaches it, and leaves without the stop line of a rank stopped
        # before it failed (launch/lifecycle.py StopRequest).
        time.sleep(REPORT_GRACE_S)
    return status


if __name__ == "__main__":
    status = main()
    if status == 0:  # a finished or stopped run: skip the teardown (exit_process's docstring)
        exit_process(status)
    # An error leaves through the interpreter's teardown, after `report` waited for the others.
    sys.exit(status)
