"""What the planner (parallel/plan.py) reads of a model: its FSDP units' parameters, from the
model built on meta exactly as train.py builds it, and what each block computes, from the
family's description (`block_shapes`, model/blocks.py), checked against those parameters.

The parameters (count, shards, float8, tensor-parallel split, what trains, expert stacks, Muon's
matrices) need nothing but the model. Activations, FLOPs per token, and the keys and values
(context parallel) and routed rows (expert parallel) that cross the network need to know what
the matrices do; a family that does not describe its blocks, or whose description disagrees
with them, is planned without those terms, and `ModelShape.missing` says why in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from model import ModelFamily, block_shapes, moe_family
from model.blocks import BlockShape
from parallel.build import BuildSettings, build_model
from parallel.float8 import Float8Config
from parallel.lora import LoRAConfig
from parallel.muon import muon_parameters


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its parameter shapes and which of them are all-gathered in float8."""

    shapes: tuple[tuple[int, ...], ...]
    float8_gathered: tuple[bool, ...]
    tp_split: tuple[bool, ...] = ()
    """Which parameters tensor parallel splits (the family's TP_PLAN); empty: none."""
    trainable: tuple[bool, ...] = ()
    """Which parameters train (train.freeze, LoRA); empty: all of them."""
    backward: bool = True
    """Whether backward runs through this unit (not: frozen, and nothing before it trains)."""
    expert: tuple[bool, ...] = ()
    """Which parameters are stacked expert weights (dim 0 = expert); empty: none."""
    muon: tuple[bool, ...] = ()
    """Which parameters Muon trains under optim.name="muon" (parallel/muon.py); empty: none."""

    def numel(self, trainable_only: bool = False) -> int:
        return sum(math.prod(s) for s, t in zip(self.shapes, self._trains(), strict=True)
                   if t or not trainable_only)  # fmt: skip

    def expert_numel(self) -> int:
        experts = self.expert or (False,) * len(self.shapes)
        return sum(math.prod(s) for s, e in zip(self.shapes, experts, strict=True) if e)

    def _trains(self) -> tuple[bool, ...]:
        return self.trainable or (True,) * len(self.shapes)

    def shard_numel(
        self,
        shard: int,
        fp8_only: bool | None = None,
        tp: int = 1,
        trainable_only: bool = False,
        ep: int = 1,
        experts: bool | None = None,
        muon: bool | None = None,
    ) -> int:
        """Elements of this rank's (padded) shard: FSDP2 pads dim 0 to a multiple of shard;
        a weight tensor parallel splits holds 1/tp of them (tp divides those dims).
        `trainable_only`: of the parameters that train (gradients, optimizer state). Expert
        weights under expert parallel: split over ep by expert first, then FSDP pads each
        rank's experts to a multiple of shard x tp / ep (expert_shard: the tp ranks compute
        other rows, parallel/ep.py; tp splits no expert). `experts`: True for the
        expert weights only, False for the others only; `muon` likewise for Muon's."""
        split = self.tp_split or (False,) * len(self.shapes)
        expert = self.expert or (False,) * len(self.shapes)
        muons = self.muon or (False,) * len(self.shapes)
        params = zip(self.shapes, self.float8_gathered, split, self._trains(), expert, muons,
                     strict=True)  # fmt: skip
        total = 0
        for s, f, t, trains, e, m in params:
            if (fp8_only is not None and f != fp8_only) or (trainable_only and not trains):
                continue
            if (experts is not None and e != experts) or (muon is not None and m != muon):
                continue
            # Under EP the experts' FSDP group is the ranks EP leaves, tp ranks included.
            group = shard * tp // ep if ep > 1 else shard
            rows = math.ceil(s[0] // ep / group) if e else math.ceil(s[0] / shard)
            total += rows * math.prod(s[1:]) // (tp if t else 1)
        return total

    def tp_numel(self, tp: int, ep: int = 1) -> int:
        """Elements of the unit on one tensor-parallel rank, gathered (before FSDP); its
        expert weights hold the rank's n_experts / ep experts."""
        return self.shard_numel(1, tp=tp, experts=False) + self.shard_numel(ep, ep=ep, experts=True)


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model, read from the model itself built on meta."""

    units: list[Unit]
    """The blocks' FSDP units in order, then the root's."""
    dim: int
    vocab_size: int
    blocks: tuple[BlockShape, ...] | None = None
    """What each block computes (model/blocks.py), one per block unit; None: not known."""
    missing: str = ""
    """Why `blocks` is None, and what the planner leaves out for it: one line ('' if known)."""
    embedding_numel: int = 0
    """The input embedding's weights when untied: a lookup, not a matmul (no FLOPs)."""
    tied_embedding: bool = False
    """The root's first parameter (the input embedding) is used under a second name too (tied
    embeddings): under pipeline parallel the last stage holds a replica of it."""

    @property
    def n_layers(self) -> int:
        return len(self.units) - 1

    @property
    def n_experts(self) -> int:
        """Experts per MoE block (dim 0 of the stacked expert weights); 0 for a dense model."""
        stacks = [s for u in self.units if u.expert for s, e in zip(u.shapes, u.expert,
                                                                     strict=True) if e]  # fmt: skip
        return max((s[0] for s in stacks), default=0)

    def numel(self, trainable_only: bool = False) -> int:
        return sum(u.numel(trainable_only) for u in self.units)

    def n_backward_blocks(self) -> int:
        """Blocks that backward runs through (all of them unless the first ones are frozen)."""
        return sum(u.backward for u in self.units[:-1])

    def active_numel(self) -> float:
        """Parameters one token uses: top_k / n_experts of each MoE block's expert weights, all
        the rest (nan for a mixture of experts whose blocks are not described)."""
        experts = [u.expert_numel() for u in self.units[:-1]]
        if not any(experts):
            return self.numel()
        if self.blocks is None:
            return math.nan
        used = sum(n * b.experts.top_k // b.experts.n_experts
                   for n, b in zip(experts, self.blocks, strict=True) if n)  # fmt: skip
        return self.numel() - sum(experts) + used

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, as the families count them for MFU: 6 per active weight
        outside an untied input embedding, plus 12 x seq_len x each block's attention width
        (scores and values, forward and backward, the full matrix); nan when not described."""
        if self.blocks is None:
            return math.nan
        attention = sum(b.attention.q_dim for b in self.blocks)
        return 6 * (self.active_numel() - self.embedding_numel) + 12 * attention * seq_len


def model_shape(
    family: ModelFamily,
    args: Any,
    fp8: Float8Config | None = None,
    lora: LoRAConfig | None = None,
    freeze: list[str] | tuple[str, ...] = (),
) -> ModelShape:
    """Build the model on meta (no memory) and read its FSDP units' parameter shapes. With fp8
    on and tensorwise, the weights of the Linear layers the FP8 policy converts are all-gathered
    in float8 (rowwise gathers in the compute dtype). `lora` (when enabled) and `freeze`: what
    trains, as train.py sets it (LoRA's adapters are parameters of their blocks' units)."""
    settings = BuildSettings(
        fp8=fp8 or Float8Config(), lora=lora or LoRAConfig(), freeze=list(freeze)
    )
    built = build_model(family, args, settings)  # on meta, as train.py builds it, without a mesh
    model = built.model
    float8 = set()
    if settings.fp8.enabled and settings.fp8.recipe == "tensorwise":
        modules = dict(model.named_modules())
        float8 = {id(modules[d.fqn].weight) for d in built.float8 if d.converted}
    # The TP plan names the base layers; their own weights (not LoRA's adapters) are split.
    split = _tp_split_params(model, getattr(family, "TP_PLAN", None))
    units = family.fsdp_units(model)
    in_unit = {id(p) for u in units for p in u.parameters()}
    embeddings = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
    # Backward reaches a block once anything before it trains: the embedding or a block.
    reached = any(p.requires_grad for p in embeddings)

    moe = moe_family(family)
    experts = set()
    if moe is not None:
        experts = {id(p) for m in moe.expert_modules(model) for p in m.parameters()}
    names = set(muon_parameters(model, units))
    muon = {id(p) for n, p in model.named_parameters() if n in names}

    def unit(params: list[nn.Parameter], backward: bool = True) -> Unit:
        shapes = tuple(tuple(p.shape) for p in params)
        return Unit(shapes, tuple(id(p) in float8 for p in params),
                    tuple(id(p) in split for p in params),
                    tuple(p.requires_grad for p in params), backward,
                    tuple(id(p) in experts for p in params),
                    tuple(id(p) in muon for p in params))  # fmt: skip

    blocks = []
    for u in units:
        reached = reached or any(p.requires_grad for p in u.parameters())
        blocks.append(unit(list(u.parameters()), reached))
    root = [p for p in model.parameters() if id(p) not in in_unit]
    uses = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    described, missing = _described(family, args, units)
    return ModelShape(
        [*blocks, unit(root)],
        dim=args.dim,
        vocab_size=args.vocab_size,
        blocks=described,
        missing=missing,
        embedding_numel=0 if args.tie_embeddings else sum(p.numel() for p in embeddings),
        tied_embedding=bool(root) and uses.count(id(root[0])) > 1,
    )


def _described(
    family: ModelFamily, args: Any, units: list[nn.Module]
) -> tuple[tuple[BlockShape, ...] | None, str]:
    """The family's block descriptions if they hold for these blocks, else None and one line
    naming what is missing or wrong (the first block that disagrees, and how many do)."""
    left_out = "activations, FLOPs per token and context/expert parallel traffic not estimated"
    described = block_shapes(family, args)
    if described is None:
        return None, f"the family gives no block_shapes(args) (model/__init__.py): {left_out}"
    if len(described) != len(units):
        return None, (f"block_shapes(args) describes {len(described)} blocks, the model has "
                      f"{len(units)} (its fsdp_units): {left_out}")  # fmt: skip
    wrong = [(i, b.matrix_numel(args.dim), _matrix_numel(u))
             for i, (b, u) in enumerate(zip(described, units, strict=True))
             if b.matrix_numel(args.dim) != _matrix_numel(u)]  # fmt: skip
    if not wrong:
        return tuple(described), ""
    i, said, held = wrong[0]
    more = f" (and {len(wrong) - 1} more blocks)" if len(wrong) > 1 else ""
    return None, (f"block_shapes(args) gives block {i} {said:,} weights in matrices, the "
                  f"model's block holds {held:,}{more}: {left_out}")  # fmt: skip


def _matrix_numel(block: nn.Module) -> int:
    """The weights of a block's matrices (parameters of 2+ dims), LoRA's adapters left out."""
    adapters = {id(p) for n, m in block.named_modules() if ".lora_" in f".{n}"
                for p in m.parameters()}  # fmt: skip
    return sum(p.numel() for p in block.parameters() if p.ndim >= 2 and id(p) not in adapters)


def _tp_split_params(model: nn.Module, tp_plan: dict[str, str] | None) -> set[int]:
    """ids of the parameters that the TP plan splits (not the replicated norm gains)."""
    from parallel.tp import SPLIT_STYLES, _matches

    split: set[int] = set()
    for name, module in model.named_modules():
        for pattern, kind in (tp_plan or {}).items():
            if kind in SPLIT_STYLES and _matches(name, pattern):
                split |= {id(p) for p in module.parameters(recurse=False)}
    return split
