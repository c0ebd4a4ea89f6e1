"""torch.compile, one transformer block at a time.

Compiling each block (not the whole model) keeps FSDP2's all-gather/reduce-scatter hooks outside
the compiled regions: `apply_fsdp` later registers them on the wrapper `torch.compile` returns,
so Dynamo never traces a collective and never graph-breaks on one. All blocks have the same
shapes, so Dynamo compiles once and reuses the code for every block. On CPU, Inductor generates
and builds C++ (a compiler must be installed); on GPU, Triton kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from configs import ConfigError
from parallel import replace_submodule


@dataclass
class CompileConfig:
    enabled: bool = False
    """Compile each transformer block with torch.compile (Inductor). The first steps are slow
    while it compiles."""
    backend: Literal["inductor", "aot_eager"] = "inductor"
    """torch.compile's backend. 'aot_eager' traces and differentiates exactly as Inductor's
    path does (Dynamo's graphs, graph breaks, recompiles, AOTAutograd's joint graph) but runs
    the graph's ops eagerly instead of generating kernels: to tell a compiler bug from a model
    bug, and for tests of how compile composes with the other features, which on CPU it runs
    in a third of Inductor's time (the suite keeps Inductor where kernels are the point:
    tests/test_ac_compile.py, tests/test_graph_fsdp.py). No speed-up of its own."""
    fullgraph: bool = True
    """Fail on a graph break instead of silently running part of a compiled region eagerly (a
    block; an MoE block under expert parallel is compiled in regions: `compile_around`)."""
    moe_regions: bool = False
    """Compile mixture-of-experts blocks in regions around their experts, as expert parallel
    always does (parallel/ep.py), also without it: to compare with whole compiled blocks."""
    loss: bool = True
    """With compile.enabled, also compile the loss: the float32 upcast, log-softmax and NLL fuse
    into kernels that read the compute-dtype logits, so no float32 copy of the (tokens x vocab)
    logits and of their gradient is ever stored (see bench/loss.py)."""
    fsdp: Literal["hooks", "graph"] = "hooks"
    """Who runs FSDP's collectives. 'hooks': FSDP2 (fully_shard), in hooks around each block,
    outside the compiled blocks. 'graph': the whole model is compiled as one graph holding the
    all-gathers and reduce-scatters, which Inductor buckets and reorders (needs
    compile.enabled; parallel/graph_fsdp.py, docs/parallelism.md)."""
    bucket_mb: float = 500.0
    """With fsdp='graph': Inductor merges consecutive all-gathers (and reduce-scatters) into
    buckets of up to this many MB of gathered weights (0 = one collective per parameter). The
    default is about one Llama 3 8B block in bf16, FSDP2's unit there; for a smaller model use
    about one of its blocks (one bucket for a whole model overlaps nothing: BENCHMARKS.md)."""

    cudagraphs: bool = False
    """With fsdp='graph' on CUDA: replay the compiled model's forward and backward as CUDA
    graphs (Inductor's CUDA graph trees, torch.compile's mode='reduce-overhead'), which
    launch a whole graph's kernels at once instead of one by one from the host
    (parallel/compile.py `check_cudagraphs` says where it is refused)."""

    def __post_init__(self) -> None:
        if self.bucket_mb < 0:
            raise ConfigError(f"compile.bucket_mb must be >= 0, got {self.bucket_mb}")
        if self.fsdp == "graph" and not self.enabled:
            raise ConfigError(
                "compile.fsdp='graph' compiles the whole model with its collectives: set "
                "compile.enabled=true too"
            )


def compile_loss(loss_fn: Callable[..., torch.Tensor], cfg: CompileConfig) -> Callable:
    """`loss_fn` compiled (compile.enabled and compile.loss), else as is. The loss sits outside
    every FSDP unit's hooks (it runs on the model's output), so it has no collective to trace."""
    if not (cfg.enabled and cfg.loss):
        return loss_fn
    return torch.compile(loss_fn, fullgraph=True, backend=cfg.backend)


def apply_compile(
    model: nn.Module, blocks: list[nn.Module], cfg: CompileConfig, apart: Sequence[nn.Module] = ()
) -> None:
    """Replace each of `blocks` (the family's `fsdp_units(model)`, after `apply_ac`: the
    checkpoint wrappers) inside `model` by its compiled wrapper; a block that holds one of
    `apart` (modules that must run eagerly: expert parallel's experts) is compiled around them
    instead (`compile_around`).

    Parameter names gain an `_orig_mod.` segment, which DCP's `get_model_state_dict` and
    `model.canonical_name` drop: checkpoints stay interchangeable with eager runs.
    Call after `apply_ac` (the checkpointed block is compiled, recompute included) and before
    `apply_fsdp` (see the module docstring). At tp > 1 with whole-block AC, torch 2.13 needs
    the reverse of the first: see parallel/workarounds.py.
    """
    if not cfg.enabled or cfg.fsdp == "graph":  # parallel/graph_fsdp.py compiles the whole model
        return
    for block in blocks:
        if _holds(block, apart):
            compile_around(block, apart, cfg)
        else:
            replace_submodule(
                model, block, torch.compile(block, fullgraph=cfg.fullgraph, backend=cfg.backend)
            )


def compile_around(module: nn.Module, apart: Sequence[nn.Module], cfg: CompileConfig) -> None:
    """Compile, in place, each child of `module` that holds none of `apart`, and descend into
    the children that do: every compiled region is a whole submodule, and what lies between
    them (`apart`, and the forward code of `module` and of the modules on the way to it) runs
    eagerly. For expert parallel's experts, an FSDP unit of their own whose all-to-all needs
    row counts on the host, that is the block's norms, attention and router (parallel/ep.py
    compiles the experts' own compute). Identical submodules of all blocks share a graph."""
    for name, child in module.named_children():
        if any(child is m for m in apart):
            continue
        if _holds(child, apart):
            compile_around(child, apart, cfg)
        else:
            setattr(
                module, name, torch.compile(child, fullgraph=cfg.fullgraph, backend=cfg.backend)
            )


def _holds(module: nn.Module, apart: Sequence[nn.Module]) -> bool:
    ids = {id(m) for m in apart}
    return any(id(m) in ids for m in module.modules())


def check_cudagraphs(
    cfg: CompileConfig, on_gpu: bool, attention_mask: str, eval_tasks: bool, pp: int
) -> None:
    """ConfigError, before any process group, for compile.cudagraphs where a CUDA graph
    cannot hold the step: a graph replays fixed shapes and addresses, recorded once."""
    if not cfg.cudagraphs:
        return
    refused = (
        (not on_gpu, "on CPU", "CUDA graphs need a CUDA device"),
        (cfg.fsdp != "graph" or cfg.backend != "inductor", "without compile.fsdp='graph' "
         "and compile.backend='inductor'", "only the graph path compiles the whole model "
         "(FSDP2's hooks run eagerly between compiled blocks, so no graph holds a step)"),
        (attention_mask == "document", "data.attention_mask='document'", "each batch's "
         "documents give its mask another shape, and every new shape records a new graph"),
        (eval_tasks, "eval.tasks", "the tasks' requests come in lengths of their own, each "
         "recording a graph that is used once"),
        (pp > 1, "parallel.pp > 1", "the pipeline's stages run one micro-batch at a time "
         "around point-to-point sends outside the graphs; untested on a GPU"),
    )  # fmt: skip
    for hit, setting, why in refused:
        if hit:
            raise ConfigError(f"compile.cudagraphs {setting}: {why}; leave it off")
