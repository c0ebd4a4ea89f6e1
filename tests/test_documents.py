"""Document masking (data.attention_mask = "document", data/documents.py): the rules (document
ids, the first token of a document is no target, positions), compile and AC, the trainer end to
end, and the config errors; and the helpers of tests/test_families.py, which checks for every
family that a packed window gives each of its documents the per-token losses it has alone, on 1
process and sharded meshes, and that the same comparison fails with causal attention."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train
from configs import ConfigError, parse_config
from data.documents import MicroBatch, document_ids, document_positions, micro_batch
from data.loader import DataConfig
from launch.check import check_config
from launch.job import JobConfig
from model import ModelConfig, get_family
from parallel.ac import ActivationCheckpointConfig, apply_ac
from parallel.compile import CompileConfig, apply_compile
from parallel.dims import LaunchEnv
from tests.test_train import FP32, TINY, assert_close, run

# The byte tokenizer's EOS (data/tokenizer.py), so the same tiny model reads the prepared
# short_docs dataset (tests/conftest.py); a vocabulary of 260 splits over tp 2.
EOS, VOCAB, SEQ = 257, 260, 40
CPU = torch.device("cpu")
DOCUMENT = DataConfig(attention_mask="document")
POSITIONS = DataConfig(attention_mask="document", document_positions=True)


def packed_windows() -> torch.Tensor:
    """Two windows of SEQ + 1 tokens, documents of different lengths packed back to back, each
    ending with EOS, the first cut by the window start and the last by its end. The rows have
    different layouts: the masks differ across the batch."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for lengths in ([7, 12, 3, 9, 10], [15, 1, 20, 5]):
        docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
        for doc in docs[:-1]:
            doc[-1] = EOS
        rows.append(torch.cat(docs)[: SEQ + 1])
    return torch.stack(rows)


def build(name: str, impl: str = "sdpa") -> torch.nn.Module:
    """The tiny model of `name`, on the default device, not initialized."""
    family = get_family(name)
    cfg = ModelConfig(name, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB)
    cfg.attention = impl
    return family.build_model(family.build_args(cfg))


def tiny_model(name: str, impl: str = "sdpa") -> torch.nn.Module:
    model = build(name, impl)
    model.init_weights(seed=0, rope_len=SEQ)
    return model


def window_batch(cfg: DataConfig = DOCUMENT) -> MicroBatch:
    window = packed_windows()
    return micro_batch(window[:, :-1], window[:, 1:], cfg, EOS, CPU)


def token_losses(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """(batch, seq) cross-entropy per position, 0 where there is no target."""
    logits = model(batch.inputs, document_ids=batch.document_ids, positions=batch.positions)
    if hasattr(logits, "full_tensor"):  # tp: the vocabulary is split over ranks; gather it
        logits = logits.full_tensor()
    return F.cross_entropy(logits.transpose(1, 2).float(), batch.targets, reduction="none")


def documents_alone(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """The per-token losses of each document of `batch` (document ids and targets) run alone:
    causal, positions from 0, placed where the document sits in the window."""
    out = torch.zeros(batch.inputs.shape)
    for row, ids in enumerate(batch.document_ids):
        for doc in ids.unique():
            where = (ids == doc).nonzero().flatten()
            s, e = int(where[0]), int(where[-1]) + 1
            alone = MicroBatch(batch.inputs[row : row + 1, s:e], batch.targets[row : row + 1, s:e])
            out[row, s:e] = token_losses(model, alone)[0]
    return out


# ---- the rules -------------------------------------------------------------------------------


def test_document_ids_first_token_rule_and_positions() -> None:
    """An EOS belongs to the document it ends; the target at each EOS (the next document's
    first token) is no target; the window's first tokens are a document whose positions start
    at the window start; positions restart after each EOS."""
    window = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, EOS, 4, 3, 2]])
    inputs, targets = window[:, :-1], window[:, 1:]
    assert document_ids(inputs, EOS).tolist() == [[0, 0, 0, 1, 1, 1, 1, 2, 3, 3]]
    batch = micro_batch(inputs, targets, POSITIONS, EOS, CPU)
    assert batch.targets.tolist() == [[6, EOS, -100, 8, 9, EOS, -100, -100, 3, 2]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0, 1]]
    assert micro_batch(inputs, targets, DOCUMENT, EOS, CPU).positions is None
    causal = micro_batch(inputs, targets, DataConfig(), EOS, CPU)
    assert causal.document_ids is None and torch.equal(causal.targets, targets)
    # A window without EOS is one document.
    assert document_positions(document_ids(window[:, 3:6], EOS)).tolist() == [[0, 1, 2]]


def test_explicit_positions() -> None:
    """`positions` indexes the RoPE table per token: explicit 0..seq-1 gives bitwise the
    default logits, restarted positions the same to rounding (RoPE scores depend only on
    relative positions, which document masking keeps within a document), and positions that
    break those relations (all 0) other logits."""
    model = tiny_model("llama3")
    batch = window_batch(POSITIONS)

    def logits(positions: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            return model(batch.inputs, document_ids=batch.document_ids, positions=positions)

    default = logits(None)
    assert torch.equal(logits(torch.arange(SEQ).expand(2, SEQ)), default)
    restarted = logits(batch.positions)
    assert not torch.equal(restarted, default)
    torch.testing.assert_close(restarted, default, rtol=1e-5, atol=1e-5)
    assert (logits(torch.zeros_like(batch.positions)) - default).abs().max() > 1e-4


# ---- compile and activation checkpointing ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("impl", "variants"),
    [
        ("sdpa", [("full", False), ("selective", False), ("op", False), ("op", True)]),
        pytest.param("chunked", [("full", True)], marks=pytest.mark.drill),
    ],
)
def test_checkpointed_and_compiled_blocks_take_the_document_mask(
    impl: str, variants: list[tuple[str, bool]]
) -> None:
    """Each AC mode's wrapper, and blocks compiled with fullgraph=True around it as train.py
    stacks them: the losses and gradients of plain eager blocks, with document ids and
    restarted positions (a graph break would raise). Two compilations (~30 s cold)."""
    batch = window_batch(POSITIONS)

    def losses_and_grads(ac: str, compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model = tiny_model("qwen3", impl)
        units = get_family("qwen3").fsdp_units
        apply_ac(model, units(model), ActivationCheckpointConfig(mode=ac, every=2))
        apply_compile(model, units(model), CompileConfig(enabled=compiled, backend="aot_eager"))
        losses = token_losses(model, batch)
        losses.sum().backward()
        return losses.detach(), [p.grad for p in model.parameters()]

    eager, eager_grads = losses_and_grads("none", compiled=False)
    for ac, compiled in variants:
        got, grads = losses_and_grads(ac, compiled)
        what = f"ac {ac}, compiled {compiled}"
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5, msg=what)
        for g, e in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6, msg=what)


# ---- the trainer -----------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_end_to_end(short_docs: str, tmp_path: Path) -> None:
    """`--data.attention_mask=document` through the real config parser and train(): 1 process
    = FSDP over 2 ranks (fp32, 1e-5; the loss is normalized by the global count of targets
    left), with evaluation, and not the causal losses. A resume that changes the mask is one
    config error."""
    steps = [*FP32, "--train.steps=4", "--train.micro_batch_size=2", "--train.eval_interval=2"]
    document = [*steps, "--data.attention_mask=document", "--data.document_positions=true"]
    single = run(short_docs, tmp_path / "one", 1, 1, [*document, "--checkpoint.interval=4"])
    fsdp = run(short_docs, tmp_path / "two", 2, 1, document)
    causal = run(short_docs, tmp_path / "causal", 1, 1, steps)
    assert single[-1] < single[0]
    assert_close(fsdp, single, rtol=1e-5)
    assert min(abs(a - b) for a, b in zip(single, causal, strict=True)) > 1e-3

    argv = [f"--data.path={short_docs}", f"--run.output_dir={tmp_path / 'one'}", *TINY, *steps]
    job = parse_config(JobConfig, [*argv, "--train.steps=6"])
    with pytest.raises(ConfigError, match="data.attention_mask: 'document' -> 'causal'"):
        check_config(job, LaunchEnv(0, 0, 1, 1, 1))


@pytest.mark.parametrize(
    ("eos_id", "override", "message"),
    [
        (None, "--data.attention_mask=document", "has eos_id null (vocab_size 258)"),
        (258, "--data.attention_mask=document", "has eos_id 258 (vocab_size 258)"),
        (257, "--data.document_positions=true", "needs data.attention_mask='document'"),
        (None, "--data.attention_mask=causal", None),  # no EOS needed: it trains as before
    ],
)
def test_document_masking_config_errors(
    short_docs: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, eos_id, override, message
) -> None:
    """Document masking on a dataset without a usable EOS id, and document positions without
    document masking: one `config error:` line and exit 2, before any process group."""
    data = tmp_path / "data"
    shutil.copytree(short_docs, data)
    index = json.loads((data / "index.json").read_text())
    (data / "index.json").write_text(json.dumps(index | {"eos_id": eos_id}))
    argv = [f"--data.path={data}", f"--run.output_dir={tmp_path}", *TINY, override]
    if message is None:
        assert check_config(parse_config(JobConfig, argv), LaunchEnv(0, 0, 1, 1, 1))
        return
    with caplog.at_level(logging.ERROR, logger="train"):
        assert train.main(argv) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith("config error: data.") and "\n" not in error
    assert message in error, error
