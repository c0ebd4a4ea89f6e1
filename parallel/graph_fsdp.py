"""FSDP whose collectives the compiler owns (compile.fsdp="graph"; SimpleFSDP, arXiv 2411.00284).

    apply_graph_fsdp(model, family, dp_mesh, joint_mesh, job.parallel, job.compile)

The parameters are sharded exactly as `apply_fsdp` shards them: each one a DTensor on the same
data-parallel mesh (dp_shard, or (dp_replicate, dp_shard) for HSDP), Shard(0) (Replicate()
across replicas), so checkpoints, the optimizer and the gradient norm see what they see under
FSDP2. What changes is how forward reaches the whole weights. Every module that holds
parameters gets a property per parameter: read inside compiled code, it returns the weight
all-gathered from its shard, cast to the compute dtype *before* it crosses (half the bytes in
bf16); its backward reduce-scatters the gradient in float32 (and all-reduces it across
replicas), averaged over the data-parallel ranks as FSDP2 averages (`_AllGatherShards`: what
DTensor's `redistribute(Replicate, forward_dtype, backward_dtype)` does, written with the
functional collectives DTensor uses, for a torch bug its docstring names). Read anywhere else
(init, checkpoints, the optimizer, LoRA's init), it is the sharded Parameter, so no code outside
the compiled forward can tell the two paths apart.

It composes as FSDP2 does:
- tensor parallel: a weight `apply_tp` made a DTensor on the tp mesh is sharded over the
  data-parallel ranks by rows of its tp part, a DTensor on (dp..., tp) with FSDP2's placements;
  the graph gathers the tp part and hands the layer the tp DTensor, whose own collectives
  DTensor runs as before (inside the same graph);
- float8 (torchao, tensorwise): a converted weight is cast to float8 on its shard, with the
  whole weight's scale, and gathered as float8 bytes (`_AllGatherFloat8`), as FSDP2's float8
  all-gather does;
- pipeline stages: each stage is a model of its own here, compiled as its own graph, which
  torch's schedules call one micro-batch at a time.

The forward is compiled as one graph (`torch.compile` of `model.forward`, in place: the
parameter names, hence the checkpoint keys, do not change; hooks on the root stay eager), and
Inductor sees every collective (parallel/graph_passes.py):
- it buckets them (`compile.bucket_mb`): consecutive all-gathers (reduce-scatters) of the same
  group and dtype, in graph order, up to that many MB each, become one collective on one
  buffer, as FSDP2's per-block unit does by hand, but sized by bytes, not by module;
- it reorders them for overlap (`reorder_for_compute_comm_overlap`): collectives issued early,
  waits sunk to the first use.
Resharding after forward is the partitioner's choice between saving a gathered weight for
backward and gathering it again; `parallel.reshard_after_forward` decides it ('never' saves
every gathered weight, the others gather each again in backward, the root's too: FSDP2's
'default' keeps the root and the last block).

The family's output projection (`model.output_layer`) is compiled on its own as well: the
chunked loss (parallel/loss.py) calls it outside the model's forward, and under checkpoint in
backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from configs import ConfigError
from model import ModelFamily, output_layer
from parallel.compile import CompileConfig
from parallel.dims import ParallelConfig
from parallel.fsdp import DTYPES
from parallel.graph_passes import inductor_options


class GraphFSDPModule:
    """Mixed into the root's class: the two FSDP2 calls the training step makes, so that the
    step does not ask which path built the model."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """No effect: every backward reduce-scatters its micro-batch's gradient inside the
        compiled graph (skipping it would need a second graph). Summing reduced gradients over
        micro-batches equals reducing their sum; it costs one reduce-scatter per micro-batch
        instead of one per step (parallel/plan.py counts it)."""

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """No effect: a gathered weight lives only inside the compiled step."""


class _Gather:
    """The forward of a parameter: its shard, cast, all-gathered (see the module docstring).
    Under tensor parallel the gathered tensor is this rank's tp part, handed to the module as
    the DTensor on the tp mesh that `apply_tp` made; a float8 weight is cast before it
    crosses (`float8`)."""

    def __init__(self, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        shard_dim = mesh.ndim - 1
        self.shard_group = mesh.get_group(shard_dim)
        self.replica_group = mesh.get_group(0) if mesh.ndim > 1 else None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def __call__(self, param: DTensor, layout: _Layout) -> torch.Tensor:
        return self.apply_to_local(param.to_local(), layout)

    def apply_to_local(self, shard: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """The weight (a DTensor on the tp mesh at tp > 1) from this rank's `shard` of it."""
        groups = (self.shard_group, self.replica_group)
        dtypes = (self.param_dtype, self.reduce_dtype)
        if layout.float8 is not None:
            stand_in, data, scale = _AllGatherFloat8.apply(shard, layout.rows, groups, dtypes,
                                                           layout.float8)  # fmt: skip
            whole = _AsFloat8.apply(stand_in, data, scale, layout.float8)
        else:
            whole = _AllGatherShards.apply(shard, layout.rows, groups, dtypes)
        if layout.tp is None:
            return whole
        mesh, placements, shape, stride = layout.tp
        return DTensor.from_local(whole, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)  # fmt: skip


@dataclass(frozen=True)
class _Layout:
    """What one parameter's gather needs: the rows it gathers (the whole weight's, or its tp
    part's), its tp DTensor's (mesh, placements, shape, stride) at tp > 1, and at float8 the
    layer's torchao settings (`_AllGatherFloat8`)."""

    rows: int
    tp: tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]] | None = None
    float8: Any = None


class _AllGatherShards(torch.autograd.Function):
    """A shard cast to the compute dtype and all-gathered over the shard group; backward: the
    gradient cast to the reduce dtype, reduce-scattered (and all-reduced over replicas),
    averaged over the data-parallel ranks as FSDP2 averages (train.py scales the loss for
    that), and cast back to the parameter's dtype.

    Functional collectives (what DTensor's redistribute runs) rather than the redistribute
    itself: under whole-block activation checkpointing torch 2.13's partitioner saves the
    DeviceMesh of a recomputed redistribute as if it were a tensor and fails (the bug of
    parallel/workarounds.py's second workaround). Shards follow DTensor's Shard(0) chunking
    (ceil(rows / ranks) each, the last ones shorter or empty): padded to equal size for the
    collectives, as FSDP2 pads."""

    @staticmethod
    def forward(
        ctx: Any, shard: torch.Tensor, rows: int, groups: tuple, dtypes: tuple
    ) -> torch.Tensor:
        _remember(ctx, shard, rows, groups, dtypes)
        return _gather_rows(shard.to(dtypes[0]), rows, groups[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _reduced(ctx, grad), None, None, None


class _AllGatherFloat8(torch.autograd.Function):
    """`_AllGatherShards` for a torchao Float8Linear's weight with tensorwise scaling: the
    shard is cast to float8 with the whole weight's scale (its amax all-reduced over the
    shard group), and the float8 bytes cross, half of bf16's. This is what FSDP2's float8
    all-gather does (torchao's `fsdp_pre_all_gather`), with the same scale.

    Its outputs are the gathered float8 data and scale, which `_AsFloat8` hands the layer as
    torchao's float8 tensor, and a stand-in for the gradient: a zero-stride (no memory) tensor
    of the weight's shape and dtype, through which the weight's gradient comes back to be
    reduce-scattered. One function returning the float8 tensor itself cannot be compiled:
    Dynamo traces its backward with a gradient of the output's type, float8, where the real
    gradient is a plain tensor."""

    @staticmethod
    def forward(
        ctx: Any, shard: torch.Tensor, rows: int, groups: tuple, dtypes: tuple, float8: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from torchao.float8.float8_training_tensor import (
            GemmInputRole,
            hp_tensor_and_scale_to_float8,
        )
        from torchao.float8.float8_utils import amax_to_scale

        _remember(ctx, shard, rows, groups, dtypes)
        dtype, mm_config, round_scales = float8
        amax = shard.abs().max() if shard.numel() else shard.new_zeros(())
        if groups[0].size() > 1:
            amax = funcol.all_reduce(amax, "max", groups[0])
        scale = amax_to_scale(amax.float(), dtype, round_scales_to_power_of_2=round_scales)
        cast = hp_tensor_and_scale_to_float8(shard, scale, dtype, mm_config, GemmInputRole.WEIGHT)
        # As bytes: gloo has no float8 collectives; NCCL gathers them the same.
        data = _gather_rows(cast._data.view(torch.uint8), rows, groups[0]).view(dtype)
        stand_in = shard.new_zeros((), dtype=dtypes[0]).expand(rows, *shard.shape[1:])
        ctx.mark_non_differentiable(data, scale)
        return stand_in, data, scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        return _reduced(ctx, grad), None, None, None, None


class _AsFloat8(torch.autograd.Function):
    """torchao's float8 tensor of the gathered `data` and `scale`; its gradient goes to the
    stand-in as it comes (see `_AllGatherFloat8`)."""

    @staticmethod
    def forward(
        ctx: Any, stand_in: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, float8: Any
    ) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, stand_in.dtype, float8[1], GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None, None


def _remember(ctx: Any, shard: torch.Tensor, rows: int, groups: tuple, dtypes: tuple) -> None:
    ctx.groups, ctx.rows, ctx.local_rows = groups, rows, shard.shape[0]
    ctx.dtypes = (dtypes[1], shard.dtype)  # the reduce dtype, the parameter's
    ctx.padded = -(-rows // groups[0].size())


def _gather_rows(x: torch.Tensor, rows: int, shard_group: Any) -> torch.Tensor:
    """The first `rows` rows of every rank's `x` (padded to ceil(rows / ranks) rows) stacked."""
    ranks = shard_group.size()
    if ranks == 1:  # dp_shard 1: the cast is all (a gather over one rank is a copy)
        return x
    padded = -(-rows // ranks)
    if padded != x.shape[0]:
        x = torch.cat([x, x.new_zeros(padded - x.shape[0], *x.shape[1:])])
    return funcol.all_gather_tensor(x, 0, shard_group)[:rows]


def _reduced(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    """A whole weight's gradient as this rank's shard of its average over the data-parallel
    ranks (the backward of both gathers)."""
    (shard_group, replica_group), (reduce_dtype, dtype) = ctx.groups, ctx.dtypes
    ranks = shard_group.size()
    g = grad.to(reduce_dtype)
    if ctx.padded * ranks != ctx.rows:
        g = torch.cat([g, g.new_zeros(ctx.padded * ranks - ctx.rows, *g.shape[1:])])
    # Summed, then divided: gloo has no averaging reduce-scatter. Over one rank neither a
    # collective nor the division is run: on one H100 they were 3.5 ms of an 8B-block
    # step's kernels (copies and a division by 1; BENCHMARKS.md "GPU at e00475b").
    if ranks > 1:
        g = funcol.reduce_scatter_tensor(g, "sum", 0, shard_group)
    if replica_group is not None and replica_group.size() > 1:
        g = funcol.all_reduce(g, "sum", replica_group)
        ranks *= replica_group.size()
    g = g[: ctx.local_rows]
    return (g / ranks if ranks > 1 else g).to(dtype)


def _gathering_property(name: str, gather: _Gather, layout: _Layout) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        param = module._parameters[name]
        # Only while Dynamo traces: eager code (init, checkpoints, LoRA) sees the Parameter.
        return gather(param, layout) if torch.compiler.is_compiling() else param

    return property(get)


def apply_graph_fsdp(
    model: nn.Module,
    family: ModelFamily,
    dp_mesh: DeviceMesh,
    joint: DeviceMesh | None,
    parallel: ParallelConfig,
    compile_cfg: CompileConfig,
    float8: bool = False,
) -> None:
    """Shard every parameter of `model` on `dp_mesh` (fully_shard's mesh) as `apply_fsdp`
    shards it, gather them inside the compiled forward, and compile the model (and its output
    projection) in place. `joint`: at tp > 1, `dp_mesh` and the tp mesh joined
    (parallel/runtime.py `fsdp_meshes`). `float8`: gather the weights of torchao's tensorwise
    Float8Linear layers in float8."""
    gather = _Gather(dp_mesh, DTYPES[parallel.param_dtype], DTYPES[parallel.reduce_dtype])
    sharded: dict[int, tuple[nn.Parameter, _Layout]] = {}  # a tied weight: one, two names
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        props = {}
        for name in names:
            param = module._parameters[name]
            if id(param) not in sharded:
                sharded[id(param)] = _shard(param, dp_mesh, joint, _float8_of(module, name, float8))
            module._parameters[name], layout = sharded[id(param)]
            props[name] = _gathering_property(name, gather, layout)
        if names:
            mixins = (GraphFSDPModule,) if module is model else ()
            module.__class__ = type(module.__class__.__name__, (*mixins, module.__class__), props)
    if model.__class__.__bases__[0] is not GraphFSDPModule:  # a root without own parameters
        model.__class__ = type(model.__class__.__name__, (GraphFSDPModule, model.__class__), {})
    kwargs: dict[str, Any] = {"fullgraph": compile_cfg.fullgraph, "backend": compile_cfg.backend}
    if compile_cfg.backend == "inductor":
        kwargs["options"] = inductor_options(compile_cfg.bucket_mb, parallel.reshard_after_forward,
                                             compile_cfg.cudagraphs)  # fmt: skip
    # The forward, not the module's call: the hooks on the root (a pipeline stage's, which
    # time it and collect its step terms: parallel/pp.py) stay eager code around the graph.
    model.forward = torch.compile(model.forward, **kwargs)
    if (output := output_layer(family, model)) is not None:
        output.compile(**kwargs)


def _shard(
    param: nn.Parameter, dp_mesh: DeviceMesh, joint: DeviceMesh | None, float8: Any
) -> tuple[nn.Parameter, _Layout]:
    """`param` as FSDP2 shards it, and the layout its gather needs. A plain tensor: Shard(0)
    on `dp_mesh` (Replicate() across replicas). A tensor-parallel DTensor: its tp part split by
    rows over the data-parallel ranks, a DTensor on `joint` with FSDP2's placements (its tp
    placement last; a tp Shard(0) makes the data-parallel split a strided one, rows of each tp
    part), so checkpoints, the optimizer and the gradient norm see FSDP2's parameter."""
    dp_placements = [Replicate()] * (dp_mesh.ndim - 1) + [Shard(0)]
    if not isinstance(param, DTensor):
        local = distribute_tensor(param.data, dp_mesh, dp_placements, src_data_rank=None)
        return nn.Parameter(local, param.requires_grad), _Layout(param.shape[0], None, float8)
    tp_part, (tp_placement,) = param.detach().to_local(), param.placements
    if joint is None or param.device_mesh.ndim != 1:
        raise ValueError(f"compile.fsdp='graph': a parameter on {param.device_mesh} is not "
                         "a tensor-parallel DTensor this path shards")  # fmt: skip
    if tp_placement == Shard(0):
        dp_placements[-1] = _StridedShard(0, split_factor=param.device_mesh.size())
    rows = distribute_tensor(tp_part, dp_mesh, [Replicate()] * (dp_mesh.ndim - 1) + [Shard(0)],
                             src_data_rank=None).to_local()  # fmt: skip
    local = DTensor.from_local(rows, joint, (*dp_placements, tp_placement), run_check=False,
                               shape=param.shape, stride=param.stride())  # fmt: skip
    tp = (param.device_mesh, param.placements, param.shape, param.stride())
    return nn.Parameter(local, param.requires_grad), _Layout(tp_part.shape[0], tp, float8)


def _float8_of(module: nn.Module, name: str, float8: bool) -> Any:
    """(float8 dtype, torchao's matmul config, scale rounding) for the weight of a torchao
    Float8Linear with tensorwise dynamic scaling, gathered in float8; else None."""
    config = getattr(module, "config", None)
    if not (float8 and name == "weight" and hasattr(module, "linear_mm_config")):
        return None
    from torchao.float8.config import ScalingGranularity, ScalingType

    weight = config.cast_config_weight
    if (weight.scaling_type, weight.scaling_granularity) != (
        ScalingType.DYNAMIC,
        ScalingGranularity.TENSORWISE,
    ):
        return None
    return weight.target_dtype, module.linear_mm_config, config.round_scales_to_power_of_2


def check_graph_fsdp(
    compile_cfg: CompileConfig, parallel: ParallelConfig, fp8: bool, loss_chunk_tokens: int = 0
) -> None:
    """ConfigError, before any process group, for what compile.fsdp='graph' does not run: one
    line saying why and what to use instead (compile.fsdp='hooks' runs all of them)."""
    if compile_cfg.fsdp != "graph":
        return
    # Measured on an H100 with torch 2.11 (tests/test_gpu.py, BENCHMARKS.md): the chunked loss's
    # backward recomputes each chunk through the compiled output projection under the
    # checkpoint's saved-tensor hooks, and Dynamo recompiles for every chunk until its
    # recompile limit stops the run. torch 2.13 runs it (tests/test_graph_fsdp.py); 2.12 is
    # untested.
    old_torch = torch_release() < (2, 13)
    refused = (
        # Measured (docs/parallelism.md): it runs, but its losses leave one process's from the
        # first step (fp32, 5e-4; eager hooks: equal): context parallel's split mask is made
        # inside the root's forward from a ContextVar its hook sets (parallel/cp.py), and the
        # whole-model graph does not read it as the eager forward does.
        (parallel.cp > 1, "parallel.cp > 1", "the compiled root's forward does not see "
         "context parallel's sequence split (its losses leave one process's from the first "
         "step, measured)"),
        (parallel.ep > 1, "parallel.ep > 1", "the experts are DTensors on the expert mesh, "
         "sharded over a group of their own, and their all-to-alls have sizes known only at "
         "run time, which the hooks path compiles around"),
        # Measured: without this refusal it trains with every shard left on the device.
        (parallel.cpu_offload, "parallel.cpu_offload", "nothing in the compiled graph moves "
         "shards between host and device (FSDP2's hooks do), so it would not offload"),
        (loss_chunk_tokens > 0 and old_torch, "train.loss_chunk_tokens on torch "
         f"{torch.__version__}", "Dynamo recompiles the compiled output projection for every "
         "chunk the loss's backward recomputes (torch 2.11: measured; 2.13 runs it)"),
        (parallel.forward_prefetch > 0 or parallel.backward_prefetch > 0,
         "parallel.forward_prefetch/backward_prefetch", "the compiler schedules the all-gathers "
         "itself (compile.bucket_mb sets their size)"),
    )  # fmt: skip
    for hit, setting, why in refused:
        if hit:
            raise ConfigError(
                f"compile.fsdp='graph' with {setting}: {why}; use compile.fsdp='hooks' "
                "(FSDP2 with per-block compile) for it"
            )


def torch_release() -> tuple[int, int]:
    """(major, minor) of the running torch, e.g. (2, 13) for '2.13.0+cpu'."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
