"""FSDP whose collectives the compiler owns (compile.fsdp="graph"; SimpleFSDP, arXiv 2411.00284).

    apply_graph_fsdp(model, family, dp_mesh, job.parallel, job.compile)   # instead of apply_fsdp

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

The whole model is then compiled as one graph (`nn.Module.compile`, in place: the parameter
names, hence the checkpoint keys, do not change), and Inductor sees every collective:
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

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy

from configs import ConfigError
from model import ModelFamily, output_layer
from parallel.compile import CompileConfig
from parallel.dims import ParallelConfig
from parallel.fsdp import DTYPES


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
    """The forward of a parameter: its shard, cast, all-gathered (see the module docstring)."""

    def __init__(self, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        shard_dim = mesh.ndim - 1
        self.shard_group = mesh.get_group(shard_dim)
        self.replica_group = mesh.get_group(0) if mesh.ndim > 1 else None
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def __call__(self, param: DTensor) -> torch.Tensor:
        return self.apply_to_local(param.to_local(), param.shape[0])

    def apply_to_local(self, shard: torch.Tensor, rows: int) -> torch.Tensor:
        """The whole weight of `rows` rows from this rank's `shard` of it."""
        return _AllGatherShards.apply(
            shard, rows, self.shard_group, self.replica_group, self.param_dtype, self.reduce_dtype
        )


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
        ctx: Any,
        shard: torch.Tensor,
        rows: int,
        shard_group: Any,
        replica_group: Any,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ) -> torch.Tensor:
        ranks = shard_group.size()
        ctx.groups, ctx.rows, ctx.local_rows = (shard_group, replica_group), rows, shard.shape[0]
        ctx.dtypes = (reduce_dtype, shard.dtype)
        ctx.padded = -(-rows // ranks)
        x = shard.to(param_dtype)
        if ranks == 1:  # dp_shard 1: the cast is all (a gather over one rank is a copy)
            return x
        if ctx.padded != ctx.local_rows:
            x = torch.cat([x, x.new_zeros(ctx.padded - ctx.local_rows, *x.shape[1:])])
        return funcol.all_gather_tensor(x, 0, shard_group)[:rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
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
        return (g / ranks if ranks > 1 else g).to(dtype), None, None, None, None, None


def _gathering_property(name: str, gather: _Gather) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        param = module._parameters[name]
        # Only while Dynamo traces: eager code (init, checkpoints, LoRA) sees the Parameter.
        return gather(param) if torch.compiler.is_compiling() else param

    return property(get)


def apply_graph_fsdp(
    model: nn.Module,
    family: ModelFamily,
    mesh: DeviceMesh,
    parallel: ParallelConfig,
    compile_cfg: CompileConfig,
) -> None:
    """Shard every parameter of `model` on `mesh` (as `apply_fsdp` does), gather them inside
    the compiled forward, and compile the model (and its output projection) in place."""
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    gather = _Gather(mesh, DTYPES[parallel.param_dtype], DTYPES[parallel.reduce_dtype])
    sharded: dict[int, nn.Parameter] = {}  # a tied weight is one Parameter under two names
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        for name in names:
            param = module._parameters[name]
            if id(param) not in sharded:
                local = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
                sharded[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            module._parameters[name] = sharded[id(param)]
        if names:
            mixins = (GraphFSDPModule,) if module is model else ()
            props = {name: _gathering_property(name, gather) for name in names}
            module.__class__ = type(module.__class__.__name__, (*mixins, module.__class__), props)
    if model.__class__.__bases__[0] is not GraphFSDPModule:  # a root without own parameters
        model.__class__ = type(model.__class__.__name__, (GraphFSDPModule, model.__class__), {})
    options = inductor_options(compile_cfg.bucket_mb, parallel.reshard_after_forward)
    model.compile(fullgraph=compile_cfg.fullgraph, options=options)
    if (output := output_layer(family, model)) is not None:
        output.compile(fullgraph=compile_cfg.fullgraph, options=options)


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
        (parallel.tp > 1, "parallel.tp > 1", "tensor parallel's weights are DTensors on the tp "
         "mesh already, and gathering them over the data-parallel mesh inside the graph needs "
         "2D placements this path does not build"),
        (parallel.cp > 1, "parallel.cp > 1", "context parallel gathers keys and values with "
         "eager c10d calls (parallel/cp.py) that one compiled graph cannot hold"),
        (parallel.ep > 1, "parallel.ep > 1", "expert parallel's experts are FSDP units on a "
         "mesh of their own, and its all-to-alls have data-dependent sizes"),
        (fp8, "fp8.enabled", "torchao's float8 weights are gathered through FSDP2's all-gather "
         "extension (fsdp_pre_all_gather), which the compiled graph never calls"),
        (parallel.pp > 1, "parallel.pp > 1", "each pipeline stage runs its forward and "
         "backward inside torch's schedules, one micro-batch at a time, which a whole-model "
         "graph does not split into"),
        (parallel.cpu_offload, "parallel.cpu_offload", "offloading moves shards between host "
         "and device in FSDP2's hooks, and this path has none"),
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


def inductor_options(bucket_mb: float, reshard_after_forward: str) -> dict[str, Any]:
    """Inductor settings for the compiled model (passed per compile, not set globally): FSDP
    bucketing of all-gathers and reduce-scatters (and HSDP's all-reduces) up to `bucket_mb`
    MB (0: none), reordering for overlap, and the resharding policy. Their names changed across
    torch releases: each is set only where this torch has it (tests/test_graph_fsdp.py fails
    when bucketing does not happen)."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor
    from torch._inductor.custom_graph_pass import CustomGraphPass

    CustomGraphPass.register(_ReshardPolicy)

    options: dict[str, Any] = {}
    if bucket_mb > 0:
        for kind, mode in (("all_gathers", "only_fsdp"), ("reduce_scatters", "all"),
                           ("all_reduces", "all")):  # fmt: skip
            name = f"bucket_{kind}_fx"
            if hasattr(inductor, name) and hasattr(inductor, f"{name}_bucket_size_determinator"):
                options[name] = mode
                options[f"{name}_bucket_size_determinator"] = _BucketCap(bucket_mb)
    if hasattr(inductor, "reorder_for_compute_comm_overlap"):
        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = [
            p for p in ("sink_waits", "raise_comms", "reorder_compute_for_overlap")
            if hasattr(comms, p)
        ]  # fmt: skip
    if hasattr(inductor, "joint_custom_post_pass"):
        options["joint_custom_post_pass"] = _ReshardPolicy(reshard_after_forward != "never")
    return options


class _BucketCap:
    """Inductor's bucket_size_determinator: the same cap in MB for every bucket. A class, not a
    closure: Inductor pickles its settings into the key of its compile cache."""

    def __init__(self, mb: float) -> None:
        self.mb = mb

    def __call__(self, bucket: int) -> float:
        return self.mb


class _ReshardPolicy:
    """A joint-graph pass (before the partitioner splits forward from backward) that marks the
    parameter all-gathers, and the casts and views between a parameter and them, to be redone
    in backward (resharded after forward) or saved (kept gathered until backward). Registered
    as an Inductor CustomGraphPass (`inductor_options`; not subclassed, since importing
    torch._inductor takes seconds) with a uuid, so that Inductor's compile cache can key it."""

    def __init__(self, reshard: bool) -> None:
        self.reshard = reshard
        self.policy = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE

    def uuid(self) -> str:
        return f"fsdp2-trainer-graph-fsdp-reshard-{self.reshard}-1"

    def __call__(self, graph: torch.fx.Graph) -> None:
        c10d = torch.ops._c10d_functional
        for wait in graph.find_nodes(op="call_function", target=c10d.wait_tensor.default):
            gather = wait.args[0]
            if getattr(gather, "target", None) != c10d.all_gather_into_tensor.default:
                continue
            chain = [wait, gather]
            node = gather.args[0]
            while isinstance(node, torch.fx.Node) and node.op == "call_function":
                if len(node.all_input_nodes) != 1:
                    break  # not a parameter's own chain (an activation's gather)
                chain.append(node)
                node = node.all_input_nodes[0]
            if not (isinstance(node, torch.fx.Node) and node.op == "placeholder"):
                continue
            for n in chain:
                n.meta["recompute"] = self.policy
                # A region of its own: nodes at the border of two checkpointed regions are
                # saved, whatever their tag (torchtitan's SimpleFSDP does the same).
                n.meta["ac_graph_id"] = 100_000
