"""Activation checkpointing and per-block torch.compile: same math, less activation memory,
same checkpoint keys."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from model import llama
from model.llama import FLAVORS, Transformer
from parallel.ac import ActivationCheckpointConfig, apply_ac
from parallel.compile import CompileConfig, apply_compile, compile_loss
from parallel.plan import activation_bytes, model_shape
from tests.test_train import FP32, assert_close, run

ARGS = replace(FLAVORS["debug"], dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128)
MODES = {
    "none": ActivationCheckpointConfig(),
    "full": ActivationCheckpointConfig(mode="full"),
    "selective": ActivationCheckpointConfig(mode="selective", every=2),
    "op": ActivationCheckpointConfig(mode="op"),
}


def build(ac: ActivationCheckpointConfig, compile_blocks: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    apply_ac(model, llama.fsdp_units(model), ac)
    apply_compile(model, llama.fsdp_units(model), CompileConfig(enabled=compile_blocks))
    model.init_weights(seed=0, rope_len=32)
    return model


def forward_bytes(model: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    """Two measures of what one forward keeps for backward, both deterministic on CPU.

    `saved`: bytes of the distinct storages autograd saves through `saved_tensors_hooks`
    (parameters excluded). Hooks inside a checkpointed region belong to checkpoint itself, so
    this misses what checkpoint keeps (block inputs, op-level AC's cached matmul outputs).
    `allocated`: net bytes the CPU allocator holds after forward (profiler memory events):
    everything alive for backward, the logits included.
    """
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).sum()
    del loss
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:  # fmt: skip
        loss = model(tokens).sum()
    allocated = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    return {"saved": sum(seen.values()), "allocated": allocated}


def test_ac_lowers_activation_memory_and_keeps_gradients() -> None:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32))
    measured, grads = {}, {}
    for name, cfg in MODES.items():
        model = build(cfg)
        measured[name] = forward_bytes(model, tokens)
        grads[name] = [p.grad for p in model.parameters()]
    alloc = {k: v["allocated"] for k, v in measured.items()}
    saved = {k: v["saved"] for k, v in measured.items()}
    assert alloc["none"] > alloc["selective"] > alloc["full"]
    assert alloc["none"] > alloc["op"] > alloc["full"]
    assert saved["none"] > saved["selective"] > saved["full"]
    assert alloc["full"] < 0.2 * alloc["none"]
    # Recompute replays the same fp32 ops: gradients are bitwise those of no AC.
    for name in MODES:
        for a, b in zip(grads[name], grads["none"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The planner's estimate of what forward keeps (logits added) is within 25% of the
    # allocator's count (measured: 2-15%).
    logits = 2 * 32 * ARGS.vocab_size * 4
    for name, cfg in MODES.items():
        kept = activation_bytes(
            model_shape(llama, ARGS), 2 * 32, "float32", cfg.mode, cfg.every, recompute=False
        )
        estimate = kept + logits
        assert estimate == pytest.approx(alloc[name], rel=0.25), (name, estimate, alloc)


def test_checkpoint_keys_and_init_unchanged_by_ac_and_compile() -> None:
    """Parameter names gain wrapper segments; DCP's state dicts (what checkpoints store) and the
    initial weights (seeded by name) do not see them."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    def keys_and_values(model: nn.Module) -> tuple[list[str], list[str], list[torch.Tensor]]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        msd = get_model_state_dict(model)
        osd = get_optimizer_state_dict(model, opt)
        return sorted(msd), sorted(osd["state"]), [msd[k] for k in sorted(msd)]

    reference = keys_and_values(build(MODES["none"]))
    assert reference[0] == sorted(Transformer(ARGS).state_dict())
    variants = {name: build(cfg) for name, cfg in MODES.items()}
    variants["compile+full"] = build(MODES["full"], compile_blocks=True)
    names = [n for n, _ in variants["compile+full"].named_parameters()]
    assert "layers.0._orig_mod._checkpoint_wrapped_module.attention.wq.weight" in names
    for name, model in variants.items():
        keys, opt_keys, values = keys_and_values(model)
        assert keys == reference[0] and opt_keys == reference[1], name
        for a, b in zip(values, reference[2], strict=True):
            assert torch.equal(a, b), name


@pytest.mark.slow
def test_ac_losses_match_eager_on_fsdp(tiny_dataset: str, tmp_path: Path) -> None:
    """2 FSDP ranks, fp32: every AC mode gives the losses of the run without AC."""
    steps = ["--train.steps=3", "--train.micro_batch_size=2", "--model.n_layers=3"]
    eager = run(tiny_dataset, tmp_path, 2, 1, FP32 + steps)
    for options in (
        ["--ac.mode=full"],
        ["--ac.mode=selective", "--ac.every=2"],
        ["--ac.mode=op"],
    ):
        assert_close(run(tiny_dataset, tmp_path, 2, 1, FP32 + steps + options), eager, rtol=1e-6)


@pytest.mark.slow
def test_compiled_blocks_match_eager(tiny_dataset: str, tmp_path: Path) -> None:
    """One rank, fp32, two steps with compiled (and checkpointed) blocks: Inductor fuses and
    reorders float ops, so the tolerance is 1e-4, not bitwise."""
    steps = ["--train.steps=2", "--train.micro_batch_size=8"]
    eager = run(tiny_dataset, tmp_path, 1, 1, FP32 + steps)
    compiled = run(
        tiny_dataset, tmp_path, 1, 1, FP32 + steps + ["--compile.enabled=true", "--ac.mode=full"]
    )
    assert_close(compiled, eager, rtol=1e-4)


def test_ac_and_compile_find_blocks_through_the_contract_not_by_attribute() -> None:
    """Blocks in a ModuleList under another name (not llama's `layers` ModuleDict): AC wraps
    and compile replaces exactly the blocks it is given, and the model computes the same."""

    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x)

    toy = Toy()
    x = torch.randn(4, 8)
    expected = toy(x)
    apply_ac(toy, list(toy.blocks), ActivationCheckpointConfig(mode="selective", every=2))
    assert [type(b).__name__ for b in toy.blocks] == [
        "CheckpointWrapper",
        "Linear",
        "CheckpointWrapper",
    ]
    # aot_eager: which modules are compiled is the point here, Inductor's kernels are above.
    apply_compile(toy, list(toy.blocks), CompileConfig(enabled=True, backend="aot_eager"))
    assert all(type(b).__name__ == "OptimizedModule" for b in toy.blocks)
    assert type(toy.head).__name__ == "Linear"
    torch.testing.assert_close(toy(x), expected)


def test_compiled_loss_equals_eager_in_value_and_gradient() -> None:
    """bf16 logits: the compiled loss (upcast, log-softmax and NLL fused) gives the eager
    loss and the same gradient, in the logits' dtype."""
    from train import cross_entropy_sum

    compiled = compile_loss(cross_entropy_sum, CompileConfig(enabled=True))
    assert compiled is not cross_entropy_sum
    assert compile_loss(cross_entropy_sum, CompileConfig(enabled=True, loss=False)) is (
        cross_entropy_sum
    )
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 16, 300, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 300, (2, 16), generator=gen)
    results = []
    for fn in (cross_entropy_sum, compiled):
        x = logits.clone().requires_grad_()
        loss = fn(x, targets)
        loss.backward()
        results.append((loss.detach(), x.grad))
    (eager, eager_grad), (fused, fused_grad) = results
    assert fused.dtype == torch.float32 and fused_grad.dtype == torch.bfloat16
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=0)
    torch.testing.assert_close(fused_grad.float(), eager_grad.float(), rtol=0, atol=2e-3)
