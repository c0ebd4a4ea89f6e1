"""The family contract, tested once for every family in `model.FAMILIES` and the test family.

The test family (tests/zoo.py, registered here by a fixture, and in the spawned ranks by
`zoo.call_registered`) has every shape the contract allows: a dense first block then MoE blocks
with a shared expert, a GeLU MLP, a routing-bias buffer that `after_step` moves, soft-capped
logits. For each family: initial weights identical on any mesh; document masking on 1 process and on
sharded meshes; logits equal to `transformers` both ways (a family with a Hugging Face mapping);
golden losses; fp32 parity of 1 process, FSDP and HSDP, and of tensor parallel (a family with a
TP_PLAN) and expert parallel (an MoE family); a bitwise resume, and init_from_hf of its export.
A fork that adds one line to FAMILIES (and a golden file) gets these tests; a family's own file
(tests/test_qwen3.py, ...) keeps only what is specific to it.

The models are tiny: `SHAPE`, the fields every family's args have, over the family's debug
flavor. Checks of the model alone on several ranks run every family in one spawn per mesh
(`on_mesh`): starting the ranks costs more than the models. The trainer runs are per family.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from data.documents import MicroBatch, micro_batch
from data.loader import DataConfig, build_dataloader
from model import (
    FAMILIES,
    ModelConfig,
    block_shapes,
    get_hf_mapping,
    moe_family,
    output_layer,
    step_terms,
)
from tests import test_documents as docs
from tests import zoo
from tests.distributed import run_distributed
from tests.test_train import FP32, TINY, assert_close, train_losses

# transformers must never reach for the network (read when huggingface_hub is first imported).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

DEFAULT = ModelConfig().name  # its trainer tests run in the quick tier, the others' in full
# The test family again, without the contract's optional block_shapes (zoo.undescribed): no
# test here may need them. It runs the in-process tests (NAMES) and the expert-load check; the
# spawned ones (SPAWNED: meshes, and trainer runs of many seconds each) leave it out, as it
# differs from the test family only in a description they never read.
ALL = {**FAMILIES, zoo.NAME: zoo, zoo.UNDESCRIBED: zoo.undescribed()}
NAMES = list(ALL)
SPAWNED = [f for f in NAMES if f != zoo.UNDESCRIBED]
TP_FAMILIES = [f for f in SPAWNED if getattr(ALL[f], "TP_PLAN", None) is not None]
MOE_FAMILIES = [f for f in SPAWNED if moe_family(ALL[f]) is not None]
HF_FAMILIES = [f for f in ALL if get_hf_mapping(f) is not None]

# GQA (4 query heads share 2 kv heads) in 2 blocks; the rest (head_dim, FFN, experts) is the
# family's debug flavor.
SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
SEQ = 32
HF_SEQ = 128


def quick_for_default(names: list[str]) -> list[Any]:
    """The default family in the quick tier; the others in the full suite only."""
    return [pytest.param(n, marks=[] if n == DEFAULT else pytest.mark.slow) for n in names]


# The shipped families whose multi-rank contract runs repeat the default family's and the test
# family's (whose blocks mix dense, MoE and extra-buffer shapes): in the drills (`-m drill`).
# What is theirs alone runs by default in their own files (logits against transformers, the
# trainer, expert parallel: tests/test_qwen3*.py, tests/test_moe_*.py). A fork's new family is
# not listed, so its CI runs every contract test.
SECOND_CASES = ("qwen3", "qwen3_moe")


def multi_rank_tiers(names: list[str]) -> list[Any]:
    """The default family in the quick tier, SECOND_CASES in the drills, the others in the
    full suite."""
    marks = {n: [pytest.mark.slow, pytest.mark.drill] for n in SECOND_CASES} | {DEFAULT: []}
    return [pytest.param(n, marks=marks.get(n, [pytest.mark.slow])) for n in names]


def tiny_args(family: str, **fields: Any) -> Any:
    return FAMILIES[family].build_args(ModelConfig(family, **(SHAPE | fields)))


def initialized(family: str, seed: int = 0, rope_len: int = SEQ, **fields: Any) -> torch.nn.Module:
    model = FAMILIES[family].build_model(tiny_args(family, vocab_size=128, **fields))
    model.init_weights(seed=seed, rope_len=rope_len)
    return model


def ties(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter that has several (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(n for n in names.values() if len(n) > 1)


def unit_scale(model: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations, 1-D ones (norm gains) around 1: at init's std 0.02
    attention is nearly uniform, so a wrong RoPE layout, norm or expert would hardly move the
    logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.ndim == 1:
                param.copy_(1 + 0.2 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)


@pytest.fixture(autouse=True)
def registered(zoo_family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test family in model.FAMILIES for every test here (tests/conftest.py), and in this
    process its variant without block_shapes."""
    monkeypatch.setitem(FAMILIES, zoo.UNDESCRIBED, ALL[zoo.UNDESCRIBED])


def in_ranks(fn: Callable) -> Callable:
    """`fn` for run_distributed: the spawned ranks register the test family too."""
    return partial(zoo.call_registered, fn)


def full(value: torch.Tensor) -> torch.Tensor:
    """A state entry whole: a DTensor's full value; a plain tensor (a buffer) is whole."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread, like the ranks of tests/distributed.py: on 2 shared, busy cores,
    thread-pool barriers can make init_weights 50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def on_mesh() -> Callable[..., list[Any]]:
    """`on_mesh(fn, world, *args, nodes=1)`: `run_distributed`, once per module for the same
    arguments, so that every family's test of one mesh reads the same spawn (a failure too)."""
    done: dict[tuple, Any] = {}

    def run(fn: Callable, world: int, *args: Any, nodes: int = 1) -> list[Any]:
        key = (fn.__name__, world, args, nodes)
        if key not in done:
            try:
                done[key] = run_distributed(in_ranks(fn), world, *args, nodes=nodes)
            except AssertionError as err:
                done[key] = err
        if isinstance(done[key], AssertionError):
            raise AssertionError(str(done[key]))
        return done[key]

    return run


# ---- initial weights -------------------------------------------------------------------------


@pytest.mark.parametrize("family", NAMES)
def test_init_is_a_function_of_the_seed(family: str) -> None:
    """The same seed gives the same values; another seed other values, except for constant
    state (norm gains, a routing bias); the same parameter of two blocks differs (the
    parameters both have: a block may be of another kind)."""
    a, b, other = initialized(family), initialized(family), initialized(family, seed=1)
    for (name, x), y, z in zip(
        a.state_dict().items(), b.state_dict().values(), other.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
        constant = bool((x == x.flatten()[0]).all())
        assert torch.equal(x, z) == constant, name
    first, second = (dict(u.named_parameters()) for u in FAMILIES[family].fsdp_units(a)[:2])
    assert first.keys() & second.keys()
    for name in first.keys() & second.keys():
        x = first[name]
        assert torch.equal(x, second[name]) == bool((x == x.flatten()[0]).all()), name


@pytest.mark.parametrize("family", NAMES)
def test_init_on_meta_and_by_regions_equals_the_plain_init(family: str) -> None:
    """The trainer's path (build on meta, to_empty, init_weights) gives the plain model's
    weights, the tie of tied embeddings restored; `assign(param, draw)` is called once for each
    parameter, and draw(region) is that region of its whole value (two halves along dim 0
    give the whole), so a rank can draw its shard alone."""
    plain = initialized(family, tie_embeddings=True)
    with torch.device("meta"):
        model = FAMILIES[family].build_model(plain.args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0, rope_len=SEQ)
    assert ties(model) == ties(plain) != []
    for (name, x), y in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(x, y), name

    calls: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def assign(param: torch.Tensor, draw: Callable) -> None:
        assert id(param) not in calls
        whole = draw(tuple(slice(0, n) for n in param.shape))
        rest, half = tuple(slice(0, n) for n in param.shape[1:]), param.shape[0] // 2
        halves = torch.cat([draw((slice(0, half), *rest)), draw((slice(half, None), *rest))])
        calls[id(param)] = whole, halves

    model.init_weights(seed=0, rope_len=SEQ, assign=assign)
    reference = dict(plain.named_parameters())
    assert len(calls) == len(reference)
    for name, param in model.named_parameters():
        whole, halves = calls[id(param)]
        assert whole.dtype == torch.float32 and whole.shape == param.shape, name
        assert torch.equal(whole, reference[name]) and torch.equal(halves, whole), name


def init_on_mesh(dp_replicate: int, tp: int, vocab_size: int, whole: bool) -> dict[str, tuple]:
    """For each family (with a TP_PLAN where tp > 1), on this rank of a (dp_replicate, dp_shard,
    tp) mesh: the full weights after a sharded init, their placements, and (elements drawn,
    elements held). `whole`: take the path for placements that are not one block (draw the
    whole parameter, keep the local part). Tensor parallel first, then FSDP, as train.py."""
    from parallel import fsdp
    from parallel.dims import LaunchEnv, ParallelConfig
    from parallel.fsdp import apply_fsdp, assign_local_shard
    from parallel.runtime import build_mesh, dp_mesh, init_distributed
    from parallel.tp import apply_tp

    if whole:
        fsdp.local_region = lambda param: None
    launch = LaunchEnv.from_env()
    device = torch.device("cpu")
    init_distributed(device, launch, 60)
    mesh = build_mesh(device, dp_replicate, launch.world_size // dp_replicate // tp, tp)
    out = {}
    for name in TP_FAMILIES if tp > 1 else FAMILIES:
        family = FAMILIES[name]
        with torch.device("meta"):
            model = family.build_model(tiny_args(name, vocab_size=vocab_size))
        if tp > 1:
            apply_tp(model, family, mesh["tp"])
        fp32 = ParallelConfig(param_dtype="float32")
        apply_fsdp(model, family.fsdp_units(model), dp_mesh(mesh), fp32)
        model.to_empty(device=device)
        drawn = [0]

        def counting(param: torch.Tensor, draw: Callable, drawn: list[int] = drawn) -> None:
            def counted(region: tuple[slice, ...]) -> torch.Tensor:
                values = draw(region)
                drawn[0] += values.numel()
                return values

            assign_local_shard(param, counted)

        model.init_weights(seed=7, rope_len=16, assign=counting)
        held = sum(p.to_local().numel() for p in model.parameters())
        state = model.state_dict()
        out[name] = (
            {k: full(v) for k, v in state.items()},
            {k: str(tuple(v.placements)) for k, v in state.items() if hasattr(v, "placements")},
            (drawn[0], held),
        )
    torch.distributed.destroy_process_group()
    return out


# (world, dp_replicate, tp, vocab_size, whole). Vocab 99 over 4 ranks: FSDP2 shards it 25, 25,
# 25, 24 (torch.chunk), an uneven last shard.
INIT_MESHES = {
    "1": (1, 1, 1, 100, False),
    "fsdp-4": (4, 1, 1, 100, False),
    "hsdp-2x2": (4, 2, 1, 100, False),
    "fsdp-4-uneven": (4, 1, 1, 99, False),
    "fsdp-4-uneven-whole-draw": (4, 1, 1, 99, True),
    "fsdp-2-tp-2": (4, 1, 2, 100, False),
    "hsdp-2x2-tp-2": (8, 2, 2, 100, False),
}
SLOW_INIT = ("fsdp-4-uneven", "fsdp-4-uneven-whole-draw", "hsdp-2x2-tp-2")


@pytest.mark.parametrize(
    ("family", "mesh"),
    [
        pytest.param(f, m, marks=[pytest.mark.slow] if m in SLOW_INIT else [], id=f"{f}-{m}")
        for m, (_, _, tp, _, _) in INIT_MESHES.items()
        for f in (TP_FAMILIES if tp > 1 else SPAWNED)
    ],
)
def test_initial_weights_identical_on_every_mesh(
    family: str, mesh: str, on_mesh: Callable[..., list[Any]]
) -> None:
    """Bit-identical to the single-device init, with each rank drawing only what it holds,
    also where FSDP shards tensor parallel's shards again (strided placements); a persistent
    buffer (the test family's routing bias) whole on every rank."""
    world, dp_replicate, tp, vocab_size, whole = INIT_MESHES[mesh]
    model = FAMILIES[family].build_model(tiny_args(family, vocab_size=vocab_size))
    model.init_weights(seed=7, rope_len=16)
    reference = model.state_dict()
    total = sum(p.numel() for p in model.parameters())
    results = on_mesh(init_on_mesh, world, dp_replicate, tp, vocab_size, whole, nodes=dp_replicate)
    for rank in results:
        full, placements, (drawn, held) = rank[family]
        assert full.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(full[name], value), name
        if tp == 1:  # FSDP leaves buffers plain tensors: every parameter is sharded
            expected = "(Shard(dim=0),)" if dp_replicate == 1 else "(Replicate(), Shard(dim=0))"
            assert set(placements.values()) == {expected}
            assert set(placements) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
        else:  # FSDP over TP's Shard(0): a strided shard on the FSDP dim
            assert any("_StridedShard" in p for p in placements.values()), placements
        # O(shard): no rank draws another rank's values (unless asked to draw whole ones).
        assert drawn == (total if whole else held)


# ---- the output path and buffers ---------------------------------------------------------------


@pytest.mark.parametrize("family", NAMES)
def test_the_logits_are_the_output_layer_of_the_hidden_states(family: str) -> None:
    """The output path is one module (model/__init__.py): forward's logits are, bitwise, the
    output layer applied to forward(..., hidden_only=True), which is what the chunked loss
    computes (the test family's soft-capping included)."""
    model = initialized(family)
    if (layer := output_layer(FAMILIES[family], model)) is None:  # optional (no chunked loss)
        pytest.skip(f"{family} has no output_layer(model)")
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(tokens, hidden_only=True)
        assert hidden.shape == (2, SEQ, model.args.dim)
        assert torch.equal(layer(hidden), model(tokens))


def test_persistent_buffers_are_checkpoint_state_hugging_face_files_refuse(
    tiny_dataset: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The test family's routing bias is a persistent buffer: in the state dict (so in every
    checkpoint), not in Hugging Face files. With a mapping, the export and the load refuse
    the model, and checkpoint.init_from_hf is a config error at start."""
    from checkpoint.hf import hf_tensors
    from configs import ConfigError, parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from model import HF_MAPPINGS, llama_hf, persistent_buffers
    from parallel.dims import LaunchEnv

    assert persistent_buffers(initialized("llama3")) == []
    model = initialized(zoo.NAME)
    assert persistent_buffers(model) == ["layers.1.moe.router.bias"]
    with pytest.raises(ConfigError, match=r"persistent buffers \(layers.1.moe.router.bias\)"):
        hf_tensors(model, llama_hf)
    monkeypatch.setitem(HF_MAPPINGS, zoo.NAME, llama_hf)
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            f"--model.name={zoo.NAME}", "--train.micro_batch_size=4",
            f"--checkpoint.init_from_hf={tiny_dataset}"]  # fmt: skip
    with pytest.raises(ConfigError, match="init_from_hf: model zoo keeps state in persistent"):
        check_config(parse_config(JobConfig, argv), LaunchEnv(0, 0, 1, 1, 1))


class DriftingZoo(zoo.Zoo):
    """The test family with a routing bias that forward changes: what the contract forbids."""

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        for router in zoo.routers(self):
            router.bias.add_(1.0)
        return super().forward(tokens, **kwargs)


def test_a_forward_that_changes_a_persistent_buffer_is_refused_at_start(
    tiny_dataset: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """check_config runs the model on meta once and finds the buffer changed: one line naming
    it, before any process group; the test family itself passes."""
    from configs import ConfigError, parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    monkeypatch.setattr(zoo, "build_model", DriftingZoo)
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            f"--model.name={zoo.NAME}", "--train.micro_batch_size=4"]  # fmt: skip
    drift = r"forward changes its persistent buffers \(layers.1.moe.router.bias\)"
    with pytest.raises(ConfigError, match=drift) as err:
        check_config(parse_config(JobConfig, argv), LaunchEnv(0, 0, 1, 1, 1))
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    check_config(parse_config(JobConfig, argv), LaunchEnv(0, 0, 1, 1, 1))


# ---- document masking --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "chunked"])
@pytest.mark.parametrize("family", NAMES)
def test_packed_window_equals_each_document_alone(family: str, impl: str) -> None:
    """fp32, 1 process: the per-token losses of two packed windows equal those of each of
    their documents alone, within 1e-5, with positions from the window start or restarted per
    document. The same comparison with causal attention fails, by far more than 1e-5."""
    model = docs.tiny_model(family, impl)
    batch = docs.window_batch()
    with torch.no_grad():
        alone = docs.documents_alone(model, batch)
        assert (batch.targets != -100).sum() > 60 and len(batch.document_ids.unique()) >= 4
        torch.testing.assert_close(docs.token_losses(model, batch), alone, rtol=1e-5, atol=1e-5)
        restarted = docs.token_losses(model, docs.window_batch(docs.POSITIONS))
        torch.testing.assert_close(restarted, alone, rtol=1e-5, atol=1e-5)
        causal = docs.token_losses(model, MicroBatch(batch.inputs, batch.targets))
    # The first document of each row sees no other either way; the later ones differ.
    later = (batch.document_ids > 0) & (batch.targets != -100)
    assert (causal - alone)[later].abs().max() > 1e-3
    torch.testing.assert_close(causal[~later], alone[~later], rtol=1e-5, atol=1e-5)


def documents_on_mesh(dims: tuple[int, int, int], val_path: str) -> dict[str, object]:
    """On this rank of a (dp_replicate, dp_shard, tp) mesh, for each family (with a TP_PLAN
    where tp > 1): the per-token losses of the packed windows (document masking, fp32) and
    `evaluate` of two micro-batches of the val split of `val_path` with document masking, as
    train.py runs it."""
    from parallel.dims import LaunchEnv, ParallelConfig
    from parallel.fsdp import apply_fsdp, assign_local_shard
    from parallel.runtime import build_mesh, dp_mesh, dp_rank_and_size, init_distributed
    from parallel.tp import apply_tp, loss_context
    from train import evaluate

    init_distributed(docs.CPU, LaunchEnv.from_env(), 60)
    mesh = build_mesh(docs.CPU, *dims)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    data = DataConfig(path=val_path, seq_len=docs.SEQ, attention_mask="document")
    out: dict[str, object] = {}
    for name in TP_FAMILIES if dims[2] > 1 else FAMILIES:
        family = FAMILIES[name]
        with torch.device("meta"):
            model = docs.build(name)
        if dims[2] > 1:
            apply_tp(model, family, mesh["tp"])
        fp32 = ParallelConfig(param_dtype="float32")
        apply_fsdp(model, family.fsdp_units(model), dp_mesh(mesh), fp32)
        model.to_empty(device=docs.CPU)
        model.init_weights(seed=0, rope_len=docs.SEQ, assign=assign_local_shard)
        with torch.no_grad():
            out[name] = docs.token_losses(model, docs.window_batch())
            # 2 micro-batches of 4 sequences over all data-parallel ranks.
            val = build_dataloader(data, "val", dp_rank=dp_rank, dp_size=dp_size,
                                   micro_batch_size=4 // dp_size, seed=0)  # fmt: skip
            with loss_context(dims[2]):
                out[f"{name} val"], _ = evaluate(
                    model, val, 2, lambda x, y: micro_batch(x, y, data, docs.EOS, docs.CPU)
                )
    torch.distributed.destroy_process_group()
    return out


def expected_val_loss(name: str, val_path: str, attention_mask: str) -> float:
    """What evaluate() should give: the mean loss per target of the first 8 val sequences,
    computed on one process without the trainer."""
    model = docs.tiny_model(name)
    data = DataConfig(path=val_path, seq_len=docs.SEQ, attention_mask=attention_mask)
    val = build_dataloader(data, "val", dp_rank=0, dp_size=1, micro_batch_size=8, seed=0)
    batch = micro_batch(*next(iter(val)), data, docs.EOS, docs.CPU)
    with torch.no_grad():
        return docs.token_losses(model, batch).sum().item() / (batch.targets != -100).sum().item()


DOCUMENT_MESHES = {"fsdp2": (1, 2, 1), "tp2": (1, 1, 2), "hsdp2x2": (2, 2, 1)}


@pytest.mark.parametrize(
    ("family", "mesh"),
    [
        pytest.param(f, m, marks=[pytest.mark.slow] if m == "hsdp2x2" else [], id=f"{f}-{m}")
        for m, dims in DOCUMENT_MESHES.items()
        for f in (TP_FAMILIES if dims[2] > 1 else SPAWNED)
    ],
)
def test_sharded_meshes_equal_documents_alone_and_evaluate(
    family: str, mesh: str, short_docs: str, on_mesh: Callable[..., list[Any]]
) -> None:
    """FSDP over 2 ranks, tensor parallel 2 (sequence parallel; the mask passes the blocks'
    PrepareModuleInput untouched) or HSDP 2x2: the packed-window losses equal each document
    alone (fp32, 1e-5), on every rank; and evaluate() gives the one-process document-masked
    validation loss, which differs from the causal one."""
    dims = DOCUMENT_MESHES[mesh]
    results = on_mesh(documents_on_mesh, math.prod(dims), dims, short_docs, nodes=dims[0])
    batch = docs.window_batch()
    with torch.no_grad():
        alone = docs.documents_alone(docs.tiny_model(family), batch)
    document = expected_val_loss(family, short_docs, "document")
    causal = expected_val_loss(family, short_docs, "causal")
    assert abs(document - causal) > 1e-3
    for rank in results:
        torch.testing.assert_close(rank[family], alone, rtol=1e-5, atol=1e-5)
        assert rank[f"{family} val"] == pytest.approx(document, rel=1e-5)


# ---- Hugging Face ------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_logits_equal_transformers_both_ways(family: str, tied: bool, tmp_path: Path) -> None:
    """Ours -> save_hf_weights -> transformers' `from_pretrained`: the same logits (fp32, max
    difference 1e-5), and our files read back bitwise. Theirs (random weights) ->
    `save_pretrained` (its own config keys and tensor layout) -> load_hf_weights: the same
    logits, and its config.json reads back as our shape."""
    transformers = pytest.importorskip("transformers")
    from checkpoint.hf import check_hf_config, load_hf_weights, save_hf_weights

    mapping = get_hf_mapping(family)
    ours = initialized(family, rope_len=HF_SEQ, tie_embeddings=tied)
    unit_scale(ours, seed=3)
    args = ours.args
    x = torch.randint(0, 128, (2, HF_SEQ), generator=torch.Generator().manual_seed(1))
    save_hf_weights(ours, mapping, tmp_path / "ours", dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max() <= 1e-5
    with torch.device("meta"):
        loaded = FAMILIES[family].build_model(args)
    loaded.to_empty(device="cpu")
    loaded.init_buffers(HF_SEQ)  # to_empty unties a plain model; FSDP2's keeps the tie
    load_hf_weights(loaded, mapping, tmp_path / "ours", rope_len=HF_SEQ)
    for (name, a), b in zip(ours.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    unit_scale(theirs, seed=4)
    theirs.save_pretrained(tmp_path / "theirs")
    check_hf_config(mapping, args, tmp_path / "theirs")
    saved = json.loads((tmp_path / "theirs" / "config.json").read_text())
    read = mapping.args_from_config_json(saved, "config.json")
    assert mapping.config_json(read, torch.float32, None, None) == mapping.config_json(
        args, torch.float32, None, None
    )
    load_hf_weights(loaded, mapping, tmp_path / "theirs", rope_len=HF_SEQ)
    with torch.no_grad():
        assert (loaded(x) - theirs(x).logits).abs().max() <= 1e-5


# ---- the trainer -------------------------------------------------------------------------------

GOLDEN_DIR = Path(__file__).parent / "golden"
# llama3 is the default family: its file predates the others and its argv names no family.
GOLDEN_FILE = {"llama3": "debug_losses.json"}


def golden_path(family: str) -> Path:
    return GOLDEN_DIR / GOLDEN_FILE.get(family, f"{family}_debug_losses.json")


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=[] if f == "llama3" else pytest.mark.slow) for f in SPAWNED]
)
def test_golden_losses_of_the_debug_flavor(family: str, tiny_dataset: str, tmp_path: Path) -> None:
    """Each family's debug flavor's first 20 losses match its golden file (fp32, 1 process).

    After an intended numerics change, regenerate with UPDATE_GOLDEN=1 and review the diff. A
    family without a golden file yet (a fork's new one) is skipped, saying how to write it.
    """
    golden = golden_path(family)
    if not golden.exists() and not os.environ.get("UPDATE_GOLDEN"):
        pytest.skip(f"no tests/golden/{golden.name}: UPDATE_GOLDEN=1 python -m pytest "
                    f"tests/test_families.py -k 'golden and {family}' writes it")  # fmt: skip
    argv = [
        f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}",
        *([] if family == "llama3" else [f"--model.name={family}"]),
        "--model.flavor=debug", "--model.vocab_size=512", "--data.seq_len=64",
        "--train.global_batch_size=4", "--train.micro_batch_size=4", "--train.steps=20",
        "--optim.warmup_steps=5", "--optim.lr=1e-3", "--train.eval_interval=0",
        "--metrics.tensorboard=false", *FP32,
    ]  # fmt: skip
    losses = run_distributed(in_ranks(train_losses), 1, argv)[0]
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(json.dumps({"argv": argv[2:], "losses": losses}, indent=1) + "\n")
    expected = json.loads(golden.read_text())
    assert expected["argv"] == argv[2:], "the golden file was made with other settings"
    # Different CPUs sum matmuls in different orders; 20 steps amplify that to ~1e-5.
    assert_close(losses, expected["losses"], rtol=1e-4)


# The trainer runs: tests/test_train.py's TINY (its shape is SHAPE with vocab 512), fp32, and
# what a family sets beyond its debug flavor (optional: a new family runs without a line here).
RUN_SHAPE = {
    "qwen3": ["--model.ffn_dim=128"],
    # 4 experts of hidden 32, top 2, both aux losses on: large enough coefficients that a wrong
    # normalization shows in the losses and grad norms.
    "qwen3_moe": ["--model.n_experts=4", "--model.top_k=2", "--model.moe_ffn_dim=32",
                  "--model.aux_loss_coef=0.1", "--model.router_z_loss_coef=0.01"],
    # The same, a shared expert and a GeLU MLP of their own widths, and a routing bias that
    # moves fast enough to change the routing within a few steps.
    zoo.NAME: ["--model.n_experts=4", "--model.top_k=2", "--model.moe_ffn_dim=32",
               "--model.shared_ffn_dim=48", "--model.ffn_dim=96", "--model.aux_loss_coef=0.1",
               "--model.router_z_loss_coef=0.01", "--model.bias_update_rate=0.01"],
}  # fmt: skip
STEPS = 6


def run_argv(dataset: str, out: Path, family: str, name: str, *extra: str) -> list[str]:
    """Run `name` of `family` in `out`: global batch 8 in micro-batches of 2."""
    return [f"--data.path={dataset}", f"--run.output_dir={out}", f"--run.name={name}", *TINY,
            f"--model.name={family}", *RUN_SHAPE.get(family, []), *FP32,
            "--train.micro_batch_size=2", *extra]  # fmt: skip


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every TensorBoard scalar of a run, by tag, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def train_run(
    dataset: str,
    out: Path,
    family: str,
    name: str,
    world: int,
    *extra: str,
    nodes: int = 1,
    steps: int = STEPS,
) -> dict[str, list[float]]:
    """`steps` steps on `world` ranks (`nodes` of them: dp_replicate), TensorBoard every step:
    the losses and rank 0's scalars."""
    args = run_argv(dataset, out, family, name, f"--train.steps={steps}",
                    "--metrics.tensorboard=true", "--metrics.log_interval=1", *extra)  # fmt: skip
    if nodes > 1:
        args.append(f"--parallel.dp_replicate={nodes}")
    losses = run_distributed(in_ranks(train_losses), world, args, nodes=nodes)[0]
    return {"losses": losses} | scalars(out / name)


def assert_same_run(got: dict, want: dict, steps: slice = slice(None)) -> None:
    """fp32: losses, grad norms and the family's own losses (an MoE's loss/aux) within 1e-5
    per step."""
    assert_close(got["losses"], want["losses"][steps], rtol=1e-5)
    for tag in ["grad_norm", *(t for t in want if t.startswith("loss/") and t != "loss/train")]:
        assert_close(got[tag], want[tag][steps], rtol=1e-5)


@pytest.fixture(scope="module")
def straight(
    tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], dict[str, Any]]:
    """`straight(family)`: the family's reference run, one process, 4 micro-batches per step
    (trained once per module), with its output folder as "out"."""
    runs: dict[str, dict[str, Any]] = {}

    def run(family: str) -> dict[str, Any]:
        if family not in runs:
            out = tmp_path_factory.mktemp(f"{family}_runs")
            runs[family] = train_run(tiny_dataset, out, family, "straight", 1) | {"out": out}
        return runs[family]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("family", multi_rank_tiers(SPAWNED))
def test_fp32_parity_one_process_fsdp_hsdp(
    family: str, straight: Callable[[str], dict], tiny_dataset: str
) -> None:
    """Same seed and global batch: 1 process (4 micro-batches of 2), FSDP 1x4 (1 micro-batch
    of 2 per rank) and HSDP 2x2 give the same losses, grad norms and step-term losses. An MoE's
    aux loss is normalized per sequence (model/__init__.py): a per-rank or per-micro-batch
    balance would differ here."""
    want = straight(family)
    out = want["out"]
    assert want["losses"][-1] < want["losses"][0] - 0.5, want["losses"]
    assert_same_run(train_run(tiny_dataset, out, family, "fsdp", 4), want)
    assert_same_run(train_run(tiny_dataset, out, family, "hsdp", 4, nodes=2), want)


@pytest.mark.slow
@pytest.mark.parametrize("family", multi_rank_tiers(TP_FAMILIES))
def test_fp32_parity_tensor_parallel(
    family: str, straight: Callable[[str], dict], tiny_dataset: str
) -> None:
    """tp 2 (sequence parallel; per-head norms on the local heads, tied embeddings, an MoE
    layer whole on both tp ranks) gives the 1-process run. Composed with FSDP and HSDP:
    tests/test_tp.py."""
    want = straight(family)
    assert_same_run(train_run(tiny_dataset, want["out"], family, "tp", 2, "--parallel.tp=2"), want)


def expert_blocks(family: Any, model: torch.nn.Module) -> list[int]:
    """The indices of the blocks (fsdp_units) that hold experts, read from the model as the
    planner reads it: block_shapes would say it too, but is optional."""
    experts = {id(m) for m in moe_family(family).expert_modules(model)}
    return [i for i, block in enumerate(family.fsdp_units(model))
            if any(id(m) in experts for m in block.modules())]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", multi_rank_tiers(MOE_FAMILIES))
def test_expert_parallel_parity_and_its_checkpoint_resumes_without_ep(
    family: str, straight: Callable[[str], dict], tiny_dataset: str
) -> None:
    """EP 2 x FSDP 2 accumulating 2 micro-batches of 1 per rank, and HSDP 2x2 with EP 2 (1
    micro-batch per rank, full AC), give the 1-process run; EP 2's checkpoint of step 3
    continues at EP 1 (FSDP 1x2) and on 1 process with the straight run's losses. TensorBoard
    holds the aux loss and every layer's expert load each step at log_interval 1; at 4, on
    steps 4 and 6 (the last), with the aux loss of that step and the load summed since the
    previous point."""
    from torch.distributed.checkpoint import FileSystemReader

    from configs import parse_config
    from launch.job import JobConfig

    want = straight(family)
    out = want["out"]
    # Micro-batches of 1: the all-to-alls run in every micro-batch's forward and backward while
    # the expert gradients accumulate unsharded, reduce-scattered after the last one only.
    ep = train_run(tiny_dataset, out, family, "ep", 4, "--parallel.ep=2",
               "--train.micro_batch_size=1", "--checkpoint.interval=3")  # fmt: skip
    assert_same_run(ep, want)
    # Full AC recomputes each block's forward in backward, all-to-alls included.
    hsdp_ep = train_run(tiny_dataset, out, family, "hsdp_ep", 4, "--parallel.ep=2",
                        "--ac.mode=full", "--metrics.log_interval=4", nodes=2)  # fmt: skip
    assert_close(hsdp_ep["losses"], want["losses"], rtol=1e-5)
    for tag in ("grad_norm", "loss/aux"):  # steps 4 and 6
        assert_close(hsdp_ep[tag], [want[tag][3], want[tag][5]], rtol=1e-5)
    step3 = out / "ep" / "checkpoints" / "step-3"
    # Its keys and shapes are the model's own: whole experts, as without EP.
    saved = FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    args = FAMILIES[family].build_args(
        parse_config(JobConfig, run_argv(tiny_dataset, out, family, "x")).model
    )
    with torch.device("meta"):
        model = FAMILIES[family].build_model(args)
    for name, param in model.state_dict().items():
        assert tuple(saved[f"model.{name}"].size) == tuple(param.shape), name
    for world in (2, 1):
        resumed = train_run(tiny_dataset, out, family, f"resumed{world}", world,
                            f"--checkpoint.resume={step3}")  # fmt: skip
        assert_same_run(resumed, want, slice(3, None))
    # Expert load: per MoE block, by its index (the test family's first block is dense), the
    # busiest expert over the mean (1 = balanced, at most n_experts / top_k) and its share of
    # the block's routed tokens (at least 1 / n_experts).
    n_experts, top_k = args.n_experts, args.top_k
    layers = expert_blocks(FAMILIES[family], model)
    blocks = range(SHAPE["n_layers"])
    assert [i for i in blocks if f"expert_load/busiest_share_layer{i:02d}" in ep] == layers
    for layer in layers:
        ratio = ep[f"expert_load/max_over_mean_layer{layer:02d}"]
        share = ep[f"expert_load/busiest_share_layer{layer:02d}"]
        assert len(ratio) == STEPS and all(1 <= r <= n_experts / top_k for r in ratio)
        assert share == pytest.approx([r / n_experts for r in ratio])
    per_layer = [ep[f"expert_load/max_over_mean_layer{layer:02d}"] for layer in layers]
    assert ep["expert_load/max_over_mean"] == pytest.approx(
        [max(step) for step in zip(*per_layer, strict=True)]
    )
    assert all(a > 0 and math.isfinite(a) for a in ep["loss/aux"])
    # Every 4 steps: the load of steps 1-4, then of 5-6. Each step routes the same number of
    # tokens, so a window's busiest expert over the mean is at most the mean of its steps'
    # ratios (the max of a sum is at most the sum of the maxima); the last step's alone can
    # exceed it.
    for layer in layers:
        ratio = hsdp_ep[f"expert_load/max_over_mean_layer{layer:02d}"]
        share = hsdp_ep[f"expert_load/busiest_share_layer{layer:02d}"]
        steps = want[f"expert_load/max_over_mean_layer{layer:02d}"]
        assert len(ratio) == len(share) == 2 and all(s >= 1 / n_experts for s in share), share
        assert share == pytest.approx([r / n_experts for r in ratio])
        for got, window in zip(ratio, (steps[:4], steps[4:]), strict=True):
            assert 1 <= got <= sum(window) / len(window) + 1e-6, (got, window)


@pytest.mark.parametrize("family", [f for f in NAMES if moe_family(ALL[f]) is not None])
def test_expert_load_is_logged_by_the_blocks_that_hold_experts(family: str) -> None:
    """After one forward, in process, the step terms log the expert load under the index of
    each block that holds experts, as the model says (the expert parallel test reads them so),
    and as block_shapes says where the family gives it. The test family without block_shapes
    runs here, not in the expert parallel runs (many seconds each)."""
    moe = FAMILIES[family]
    model = initialized(family)
    layers = expert_blocks(moe, model)
    if (described := block_shapes(moe, model.args)) is not None:
        assert layers == [i for i, b in enumerate(described) if b.experts]
    terms = step_terms(moe, model)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0)))
    _, stats = terms.collect(2)
    logged, blocks = terms.after_step(stats, log=True), range(SHAPE["n_layers"])
    assert [i for i in blocks if f"expert_load/max_over_mean_layer{i:02d}" in logged] == layers


@pytest.mark.parametrize("family", multi_rank_tiers(SPAWNED))
def test_resume_is_bitwise_exact(
    family: str, saved_runs: Callable[[str], tuple[list, Path]], tiny_dataset: str
) -> None:
    """8 steps straight = a resume from that run's step-4 checkpoint for 4 more, bitwise:
    weights, optimizer, schedule and data position carry over (FSDP on 2 ranks, fp32). The LR
    schedule spans train.steps, so the 'stop' at 4 is the checkpoint of the 8-step run. Both
    runs' step-8 checkpoints hold the same bits in every entry, torch's RNG included (a
    resumed run's first iter() of its loader once drew from it, leaving it one draw off)."""
    from checkpoint.state import CONFIG, load_no_dist
    from configs import parse_config
    from launch.job import JobConfig
    from model import persistent_buffers
    from tests.test_checkpoint import assert_same_entries, load_everything

    losses, out = saved_runs(family)
    step4 = out / "sync" / "checkpoints" / "step-4"
    argv = run_argv(tiny_dataset, out, family, "family-resumed", "--train.steps=8",
                    "--checkpoint.interval=4", f"--checkpoint.resume={step4}")  # fmt: skip
    assert run_distributed(in_ranks(train_losses), 2, argv)[0] == losses[4:]
    tmp = out / "family-resumed"
    straight = load_everything(out / "sync" / "checkpoints" / "step-8", tmp)
    resumed = load_everything(tmp / "checkpoints" / "step-8", tmp)
    for entries in (straight, resumed):
        del entries[CONFIG]  # the run's name and its resume setting differ
    assert_same_entries(resumed, straight, "step 8, straight and resumed")
    # A persistent buffer that after_step moves (the test family's routing bias) is in the
    # checkpoint, moved: the resume above then depends on it.
    with torch.device("meta"):
        model = FAMILIES[family].build_model(
            FAMILIES[family].build_args(parse_config(JobConfig, argv).model)
        )
    saved = {f"model.{name}": torch.zeros(model.get_buffer(name).shape)
             for name in persistent_buffers(model)}  # fmt: skip
    load_no_dist(saved, step4)
    assert all(value.abs().sum() > 0 for value in saved.values()), saved


@pytest.mark.parametrize("family", quick_for_default(HF_FAMILIES))
def test_init_from_hf_equals_load_model_only(
    family: str, saved_runs: Callable[[str], tuple[list, Path]], tiny_dataset: str
) -> None:
    """Starting from the Hugging Face export of a checkpoint (each of 2 ranks reads its
    shards' rows) is starting from the checkpoint's weights: the same losses, bitwise."""
    from checkpoint.export import export_checkpoint

    _, out = saved_runs(family)
    step4 = out / "sync" / "checkpoints" / "step-4"
    hf_dir = out / "family-hf"
    export_checkpoint(step4, hf_dir, dtype=torch.float32)
    from_hf = run_argv(tiny_dataset, out, family, "family-from-hf", "--train.steps=3",
                       f"--checkpoint.init_from_hf={hf_dir}")  # fmt: skip
    from_dcp = run_argv(tiny_dataset, out, family, "family-from-dcp", "--train.steps=3",
                        "--checkpoint.load_model_only", f"--checkpoint.resume={step4}")  # fmt: skip
    assert (
        run_distributed(train_losses, 2, from_hf)[0]
        == run_distributed(train_losses, 2, from_dcp)[0]
    )
