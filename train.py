"""Train a model of any family in model/ with FSDP2 on a (dp_replicate, dp_shard) mesh.

    torchrun --standalone --nproc-per-node=4 train.py configs/debug.toml --train.steps=100

The whole run reads top to bottom in `train()`: process group -> mesh -> model on meta ->
shard -> materialize and init -> optimizer and schedule -> data -> resume -> loop and save.
The config tree (`JobConfig`) is `launch/job.py`. It is checked by `launch.check.check_config()`
on every rank before any process group exists, so a bad config is one error line on rank 0,
never a hang.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from checkpoint import (
    Checkpointer,
    CheckpointError,
    TrainState,
    build_states,
    checkpoint_folder,
    step_dir,
    warn_if_low_space,
)
from checkpoint.hf import load_hf_weights
from configs import ConfigError, HelpRequested, config_to_toml, parse_config
from data.documents import MicroBatch, micro_batch
from data.loader import DataSource, build_dataloader
from data.stream import SourceMeter
from launch.check import Plan, check_config, dry_run, unintended_settings
from launch.job import JobConfig, OptimizerConfig
from launch.lifecycle import (
    RunLock,
    StopRequest,
    exit_with_launcher,
    set_aside_earlier_attempt,
    setup_logging,
)
from launch.metrics import (
    MetricsLogger,
    RunSummary,
    ThroughputMeter,
    Timer,
    expert_load_scalars,
    memory_stats,
    peak_tflops,
    profile_step,
)
from launch.preflight import network_problem
from model import count_params, get_hf_mapping, moe_family
from parallel.ac import apply_ac
from parallel.compile import apply_compile, compile_loss
from parallel.dims import LaunchEnv
from parallel.ep import apply_ep, build_expert_mesh
from parallel.float8 import apply_float8, precompute_float8_scales
from parallel.freeze import apply_freeze
from parallel.fsdp import apply_fsdp, assign_local_shard, reshard_plan
from parallel.lora import adapter_names, apply_lora, init_lora
from parallel.runtime import (
    build_mesh,
    dp_mesh,
    dp_rank_and_size,
    init_distributed,
    launched_by_torchrun,
    pick_device,
)
from parallel.tp import apply_tp, loss_context
from parallel.workarounds import tp_compile_workarounds

logger = logging.getLogger("train")


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    # Trainable parameters only: frozen ones (train.freeze, LoRA's base) get no state.
    # Decay matrices only: decaying RMSNorm gains toward 0 fights the normalization.
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    impl = "fused" if cfg.implementation == "auto" else cfg.implementation
    kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(impl, {"foreach": False})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel)


def lr_lambda(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Multiplier of the peak lr after `step` optimizer steps (LambdaLR convention)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


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
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    lr = cfg.lr * lr_lambda(step, cfg, total_steps)
    for group in optimizer.param_groups:
        group.update(lr=lr, initial_lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    optimizer.param_groups[0]["weight_decay"] = cfg.weight_decay  # matrices (build_optimizer)


class NonFiniteError(RuntimeError):
    pass


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) cross-entropy, in float32 for a stable log-softmax."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def summed_loss(
    model: torch.nn.Module,
    batch: MicroBatch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum,
) -> torch.Tensor:
    """The model's summed loss on one micro-batch (`loss_fn`: possibly the compiled one).
    At tp > 1 call it under `loss_context`: the loss is then a DTensor holding the whole value
    on every tp rank, returned as a plain tensor (its backward still runs through DTensor)."""
    logits = model(batch.inputs, document_ids=batch.document_ids, positions=batch.positions)
    loss = loss_fn(logits, batch.targets)
    return loss.to_local() if isinstance(loss, DTensor) else loss


def train(
    job: JobConfig, plan: Plan, env: LaunchEnv, stop: StopRequest | None = None
) -> list[float]:
    """Run training; returns the global training loss of every step it ran (after a resume,
    only those after the checkpoint's step). `stop`: the installed signal handler, if any."""
    stop = stop or StopRequest()
    device = pick_device(job.parallel.device, env)
    init_distributed(device, env, job.parallel.timeout_s)
    lock = RunLock(Path(job.run.output_dir) / job.run.name)
    try:
        # One trainer per run folder: rank 0 holds the lock, and every rank learns the answer
        # (all of them are in this collective, so it cannot hang).
        refused = [lock.acquire() if env.rank == 0 else None]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] is not None:
            raise ConfigError(refused[0])
        return _train(job, plan, env, device, stop)
    finally:
        lock.release()
        dist.destroy_process_group()


def _train(
    job: JobConfig, plan: Plan, env: LaunchEnv, device: torch.device, stop: StopRequest
) -> list[float]:
    t = job.train
    torch.manual_seed(t.seed)
    torch.use_deterministic_algorithms(t.deterministic)
    mesh = build_mesh(device, plan.dp_replicate, plan.dp_shard, plan.tp)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    is_rank0 = env.rank == 0
    run_dir = Path(job.run.output_dir) / job.run.name
    ckpt_folder = checkpoint_folder(job.checkpoint, run_dir)
    config_toml = config_to_toml(job)
    if is_rank0:
        if plan.resume is None or plan.resume.model_only:
            set_aside_earlier_attempt(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_toml)
        log_orientation(job, plan, run_dir, ckpt_folder)
        logger.info("mesh %s on %s, grad accumulation %d", mesh, device, plan.grad_accum_steps)

    # Model: build on meta (no memory), shard, then allocate only this rank's shards and
    # initialize them. Each block is its own FSDP unit; see parallel/fsdp.py.
    with torch.device("meta"):
        model = plan.family.build_model(plan.args)
    if job.fp8.enabled:  # before FSDP, so it shards the float8-aware weights; logs its choices
        candidates = plan.family.fp8_linears(model)
        apply_float8(model, job.fp8, candidates=candidates, weights_sharded=plan.dp_shard > 1)
    # Tensor parallel after float8 (its float8 styles need the Float8Linear layers) and before
    # AC, compile and FSDP: they wrap or shard the TP-split modules and DTensors it leaves.
    if plan.tp > 1:
        fp8_comm = job.fp8.enabled and job.fp8.recipe == "tensorwise" and device.type == "cuda"
        # Not under LoRA: torchao's float8 styles hand the layer a float8 input, which the
        # adapters would then receive too.
        fp8_comm = fp8_comm and not job.lora.enabled
        apply_tp(model, plan.family, mesh["tp"], float8_collectives=fp8_comm)
    # Expert parallel, like tensor parallel, on the model on meta before AC and FSDP: the
    # experts split over groups of ep ranks inside dp_shard, on a mesh of their own.
    experts = None
    if plan.ep > 1:
        expert_mesh = build_expert_mesh(device, plan.dp_replicate, plan.dp_shard, plan.ep)
        experts = apply_ep(model, plan.family, expert_mesh)
    # Fine-tuning: LoRA after tensor parallel (its adapters take their placements from the
    # split base weights) and after float8 (a float8 base keeps its float8 matmul, and the
    # adapters are never converted); both before FSDP, which keeps frozen and trainable
    # parameters in the same units. Each leaves requires_grad=False on what does not train.
    if job.lora.enabled:
        adapted = apply_lora(model, job.lora)
        if is_rank0:
            logger.info("lora: rank %d, alpha %g on %d Linear layers (%s)", job.lora.rank,
                        job.lora.alpha, len(adapted), ", ".join(job.lora.targets))  # fmt: skip
    if t.freeze:
        apply_freeze(model, t.freeze)
    # AC before compile, so the compiled block includes its recompute; compile before FSDP, so
    # its collectives stay outside compiled code. Each asks the family for the blocks anew: the
    # step before may have wrapped them. Compiled blocks at tp > 1 need torch workarounds,
    # one of which reverses that order for whole-block AC (parallel/workarounds.py).
    compile_first = tp_compile_workarounds(
        model, plan.family, plan.tp, job.compile.enabled, job.ac.mode
    )
    if compile_first:
        apply_compile(model, plan.family.fsdp_units(model), job.compile)
        apply_ac(model, plan.family.fsdp_units(model), job.ac)
    else:
        apply_ac(model, plan.family.fsdp_units(model), job.ac)
        apply_compile(model, plan.family.fsdp_units(model), job.compile)
    # At tp > 1 loss parallel (loss_context) keeps the logits split instead: no compiled loss.
    loss_fn = compile_loss(cross_entropy_sum, job.compile) if plan.tp == 1 else cross_entropy_sum
    apply_fsdp(model, plan.family.fsdp_units(model), dp_mesh(mesh), job.parallel, experts)
    model.to_empty(device=device)
    if job.checkpoint.init_from_hf and plan.resume is None:
        mapping = get_hf_mapping(job.model.name)  # checked by check_config
        hf_dir, adapters = job.checkpoint.init_from_hf, adapter_names(model)
        load_hf_weights(model, mapping, hf_dir, job.data.seq_len, exclude=adapters)
    else:  # random init, also when a checkpoint is about to overwrite it (it sets the RoPE table)
        model.init_weights(seed=t.seed, rope_len=job.data.seq_len, assign=assign_local_shard)
    # LoRA's adapters by their own rule, on the base weights from either: B = 0, so the model
    # starts as the base model, exactly.
    init_lora(model, t.seed, assign_local_shard)
    n_params = count_params(model)
    if is_rank0:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = f" ({trainable:,} trainable, {n_params - trainable:,} frozen)"
        logger.info("model %s: %s parameters%s", job.model.flavor, f"{n_params:,}",
                    frozen if trainable < n_params else "")  # fmt: skip

    optimizer = build_optimizer(model, job.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, job.optim, t.steps)
    )
    loader = build_loader(job, plan, "train", dp_rank, dp_size)
    # A loader's (inputs, targets) on the device, with their document ids and targets under
    # data.attention_mask="document" (data/documents.py): derived per micro-batch, on the device.
    to_batch = partial(micro_batch, cfg=job.data, eos_id=plan.dataset.eos_id, device=device)

    # Resume: everything that changes during training is a Stateful in one dict, loaded in
    # place before the loader is iterated (DCP reshards it onto this mesh).
    progress = TrainState()
    states = build_states(model, optimizer, scheduler, loader, progress, config_toml)
    checkpointer = Checkpointer(job.checkpoint, ckpt_folder, is_rank0)
    if is_rank0 and job.checkpoint.interval > 0:
        # fp32 weights, plus AdamW's two fp32 moments of what trains (a lower bound: the data
        # position, RNG and config are small).
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        warn_if_low_space(ckpt_folder, 4 * n_params + 8 * trainable)
    resumed = checkpointer.load(states, plan.resume)  # an older one if plan.resume is damaged
    # The checkpoint brought its own lr, betas, ...: what this run's config says wins (the
    # changes were checked and listed by check_config).
    apply_optimizer_config(optimizer, scheduler, job.optim, progress.step, t.steps)
    batches = iter(loader)  # loads the checkpoint's data position (and any new mixture weights)
    # What each source has served is a function of the stream position: rank 0 counts tokens
    # per source and sees a source run out without asking the other ranks or the workers.
    sources_seen = SourceMeter(loader.batch_sampler.stream, job.data.seq_len, progress.samples_seen)
    if is_rank0 and progress.step >= t.steps:
        logger.info("resumed at step %d of train.steps=%d: nothing to do", progress.step, t.steps)

    # After a resume, TensorBoard drops what an earlier attempt logged past the checkpoint.
    metrics = MetricsLogger(job.metrics, run_dir, is_rank0, t.steps, purge_step=progress.step + 1)
    tokens_per_step = t.global_batch_size * job.data.seq_len
    flops = plan.family.flops_per_token(model, job.data.seq_len)
    # The peak MFU is measured against (none is listed for fp32: set metrics.peak_tflops).
    precision = "fp8" if job.fp8.enabled else {"bfloat16": "bf16"}.get(job.parallel.param_dtype)
    meter = ThroughputMeter(
        job.metrics.warmup_steps,
        env.world_size,
        flops,
        peak_tflops(device, precision, job.metrics.peak_tflops),
    )
    losses: list[float] = []
    val_loss: float | None = None
    val_step: int | None = None
    saved: Path | None = None
    skipped_in_a_row = 0
    timer = Timer(device)
    started = time.perf_counter()
    # No block freed after forward ('never', or 'default' at dp_shard = 1): keep them gathered
    # between micro-batches too, saving an all-gather (a copy at dp_shard = 1) per block.
    resharded = reshard_plan(
        len(plan.family.fsdp_units(model)),
        job.parallel.reshard_after_forward,
        plan.dp_shard,
        job.parallel.cpu_offload,
    )
    keep_gathered = plan.grad_accum_steps > 1 and not any(resharded)
    stopping = False
    moe = moe_family(plan.family)  # None for a dense family: no aux loss, no expert load
    expert_load = None  # MoE: tokens per expert since the last log line (layers, experts)

    for step in range(progress.step + 1, t.steps + 1):
        # All micro-batches up front: their target count fixes the loss normalization.
        micro_batches = [to_batch(*next(batches)) for _ in range(plan.grad_accum_steps)]
        data_time = timer.lap()
        # Normalize by the *global* number of target tokens of the step, so the loss and the
        # gradients are the same for any micro-batching and any mesh shape.
        global_tokens = sum((b.targets != -100).sum() for b in micro_batches).float()
        dist.all_reduce(global_tokens)

        # One step (by default none) under torch.profiler: see metrics.profile_step.
        with profile_step(job.metrics, step, run_dir, env.rank):
            loss_sum = torch.zeros((), device=device)
            moe_sums = []  # MoE: this rank's aux loss and expert load over the step
            for i, batch in enumerate(micro_batches):
                last = i == plan.grad_accum_steps - 1
                # Reduce-scatter (and the HSDP all-reduce) only after the last micro-batch;
                # earlier ones accumulate unsharded gradients locally, with no communication.
                model.set_requires_gradient_sync(last)
                if keep_gathered:
                    # Every block is still gathered at the end of forward anyway: keeping them
                    # through backward adds nothing to the peak.
                    model.set_reshard_after_backward(last)
                with loss_context(plan.tp):
                    loss = summed_loss(model, batch, loss_fn) / global_tokens
                    # FSDP averages gradients over the dp ranks; our loss is already a global
                    # mean, so scale by dp_size to turn that average into the sum we want. Each
                    # of the tp ranks of a dp rank counted the same targets into global_tokens:
                    # x tp undoes it.
                    objective = loss * dp_size * plan.tp
                    if moe is not None:
                        # The MoE aux loss is summed over this micro-batch's sequences: divided
                        # by the step's sequences, it is a global mean like the loss (on any
                        # mesh and micro-batching, model/__init__.py). Every tp rank computes
                        # the same value, with the same gradients: no x tp.
                        aux = moe.aux_loss(model) / t.global_batch_size
                        objective = objective + aux * dp_size
                        moe_sums.append(
                            torch.cat([aux.detach()[None], moe.expert_load(model).flatten()])
                        )
                    objective.backward()
                loss_sum += loss.detach()

            grad_norm = clip_grad_norm(model, t.max_grad_norm)
            # The stop flag rides on the loss all-reduce: every rank stops after the same step,
            # also one that the signal did not reach, and no extra collective is needed; so do
            # an MoE's aux loss and expert load.
            summed = torch.stack([loss_sum, torch.tensor(float(stop.requested), device=device)])
            if moe_sums:
                summed = torch.cat([summed, torch.stack(moe_sums).sum(0)])
            dist.all_reduce(summed)
            loss_value, grad_norm_value = summed[0].item(), grad_norm.item()
            stopping = summed[1].item() > 0
            if moe_sums:  # every tp rank added the same values
                aux_value = summed[2].item() / plan.tp
                load = summed[3:].view(-1, moe.expert_load(model).shape[-1]) / plan.tp
                expert_load = load if expert_load is None else expert_load + load
            if math.isfinite(loss_value) and math.isfinite(grad_norm_value):
                optimizer.step()
                precompute_float8_scales(model, job.fp8)  # no-op unless fp8 tensorwise
                skipped_in_a_row = 0
            elif t.on_nonfinite == "error":
                raise NonFiniteError(
                    f"step {step}: loss {loss_value}, grad norm {grad_norm_value}; stopping "
                    "(set train.on_nonfinite='skip' to skip such steps instead)"
                )
            else:
                skipped_in_a_row += 1
                if is_rank0:
                    logger.warning("step %d: non-finite loss/grad norm, update skipped", step)
                if skipped_in_a_row >= t.max_skipped_steps:
                    raise NonFiniteError(
                        f"step {step}: {skipped_in_a_row} steps in a row had a non-finite loss "
                        f"or grad norm (train.max_skipped_steps={t.max_skipped_steps}); the run "
                        "is not recovering, stopping (its checkpoints hold the last good weights)"
                    )
            optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        losses.append(loss_value)
        progress.step = step
        progress.samples_seen += t.global_batch_size
        progress.tokens_seen += tokens_per_step
        source_scalars = sources_seen.update(progress.samples_seen, step) if is_rank0 else {}
        # Steps since this process started: the first ones after a resume warm up too.
        meter.record(len(losses), timer.lap() + data_time, data_time, tokens_per_step)

        if step % job.metrics.log_interval == 0 or step == t.steps:
            scalars = {"loss/train": loss_value, "lr": lr, "grad_norm": grad_norm_value}
            if expert_load is not None:  # MoE: this step's aux loss, the load since last time
                scalars |= {"loss/aux": aux_value} | expert_load_scalars(expert_load)
                expert_load = None
            eta = (time.perf_counter() - started) / len(losses) * (t.steps - step)
            scalars |= source_scalars | meter.summary() | memory_stats(device)
            metrics.log(step, scalars, eta_s=eta)
        if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
            # Each source on its own validation split; loss/val is their mean (docs/data.md).
            val_losses = {}
            for source in plan.sources:
                val = build_loader(job, plan, "val", dp_rank, dp_size, source)
                n_val = t.eval_batches * plan.grad_accum_steps
                with loss_context(plan.tp):
                    val_losses[f"loss/val/{source.name}"] = evaluate(
                        model, val, n_val, to_batch, loss_fn
                    )
            val_loss, val_step = sum(val_losses.values()) / len(val_losses), step
            metrics.log(step, {"loss/val": val_loss} | (val_losses if len(val_losses) > 1 else {}))
            timer.lap()  # evaluation time is not training throughput
        # After the optimizer step, so the checkpoint of step N holds N updates. A stop
        # request saves now: the next start redoes no finished step.
        if checkpointer.maybe_save(step, states, last=step == t.steps or stopping):
            saved = step_dir(ckpt_folder, step)
            timer.lap()  # nor is saving: its time is logged on its own line
        if stopping:
            break
    checkpointer.wait()  # an async save still in flight must finish before the group goes
    # No rank exits before rank 0 has marked the last save complete: under srun
    # --kill-on-bad-exit the first node whose launcher exits ends the others' processes.
    dist.barrier()
    metrics.close()
    if is_rank0:
        summary = RunSummary(
            progress.step, t.steps, losses, val_loss, progress.tokens_seen,
            time.perf_counter() - started, saved or (resumed and resumed.path), val_step,
        )  # fmt: skip
        reason = (stop.signal_name or "a signal to another rank") if stopping else None
        for line in summary.lines(reason, job.checkpoint.interval):
            logger.info("%s", line)
    return losses


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the true global norm: the norm of DTensor gradients reduces over all shards
    (and is the same on every replica), unlike a norm of the local shard. Frozen parameters
    have no gradient: the norm is over the trainable ones. Gradients on different meshes (the
    experts under expert parallel) are reduced per mesh, then combined."""
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in list(by_mesh.values()) or [[]]:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        # A DTensor: materialize the reduced value.
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
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
):
    """This rank's loader of `split`: its slice of the global stream (see data/loader.py), of
    every source for training, of one `source` for validation."""
    return build_dataloader(
        job.data,
        split,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batch_size=job.train.micro_batch_size,
        seed=job.train.seed,
        sources=plan.sources if source is None else [source],
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: Iterable,
    micro_batches: int,
    to_batch: Callable[[torch.Tensor, torch.Tensor], MicroBatch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum,
) -> float:
    """Mean loss per target token over the first `micro_batches` of a validation loader, over
    all data-parallel ranks. `to_batch`: as in training (device, document masking)."""
    batches = iter(loader)
    losses, targets = [], []
    for _ in range(micro_batches):
        batch = to_batch(*next(batches))
        losses.append(summed_loss(model, batch, loss_fn))
        targets.append((batch.targets != -100).sum())
    totals = torch.stack([torch.stack(losses).sum(), torch.stack(targets).sum().float()])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


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
    if plan.resume is None:
        logger.info("starting at step 0 of %d", job.train.steps)
    elif not plan.resume.model_only:
        logger.info("resuming %s at step %d of %d", plan.resume.path, plan.resume.step,
                    job.train.steps)  # fmt: skip
    for change in plan.resume_changes:
        logger.info("changed since the checkpoint, applied: %s", change)


# Seconds the other ranks wait before exiting on an error that rank 0 reports.
REPORT_GRACE_S = 2.0


def main(argv: list[str] | None = None) -> int:
    env = LaunchEnv.from_env()
    setup_logging(env.rank)
    exit_with_launcher()  # a rank never outlives its torchrun agent
    stop = StopRequest()
    stop.install()  # SIGTERM/SIGINT/SIGUSR1: finish the step, save, exit 0
    try:
        job = parse_config(JobConfig, sys.argv[1:] if argv is None else argv)
        plan = check_config(job, env)
        if env.rank == 0:
            for warning in unintended_settings(job):
                logger.warning("%s", warning)
        if job.dry_run:
            if env.rank == 0:
                dry_run(job, plan, env)
            return 0
        if launched_by_torchrun() and (problem := network_problem(dict(os.environ))):
            # Under a plain torchrun nothing checked this yet (the launch scripts do): gloo and
            # NCCL would fail inside init_process_group, with a traceback from every rank. Each
            # node says it once, since another node's interfaces may differ from rank 0's.
            return report(env, f"network error: {problem}", 2, everywhere=env.local_rank == 0)
        train(job, plan, env, stop)
    except HelpRequested as help_request:
        if env.rank == 0:
            print(help_request.text)
        return 0
    except ConfigError as err:
        return report(env, f"config error: {err}", 2)
    except (NonFiniteError, CheckpointError) as err:  # one line each, e.g. a full disk
        return report(env, str(err), 1)
    return 0


def report(env: LaunchEnv, message: str, status: int, everywhere: bool = False) -> int:
    """One line on rank 0 (and on each rank given `everywhere`) for an error every rank hit;
    returns the exit status."""
    if env.rank == 0 or everywhere:
        logger.error("%s", message)
    else:
        # torchrun stops all ranks when the first one exits: give rank 0 time to report.
        time.sleep(REPORT_GRACE_S)
    return status


if __name__ == "__main__":
    sys.exit(main())
