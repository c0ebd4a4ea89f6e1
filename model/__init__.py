"""Model families, and the one contract between a family and the trainer.

A *family* is a module of this package (`model/llama.py`, `model/qwen3.py`,
`model/qwen3_moe.py`) that provides what
`ModelFamily` below lists. The trainer finds it by `--model.name` through `FAMILIES`, a plain
dict at the end of this file: a reader can jump from the name to the module. Its Hugging Face
mapping, if it has one, is a module of its own (`model/llama_hf.py`), named beside it in
`HF_MAPPINGS`. `train.py`, `parallel/`, `checkpoint/` and `data/` use only this contract and
name no family, so adding a model means new files in `model/` and one line in `FAMILIES` (and
one in `HF_MAPPINGS`; docs/forking.md walks through it).

What the trainer may assume, and nothing more:

- **Shape.** `build_args(cfg)` turns `ModelConfig` (a flavor plus single-field overrides)
  into the family's frozen args dataclass, which has at least the fields of `ModelArgs`.
  `FLAVORS` maps flavor names to args. The args dataclass is also the family's config: every
  field of it that `ModelConfig` does not share is a `[model]` key of this family (with its
  type and docstring, in `--help`), so a family adds its settings in its own file; a key of
  another family is a `ConfigError` naming it, never silently ignored.
- **Construction.** `build_model(args)` constructs the model under the caller's default device:
  the trainer builds on `meta`, applies parallelism, calls `to_empty`, then `init_weights`.
  Model code is single-device: it never imports `torch.distributed`.
- **The model** (`TrainableModel`): `forward(tokens, document_ids=None, positions=None) ->
  logits (batch, seq, vocab)`, tokens (batch, seq) int64. `document_ids` (batch, seq), the
  document of each token, nondecreasing along the sequence (data/documents.py): a token attends
  only to earlier tokens of its own document; None: to every earlier token (plain causal).
  `positions` (batch, seq): each token's position for RoPE; None: 0..seq-1. A family passes
  both to `model.attention.document_mask` and `attention` (the shared dispatch: SDPA, the
  chunked CPU kernel, FlexAttention on GPUs) and indexes its RoPE table with `positions`; one
  that cannot mask documents raises on `document_ids`. Calling `document_mask` once per
  forward (also without ids) and `attention` with its result is what makes context parallel
  work unchanged: under it (parallel/cp.py) the forward gets this rank's chunks of the
  sequence with their positions, `document_mask` returns a `SplitMask` (hook:
  `model.attention.SEQUENCE_SPLIT`) and `attention` gathers the whole sequence's keys and
  values through it. So a family must not build its own mask, and must pass the mask to each
  block as an argument (activation checkpointing's recompute reuses it).
  `init_weights(seed, rope_len, assign)` fills every parameter from the seed alone,
  identically on any mesh and device, storing each value through `assign` (the sharded trainer
  keeps only its shard) and (re)builds non-persistent buffers such as the RoPE table for
  sequences up to `rope_len`; `init_buffers(rope_len)` rebuilds only those buffers (after
  weights were loaded from elsewhere). Parameter names are the checkpoint keys: they must not
  depend on the mesh, and wrappers (`torch.compile`, activation checkpointing) are stripped by
  `canonical_name`.
- **The output path, apart** (optional: `output_layer(model)`, read through
  `model.output_layer(family, model)`; `train.loss_chunk_tokens` needs it): the module that
  turns the final hidden states into logits, called as `layer(hidden)`, and
  `forward(..., hidden_only=True)`, which returns its input, (batch, seq, dim), instead of
  the logits, with everything else of the forward unchanged (an MoE's terms are kept). The
  trainer then applies the layer itself, a chunk of tokens at a time (parallel/loss.py). It
  must stay in the root FSDP unit (not inside `fsdp_units`). It is the *whole* path after the
  hidden states: an operation on the logits (soft-capping, a final scale) goes inside this
  module's forward, around its projection (a Linear of its own: LoRA and float8 then adapt or
  convert the projection alone, and fp8.skip's default 'output' keeps it in high precision), so
  that `forward` returns the layer's output unchanged. Whole and chunked loss then compute
  the same thing; with `train.loss_chunk_tokens` the trainer checks this at start on the
  model on meta (launch/check.py `check_forward`: a config error otherwise), and
  tests/test_families.py compares the values.
- **FSDP units.** `fsdp_units(model)`: the modules sharded as their own unit, in forward order
  (the transformer blocks); what is left (embeddings, final norm, output) is the root unit.
  Blocks need not be alike: a dense first block and MoE blocks after it, FFNs of other widths
  or matrix counts (a two-matrix GeLU MLP beside SwiGLU experts), shared experts. Each block
  takes the hidden states, the RoPE rows and the mask positionally and returns its hidden
  states (an MoE block also its terms, below).
  Pipeline parallel (parallel/pp_split.py) cuts the model between them: a stage replaces the
  other stages' blocks by pass-throughs (their extra outputs zeros, so sums over blocks add up
  across stages) and the modules outside the blocks by pass-throughs except on the first stage
  (those before the first block) or the last (after the last block). So the forward must not
  compute on the hidden state outside modules between the embeddings and the output. A weight
  tied between a module before the blocks and one after them (tied embeddings) must be a
  module's own parameter (`output.weight = tok_embeddings.weight`): the first and the last
  stage each hold it under both names, the pass-through keeping it; elsewhere a pass-through
  answers the names with None, so code that restores the tie compares the two attributes'
  identity, as `init_buffers` does here, and never assumes both modules exist.
- **Block shapes** (optional: `block_shapes(args) -> list[model.blocks.BlockShape]`, one per
  FSDP unit, read through `model.block_shapes(family, args)`): each block's attention, dense FFN
  (width, matrix count), routed experts (count, top_k, expert FFN) and shared expert, as plain
  data (model/blocks.py). The planner (parallel/plan.py) reads parameters from the model
  itself, and activations, FLOPs and context/expert parallel traffic from these; a family
  without them (or whose description disagrees with a block's matrices) is still planned,
  those terms left out, with one line that says why.
- **Buffers.** Non-persistent buffers (the RoPE table) are functions of the args, rebuilt by
  `init_buffers`. A persistent buffer (`register_buffer(name, t)`: a routing bias, say) is
  state like a parameter: in `state_dict` under its name, so checkpoints save and resume it on
  any mesh. It is whole on every rank (FSDP does not shard buffers; under a "replicate" TP style
  it is a replicated DTensor: read and update it through `model.moe.local`), so it must stay
  the same on every rank: `init_weights` sets it after `to_empty` (from the seed and args
  alone), `forward` never changes it (activation checkpointing runs forward twice, and the
  ranks see different tokens; checked at start by a forward on meta, launch/check.py
  `check_forward`), and only `StepTerms.after_step` updates it, from the step's
  statistics summed over the ranks. Hugging Face files carry parameters only:
  `checkpoint.init_from_hf` and the export refuse a model with persistent buffers (a config
  error at start).
- **FP8 candidates.** `fp8_linears(model)`: names of the `nn.Linear` layers FP8 may convert
  (the FP8 policy then filters by shape and `fp8.skip`).
- **Fine-tuning** (`parallel/freeze.py`, `parallel/lora.py`): `train.freeze` matches parameter
  names and `lora.targets` module names, nothing else. LoRA may adapt any `nn.Linear` (or
  subclass) the family calls as `layer(x)` and uses the output of as is; a family that reads a
  Linear's `.weight` in its forward would bypass the adapter.
- **FLOPs.** `flops_per_token(model, seq_len)`: training FLOPs per token, for MFU.
- **Hugging Face** (optional: a module `HFMapping` describes, named in `HF_MAPPINGS`, found by
  `get_hf_mapping`): parameter names, any row permutation, and config.json both ways;
  `checkpoint/export.py` and `checkpoint.init_from_hf` go through it. The mapping imports its
  family (it builds the family's args); the family never imports its mapping.
- **Tensor parallel** (optional, `TP_PLAN`, None = no TP): module name (`*` = any one name
  segment, e.g. `layers.*.attention.wq`) -> a `TPStyle` below, plain data that
  `parallel/tp.py` turns into `torch.distributed.tensor.parallel` styles. Every parameter must
  be covered. With tp > 1 the attention sees n_heads / tp local heads, so it must size its
  reshapes from the tensor (`view(b, s, -1, head_dim)`), never from `n_heads`. A
  "gather_input" module takes its inputs positionally, all of them on every call (the RoPE
  rows and the mask follow the activations untouched). A "replicate" module runs whole on every
  tp rank (an MoE layer: routing needs whole tokens): its weights are replicated DTensors and
  it computes with their local tensors (`model.moe.local`).

- **Step terms** (optional: `step_terms(model) -> StepTerms | None`, read through
  `model.step_terms(family, model)`): what a family adds to each training step beyond the
  cross-entropy, so that an auxiliary loss, a z-loss, a multi-token-prediction head or a
  bias update after the optimizer step needs no edit to `train.py`. The trainer calls
  `collect(sequences)` after each micro-batch's forward and gets `(extra loss, statistics)`:
  the extra loss is differentiable and already a **global mean** (the family normalizes it;
  `sequences` is the step's sequence count over all ranks), and every tp rank computes the same
  value; the statistics are a detached 1-D float32 tensor that the trainer sums over the step's
  micro-batches and, riding on the loss all-reduce, over the data-parallel ranks. After the
  optimizer step it calls `after_step(summed statistics, log)`: the family may update what it
  keeps (DeepSeek-V3's per-expert bias from the load summed over ranks, say) and, when `log`
  is true, returns the scalars to log since the last log step.

A **mixture-of-experts** family (`MoEFamily`; `moe_family(family)` says whether one is) also
provides, and `parallel/` may assume:

- **MoE blocks may be some of the blocks** (dense ones before them, say); `expert_modules`
  lists those that have experts, and the expert load is logged by block index.
- **The auxiliary loss reaches the trainer through the model**, not through `forward`'s result
  (which stays the logits, so everything that reads logits is unchanged): each MoE block
  returns its layer's terms as extra outputs (compile, AC and FSDP see plain tensors; no
  collective and no state inside a block) and the model's forward keeps their total until the
  next forward;
  `model.moe.MoETerms` turns it into step terms. That total is the load-balance loss and the
  router z-loss, coefficients (`args.aux_loss_coef`, `args.router_z_loss_coef`) applied, each
  computed **per sequence**, averaged over the MoE layers and **summed over the micro-batch's
  sequences**; divided by the step's sequences over all ranks it is a global mean like the main
  loss. A sequence is never split across micro-batches, so it is the same for any mesh and
  micro-batching; a loss balanced over each rank's batch would not be. Context parallel does
  split sequences: there each block's mask is a `SplitMask`, which the MoE layer takes to sum
  each sequence's tokens per expert over the split (`sum_over_split`) and to divide by the
  whole length, so each rank returns its part of the whole sequences' terms and the trainer
  adds the parts (x cp). Its statistics are
  the aux value and the tokens routed to each expert (MoE blocks, experts), logged per MoE block
  under its block index (`model.moe.MoETerms`).
- `expert_modules(model)`: each MoE layer's experts module (`model.moe.GroupedExperts`), inside
  its block: stacked weights with the expert as dim 0, computed with their local tensors
  (`model.moe.local`), and `forward(rows sorted by expert, counts per expert)`. Without
  expert parallel they belong to their block's FSDP unit. Expert parallel (parallel/ep.py)
  splits these weights over experts, makes the module an FSDP unit of its own and wraps its
  forward (all-to-all before and after); the model must not read the weights elsewhere.
- Its args have `n_experts`, `top_k` and `moe_ffn_dim` (`MoEArgs`); `flops_per_token` counts
  the *active* parameters (top_k of n_experts experts, plus every dense one), and
  `fp8_linears` leaves out the router and the experts (they are no nn.Linear; float8 grouped
  GEMMs are untested here).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_type_hints

import torch
from torch import nn

from configs import ConfigError, field_docs
from model.blocks import BlockShape

AttentionImpl = Literal["sdpa", "chunked", "varlen"]

# What a TP_PLAN entry says about one module (parallel/tp.py implements each). Activations
# between blocks are split along the sequence (sequence parallel), inside attention and FFN
# along heads / hidden features.
TPStyle = Literal[
    "embedding",  # nn.Embedding: vocabulary rows split; output split along the sequence
    "sequence",  # a norm over the hidden dim, run on this rank's part of the sequence
    "gather_input",  # a module whose first input is gathered whole from sequence shards
    "replicate",  # a module run whole on every tp rank: first input gathered, output split
    "colwise",  # nn.Linear with output features split (q, k, v, w1, w3): whole heads per rank
    "rowwise",  # nn.Linear with input features split (wo, w2): sums land as sequence shards
    "per_head",  # a norm over head_dim of (batch, seq, heads, head_dim): this rank's heads
    "output",  # the output projection: vocabulary split, logits gathered whole
]


# The `[model]` keys every family has; a family's other fields are its own (`ModelConfig.extra`).
@dataclass
class ModelConfig:
    """`[model]`: which family and flavor, and single fields that override the flavor's shape.

    The keys here are the ones every family shares. A family's own fields (llama3's
    `multiple_of`, qwen3's `head_dim`, an MoE's `n_experts`, ...) are the other fields of its
    args dataclass: set them as `model.KEY` too (TOML or command line); they are checked
    against the family named by `model.name` (`--help` lists them per family) and kept in
    `extra`. `ModelConfig(name="qwen3", head_dim=64)` takes them as keywords as well."""

    name: str = "llama3"
    """Model family: a key of model.FAMILIES (the registered ones are listed below, each with
    its own keys)."""
    flavor: str = "debug"
    """Named shape of the family (e.g. llama3: debug, 1B, 3B, 8B, 70B, 405B)."""
    dim: int | None = None
    """Hidden size (default: the flavor's)."""
    n_layers: int | None = None
    """Number of transformer blocks (default: the flavor's)."""
    n_heads: int | None = None
    """Attention heads (default: the flavor's)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (default: the flavor's)."""
    vocab_size: int | None = None
    """Embedding rows; must cover the dataset's tokenizer (default: the flavor's)."""
    rope_theta: float | None = None
    """RoPE base frequency (default: the flavor's)."""
    tie_embeddings: bool | None = None
    """Share the input embedding and output projection (default: the flavor's)."""
    norm_eps: float | None = None
    """RMSNorm epsilon (default: the flavor's)."""
    attention: AttentionImpl | None = None
    """'sdpa' (default): F.scaled_dot_product_attention, the right choice on GPUs and in fp32.
    'chunked': model/attention.py, the same math in blocks of batched matmuls, for bf16 on CPU,
    where it is 1.2-2.3x faster than SDPA's flash kernel at head_dim <= 64 (BENCHMARKS.md).
    'varlen': with data.attention_mask='document', FlashAttention's variable-length kernel on
    the packed documents instead of FlexAttention's masked one (CUDA only)."""
    extra: dict[str, Any] = field(default_factory=dict, init=False, metadata={"inline": True})
    """The family's own fields that are set, by name (written as `[model]` keys)."""

    def __init__(self, *args: Any, **values: Any) -> None:
        shared = [f for f in dataclasses.fields(ModelConfig) if f.init]
        if len(args) > len(shared):
            raise TypeError(f"ModelConfig takes at most {len(shared)} positional arguments")
        values |= dict(zip((f.name for f in shared), args, strict=False))
        for f in shared:
            setattr(self, f.name, values.pop(f.name, f.default))
        self.extra = values
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.name not in FAMILIES:
            raise ConfigError(
                f"model.name: {self.name!r} is not one of: {', '.join(FAMILIES)} "
                "(the families of model/__init__.py)"
            )
        # Shapes and counts are checked by each family's args; these would only show up as a
        # nan loss (rope_theta 0 gives 0/0 frequencies, norm_eps 0 divides by zero on a
        # zero row), so they are refused here, by name.
        for name in ("rope_theta", "norm_eps"):
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {value}")

    @staticmethod
    def extra_keys(values: dict[str, Any], names: list[str]) -> dict[str, Any]:
        """configs/parse.py's hook for keys beyond the shared ones: their types, from the
        args of the family `values["name"]`; ConfigError for a key it does not have."""
        name = values.get("name") or "llama3"
        if name not in FAMILIES:
            raise ConfigError(f"model.name: {name!r} is not one of: {', '.join(FAMILIES)}")
        own = family_fields(FAMILIES[name])
        for key in names:
            if key in own:
                continue
            if others := [n for n, fam in FAMILIES.items() if key in family_fields(fam)]:
                raise ConfigError(
                    f"model.{key} does not apply to {name} (a field of {', '.join(others)}; "
                    f"{name}'s own: {', '.join(own) or 'none'})"
                )
            keys = [f.name for f in dataclasses.fields(ModelConfig) if f.init] + list(own)
            close = difflib.get_close_matches(key, keys, n=1)
            guess = f"did you mean 'model.{close[0]}'? " if close else ""
            raise ConfigError(f"unknown key 'model.{key}': {guess}valid keys: {', '.join(keys)}")
        return {key: own[key][0] for key in names}

    @staticmethod
    def extra_help() -> list[tuple[str, dict[str, tuple[Any, str, str]]]]:
        """Each family's own keys for `--help`: (title, {key: (type, default, doc)})."""
        return [
            (f"{name}'s own (model.name={name}):",
             {k: (hint, "default: the flavor's", doc) for k, (hint, doc) in
              family_fields(family).items()})
            for name, family in FAMILIES.items()
        ]  # fmt: skip


def family_fields(family: ModelFamily) -> dict[str, tuple[Any, str]]:
    """A family's own `[model]` keys: the fields of its args dataclass that are not shared
    ones, with their type and docstring."""
    args_type = type(next(iter(family.FLAVORS.values())))
    hints = get_type_hints(args_type)
    docs = field_docs(args_type)
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    return {
        f.name: (hints[f.name], docs.get(f.name, ""))
        for f in dataclasses.fields(args_type)
        if f.name not in shared
    }


def resolve_args(cfg: ModelConfig, flavors: dict[str, Any]) -> Any:
    """A flavor's args with `cfg`'s set fields replaced; ConfigError for an unknown flavor or a
    field this family's args do not have."""
    if cfg.flavor not in flavors:
        raise ConfigError(
            f"model.flavor: {cfg.flavor!r} is not a {cfg.name} flavor: {', '.join(flavors)}"
        )
    base = flavors[cfg.flavor]
    own = {f.name for f in dataclasses.fields(base)}
    overrides = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.init and f.name not in ("name", "flavor") and getattr(cfg, f.name) is not None
    } | cfg.extra
    if foreign := sorted(set(overrides) - own):
        mine = sorted(own - {f.name for f in dataclasses.fields(cfg)})
        raise ConfigError(
            f"model: {', '.join('model.' + k for k in foreign)} does not apply to {cfg.name} "
            f"(its own fields: {', '.join(mine)})"
        )
    return dataclasses.replace(base, **overrides)


def count_params(model: nn.Module) -> int:
    """Number of parameters (global: works on meta, sharded or plain models; a tied weight
    counts once)."""
    return sum(p.numel() for p in model.parameters())


# Stores a parameter's full value (or only this rank's shard of it): see parallel/fsdp.py.
Assign = Callable[[torch.Tensor, torch.Tensor], None]

# Segments that torch.compile and activation checkpointing insert into parameter names.
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name without wrapper segments: what seeds its init and keys checkpoints."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


class ModelArgs(Protocol):
    """Fields every family's args have (the planner, FLOPs and checks read these)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int: ...


class MoEArgs(ModelArgs, Protocol):
    """Fields a mixture-of-experts family's args add (the planner reads them)."""

    n_experts: int
    top_k: int
    moe_ffn_dim: int


class TrainableModel(Protocol):
    args: Any

    def __call__(
        self,
        tokens: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        hidden_only: bool = False,
    ) -> torch.Tensor: ...

    def init_weights(
        self, seed: int = 0, rope_len: int | None = None, assign: Assign | None = None
    ) -> None: ...

    def init_buffers(self, rope_len: int) -> None:
        """Restore what is not a parameter's own value, after `to_empty` or loading weights
        from elsewhere: non-persistent buffers (the RoPE table) and tied weights."""


class HFMapping(Protocol):
    """How a family's checkpoint maps to a Hugging Face `transformers` model and back.

    Optionally also `split_names(name, args) -> list[str] | None`: for a parameter that HF files
    hold as one tensor per row of dim 0 (stacked experts: Qwen3-MoE's
    `mlp.experts.{e}.gate_proj.weight`), their names in row order; None for the others. Read
    it through `hf_split_names`; a mapping without it keeps every tensor whole.
    """

    def hf_name(self, name: str) -> str:
        """HF tensor name of one of our (canonical) parameter names."""

    def rotated_head_dim(self, name: str, args: Any) -> int | None:
        """For a weight whose rows HF orders differently inside each head (Llama's q/k RoPE
        layout), the head size over which rows are interleaved; None for the others."""

    def config_json(
        self, args: Any, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
    ) -> dict:
        """config.json of the HF model with the shape of `args`."""

    def args_from_config_json(self, cfg: dict, path: str) -> Any:
        """Our args for an HF config.json; ConfigError naming what our model cannot run."""

    def mismatches(self, ours: Any, theirs: Any) -> list[str]:
        """'field ours vs theirs' for every setting where two args differ."""


def hf_split_names(mapping: HFMapping, name: str, args: Any) -> list[str] | None:
    """The HF tensors holding the rows of parameter `name`, if the mapping splits it (see
    `HFMapping`); None when HF holds it whole, as `mapping.hf_name(name)`."""
    split = getattr(mapping, "split_names", None)
    return None if split is None else split(name, args)


class ModelFamily(Protocol):
    """What a family module provides (a module satisfies a Protocol structurally)."""

    FLAVORS: dict[str, Any]

    def build_args(self, cfg: Any) -> Any: ...

    def build_model(self, args: Any) -> nn.Module: ...

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]: ...

    def fp8_linears(self, model: nn.Module) -> list[str]: ...

    def flops_per_token(self, model: nn.Module, seq_len: int) -> int: ...

    TP_PLAN: dict[str, TPStyle] | None


class StepTerms(Protocol):
    """What a family adds to each training step (see the module docstring)."""

    def collect(self, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After a micro-batch's forward: (extra loss, a global mean; statistics, 1-D)."""

    def after_step(self, stats: torch.Tensor, log: bool) -> dict[str, float]:
        """After the optimizer step, with the step's statistics summed over micro-batches and
        data-parallel ranks; the scalars to log when `log`."""


def step_terms(family: ModelFamily, model: nn.Module) -> StepTerms | None:
    """The family's step terms for `model`, or None for a family that adds none."""
    make = getattr(family, "step_terms", None)
    return None if make is None else make(model)


def output_layer(family: ModelFamily, model: nn.Module) -> nn.Module | None:
    """The family's output projection of `model` (see the module docstring), or None for a
    family that does not hand it out."""
    get = getattr(family, "output_layer", None)
    return None if get is None else get(model)


def block_shapes(family: ModelFamily, args: Any) -> list[BlockShape] | None:
    """The family's description of each block of a model with `args` (model/blocks.py), or
    None for a family that gives none."""
    describe = getattr(family, "block_shapes", None)
    return None if describe is None else describe(args)


def persistent_buffers(model: nn.Module) -> list[str]:
    """Canonical names of the model's persistent buffers: state that checkpoints hold besides
    the parameters (see the module docstring, "Buffers")."""
    return [
        canonical_name(f"{prefix}.{name}" if prefix else name)
        for prefix, module in model.named_modules()
        for name, buffer in module.named_buffers(recurse=False)
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]


class MoEFamily(ModelFamily, Protocol):
    """What a mixture-of-experts family provides on top (see the module docstring)."""

    def expert_modules(self, model: nn.Module) -> list[nn.Module]: ...


def moe_family(family: ModelFamily) -> MoEFamily | None:
    """`family` as a mixture-of-experts family, or None for a dense one."""
    return family if hasattr(family, "expert_modules") else None  # type: ignore[return-value]


# The families, by --model.name, and their Hugging Face mappings. Adding one: its module(s) in
# model/ and one line in each dict (none in HF_MAPPINGS for a family without a mapping).
from model import llama, llama_hf, qwen3, qwen3_hf, qwen3_moe, qwen3_moe_hf  # noqa: E402, I001

FAMILIES: dict[str, ModelFamily] = {
    "llama3": llama,
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
}

HF_MAPPINGS: dict[str, HFMapping] = {
    "llama3": llama_hf,
    "qwen3": qwen3_hf,
    "qwen3_moe": qwen3_moe_hf,
}


def get_family(name: str) -> ModelFamily:
    return FAMILIES[name]


def get_hf_mapping(name: str) -> HFMapping | None:
    """The Hugging Face mapping of family `name`; None for a family that has none."""
    return HF_MAPPINGS.get(name)
