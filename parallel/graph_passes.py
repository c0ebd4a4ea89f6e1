"""What Inductor does with the graph of compile.fsdp='graph' (parallel/graph_fsdp.py): FSDP's
collectives bucketed and reordered for overlap, and the resharding policy, as settings passed
per compile (never set globally, so the hooks path's blocks compile as before)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy


def inductor_options(
    bucket_mb: float, reshard_after_forward: str, cudagraphs: bool = False
) -> dict[str, Any]:
    """Inductor settings for the compiled model (passed per compile, not set globally): FSDP
    bucketing of all-gathers and reduce-scatters (and HSDP's all-reduces) up to `bucket_mb`
    MB (0: none), reordering for overlap, the resharding policy, and CUDA graphs
    (`cudagraphs`: what mode='reduce-overhead' sets, which torch.compile takes only without
    options). Their names changed across torch releases: each is set only where this torch has
    it (tests/test_graph_fsdp.py fails when bucketing does not happen)."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor
    from torch._inductor.custom_graph_pass import CustomGraphPass

    CustomGraphPass.register(_ReshardPolicy)

    options: dict[str, Any] = {"triton.cudagraphs": True} if cudagraphs else {}
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
        # The rank in its cache uuid: bucketed all-gathers bake it into the generated code
        # (parallel/workarounds.py, workaround 5).
        rank = dist.get_rank() if dist.is_initialized() else 0
        options["joint_custom_post_pass"] = _ReshardPolicy(reshard_after_forward != "never", rank)
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

    def __init__(self, reshard: bool, rank: int = 0) -> None:
        self.reshard, self.rank = reshard, rank
        self.policy = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE

    def uuid(self) -> str:
        return f"fsdp2-trainer-graph-fsdp-reshard-{self.reshard}-rank-{self.rank}-2"

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
