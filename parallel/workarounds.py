"""Workarounds for torch bugs, in one place: each names the bug it works around and the torch
issue, and tests/test_workarounds.py reproduces each bug without its workaround, failing once a
torch release no longer has it (that is when to delete the workaround).

The first two concern tensor parallel with compiled blocks, seen on torch 2.13 (CPU/gloo):

1. **Embedding output copy.** The TP embedding's reduce-scatter is async: its output is an
   AsyncCollectiveTensor. AOTAutograd waits on such an input of a compiled block and the waited
   tensor no longer requires grad (since pytorch/pytorch#179849; a fix is proposed in
   pytorch/pytorch#191113), so the first block sends no gradient back and the embedding never
   learns (inside FSDP silently; without it, DTensor's backward fails). Standalone repro:
   docs/notes/tp_compile_repro.py.
2. **Compile before whole-block AC.** Compiling a block that `checkpoint_wrapper` recomputes
   whole, with DTensor ops inside, fails at its first forward: AOTAutograd's partitioner puts
   the DeviceMesh of the recomputed redistributions among the saved tensors ("expected all
   tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh"). No torch issue was found
   for it; search for that message. Op-level AC compiles fine; so does checkpointing the
   compiled block, which recomputes the same ops and gives the same numbers.
3. **Gradients divided twice.** An FSDP unit with `set_gradient_divide_factor` (expert
   parallel's experts) reduces with NCCL's PREMUL_SUM; gloo has none, so on CPU it must also
   `set_force_sum_reduction_for_comms` (sum, then divide). With a shard group of one rank
   (HSDP with ep = dp_shard) torch 2.13 then divides by the factor both when it copies the
   gradient in place of the reduce-scatter and again after the all-reduce
   (`foreach_reduce`, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py; no torch
   issue found). Its PREMUL_SUM path divides only in that copy, so a one-rank shard group
   keeps it: it never reaches gloo.
4. **Profiler ranges in op-level AC.** Selective activation checkpointing replays each op's
   saved outputs by counting the ops a block ran in forward; every op of the recompute must
   have been counted then. FSDP2's hooks mark their phases with `record_function`, itself a
   pair of dispatched ops, and a nested FSDP unit (expert parallel's experts, inside their
   block's unit) opens one more range in the recompute than in forward ("FSDP::root_pre_forward":
   its hooks see a new forward pass); where that unit gathers nothing in forward (a one-rank
   `expert_shard`, as with ep = dp_shard) the counts no longer match and backward fails
   ("profiler._record_function_enter_new.default invocation index 3 encountered during
   backward but not found in storage"). Reported as pytorch/torchtitan#3427; the fix proposed
   in torch (pytorch/pytorch#196862) leaves profiler ops out of the count, and so does this
   workaround, adding them to torch's public `torch.utils.checkpoint.SAC_IGNORED_OPS`: they
   compute nothing.
5. **A DeviceMesh's per-process hash in Inductor's cache key.** Under compile.fsdp="graph"
   (and compiled blocks at tp > 1) the graph takes each DTensor's DeviceMesh as an input, and
   Inductor's FX graph cache key pickles it with the hash the mesh caches on itself (`_hash`,
   kept by its `__getstate__`): a hash of its dim names (str hashes, randomized per process)
   and of its `_thread_id` (None, whose hash on Python 3.11 is an address). So the key changed
   from process to process and a restart never found its graphs (measured: the model's two
   graphs missed on every restart; with this workaround every lookup hits:
   tests/test_graph_fsdp.py, BENCHMARKS.md). No torch issue was found; the fix would be
   `__getstate__` leaving `_hash` out, which this does with a copyreg reducer (the hash is
   recomputed on first use). Each rank keeps keys of its own (the pickled mesh holds its
   coordinate, and graph FSDP's pass its rank): bucketed all-gathers bake the rank into the
   generated code (pytorch/pytorch#188332), so no rank may load another's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from model import ModelFamily
from parallel.tp import _matches


def tp_compile_workarounds(
    model: nn.Module, family: ModelFamily, tp: int, compiled: bool, ac_mode: str
) -> bool:
    """Apply the workarounds that compiled blocks at tp > 1 need, after `apply_tp` and before
    `apply_ac` and `apply_compile`. Returns True when the blocks must be compiled before AC
    wraps them (workaround 2), the reverse of the usual order; False otherwise."""
    if tp == 1 or not compiled:
        return False
    # Workaround 1 (pytorch/pytorch#179849): registered after the embedding style's own hook,
    # which returns the async output.
    embeddings = [p for p, kind in family.TP_PLAN.items() if kind == "embedding"]
    for name, module in model.named_modules():
        if any(_matches(name, pattern) for pattern in embeddings):
            module.register_forward_hook(_resolved_output)
    # Workaround 2 (no torch issue found): only whole-block AC recomputes DTensor redistributions.
    return ac_mode in ("full", "selective")


def _resolved_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output copied out of the AsyncCollectiveTensor (workaround 1): a plain
    tensor with autograd history (`wait()` would detach it). The copy, (batch, seq / tp, dim)
    once per forward, costs no overlap: the first block's norm needs the reduce-scatter at once."""
    return output.clone()


def set_gradient_divide_factor(module: nn.Module, factor: float, mesh: DeviceMesh) -> None:
    """`module.set_gradient_divide_factor(factor)` for an FSDP unit on `mesh` (its shard dim
    last), summing where there is no PREMUL_SUM except where that divides twice (workaround
    3)."""
    module.set_gradient_divide_factor(factor)
    if mesh.device_type != "cuda" and mesh.size(mesh.ndim - 1) > 1:
        module.set_force_sum_reduction_for_comms(True)


def sac_ignores_profiler_ranges() -> None:
    """Leave `record_function`'s ops out of selective activation checkpointing's op counts
    (workaround 4). Process-wide and idempotent; called by `apply_ac` for op-level AC."""
    import torch.utils.checkpoint as checkpoint

    ranges = torch.ops.profiler
    checkpoint.SAC_IGNORED_OPS.update(
        {ranges._record_function_enter_new.default, ranges._record_function_exit._RecordFunction}
    )


def pickle_meshes_without_their_hash() -> None:
    """Pickle every DeviceMesh without its cached, per-process `_hash` (workaround 5), so that
    Inductor's cache keys of the graph FSDP path are the same in every process of a run.
    Process-wide and idempotent; called by the build when anything is compiled (per-block
    compile takes meshes too at tp > 1)."""
    import copyreg

    from torch.distributed.device_mesh import DeviceMesh

    copyreg.pickle(DeviceMesh, _mesh_without_hash)


def _mesh_without_hash(mesh: DeviceMesh) -> Any:
    reduced = mesh.__reduce_ex__(2)
    state = dict(reduced[2]) | {"_hash": None}
    return (reduced[0], reduced[1], state, *reduced[3:])
