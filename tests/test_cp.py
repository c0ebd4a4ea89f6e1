"""Context parallel (parallel.cp, parallel/cp.py): the split and its inverse, the config errors,
the chunked kernel's offset queries, fp32 losses and gradients at cp 2 and cp 4 (causal and
document-masked with per-document positions, SDPA and the chunked kernel, with and without
activation checkpointing; llama3, and qwen3 at cp 2) equal to one process, float8, compiled
blocks and the MoE family at cp 2, the trainer at cp 2 x dp_shard 2, and a cp 2 checkpoint
resumed on 1 process and on dp_shard 2."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from configs import ConfigError, parse_config
from launch.check import check_config
from launch.job import JobConfig
from model.attention import chunked_causal_attention
from parallel.cp import chunk_spans, split_batch, split_sequence, unsplit_sequence
from parallel.dims import LaunchEnv, ParallelConfig, resolve_dims
from tests.distributed import run_distributed
from tests.test_families import assert_same_run
from tests.test_train import FP32, TINY, assert_close, run, train_losses

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

EOS, VOCAB, SEQ = 257, 260, 32


def env(world: int) -> LaunchEnv:
    return LaunchEnv(rank=0, local_rank=0, world_size=world, local_world_size=world, num_nodes=1)


# ---- the split, no processes -------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_keeps_a_head_and_a_tail_chunk_and_unsplit_inverts_it(cp: int) -> None:
    seq = 2 * cp * 3
    x = torch.arange(2 * seq).view(2, seq)
    parts = [split_sequence(x, r, cp) for r in range(cp)]
    chunk = seq // (2 * cp)
    for r, part in enumerate(parts):
        head, tail = r * chunk, (2 * cp - 1 - r) * chunk
        assert part[0].tolist() == [*range(head, head + chunk), *range(tail, tail + chunk)]
        rows = torch.cat([torch.arange(g, g + n) for _, g, n in chunk_spans(r, cp, 2 * chunk)])
        assert torch.equal(part[0], rows)
    assert torch.equal(unsplit_sequence(torch.cat(parts, dim=1), cp), x)
    # Every rank gets the same causal work: the query-key pairs of its rows.
    work = {sum(int(row) + 1 for row in part[0]) for part in parts}
    assert len(work) == 1


def test_split_batch_keeps_each_tokens_position_and_document() -> None:
    from data.documents import MicroBatch

    inputs = torch.arange(8).view(1, 8)
    batch = split_batch(MicroBatch(inputs, inputs + 1, inputs // 3, None), 1, 2)
    assert batch.inputs.tolist() == [[2, 3, 4, 5]]
    assert batch.targets.tolist() == [[3, 4, 5, 6]]
    assert batch.document_ids.tolist() == [[0, 1, 1, 1]]
    assert batch.positions.tolist() == [[2, 3, 4, 5]]  # rows of the whole window


def test_chunked_kernel_with_offset_equals_the_rows_of_the_whole() -> None:
    """A late chunk of queries against keys up to its end (what each rank computes under cp)
    gives the same output and gradients as those rows of whole-sequence attention."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 8, generator=gen, dtype=torch.float64) for _ in "qkv")
    ids = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7, [0] * 20 + [1] * 4])
    for doc in (None, ids):
        q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
        whole = chunked_causal_attention(q1, k1, v1, doc)[:, :, 16:]
        whole.sum().backward()
        q2, k2, v2 = (t.clone().requires_grad_() for t in (q[:, :, 16:], k, v))
        late = chunked_causal_attention(q2, k2, v2, doc, offset=16)
        late.sum().backward()
        torch.testing.assert_close(late, whole)
        torch.testing.assert_close(q2.grad, q1.grad[:, :, 16:])
        torch.testing.assert_close(k2.grad, k1.grad)
        torch.testing.assert_close(v2.grad, v1.grad)


def check_split_attention(device: str, impl: str, documents: bool, dtype: torch.dtype) -> None:
    """Each of cp 2 ranks' SplitMask attention (its gather faked: the whole K/V, whose gradients
    then sum over the ranks as the reduce-scatter sums them) gives its rows of whole-sequence
    attention, and the ranks' gradients add up to the whole's. On CUDA this is FlexAttention's
    mask_mod over whole-sequence rows (tests/test_gpu.py)."""
    from data.documents import document_ids
    from model.attention import attention, document_mask, split_mask

    cp, seq = 2, 64
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(2, 4, seq, 16), (2, 2, seq, 16), (2, 2, seq, 16), (2, 4, seq, 16)]
    q, k, v, dout = (torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes)
    ids = None
    if documents:
        ids = document_ids(torch.randint(0, 12, (2, seq), generator=gen, device=device), 0)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    whole = attention(q, k, v, document_mask(ids, impl), impl)
    want = [whole, *torch.autograd.grad(whole, leaves, dout)]
    outs, total = [], 0
    for rank in range(cp):
        k_local, v_local = (split_sequence(t, rank, cp, dim=2) for t in (k, v))
        gather = lambda t, kl=k_local: k if t is kl else v  # noqa: E731
        mask = split_mask(chunk_spans(rank, cp, seq // cp), seq, gather, ids, impl, q.device)
        out = attention(split_sequence(q, rank, cp, dim=2), k_local, v_local, mask, impl)
        outs.append(out)
        total = total + (out * split_sequence(dout, rank, cp, dim=2)).sum()
    got = [unsplit_sequence(torch.cat(outs, dim=2), cp, dim=2), *torch.autograd.grad(total, leaves)]
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {}
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, msg=name, **tol)


@pytest.mark.parametrize("impl", ["sdpa", "chunked"])
@pytest.mark.parametrize("documents", [False, True])
def test_split_attention_gives_the_rows_of_whole_attention(impl: str, documents: bool) -> None:
    check_split_attention("cpu", impl, documents, torch.float64)


# ---- config errors, before any process group -------------------------------------------------


def test_cp_fills_the_world_with_dp() -> None:
    assert resolve_dims(ParallelConfig(cp=2), env(4)) == (1, 2)
    assert resolve_dims(ParallelConfig(cp=2, dp_replicate=2, dp_shard=1), env(4)) == (2, 1)
    with pytest.raises(ConfigError, match=r"cp \(3\) must divide the world size \(4"):
        resolve_dims(ParallelConfig(cp=3), env(4))
    with pytest.raises(ConfigError, match=r"x cp \(2\) = 8 does not equal the world size \(4"):
        resolve_dims(ParallelConfig(cp=2, dp_shard=4), env(4))
    with pytest.raises(ConfigError, match="parallel.cp must be >= 1"):
        ParallelConfig(cp=0)


MOE = ["--model.name=qwen3_moe", "--model.flavor=debug"]


@pytest.mark.parametrize(
    ("world", "extra", "message"),
    [
        (3, ["--parallel.cp=3"], r"split data.seq_len \(32\) into 2 x cp = 6 equal chunks"),
        (4, [*MOE, "--parallel.ep=3", "--model.n_experts=6"], r"divide dp_shard x cp=4"),
    ],
)
def test_cp_config_errors(
    tiny_dataset: str, tmp_path: Path, world: int, extra: list[str], message: str
) -> None:
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--parallel.cp=2", *extra]  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        check_config(parse_config(JobConfig, argv), env(world))


@pytest.mark.parametrize(
    "extra", [["--fp8.enabled=true", "--fp8.emulate=true"], ["--compile.enabled=true"]]
)
def test_cp_takes_fp8_and_compile(tiny_dataset: str, tmp_path: Path, extra: list[str]) -> None:
    """float8 and compiled blocks pass the checks at cp 2 (their parity: below)."""
    if "--fp8.enabled=true" in extra:
        pytest.importorskip("torchao", reason="fp8 extra not installed: pip install '.[fp8]'")
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--parallel.cp=2", *extra]  # fmt: skip
    assert check_config(parse_config(JobConfig, argv), env(2)).cp == 2


# ---- fp32 parity on real gloo ranks --------------------------------------------------------------


def packed_windows(rows: int, gen: torch.Generator) -> torch.Tensor:
    """`rows` windows of SEQ + 1 byte tokens, documents of 3-12 tokens each ending with EOS."""
    out = torch.randint(0, 256, (rows, SEQ + 1), generator=gen)
    ends = torch.rand(rows, SEQ + 1, generator=gen) < 0.15
    return out.masked_fill(ends, EOS)


CASES = [
    ("sdpa", "causal", "none"),
    ("chunked", "causal", "none"),
    ("sdpa", "positions", "none"),
    ("chunked", "positions", "none"),
    ("sdpa", "positions", "full"),
]


# The parity model of each family: dim 64, 2 layers, 4 query and 2 key/value heads, and what
# the family needs beyond the shared fields to stay that small.
SHAPES: dict[str, dict] = {"llama3": {}, "qwen3": {"head_dim": 16, "ffn_dim": 128}}


def losses_and_grads(
    dims: tuple[int, int, int], cases: list = CASES, extra: str = "", family: str = "llama3"
) -> dict:
    """For each of `cases` (attention, mask, ac): the summed loss over the global batch and every
    gradient, on a (dp_replicate, dp_shard, cp) mesh in fp32, the loss divided by the global
    target count as train.py does; and the same on one plain model in this process. `extra`:
    'fp8' (emulated float8 Linears on both, the reference on one process too) or 'compile' (the
    split model's blocks compiled, fullgraph, the reference eager). `family`: a key of
    SHAPES."""
    from parallel.runtime import build_mesh, init_distributed

    init_distributed(torch.device("cpu"), LaunchEnv.from_env(), 60)
    mesh = build_mesh(torch.device("cpu"), dims[0], dims[1], cp=dims[2])
    windows = packed_windows(4, torch.Generator().manual_seed(0))
    results = {case: one_case(mesh, windows, *case, extra, family) for case in cases}
    torch.distributed.destroy_process_group()
    return results


def one_case(
    mesh: DeviceMesh, windows: torch.Tensor, impl: str, mask: str, ac: str, extra: str, name: str
) -> dict:
    """One case of `losses_and_grads` on `mesh`."""
    from data.documents import micro_batch
    from data.loader import DataConfig
    from model import ModelConfig, canonical_name, get_family
    from parallel import replace_submodule
    from parallel.ac import ActivationCheckpointConfig, apply_ac
    from parallel.cp import apply_cp
    from parallel.float8 import Float8Config, apply_float8
    from parallel.fsdp import apply_fsdp, assign_local_shard
    from parallel.objective import summed_loss
    from parallel.runtime import dp_mesh, dp_rank_and_size

    dist = torch.distributed
    device = torch.device("cpu")
    dp_rank, dp_size = dp_rank_and_size(mesh)
    cp_rank, cp = mesh["cp"].get_local_rank(), mesh["cp"].size()
    family = get_family(name)
    fp8 = Float8Config(enabled=True, emulate=True, filter="none")
    cfg = ModelConfig(name, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                      **SHAPES[name])  # fmt: skip
    cfg.attention = impl
    args = family.build_args(cfg)
    data = DataConfig(attention_mask="document", document_positions=True)
    if mask == "causal":
        data = DataConfig()
    whole = micro_batch(windows[:, :-1], windows[:, 1:], data, EOS, device)
    # The reference: one plain model, the whole batch.
    ref = family.build_model(args)
    if extra == "fp8":
        apply_float8(ref, fp8, weights_sharded=False)
    ref.init_weights(seed=0, rope_len=SEQ)
    ref_loss = summed_loss(ref, whole) / (whole.targets != -100).sum()
    ref_loss.backward()
    ref_grads = {canonical_name(n): p.grad for n, p in ref.named_parameters()}
    # The split: this dp rank's sequences, this cp rank's chunks of them.
    with torch.device("meta"):
        model = family.build_model(args)
    if extra == "fp8":  # FSDP shards over dp_shard x cp: float8 all-gathers even at dp_shard 1
        apply_float8(model, fp8, weights_sharded=True)
    apply_cp(model, mesh["cp"])
    apply_ac(model, family.fsdp_units(model), ActivationCheckpointConfig(mode=ac))
    if extra == "compile":
        # apply_compile's loop with the aot_eager backend: Dynamo and AOTAutograd, what the
        # SplitMask and the gather meet, without Inductor's code generation (~20 s more per
        # case here; by hand, Inductor on SDPA document-masked gave these gradients within 1e-7).
        for block in family.fsdp_units(model):
            compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
            replace_submodule(model, block, compiled)
    parallel = ParallelConfig(param_dtype="float32")
    apply_fsdp(model, family.fsdp_units(model), dp_mesh(mesh), parallel)
    model.to_empty(device=device)
    model.init_weights(seed=0, rope_len=SEQ, assign=assign_local_shard)
    rows = slice(dp_rank * 4 // dp_size, (dp_rank + 1) * 4 // dp_size)
    mine = split_batch(type(whole)(*(t if t is None else t[rows] for t in whole)), cp_rank, cp)
    local = (mine.targets != -100).sum().float()
    total = local.clone()
    dist.all_reduce(total)
    loss = summed_loss(model, mine) / total
    (loss * dp_size * cp).backward()  # FSDP averages over dp x cp (train.py)
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    grads = {canonical_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    return {"loss": summed.item(), "ref_loss": ref_loss.item(), "grads": grads,
            "ref_grads": ref_grads}  # fmt: skip


def assert_parity(results: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for case, got in results.items():
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=rtol), case
        for name, grad in got["ref_grads"].items():
            msg = f"{case} {name}"
            torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=atol, msg=msg)


def test_cp2_losses_and_gradients_equal_one_process() -> None:
    """cp 2 on 2 ranks: every case of CASES (causal and document-masked with per-document
    positions; SDPA and the chunked kernel; full AC, whose recompute gathers again) gives the
    one-process loss and gradients within 1e-5."""
    assert_parity(run_distributed(losses_and_grads, 2, (1, 1, 2))[0])


@pytest.mark.slow
def test_cp4_losses_and_gradients_equal_one_process() -> None:
    """cp 4 on 4 ranks, each holding two chunks of 4 of the 32 tokens (its K/V gather joins 4
    parts, the reduce-scatter of their gradients sums 4): every case of CASES gives the
    one-process loss and gradients within 1e-5."""
    assert_parity(run_distributed(losses_and_grads, 4, (1, 1, 4))[0])


@pytest.mark.slow
def test_qwen3_at_cp2_losses_and_gradients_equal_one_process() -> None:
    """qwen3, the other dense family (per-head RMSNorm of q and k on each rank's own tokens
    before the gather, tied embeddings), at cp 2: every case of CASES gives the one-process
    loss and gradients within 1e-5. It calls the shared `document_mask` and `attention`, as
    the model contract asks, and needs nothing of cp itself."""
    assert_parity(run_distributed(losses_and_grads, 2, (1, 1, 2), CASES, "", "qwen3")[0])


@pytest.mark.slow
@pytest.mark.parametrize("dims", [(1, 2, 2), (2, 1, 2)], ids=["dp_shard2-cp2", "hsdp2-cp2"])
def test_cp2_with_dp_losses_and_gradients_equal_one_process(dims: tuple[int, int, int]) -> None:
    """dp_shard 2 x cp 2 and HSDP 2 x cp 2 (4 ranks): FSDP spans dp_shard x cp (and the
    replicas), each dp rank its own sequences."""
    assert_parity(run_distributed(losses_and_grads, 4, dims, nodes=dims[0])[0])


# ---- the trainer ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_at_cp2_dp2_and_resume_across_cp(short_docs: str, tmp_path: Path) -> None:
    """The trainer on cp 2 x dp_shard 2 (4 ranks, document-masked, per-document positions, the
    chunked kernel, full AC) gives the 1-process losses; its step-2 checkpoint resumes on 1
    process and on cp 1 x dp_shard 2 with the straight run's losses (keys and data position do
    not depend on cp)."""
    base = [*FP32, "--model.vocab_size=260", "--train.micro_batch_size=2", "--train.steps=4",
            "--data.attention_mask=document", "--data.document_positions=true",
            "--model.attention=chunked", "--checkpoint.interval=2",
            "--checkpoint.keep_last=0", "--train.eval_interval=4", "--ac.mode=full"]  # fmt: skip
    single = run(short_docs, tmp_path, 1, 1, [*base, "--run.name=one"])
    split = run(short_docs, tmp_path, 4, 1, [*base, "--parallel.cp=2", "--run.name=cp"])
    assert_close(split, single, rtol=1e-5)
    saved = tmp_path / "cp" / "checkpoints" / "step-2"
    for world, name in [(1, "on1"), (2, "ondp2")]:
        resumed = run(short_docs, tmp_path, world, 1,
                      [*base, f"--run.name={name}", f"--checkpoint.resume={saved}"])  # fmt: skip
        assert_close(resumed, single[2:], rtol=1e-5)


@pytest.mark.slow
def test_trainer_at_cp2_on_a_mixture_with_fine_tuning_examples(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Mixtures and fine-tuning examples are decided before the split, and LoRA changes no
    attention: LoRA at cp 2 on a mixture of text and prompt/response examples (whose prompts
    are no target) gives the 1-process losses."""
    from data.prepare import prepare
    from tests.test_sft import additions, write_jsonl

    jsonl = write_jsonl(tmp_path / "sums.jsonl", additions(300))
    sums = prepare([jsonl], tmp_path / "sums", val_fraction=0.2, format="prompt_response")
    mix = [f"--data.sources.text.path={tiny_dataset}", "--data.sources.text.weight=0.5",
           f"--data.sources.sums.path={sums}", "--data.sources.sums.weight=0.5"]  # fmt: skip
    base = [*FP32, *mix, "--model.vocab_size=260", "--train.micro_batch_size=4",
            "--train.steps=3", "--data.attention_mask=document", "--lora.enabled=true",
            "--optim.lr=3e-2"]  # fmt: skip
    argv = [f"--run.output_dir={tmp_path}", *TINY, *base]
    single = run_distributed(train_losses, 1, [*argv, "--run.name=one"])[0]
    split = run_distributed(train_losses, 2, [*argv, "--run.name=cp", "--parallel.cp=2"])[0]
    assert_close(split, single, rtol=1e-5)


# ---- compositions: float8 and compiled blocks ------------------------------------------------


@pytest.mark.slow
def test_cp2_fp8_equals_fp8_on_one_process() -> None:
    """Emulated float8 Linears at cp 2 (the chunked kernel, causal; SDPA, document-masked, full
    AC) against float8 on one process. Not bitwise: tensorwise scaling takes each input's amax
    over the tokens a rank holds, as on data-parallel ranks, so the casts round differently.
    Losses within 1e-3, tests/test_float8.py's tolerance between meshes (measured 2e-5); all
    gradients together within 3% in norm (measured 0.9-1.4%; float8 itself moves them 0.8-1.3%
    from fp32 here, and single small tensors such as wq's by 10%, so no per-tensor bound is
    tight; a rank's gradients left out or counted twice would move them by 50% or more)."""
    pytest.importorskip("torchao", reason="fp8 extra not installed: pip install '.[fp8]'")
    results = run_distributed(losses_and_grads, 2, (1, 1, 2), [CASES[1], CASES[-1]], "fp8")[0]
    for case, got in results.items():
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-3), case
        names = list(got["ref_grads"])
        want = torch.cat([got["ref_grads"][n].flatten() for n in names])
        grads = torch.cat([got["grads"][n].flatten() for n in names])
        error = (grads - want).norm() / want.norm()
        assert error < 0.03, f"{case}: {error:.4f}"


@pytest.mark.slow
def test_cp2_compiled_blocks_equal_eager_on_one_process() -> None:
    """Compiled blocks (fullgraph) at cp 2 give the eager one-process loss and gradients within
    1e-5: the chunked kernel, document-masked with per-document positions, under full AC (the
    recompute gathers again, inside the compiled block); one case, as each recompiles. Dynamo
    traces the SplitMask (a frozen dataclass: its tensors become graph inputs, its spans
    constants) and the gather's autograd.Function, whose gloo collectives it turns into
    functional ones: no graph break, no custom op needed."""
    case = ("chunked", "positions", "full")
    assert_parity(run_distributed(losses_and_grads, 2, (1, 1, 2), [case], "compile")[0])


@pytest.mark.slow
def test_moe_at_cp2_tp2_equals_one_process(tiny_dataset: str, tmp_path: Path) -> None:
    """qwen3_moe at cp 2 x tp 2 (4 ranks; both aux losses on, coefficients raised so they move
    the weights; document-masked with per-document positions) gives the 1-process losses, grad
    norms, aux losses and expert loads within 1e-5 over 6 steps. MoE: each rank's load-balance
    and z-loss terms are its part of its sequences' terms, the tokens per expert summed over the
    split (model/moe.py; with the counts left per rank the losses differ by 2e-4). tp: FSDP's
    dp_shard x cp mesh and the tp mesh share one root (parallel/runtime.py), and sequence
    parallel shards each cp rank's part again."""
    from tests.test_moe_trainer import train

    masked = ["--data.attention_mask=document", "--data.document_positions=true"]
    one = train(tiny_dataset, tmp_path, "one", 1, *masked)
    split = train(tiny_dataset, tmp_path, "cp", 4, *masked, "--parallel.cp=2", "--parallel.tp=2")
    assert_same_run(split, one)
    assert_close(split["expert_load/max_over_mean"], one["expert_load/max_over_mean"], rtol=1e-5)


@pytest.mark.slow
def test_moe_with_ep2_at_cp2_equals_one_process(tiny_dataset: str, tmp_path: Path) -> None:
    """qwen3_moe with expert parallel 2 at cp 2 (2 ranks: the EP group is the cp pair, each
    rank sending its part of the sequences' tokens to the other's experts) gives the 1-process
    losses, grad norms, aux losses and expert loads within 1e-5."""
    from tests.test_moe_trainer import train

    one = train(tiny_dataset, tmp_path, "one", 1)
    split = train(tiny_dataset, tmp_path, "cp", 2, "--parallel.cp=2", "--parallel.ep=2")
    assert_same_run(split, one)
    assert_close(split["expert_load/max_over_mean"], one["expert_load/max_over_mean"], rtol=1e-5)
