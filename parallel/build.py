"""The model as it will train: one builder, one order, called by train.py, the checks and the
planner alike.

    built = build_model(family, args, settings)                     # meta, no mesh: checks, planner
    built = build_model(family, args, settings, mesh, expert_mesh)  # train.py: parallelized, meta

`settings` (`BuildSettings`) holds the sections of the job that the build reads, and nothing
else: train.py and the checks pass `job.build_settings()` (launch/job.py), the planner its own.

Without a mesh it stops after step 4 below (it needs no process group and no torchao): the
checks read the checkpoint keys and shapes of what will train, the planner its FSDP units, which
weights float8 converts and which parameters train. With a mesh every step runs. The order, and
why each step comes where it does:

1. The family's model on meta: no memory yet; each rank allocates only its shards later.
   With parallel.pp > 1 (1b), cut into stages of contiguous blocks (parallel/pp_split.py): this
   rank keeps its stages, each a copy of the model whose other blocks are skipped, and every
   step below runs on each stage as it would on the whole model (each stage is its own FSDP
   root over its data-parallel ranks). First, because everything after it (float8's choice of
   layers, the TP plan, LoRA's targets, FSDP's units) is per stage.
2. Float8 (fp8.enabled): torchao's Float8Linear in place of the Linear layers the policy picks
   (`float8_policy`), before tensor parallel (its float8 styles need those layers) and before
   FSDP (which then shards the float8-aware weights). Without a mesh: only the decisions.
3. Tensor parallel (tp > 1), then expert parallel (an expert mesh): on the model on meta,
   before AC, compile and FSDP, which wrap or shard the split modules and DTensors they leave.
   Its tp mesh comes from the root of FSDP's (`fsdp_meshes`): FSDP2 joins them.
   At tp > 1 expert parallel splits the MoE layer's routed rows over tp (parallel/ep.py).
   Then context parallel (cp > 1): hooks around the root's forward, no module or parameter
   changed, so nothing after it sees a difference; activation checkpointing's recompute gets
   the split mask as a block input (parallel/cp.py).
4. LoRA (after tensor parallel: its adapters take their placements from the split base
   weights; after float8: a float8 base keeps its float8 matmul) or train.freeze. Both before
   FSDP, which keeps frozen and trainable parameters in the same units.
5. Activation checkpointing, then compile, per block: the compiled block includes its
   recompute, and FSDP's collectives stay outside compiled code. At tp > 1 compiled blocks need
   torch workarounds, one of which reverses that order for whole-block AC
   (parallel/workarounds.py); this is the only place that order is decided. A block whose
   experts run under expert parallel is compiled in regions around them (`experts_apart`).
6. FSDP: each block (and, under expert parallel, each expert module inside it) its own unit,
   then the root.

With compile.fsdp="graph" steps 5 and 6 are one: AC wraps the blocks, then
`apply_graph_fsdp` shards the same parameters on the same mesh and compiles the whole model,
FSDP's collectives inside the graph (parallel/graph_fsdp.py), in place of per-block compile
and `apply_fsdp`.

Each step asks the family for its blocks anew (`fsdp_units`): the step before may have wrapped
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from model import ModelFamily, StepTerms, step_terms
from parallel.ac import ActivationCheckpointConfig, apply_ac
from parallel.compile import CompileConfig, apply_compile
from parallel.cp import apply_cp
from parallel.dims import ParallelConfig
from parallel.ep import apply_ep, experts_apart
from parallel.float8 import (
    Float8Config,
    Float8Decision,
    apply_float8,
    float8_policy,
    precompute_float8_scales,
)
from parallel.freeze import apply_freeze
from parallel.fsdp import apply_fsdp
from parallel.graph_fsdp import apply_graph_fsdp
from parallel.lora import LoRAConfig, apply_lora
from parallel.pp_split import Stage, StageFamily, merged_view, split_model
from parallel.runtime import fsdp_meshes, pp_size
from parallel.tp import apply_tp
from parallel.workarounds import pickle_meshes_without_their_hash, tp_compile_workarounds

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class BuildSettings:
    """What the build reads of the job: its sections that shape the model as it trains (not a
    section of its own; launch/job.py `JobConfig.build_settings` gathers them from a job)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: Float8Config = field(default_factory=Float8Config)
    ac: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    freeze: list[str] = field(default_factory=list)
    """train.freeze: glob patterns of the parameters that do not train."""


@dataclass
class BuiltModel:
    """The model as it will train, and what the training step needs of it beyond forward."""

    model: nn.Module
    float8: list[Float8Decision] = field(default_factory=list)
    """Per Linear layer: trained in float8 or not, and why (empty with fp8 off)."""
    adapted: list[str] = field(default_factory=list)
    """The Linear layers LoRA adapts."""
    terms: StepTerms | None = None
    """The family's extra loss terms and step statistics (model/__init__.py), or None."""
    stages: list[Stage] = field(default_factory=list)
    """Under pipeline parallel, this rank's stages (`model` then only gathers their modules
    under the unsplit names, for the optimizer and checkpoints); empty without."""
    _after_step: list[Any] = field(default_factory=list)

    @property
    def parts(self) -> list[nn.Module]:
        """The modules that run: the model, or each of this rank's pipeline stages."""
        return [s.model for s in self.stages] or [self.model]

    def collect(self, sequences: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """After a micro-batch's forward: the family's extra loss (a global mean) and its
        statistics, or (None, None) for a family that adds none."""
        return self.terms.collect(sequences) if self.terms else (None, None)

    def after_step(self, stats: torch.Tensor | None, log: bool) -> dict[str, float]:
        """After each optimizer step: float8's weight scales, then the family's own update
        from `stats` summed over the data-parallel ranks; returns the scalars to log if
        `log`."""
        for hook in self._after_step:
            hook()
        # Under pp every stage updates its own blocks from the step's statistics (summed over
        # the stages too); their scalars to log are the same.
        scalars: dict[str, float] = {}
        for terms in [s.terms for s in self.stages] or [self.terms]:
            if terms is not None and stats is not None:
                scalars = terms.after_step(stats, log)
        return scalars


def build_model(
    family: ModelFamily,
    args: Any,
    settings: BuildSettings,
    mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    stage_sizes: list[int] | None = None,
) -> BuiltModel:
    """The model of `family` with `args`, built on meta and, given the (dp_replicate,
    dp_shard, cp, tp) `mesh` (and, for expert parallel, the expert mesh), parallelized as it will
    train with `settings`, in the module docstring's order. Materialize it with `model.to_empty`.
    `stage_sizes`: blocks per pipeline stage (pp > 1; launch.check `Plan.stage_sizes`)."""
    import torch

    with torch.device("meta"):
        model = family.build_model(args)
    built = BuiltModel(model)
    # FSDP's and tp's meshes, once: with cp they are new process groups (parallel/runtime.py).
    meshes = None if mesh is None else fsdp_meshes(mesh)
    pp = 1 if mesh is None else pp_size(mesh)
    if pp == 1:
        built.terms = _parallelize(built, model, family, settings, mesh, meshes, expert_mesh)
        return built
    # 1b. The pipeline split: this rank's stages, each a copy of the model on meta holding its
    # blocks (parallel/pp_split.py); steps 2-6 then run on each stage as on a whole model.
    pp_rank = mesh["pp"].get_local_rank()
    pipeline = settings.parallel.pipeline
    sizes = stage_sizes or list(pipeline.split)  # launch.check chose them
    built.stages = split_model(model, family, pipeline, pp, pp_rank, sizes)
    for stage in built.stages:
        stage.terms = _parallelize(built, stage.model, stage.family, settings, mesh, meshes,
                                   expert_mesh)  # fmt: skip
    built.model = merged_view(model, built.stages)
    return built


def _parallelize(
    built: BuiltModel,
    model: nn.Module,
    family: ModelFamily,
    settings: BuildSettings,
    mesh: DeviceMesh | None,
    meshes: tuple[DeviceMesh, DeviceMesh, DeviceMesh] | None,
    expert_mesh: DeviceMesh | None,
) -> StepTerms | None:
    """Steps 2-6 on `model` (the whole model, or one pipeline stage); returns its step terms."""
    fp8, graph = settings.fp8, settings.compile.fsdp == "graph"
    if fp8.enabled:  # 2
        candidates = family.fp8_linears(model)
        if mesh is None:
            built.float8 = float8_policy(model, fp8, candidates)
        else:
            # FSDP shards over dp_shard x cp (parallel/runtime.py dp_mesh): cp ranks gather too.
            sharded = mesh["dp_shard"].size() * mesh["cp"].size() > 1
            built.float8 += apply_float8(model, fp8, candidates=candidates,
                                         weights_sharded=sharded, in_graph=graph)  # fmt: skip
            built._after_step.append(lambda: precompute_float8_scales(model, fp8))
    tp = 1 if mesh is None else mesh["tp"].size()
    if meshes is not None:
        fsdp_mesh, tp_mesh, joint_mesh = meshes
    if tp > 1:  # 3
        # torchao's float8 styles hand the layer a float8 input, which LoRA's adapters would
        # then receive too; and gloo has no float8 collectives.
        float8_comm = fp8.enabled and fp8.recipe == "tensorwise" and not settings.lora.enabled
        float8_comm = float8_comm and mesh.device_type == "cuda"
        apply_tp(model, family, tp_mesh, float8_collectives=float8_comm)
    experts = None
    if expert_mesh is not None:  # its rows split over tp at tp > 1; its compute compiled apart
        tp_split = tp_mesh if tp > 1 else None
        experts = apply_ep(model, family, expert_mesh, tp_split, settings.compile)
    if mesh is not None and mesh["cp"].size() > 1:
        apply_cp(model, mesh["cp"])
    lora, freeze = settings.lora, settings.freeze
    if isinstance(family, StageFamily):  # a pipeline stage: what it holds of the patterns
        lora = replace(lora, targets=family.own(lora.targets, "linears"))
        freeze = family.own(freeze, "params")
    if lora.enabled:  # 4
        built.adapted += apply_lora(model, lora)
    if freeze:
        apply_freeze(model, freeze)
    terms = step_terms(family, model)
    if mesh is None:
        return terms
    compile_cfg, ac = settings.compile, settings.ac
    if compile_cfg.enabled:  # a restart then finds its graphs in Inductor's cache
        pickle_meshes_without_their_hash()
    if compile_cfg.fsdp == "graph":  # 5-6 as one graph that holds FSDP's collectives
        apply_ac(model, family.fsdp_units(model), ac, in_graph=True)
        apply_graph_fsdp(model, family, fsdp_mesh, joint_mesh if tp > 1 else None,
                         settings.parallel, compile_cfg, fp8.enabled)  # fmt: skip
        return terms
    compile_first = tp_compile_workarounds(model, family, tp, compile_cfg.enabled, ac.mode)
    apart = experts_apart(model, family, compile_cfg, experts)  # compiled around them
    if compile_first:  # 5
        apply_compile(model, family.fsdp_units(model), compile_cfg, apart)
        apply_ac(model, family.fsdp_units(model), ac)
    else:
        apply_ac(model, family.fsdp_units(model), ac)
        apply_compile(model, family.fsdp_units(model), compile_cfg, apart)
    apply_fsdp(model, family.fsdp_units(model), fsdp_mesh, settings.parallel, experts)  # 6
    return terms
