"""The chunked loss (`train.loss_chunk_tokens`, parallel/loss.py): the unchunked loss and
gradients in fp32, on one process for every family and through the trainer on FSDP and cp;
its config errors; the planner's count."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from configs import ConfigError
from data.documents import MicroBatch
from model import FAMILIES, ModelConfig, llama, output_layer
from parallel.loss import ChunkedLoss
from parallel.objective import cross_entropy_sum, summed_loss
from tests import zoo
from tests.test_train import FP32, assert_close, run


def _loss_and_grads(model: torch.nn.Module, batch: MicroBatch, loss_fn) -> tuple:
    model.zero_grad(set_to_none=True)
    # The mean per target, as train_step normalizes it: gradients of order 1 (a sum's grow
    # with the token count, and fp32 rounding with them).
    loss = summed_loss(model, batch, loss_fn) / (batch.targets != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# Every registered family and the test family (tests/zoo.py: soft-capped logits, a dense first
# block then MoE ones), and one with tied embeddings (the output projection is the embedding).
CHUNKED = [(name, {}) for name in [*FAMILIES, zoo.NAME]] + [("llama3", {"tie_embeddings": True})]


@pytest.mark.parametrize(
    ("name", "overrides"), CHUNKED, ids=[n + ("-tied" if o else "") for n, o in CHUNKED]
)
def test_chunked_loss_equals_whole_loss_and_gradients(
    name: str, overrides: dict, zoo_family: str
) -> None:
    """Chunks of 7 tokens (not dividing the batch's 2 x 24, so the last is short) across the
    batch's sequences, some targets ignored: the loss and every parameter's gradient equal the
    unchunked ones within 1e-6 (fp32), and so does the no_grad (validation) loss."""
    family = FAMILIES[name]
    small = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}
    args = family.build_args(ModelConfig(name=name, flavor="debug", **small, **overrides))
    torch.manual_seed(0)
    model = family.build_model(args)
    model.init_weights(seed=0, rope_len=24)
    if output_layer(family, model) is None:  # optional: the family refuses loss_chunk_tokens
        pytest.skip(f"{name} has no output_layer(model)")
    tokens = torch.randint(0, args.vocab_size, (2, 25))
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100  # a prompt's targets, as fine-tuning masks them
    batch = MicroBatch(tokens[:, :-1], targets)
    chunked = ChunkedLoss(output_layer(family, model), 7, cross_entropy_sum)
    whole_loss, whole_grads = _loss_and_grads(model, batch, cross_entropy_sum)
    chunk_loss, chunk_grads = _loss_and_grads(model, batch, chunked)
    torch.testing.assert_close(chunk_loss, whole_loss, rtol=1e-6, atol=1e-6)
    assert chunk_grads.keys() == whole_grads.keys()
    for n, grad in whole_grads.items():
        torch.testing.assert_close(chunk_grads[n], grad, rtol=1e-6, atol=1e-6, msg=n)
    with torch.no_grad():
        val_loss = summed_loss(model, batch, chunked) / (targets != -100).sum()
    torch.testing.assert_close(val_loss, whole_loss, rtol=1e-6, atol=1e-6)


def test_chunks_recompute_the_logits_in_backward() -> None:
    """What forward keeps for backward is the hidden states, never a (tokens x vocab) tensor:
    the logits of a chunk exist only while its loss, or its recompute in backward, runs."""
    output = torch.nn.Linear(16, 1000, bias=False)
    hidden = torch.randn(1, 64, 16, requires_grad=True)
    targets = torch.randint(0, 1000, (1, 64))
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    # Outside the checkpoints only: inside, checkpoint's own hooks take precedence.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy_sum(output(hidden), targets)  # the control: whole logits are saved
        assert max(s.numel() for s in saved) >= 64 * 1000
        saved.clear()
        loss = ChunkedLoss(output, 16, cross_entropy_sum)(hidden, targets)
    assert saved == [] or max(s.numel() for s in saved) < 16 * 1000
    loss.backward()
    assert hidden.grad is not None and output.weight.grad is not None


class CappedAfterTheOutput(llama.Transformer):
    """Llama with soft-capping done in forward, after the output layer: what the contract
    forbids (model/__init__.py, the output path), since the chunked loss would skip it."""

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = super().forward(tokens, **kwargs)
        return out if kwargs.get("hidden_only") else 30 * torch.tanh(out / 30)


def test_a_forward_that_changes_the_logits_after_the_output_layer_is_refused_with_chunking(
    tiny_dataset: str, monkeypatch: pytest.MonkeyPatch, zoo_family: str, tmp_path: Path
) -> None:
    """The chunked loss of such a model silently differs from its loss (the cap skipped): with
    train.loss_chunk_tokens, check_config refuses it in one line, from the model on meta;
    unchunked, it trains. The test family, which caps inside its output layer, passes."""
    from configs import parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv
    from tests.test_train import TINY

    names = ["FLAVORS", "build_args", "fsdp_units", "output_layer", "fp8_linears",
             "flops_per_token", "TP_PLAN", "block_shapes"]  # fmt: skip
    capped = SimpleNamespace(build_model=CappedAfterTheOutput,
                             **{n: getattr(llama, n) for n in names})  # fmt: skip
    monkeypatch.setitem(FAMILIES, "capped", capped)
    args = capped.build_args(ModelConfig("capped", dim=64, n_layers=1, n_heads=4, n_kv_heads=4))
    model = capped.build_model(args)
    model.init_weights(seed=0, rope_len=24)
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    chunked = ChunkedLoss(output_layer(capped, model), 7, cross_entropy_sum)
    whole = summed_loss(model, MicroBatch(tokens, tokens), cross_entropy_sum)
    assert (summed_loss(model, MicroBatch(tokens, tokens), chunked) - whole).abs() > 1e-2

    base = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.micro_batch_size=4"]  # fmt: skip
    env = LaunchEnv(0, 0, 1, 1, 1)
    check_config(parse_config(JobConfig, [*base, "--model.name=capped"]), env)
    argv = [*base, "--model.name=capped", "--train.loss_chunk_tokens=16"]
    with pytest.raises(ConfigError, match="forward changes the logits after output_layer") as err:
        check_config(parse_config(JobConfig, argv), env)
    assert "\n" not in str(err.value)
    zoo_argv = [*base, f"--model.name={zoo_family}", "--train.loss_chunk_tokens=16"]
    check_config(parse_config(JobConfig, zoo_argv), env)


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (["--parallel.reshard_after_forward=always"], 2, r"'always': the chunked loss uses"),
        (["--train.loss_chunk_tokens=-1"], 1, r"loss_chunk_tokens must be >= 0"),
    ],
    ids=["reshard-always", "negative"],
)
def test_chunked_loss_config_errors(
    tiny_dataset: str, tmp_path: Path, extra: list[str], world: int, message: str
) -> None:
    from configs import parse_config
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv
    from tests.test_train import TINY

    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.loss_chunk_tokens=16",
            "--train.micro_batch_size=4", *extra]  # fmt: skip
    with pytest.raises(ConfigError, match=message) as err:
        check_config(parse_config(JobConfig, argv), LaunchEnv(0, 0, world, world, 1))
    assert "\n" not in str(err.value)


def test_planner_counts_one_chunk_of_logits() -> None:
    """Llama 3 8B at seq 8,192 on 8 ranks: the logits term holds 4,096 tokens' worth when
    chunked by 4,096, and a chunk larger than the micro-batch changes nothing."""
    from model import llama
    from parallel.plan import model_shape, plan_memory

    shape = model_shape(llama, llama.build_args(ModelConfig(flavor="8B")))
    whole = plan_memory(shape, 8, 1, 8192, ac_mode="full")["logits"]
    chunked = plan_memory(shape, 8, 1, 8192, ac_mode="full", loss_chunk_tokens=4096)["logits"]
    larger = plan_memory(shape, 8, 1, 8192, ac_mode="full", loss_chunk_tokens=10**6)["logits"]
    assert whole == 8192 * 128_256 * (2 + 12)  # bf16 logits, eager loss's float32 temporaries
    assert chunked == whole / 2 and larger == whole


def losses_and_val_losses(argv: list[str]) -> list[float]:
    """A rank's training losses, then the validation losses it computed (train.evaluate)."""
    import train as trainer
    from tests.test_train import train_losses

    seen, evaluate = [], trainer.evaluate

    def recorded(*args, **kwargs) -> tuple[float, torch.Tensor]:
        loss, stats = evaluate(*args, **kwargs)
        seen.append(loss)
        return loss, stats

    trainer.evaluate = recorded  # validate() looks it up by name
    return train_losses(argv) + seen


# The quick tier has the one-process parity above; the trainer's runs are slow (CI's budget).
# HSDP adds only the replicas' all-reduce, which the chunks do not touch: FSDP stands for both.
@pytest.mark.slow
def test_fsdp_chunked_loss_equals_unchunked(tiny_dataset: str, tmp_path: Path) -> None:
    """FSDP 1x2 with tied embeddings, loss in chunks of 48 tokens (micro-batches of 2 x 32: 2
    chunks, the last short; two micro-batches per step, whose chunks' gradients accumulate
    unreduced until the last): the output projection runs outside the root unit's forward, on
    its gathered weight (also the embedding's: two uses of one gathered parameter, one
    reduction), and its gradient is reduce-scattered with the root's: the losses of 3 steps
    (each step's update follows the gradients) and the validation loss after them (chunks
    under no_grad) equal the unchunked run's on the same mesh."""
    from tests.distributed import run_distributed
    from tests.test_train import TINY

    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY, *FP32,
            "--train.steps=3", "--train.micro_batch_size=2", "--train.eval_interval=3",
            "--train.eval_batches=1", "--model.tie_embeddings=true"]  # fmt: skip
    whole = run_distributed(losses_and_val_losses, 2, argv)[0]
    chunked = run_distributed(losses_and_val_losses, 2, [*argv, "--train.loss_chunk_tokens=48"])[0]
    assert len(whole) == 4 and whole[0] != whole[2]  # 3 steps moved the loss, 1 validation
    assert_close(chunked, whole, rtol=1e-6)


@pytest.mark.slow
def test_context_parallel_chunked_loss_equals_unchunked(tiny_dataset: str, tmp_path: Path) -> None:
    """cp 2: each rank chunks its own part of each sequence (its head and tail chunks, in one
    row); the loss is a sum over tokens, so the split does not matter."""
    steps = FP32 + ["--train.steps=3", "--train.micro_batch_size=4", "--parallel.cp=2"]
    whole = run(tiny_dataset, tmp_path, 2, 1, steps)
    chunked = run(tiny_dataset, tmp_path, 2, 1, steps + ["--train.loss_chunk_tokens=40"])
    assert_close(chunked, whole, rtol=1e-6)


@pytest.mark.slow
def test_tensor_parallel_chunked_loss_equals_unchunked(tiny_dataset: str, tmp_path: Path) -> None:
    """tp 2 (loss parallel): the final norm's sequence shards are gathered once, and each chunk
    of 24 tokens (micro-batches of 2 x 32: 3 chunks, the last short) goes through the
    vocabulary-split projection and loss parallel's cross-entropy, forward and recompute; the
    losses of 3 steps equal the unchunked tp 2 run's."""
    steps = FP32 + ["--train.steps=3", "--train.micro_batch_size=2", "--parallel.tp=2"]
    whole = run(tiny_dataset, tmp_path, 2, 1, steps)
    chunked = run(tiny_dataset, tmp_path, 2, 1, steps + ["--train.loss_chunk_tokens=24"])
    assert_close(chunked, whole, rtol=1e-6)


@pytest.mark.slow
def test_chunked_loss_composes_with_the_compiled_loss() -> None:
    """compile.loss: each chunk's cross-entropy is the compiled function (compiled for a full
    and then a short chunk; by Dynamo and AOTAutograd, the kernels are test_ac_compile's),
    inside the checkpoint and again in its recompute; loss and gradients equal the eager
    unchunked ones."""
    from parallel.compile import CompileConfig, compile_loss

    torch.manual_seed(0)
    output = torch.nn.Linear(32, 512, bias=False)
    hidden = torch.randn(2, 24, 32, requires_grad=True)
    targets = torch.randint(0, 512, (2, 24))
    targets[0, :3] = -100

    def loss_and_grads(fn) -> list[torch.Tensor]:
        hidden.grad = output.weight.grad = None
        loss = fn(hidden, targets) / (targets != -100).sum()
        loss.backward()
        return [loss.detach(), hidden.grad, output.weight.grad]

    whole = loss_and_grads(lambda h, t: cross_entropy_sum(output(h), t))
    compiled = compile_loss(cross_entropy_sum, CompileConfig(enabled=True, backend="aot_eager"))
    for _ in range(2):  # the second call reuses the compiled code
        chunked = loss_and_grads(ChunkedLoss(output, 10, compiled))
        for got, want in zip(chunked, whole, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
