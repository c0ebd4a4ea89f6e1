"""Everything checked before the first collective: the config against the launch, the data,
the checkpoint to resume and what a resume may change; and the same checks once per job, before
any rank starts.

    python -m launch.check --world-size 16 --nnodes 2 configs/llama3_8b.toml --train.steps=10

Every rank runs `check_config` on the same inputs before its process group exists, so every
rank raises the same ConfigError and none can wait on a missing peer. Every launch script also
runs this module before torchrun (hsdp.sbatch: once, in the batch shell, before srun). A
deterministic failure (a config error, missing data, a mesh that does not divide the world, a
run folder in use, a *_SOCKET_IFNAME that names no interface here) then ends the job with one
line and exit status 2, instead of every rank failing the same way, torchrun printing its
ChildFailedError and restarting them MAX_RESTARTS times. The arguments after the launch options
are train.py's, in any order.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from checkpoint import ResumePoint, check_resume, checkpoint_folder, list_step_dirs
from checkpoint.hf import check_hf_config
from checkpoint.integrity import CorruptCheckpoint, read_manifest, verify_files
from checkpoint.resume import DAMAGED_HINT, ModelMismatch
from configs import ConfigError, HelpRequested, config_to_toml, parse_config
from data.documents import check_documents
from data.loader import (
    DataConfig,
    DatasetIndex,
    DataSource,
    check_eval_split,
    check_token_ids,
    open_sources,
)
from data.tasks import Task, load_tasks
from launch.elastic import mesh_for_world, unfit_node_counts
from launch.job import JobConfig
from launch.lifecycle import RunLock, setup_logging
from launch.metrics import MetricsConfig
from launch.plan import format_plan
from launch.resume_rules import explain_misfit, resume_changes
from launch.wandb_run import check_wandb
from model import ModelFamily, get_family, get_hf_mapping, output_layer, persistent_buffers
from model.attention import check_attention
from parallel.ac import ActivationCheckpointConfig
from parallel.build import build_model
from parallel.compile import CompileConfig, check_cudagraphs
from parallel.cp import check_cp
from parallel.dims import LaunchEnv
from parallel.dpo import DPOLoss
from parallel.dpo_reference import check_dpo, check_dpo_data
from parallel.float8 import Float8Config, check_float8, unmatched_skips
from parallel.fsdp import reshard_plan
from parallel.ft_config import FaultToleranceConfig, check_ft, group_folder
from parallel.graph_fsdp import check_graph_fsdp
from parallel.loss import check_chunked_loss
from parallel.muon import MuonConfig, check_muon
from parallel.plan import (
    GraphBuckets,
    ModelShape,
    graph_buckets,
    model_shape,
    plan_communication,
    plan_memory,
    reference_gathers,
)
from parallel.pp import check_pp
from parallel.pp_config import PipelineConfig
from parallel.pp_plan import balanced_split, block_costs, describe, plan_pipeline
from parallel.runtime import launched_by_torchrun
from parallel.tp import check_tp

logger = logging.getLogger("launch.check")


@dataclass(frozen=True)
class Plan:
    """Everything derived from the config and the launch, checked before training starts."""

    family: ModelFamily
    """The model family of model.name (model/__init__.py)."""
    args: Any
    """Its resolved shape."""
    dp_replicate: int
    dp_shard: int
    grad_accum_steps: int
    dataset: DatasetIndex | None
    """The first source's index: the tokenizer every source shares (vocabulary, EOS). None only
    in a dry run whose data is not there (yet)."""
    resume: ResumePoint | None
    resume_changes: tuple[str, ...] = ()
    """Settings that differ from the resumed checkpoint's, applied: "optim.lr: 0.0003 -> 0.001"."""
    tp: int = 1
    """Tensor-parallel degree (parallel/tp.py); the data-parallel ranks are the world / tp."""
    ep: int = 1
    """Expert-parallel degree (parallel/ep.py): groups of ep ranks of dp_shard x cp x tp."""
    cp: int = 1
    """Context-parallel degree (parallel/cp.py): each sequence split over cp ranks."""
    pp: int = 1
    """Pipeline-parallel degree (parallel/pp.py): the outermost mesh dimension."""
    stage_sizes: tuple[int, ...] = ()
    """Blocks per pipeline stage: parallel.pipeline.split, or balanced by the planner."""
    sources: tuple[DataSource, ...] = ()
    """The training sources (data.path, or the data.sources mixture), sorted by name."""
    tasks: tuple[Task, ...] = ()
    """The eval.tasks, read and tokenized (data/tasks.py); none when nothing evaluates."""


def check_tasks(job: JobConfig, sources: tuple) -> tuple:
    """The eval.tasks read and tokenized (none without data, or without evaluation: then
    unintended_settings says that they are not scored, nor their files read); a task file that
    is missing or malformed is a ConfigError naming its file and line."""
    task_files = [Path(task.path) for task in job.eval.tasks.values()]
    # As for the data: a dry run may plan for task files that are not here (yet).
    skip = job.dry_run and not all(file.exists() for file in task_files)
    if not sources or job.train.eval_interval <= 0 or not task_files or skip:
        return ()
    return load_tasks(job.eval, sources[0].index, job.data.seq_len)


def check_config(job: JobConfig, env: LaunchEnv) -> Plan:
    """Cross-section checks. Every rank runs them on the same inputs, so every rank raises the
    same ConfigError and exits before a collective could wait on a missing peer."""
    family = get_family(job.model.name)
    args = family.build_args(job.model)
    check_graph_fsdp(job.compile, job.parallel, job.fp8.enabled, job.train.loss_chunk_tokens)
    # The mesh and grad accumulation for this world (after an elastic restart, a smaller one:
    # same global batch, or one line that says what would fit; launch/elastic.py).
    mesh = mesh_for_world(job, family, args, env)
    dp_replicate, dp_shard, accum = mesh.dp_replicate, mesh.dp_shard, mesh.grad_accum_steps
    check_replica_groups(job, dp_replicate)
    check_tp(family, args, job.parallel.tp, job.model.name)
    check_chunked_loss(family, job.train.loss_chunk_tokens,
                       job.parallel.reshard_after_forward, job.model.name)  # fmt: skip
    check_cp(job.parallel, job.data.seq_len)
    # The data-parallel ranks of the global batch: under ft.enabled every group's too.
    dp = dp_replicate * dp_shard * (job.ft.groups if job.ft.enabled else 1)
    t = job.train
    # A dry run needs no data: it reports the plan for a cluster the data may not be on yet.
    paths = data_paths(job.data)
    present = bool(paths) and all(Path(path).exists() for path in paths)
    sources = () if job.dry_run and not present else tuple(open_sources(job.data))
    if sources:
        check_dpo_data(job, sources)  # DPO's pairs: before the checks of other datasets
        check_dataset(job, args, sources)
    tasks = check_tasks(job, sources)
    check_device_settings(job, bool(tasks))
    check_muon(job.optim.name, job.parallel.cpu_offload)
    if not job.dry_run:  # as for the data: a dry run plans, W&B need not be set up here (yet)
        check_wandb(job.metrics, os.environ)
    if job.lora.enabled and t.freeze:
        raise ConfigError(
            "train.freeze with lora.enabled: LoRA already freezes every parameter but its "
            "adapters; choose the adapted layers with lora.targets instead"
        )
    # The model as train.py builds it, on meta without a mesh (no memory): its checkpoint keys
    # and shapes (LoRA's adapters included), layer names and what trains. Patterns that match
    # nothing (lora.targets, train.freeze) fail here.
    built = build_model(family, args, job.build_settings())
    meta_model = built.model
    check_pp(job.parallel, job.compile.enabled, family, meta_model, accum)
    stage_sizes = pipeline_split(job, family, args)
    # Checkpoint problems (wrong shapes, a data position this mesh cannot continue, a missing
    # or unwritable path) surface here too, before anything could hang on them.
    shapes = {k: tuple(v.shape) for k, v in meta_model.state_dict().items()}
    try:
        resume = check_resume(
            job.checkpoint,
            Path(job.run.output_dir) / job.run.name,
            shapes,
            positions_per_micro_step=t.micro_batch_size * dp,
            is_rank0=env.rank == 0,
            check_writable=not job.dry_run,
        )
    except ModelMismatch as misfit:
        raise explain_misfit(job, misfit) from None
    check_forward(family, meta_model, job.model.name, bool(t.loss_chunk_tokens))
    check_built_model(job, args, meta_model)
    changes: list[str] = []
    if resume is not None and not resume.model_only:
        changes = resume_changes(job, resume.path)
    elif job.checkpoint.resume == "none" and list_step_dirs(
        checkpoint_folder(job.checkpoint, Path(job.run.output_dir) / job.run.name)
    ):
        raise ConfigError(
            f"checkpoint.resume=none but run {job.run.name!r} already has checkpoints, which "
            "this run would prune (keep_last): choose another run.name or checkpoint.folder"
        )
    run_dir = group_folder(Path(job.run.output_dir) / job.run.name, job.ft)
    model_only = resume is not None and resume.model_only
    check_dpo(job, sources, run_dir, resume is not None and not model_only, model_only)
    dataset = sources[0].index if sources else None
    return Plan(
        family, args, dp_replicate, dp_shard, accum, dataset, resume, tuple(changes),
        tp=job.parallel.tp, ep=job.parallel.ep, cp=job.parallel.cp, pp=job.parallel.pp,
        stage_sizes=stage_sizes, sources=sources, tasks=tasks,
    )  # fmt: skip


# Set by main: the launch scripts' check of a config before torchrun starts the ranks.
_preflight = False


def check_replica_groups(job: JobConfig, dp_replicate: int) -> None:
    """ConfigError for fault-tolerant replica groups (ft.enabled, parallel/ft.py) that cannot
    run: what the group's mesh cannot hold, then torchft, torchrun and the lighthouse."""
    if not job.ft.enabled:
        return
    p = job.parallel
    refused = (
        (dp_replicate > 1, f"parallel.dp_replicate={dp_replicate}", "the replica groups are "
         "the replicate dimension: each group shards over dp_shard; set dp_replicate=1"),
        (p.ep > 1, "parallel.ep > 1", "FSDP2's all-reduce hook, which sums gradients over the "
         "groups, takes one mesh per module and expert parallel gives the experts a second "
         "(torch refuses the hook there); run ep=1"),
        (job.compile.fsdp == "graph", "compile.fsdp='graph'", "the compiled graph holds FSDP's "
         "collectives and has no all-reduce hook for the groups; use compile.fsdp='hooks'"),
    )  # fmt: skip
    for bad, setting, why in refused:
        if bad:
            raise ConfigError(f"ft.enabled with {setting}: {why}")
    if job.dry_run:  # a plan for a cluster: its lighthouse need not be up yet
        return
    # The launch scripts' preflight (this module's main) runs before torchrun starts the ranks.
    check_ft(job.ft, dict(os.environ), launched_by_torchrun() or _preflight)


def replica_settings(job: JobConfig, env: LaunchEnv) -> dict[str, Any]:
    """What every replica group must agree on (ft.enabled): compared at each step's quorum,
    a difference is one line naming the setting (parallel/ft.py)."""
    d, t = job.data, job.train
    return {
        "[model]": repr(job.model),
        "data (path, sources, seq_len, attention_mask)": (
            d.path,
            repr(d.sources),
            d.seq_len,
            d.attention_mask,
        ),  # fmt: skip
        "train.global_batch_size": t.global_batch_size,
        "train.micro_batch_size": t.micro_batch_size,
        "train.seed": t.seed,
        "train.steps": t.steps,
        "[optim]": repr(job.optim),
        "ft (groups, min_groups, compare_interval)": (
            job.ft.groups,
            job.ft.min_groups,
            job.ft.compare_interval,
        ),  # fmt: skip
        "the group's world size": env.world_size,
        "parallel (dp_shard, tp, cp, pp)": (
            job.parallel.dp_shard,
            job.parallel.tp,
            job.parallel.cp,
            job.parallel.pp,
        ),  # fmt: skip
    }


def check_built_model(job: JobConfig, args: Any, meta_model: torch.nn.Module) -> None:
    """ConfigError for what the model as built on meta cannot take: Hugging Face weights
    (checkpoint.init_from_hf) without a mapping, into persistent buffers, or of another shape;
    fp8.skip entries that match no Linear layer."""
    if job.checkpoint.init_from_hf:
        if (mapping := get_hf_mapping(job.model.name)) is None:
            raise ConfigError(f"checkpoint.init_from_hf: {job.model.name} has no HF mapping")
        if buffers := persistent_buffers(meta_model):
            raise ConfigError(
                f"checkpoint.init_from_hf: model {job.model.name} keeps state in persistent "
                f"buffers ({', '.join(buffers)}) that Hugging Face weights do not carry: start "
                "from a checkpoint of this trainer (checkpoint.load_model_only) instead"
            )
        check_hf_config(mapping, args, job.checkpoint.init_from_hf)
    if job.fp8.enabled and (unmatched := unmatched_skips(meta_model, job.fp8.skip)):
        raise ConfigError(
            f"fp8.skip: {', '.join(unmatched)} matches no Linear layer of this model "
            "(entries are module names or their dotted suffixes, e.g. 'output', 'attention.wo')"
        )


def pipeline_split(job: JobConfig, family: ModelFamily, args: Any) -> tuple[int, ...]:
    """Blocks per pipeline stage (pp > 1): the setting, or balanced by the planner's cost of
    each block (parallel/pp_plan.py); () without pp."""
    cfg, pp = job.parallel.pipeline, job.parallel.pp
    if pp == 1 or cfg.split:
        return tuple(cfg.split)
    costs, output = block_costs(model_shape(family, args), job.data.seq_len)
    return tuple(balanced_split(costs, output, pp * cfg.local_stages()))


def check_forward(family: ModelFamily, model: torch.nn.Module, name: str, chunked: bool) -> None:
    """What the trainer cannot honour in a family's forward, found by one forward of two tokens
    on the model built on meta (shapes only: no memory, no compute), before any process group:
    a persistent buffer that forward changes (AC recomputes forward, each rank sees other
    tokens: update it in after_step), and, for the chunked loss, logits that are not the
    output layer's own output (what forward did after that layer, the chunks would skip).
    A forward that cannot run on meta is only an error where the chunked loss needs the check
    (model/__init__.py: Buffers, the output path)."""
    buffers = {n: model.get_buffer(n) for n in persistent_buffers(model)}
    versions = {n: b._version for n, b in buffers.items()}
    outputs: list[torch.Tensor] = []
    layer = output_layer(family, model) if chunked else None
    hook = layer.register_forward_hook(lambda _m, _a, out: outputs.append(out)) if layer else None
    try:
        model.init_buffers(2)
        with torch.no_grad():
            logits = model(torch.zeros(1, 2, dtype=torch.long, device="meta"))
    except Exception as err:  # noqa: BLE001 - any failure means the forward went unchecked
        if not chunked:
            return
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(
            f"train.loss_chunk_tokens: model {name}'s forward does not run on the meta device "
            f"({type(err).__name__}: {first}), where the trainer checks that the chunked loss "
            "computes what forward does (model/__init__.py, the output path); or set "
            "train.loss_chunk_tokens=0"
        ) from None
    finally:
        if hook is not None:
            hook.remove()
    changed = [n for n, b in buffers.items()
               if model.get_buffer(n) is not b or b._version != versions[n]]  # fmt: skip
    if changed:
        raise ConfigError(
            f"model {name}'s forward changes its persistent buffers ({', '.join(changed)}), "
            "which activation checkpointing would change twice and each rank differently: "
            "update them in step_terms(model).after_step (model/__init__.py, Buffers)"
        )
    if chunked and not any(logits is out for out in outputs):
        raise ConfigError(
            f"train.loss_chunk_tokens: model {name}'s forward changes the logits after "
            "output_layer(model) (soft-capping, a scale?), which the chunked loss would skip: "
            "do it inside the output layer's forward (model/__init__.py, the output path)"
        )


def unintended_settings(job: JobConfig) -> list[str]:
    """Settings that are valid but most likely not what was meant, as warnings for rank 0's
    log: the run goes on, since a short test run of a long config is a fair thing to do."""
    warnings, steps = [], job.train.steps
    if job.optim.warmup_steps > steps:
        warnings.append(
            f"optim.warmup_steps ({job.optim.warmup_steps}) > train.steps ({steps}): the "
            f"learning rate never reaches optim.lr ({job.optim.lr}) and never decays"
        )
    optim = job.optim
    if optim.decay_steps > 0 and optim.warmup_steps + optim.decay_steps > steps:
        warnings.append(
            f"optim.warmup_steps ({optim.warmup_steps}) + optim.decay_steps "
            f"({optim.decay_steps}) > train.steps ({steps}): no stable phase, the decay takes "
            f"the {max(0, steps - optim.warmup_steps)} steps after warm-up"
        )
    if job.model.attention == "varlen" and job.data.attention_mask != "document":
        warnings.append(
            "model.attention='varlen' has no effect with data.attention_mask="
            f"{job.data.attention_mask!r}: a whole window is one sequence, which SDPA already "
            "runs on FlashAttention"
        )
    if job.metrics.profile_step > steps:
        warnings.append(
            f"metrics.profile_step ({job.metrics.profile_step}) > train.steps ({steps}): "
            "nothing will be profiled"
        )
    # A key that only another mode reads, changed from its default: said, not ignored. Not an
    # error: switching a feature off for one run (--fp8.enabled=false) keeps its section's keys.
    if job.ac.every != ActivationCheckpointConfig().every and job.ac.mode != "selective":
        warnings.append(
            f"ac.every={job.ac.every} has no effect with ac.mode={job.ac.mode!r}: it picks the "
            "recomputed blocks of ac.mode='selective' only"
        )
    if job.optim.name != "muon" and (unused := changed_fields(job.optim.muon, MuonConfig())):
        warnings.append(no_effect("optim.muon", unused, f"optim.name={job.optim.name!r}"))
    if not job.compile.enabled and (unused := changed_fields(job.compile, CompileConfig())):
        warnings.append(no_effect("compile", unused, "compile.enabled=false"))
    elif job.compile.bucket_mb != CompileConfig().bucket_mb and (
        job.compile.fsdp == "hooks" or job.compile.backend != "inductor"
    ):
        why = "it sizes the collective buckets Inductor makes under compile.fsdp='graph' only "
        why += "(FSDP2's hooks gather a whole unit at once)"
        unused = {"bucket_mb": job.compile.bucket_mb}
        mode = "compile.fsdp='hooks'"
        if job.compile.fsdp == "graph":
            mode = f"compile.backend={job.compile.backend!r}"
        warnings.append(no_effect("compile", unused, mode, why))
    pipeline = job.parallel.pipeline
    if job.parallel.pp == 1 and (unused := changed_fields(pipeline, PipelineConfig())):
        why = "[parallel.pipeline] sets how parallel.pp > 1 runs its stages"
        warnings.append(no_effect("parallel.pipeline", unused, "parallel.pp=1", why))
    # Not an error: turning evaluation off for one run (--train.eval_interval=0) keeps the
    # config's tasks, whose files may not be there; but a broken one goes unnoticed until then.
    if job.eval.tasks and job.train.eval_interval <= 0:
        names = ", ".join(sorted(job.eval.tasks))
        warnings.append(
            f"eval.tasks ({names}) will not be scored with train.eval_interval=0, and their "
            "files are not read (nor checked): set train.eval_interval to score them"
        )
    if not job.fp8.enabled and (unused := changed_fields(job.fp8, Float8Config())):
        warnings.append(no_effect("fp8", unused, "fp8.enabled=false"))
    ft, unused = job.ft, changed_fields(job.ft, FaultToleranceConfig())
    outer = {k: v for k, v in unused.items() if k.startswith("outer_")}
    if not ft.enabled and unused:
        warnings.append(no_effect("ft", unused, "ft.enabled=false"))
    elif ft.sync_steps == 0 and outer:
        why = "DiLoCo's outer optimizer runs with ft.sync_steps > 0 only"
        warnings.append(no_effect("ft", outer, "ft.sync_steps=0", why))
    # (W&B's own WANDB_* variables are for any script on the machine: they are not named.)
    unused = changed_fields(job.metrics, MetricsConfig())
    if not job.metrics.wandb and (unused := {k: v for k, v in unused.items() if "wandb_" in k}):
        warnings.append(no_effect("metrics", unused, "metrics.wandb=false"))
    return warnings


def no_effect(section: str, unused: dict[str, Any], mode: str, why: str = "") -> str:
    """'section.key=value, ... has (have) no effect with `mode`[: why]': one warning for the
    changed keys of a section that the mode does not read."""
    settings = ", ".join(f"{section}.{name}={value!r}" for name, value in unused.items())
    verb = "has" if len(unused) == 1 else "have"
    return f"{settings} {verb} no effect with {mode}" + (f": {why}" if why else "")


def changed_fields(cfg: Any, default: Any) -> dict[str, Any]:
    """The fields of a config section, but its `enabled` switch, that differ from `default`."""
    return {
        f.name: getattr(cfg, f.name)
        for f in fields(cfg)
        if f.name != "enabled" and getattr(cfg, f.name) != getattr(default, f.name)
    }


def data_paths(cfg: DataConfig) -> list[str]:
    """The dataset folders the config names: data.path, or each source's."""
    return [cfg.path] if cfg.path is not None else [s.path for s in cfg.sources.values()]


def check_dataset(job: JobConfig, args: Any, sources: tuple[DataSource, ...]) -> None:
    dataset = sources[0].index  # every source has the same tokenizer (open_sources checks it)
    for source in sources:  # document masking needs every source's EOS id
        check_documents(job.data, source.index, source.key)
    if dataset.vocab_size > args.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({args.vocab_size}) is smaller than the dataset's tokenizer "
            f"vocabulary ({dataset.vocab_size}, {dataset.path}): set model.vocab_size"
        )
    if job.data.seq_len > args.max_seq_len:
        raise ConfigError(
            f"data.seq_len ({job.data.seq_len}) exceeds the model's max_seq_len "
            f"({args.max_seq_len})"
        )
    for source in sources:  # after the tokenizer check, which names the likelier cause
        check_token_ids(source.index, args.vocab_size, source.key)
    t = job.train
    for source in sources if t.eval_interval > 0 else ():  # each source is evaluated alone
        if source.index.num_tokens("val") == 0:
            raise ConfigError(
                f"train.eval_interval={t.eval_interval} but {source.key}={source.index.path} "
                "has no validation split: prepare it with --val-fraction > 0, or set "
                "train.eval_interval=0"
            )
        # A split too short for one window, or fewer windows than eval_batches asks for, would
        # fail at the first evaluation (after the steps before it) or silently repeat data.
        check_eval_split(source.index, job.data.seq_len, t.global_batch_size, t.eval_batches)


def check_device_settings(job: JobConfig, eval_tasks: bool) -> None:
    """ConfigError for what this device cannot run: CUDA asked for and absent, float8 without
    its kernels, CUDA-only attention and CUDA graphs (a dry run plans for the cluster: those
    kernels need not run here)."""
    if job.parallel.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.device='cuda' but no CUDA device is visible")
    on_gpu = job.parallel.device != "cpu" and torch.cuda.is_available()
    check_float8(job.fp8, "cuda" if on_gpu else "cpu")
    check_attention(job.model.attention, on_gpu or job.dry_run, job.parallel.cp)
    check_cudagraphs(job.compile, on_gpu or job.dry_run, job.data.attention_mask, eval_tasks,
                     job.parallel.pp)  # fmt: skip


def _ep_ranks(plan: Plan) -> str:
    """The ranks EP groups come from (parallel/ep.py), as the dry run names them."""
    return "dp_shard" + " x cp" * (plan.cp > 1) + " x tp" * (plan.tp > 1)


def dry_run(job: JobConfig, plan: Plan, env: LaunchEnv) -> None:
    """`train.py --dry-run`: the resolved config and the run's memory and communication plan,
    printed; nothing is trained and no data is needed."""
    # The resolved config first: whatever the planner can or cannot derive, it is printed.
    print(config_to_toml(job))
    shape = model_shape(plan.family, plan.args, job.fp8, job.lora, job.train.freeze)
    muon = job.optim.muon.ns_dtype if job.optim.name == "muon" else None
    pipelined, graph = plan.pp > 1, job.compile.fsdp == "graph"
    buckets = _graph_buckets(job, plan, shape)
    # Rows per micro-batch: DPO's samples are pairs, a chosen and a rejected row each.
    rows = job.train.micro_batch_size * (DPOLoss.rows_per_sample if job.dpo.enabled else 1)

    def memory(shape: ModelShape, last: bool = True) -> dict[str, float]:
        buckets = _graph_buckets(job, plan, shape)  # a pp stage's are its own
        mem = plan_memory(
            shape,
            plan.dp_shard,
            rows,
            job.data.seq_len,
            job.parallel.param_dtype,
            job.ac.mode,
            job.ac.every,
            job.parallel.reshard_after_forward,
            job.parallel.cpu_offload,
            compiled_loss=job.compile.enabled and job.compile.loss and job.parallel.tp == 1,
            tp=plan.tp,
            ep=plan.ep,
            cp=plan.cp,
            loss_chunk_tokens=job.train.loss_chunk_tokens,
            muon_dtype=muon,
            pipelined=pipelined,
            graph_bucket_bytes=max(buckets.all_gather) if buckets else None,
        )
        if job.dpo.enabled and job.dpo.reference == "copy":  # its fp32 shards (no adapters)
            mem = {"params": mem["params"], "reference": mem["params"]} | mem
        return mem if last else mem | {"logits": 0.0}  # under pp, the last stage's

    # ft.enabled: the groups' all-reduce crosses them as HSDP's would (DiLoCo: 1 step in N).
    groups, every = (job.ft.groups, max(1, job.ft.sync_steps)) if job.ft.enabled else (1, 1)

    def communication(shape: ModelShape) -> dict[str, dict[str, float]]:
        comm = plan_communication(
            shape,
            plan.dp_replicate * groups,
            plan.dp_shard,
            job.parallel.param_dtype,
            job.parallel.reduce_dtype,
            reshard_after_forward=job.parallel.reshard_after_forward,
            grad_accum_steps=plan.grad_accum_steps,
            cpu_offload=job.parallel.cpu_offload,
            tp=plan.tp,
            tokens=rows * job.data.seq_len,
            ac_mode=job.ac.mode,
            ac_every=job.ac.every,
            ep=plan.ep,
            cp=plan.cp,
            muon_dtype=muon,
            pipelined=pipelined,
            graph_fsdp=graph,
        )
        comm["dp_replicate"]["all_reduce"] /= every
        comm["dp_shard"]["all_gather"] += _reference_gathers(job, plan, shape)
        return comm

    mem, comm, pipeline = memory(shape), communication(shape), None
    if pipelined:  # the pp rank with the most memory: its stages, activations in flight
        mem, comm, pipeline = plan_pipeline(
            shape, job.parallel.pipeline, plan.pp, plan.grad_accum_steps,
            rows, job.data.seq_len, memory, communication,
            job.parallel.param_dtype, plan.tp, plan.cp,
        )  # fmt: skip
    print(mesh_line(plan, env))
    print_plan_notes(job, plan, shape, buckets, pipeline)
    if job.ft.enabled:
        print(f"# {replica_groups_note(job.ft, env.world_size, mem)}")
    print("\n".join(f"# {line}" for line in format_plan({mesh_label(job, plan): (mem, comm)})))


def mesh_line(plan: Plan, env: LaunchEnv) -> str:
    """The dry run's line on the mesh: '# mesh: pp=2 x dp_replicate=1 x dp_shard=4 ...'."""
    return (
        f"# mesh: {f'pp={plan.pp} x ' if plan.pp > 1 else ''}dp_replicate={plan.dp_replicate} x "
        f"dp_shard={plan.dp_shard}"
        + (f" x cp={plan.cp}" if plan.cp > 1 else "")
        + (f" x tp={plan.tp}" if plan.tp > 1 else "")
        + (f" (ep={plan.ep} inside {_ep_ranks(plan)})" if plan.ep > 1 else "")
        + " "
        f"(world size {env.world_size}), gradient accumulation {plan.grad_accum_steps}"
    )


def _reference_gathers(job: JobConfig, plan: Plan, shape: ModelShape) -> float:
    """DPO's reference forward: its all-gather bytes per step (0 without one)."""
    cfg, p = job.dpo, job.parallel
    if not cfg.enabled or cfg.reference == "precomputed":
        return 0.0
    units, shard = len(shape.units), plan.dp_shard * plan.cp
    resharded = (
        [True] * units  # the copy (train.py build_reference)
        if cfg.reference == "copy"
        else reshard_plan(units - 1, p.reshard_after_forward, shard, p.cpu_offload, plan.pp > 1)
    )
    return reference_gathers(shape, shard, p.param_dtype, plan.grad_accum_steps, resharded,
                             plan.tp, plan.ep)  # fmt: skip


def _graph_buckets(job: JobConfig, plan: Plan, shape: ModelShape) -> GraphBuckets | None:
    """compile.fsdp='graph': Inductor's collective buckets for `shape` (None otherwise)."""
    if job.compile.fsdp != "graph":
        return None
    p = job.parallel
    return graph_buckets(shape, plan.dp_shard * plan.cp, p.param_dtype, p.reduce_dtype,
                         job.compile.bucket_mb, plan.tp)  # fmt: skip


def replica_groups_note(ft: FaultToleranceConfig, world: int, mem: dict[str, float]) -> str:
    """The dry run's line on replica groups: what crosses them, and what a heal moves (each
    rank's shard of the fp32 weights and optimizer state)."""
    heal = mem["params"] + mem["optimizer"]
    every = f" every {ft.sync_steps} steps (DiLoCo)" if ft.sync_steps else ""
    return (
        f"ft: {ft.groups} replica groups of {world} ranks on torchft (the dp_replicate all-reduce "
        f"row crosses them{every}); a heal sends each rank of the healing group "
        f"{heal / 2**20:,.1f} MiB from its peer, {heal * world / 2**30:,.2f} GiB in all"
    )


def mesh_label(job: JobConfig, plan: Plan) -> str:
    """The plan table's column: 'PP2 FT4 x HSDP 2x4 TP2', ..."""
    mesh = f"{'HSDP' if plan.dp_replicate > 1 else 'FSDP'} {plan.dp_replicate}x{plan.dp_shard}"
    mesh = f"FT{job.ft.groups} x " + mesh if job.ft.enabled else mesh
    mesh += f" (dp_shard x CP{plan.cp})" if plan.cp > 1 else ""
    mesh += f" TP{plan.tp}" if plan.tp > 1 else ""
    mesh += f" EP{plan.ep}" if plan.ep > 1 else ""
    return f"PP{plan.pp} " + mesh if plan.pp > 1 else mesh


def print_plan_notes(
    job: JobConfig, plan: Plan, shape: ModelShape, buckets: Any, pipeline: Any
) -> None:
    """The dry run's lines between the mesh and the plan: parameters, graph FSDP's buckets,
    FLOPs (or what the planner lacks), the data and checkpoint found, the pipeline."""
    print(f"# parameters: {shape.numel():,}, trainable {shape.numel(trainable_only=True):,}")
    if buckets is not None:
        print(f"# compile.fsdp='graph': per micro-batch {len(buckets.all_gather)} all-gather "
              f"buckets in forward (largest {max(buckets.all_gather) / 2**20:.1f} MiB), "
              f"{len(buckets.reduce_scatter)} reduce-scatter buckets in backward")  # fmt: skip
    if shape.missing:  # one line: what the family's description leaves the planner without
        print(f"# planner: {job.model.name}: {shape.missing}")
    else:
        flops = shape.flops_per_token(job.data.seq_len)
        print(f"# training FLOPs per token: {int(flops):,} at seq_len {job.data.seq_len}")
    if plan.dataset is None:
        where = ", ".join(data_paths(job.data)) or "no data.path or data.sources"
        print(f"# data: {where} not found (a dry run does not need it; training does)")
    if plan.resume is not None:
        print(f"# resume: {plan.resume.path} (step {plan.resume.step})")
    if pipeline is not None:
        print(f"# {describe(pipeline, plan.pp, plan.grad_accum_steps)}")


# ---- python -m launch.check ------------------------------------------------------------------


def validate(argv: list[str], env: LaunchEnv, min_nodes: int | None = None) -> int:
    """Check a command line for the world a launcher is about to start, before any rank exists.

    `python -m launch.check` runs this once per job: a config error (bad key, a mesh that does
    not divide the world, missing data, a checkpoint that does not fit) then ends the job with
    one line and exit status 2, instead of every rank failing and torchrun retrying it.
    Returns 0 when the config is fine, else 2 after logging the one line. `min_nodes`: the
    fewest nodes an elastic launch (--nnodes=MIN:MAX) may go on with; the node counts down to it
    that could not hold the run are one warning.
    """
    try:
        job = parse_config(JobConfig, argv)
        plan = check_config(job, env)
        if min_nodes and (line := unfit_node_counts(job, plan.family, plan.args, env, min_nodes)):
            logger.warning("%s", line)
        if not job.dry_run and plan.resume is not None:
            verify_explicit_resume(job.checkpoint.resume, plan.resume.path)
        # A run folder in use: say so now, not after torchrun started. Not for an elastic
        # launch (min_nodes < nodes): a node that joins a running job finds its own run's lock
        # held; a second run is still refused, by its rank 0 (train.py), a little later.
        if not job.dry_run and not (min_nodes and min_nodes < env.num_nodes):
            lock = RunLock(group_folder(Path(job.run.output_dir) / job.run.name, job.ft))
            # A few tries: the checks of several nodes may probe a shared folder at once, each
            # holding the lock for an instant; a trainer holds it for the whole run.
            for _ in range(4):
                if (refused := lock.acquire()) is None:
                    break
                time.sleep(0.5)
            if refused:
                raise ConfigError(refused)
            lock.release()
    except HelpRequested:
        return 0
    except ConfigError as err:
        logger.error("config error: %s", err)
        return 2
    return 0


def verify_explicit_resume(resume: str, chosen: Path) -> None:
    """Sum every file of an explicit checkpoint.resume path once, here, before any rank starts.

    The ranks verify it too, each its share, but only after the process group exists: a damaged
    file would then fail every rank under torchrun, which restarts them MAX_RESTARTS times. A
    path the user named is never replaced by another, so its damage is a config error, once.
    (`resume=auto` falls back to an older checkpoint of the run inside the ranks instead.)"""
    if resume in ("auto", "none") or Path(resume).resolve() != chosen.resolve():
        return
    try:
        manifest = read_manifest(chosen)
    except CorruptCheckpoint as bad:  # check_config read it fine: it changed since
        raise ConfigError(f"checkpoint.resume: {bad}; {DAMAGED_HINT}") from None
    size = sum(entry["bytes"] for entry in manifest.values())
    if size > 2**30:
        logger.info("checking %s (%.1f GB of checksums) before the ranks start", chosen, size / 1e9)
    if bad := verify_files(chosen, sorted(manifest)):
        raise ConfigError(f"checkpoint.resume: {bad[0]}; {DAMAGED_HINT}")


def check_network(environ: dict[str, str], nodes: int) -> str | None:
    """Log the interface the ranks will use; returns the one-line problem, if any."""
    from launch.preflight import describe_interfaces, network_problem

    if problem := network_problem(environ):
        return problem
    logger.info("network: %s", describe_interfaces(environ, nodes))
    return None


def main(argv: list[str] | None = None) -> int:
    # No -h of our own and no abbreviations: everything we do not know is train.py's.
    parser = argparse.ArgumentParser(prog="python -m launch.check", add_help=False,
                                     allow_abbrev=False)  # fmt: skip
    parser.add_argument("--world-size", type=int, required=True, help="ranks in all")
    parser.add_argument("--nnodes", type=int, default=1, help="torchrun agents (nodes)")
    parser.add_argument("--local-world-size", type=int, help="ranks per node "
                        "(default world-size / nnodes)")  # fmt: skip
    parser.add_argument("--min-nnodes", type=int, help="the fewest nodes an elastic launch "
                        "may go on with (torchrun --nnodes=MIN:MAX)")  # fmt: skip
    args, train_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    setup_logging(0)
    global _preflight
    _preflight = True
    if problem := check_network(dict(os.environ), args.nnodes):
        logger.error("network error: %s", problem)
        return 2
    env = LaunchEnv(
        rank=0,
        local_rank=0,
        world_size=args.world_size,
        local_world_size=args.local_world_size or args.world_size // max(1, args.nnodes),
        num_nodes=args.nnodes,
    )
    return validate(train_argv, env, args.min_nnodes)


if __name__ == "__main__":
    sys.exit(main())
