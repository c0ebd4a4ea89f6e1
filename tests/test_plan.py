"""The planner against a real run: the bytes FSDP sends per mesh dimension, the sharded state."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from launch.plan import main
from model import FAMILIES, ModelConfig, count_params, get_family, llama
from parallel.float8 import Float8Config
from parallel.plan import activation_bytes, model_shape, plan_communication, plan_memory
from tests.distributed import run_distributed
from tests.test_families import RUN_SHAPE
from tests.test_moe_trainer import MOE
from tests.test_train import FP8, TINY
from tests.zoo import NAME, call_registered

ZOO = [f"--model.name={NAME}", *RUN_SHAPE[NAME]]

# Ring algorithms: bytes one rank sends for an input of `nbytes` on a group of `size` ranks.
RING = {
    "all_gather": lambda nbytes, size: (size - 1) * nbytes,
    "reduce_scatter": lambda nbytes, size: (size - 1) / size * nbytes,
    "all_reduce": lambda nbytes, size: 2 * (size - 1) / size * nbytes,
    # What leaves the rank when every destination gets an equal part (the mean over ranks).
    "all_to_all": lambda nbytes, size: (size - 1) / size * nbytes,
}
# FSDP2 calls the *_single collectives in torch 2.13, the *_tensor ones in older releases.
SPIED = {
    "all_gather_single": ("all_gather", 1),  # (collective, index of the input argument)
    "all_gather_into_tensor": ("all_gather", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_reduce": ("all_reduce", 0),
    "all_to_all_single": ("all_to_all", 1),
}


def _local_bytes(t: Any) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def instrumented_step(argv: list[str]) -> dict[str, Any]:
    """Train one step with every collective spied on; returns the bytes this rank sent per
    (mesh dim, collective) and its sharded state right after optimizer.step()."""
    import torch.distributed as dist

    import parallel.build
    import train
    from parallel import cp
    from tests.test_train import train_losses

    captured: dict[str, Any] = {}
    sent: dict[tuple[str, str], float] = {}
    build_mesh, build_optimizer = train.build_mesh, train.build_optimizer
    build_expert_mesh = train.build_expert_mesh
    fsdp_meshes = parallel.build.fsdp_meshes

    def dp_mesh_spy(mesh: Any) -> Any:  # FSDP's mesh: with cp, dp_shard x cp made anew
        meshes = fsdp_meshes(mesh)
        captured["dp_mesh"] = meshes[0]
        return meshes

    def mesh_spy(*args: Any) -> Any:
        captured["mesh"] = build_mesh(*args)
        return captured["mesh"]

    def expert_mesh_spy(*args: Any) -> Any:
        captured["expert_mesh"] = build_expert_mesh(*args)
        return captured["expert_mesh"]

    def optimizer_spy(model: Any, *args: Any) -> Any:
        opt = build_optimizer(model, *args)

        def measure(o: Any, *_: Any) -> None:
            params = list(model.parameters())
            captured["state"] = {
                "params": sum(_local_bytes(p) for p in params),
                "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(_local_bytes(v) for s in o.state.values() for v in s.values()),
            }

        opt.register_step_post_hook(measure)
        return opt

    def dim_of(group: Any) -> str:
        # FSDP's own mesh first: under cp it is made anew, with dp_shard x cp as one dim.
        fsdp = captured["dp_mesh"]
        for i, name in enumerate(fsdp.mesh_dim_names or ()):
            if group is not None and group == fsdp.get_group(i):
                return "dp_shard" if name == "dp_shard_cp" else name
        meshes = {"dp_shard": captured["mesh"], "dp_replicate": captured["mesh"]}
        meshes["cp"] = captured["mesh"]
        if "expert_mesh" in captured:  # expert parallel: the experts' own mesh
            expert_mesh = captured["expert_mesh"]
            meshes |= {"expert_shard": expert_mesh, "ep": expert_mesh}
            if group is not None and group == expert_mesh["dp_replicate"].get_group():
                return "dp_replicate"
        for dim, mesh in meshes.items():
            if group is not None and group == mesh[dim].get_group():
                return dim
        return "other"  # the trainer's scalar all-reduces on the default group

    originals = {n: getattr(dist, n) for n in SPIED if hasattr(dist, n)}
    active = [False]  # one public collective may call another: count only the outer one

    def spy(name: str) -> Any:
        collective, input_index = SPIED[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            if not active[0]:
                inp = kwargs.get("input", args[input_index] if len(args) > input_index else None)
                if inp is None:
                    inp = kwargs["tensor"]
                group = kwargs.get("group")
                size = dist.get_world_size(group)
                key = (dim_of(group), collective)
                sent[key] = sent.get(key, 0) + RING[collective](_local_bytes(inp), size)
                if collective == "all_to_all":  # Muon's owners: the largest bucket received
                    out = kwargs.get("output", args[0] if args else None)
                    peak = (key[0], "largest_output")
                    sent[peak] = max(sent.get(peak, 0), _local_bytes(out))
            active[0] = True
            try:
                return originals[name](*args, **kwargs)
            finally:
                active[0] = False

        return call

    train.build_mesh, train.build_optimizer = mesh_spy, optimizer_spy
    train.build_expert_mesh = expert_mesh_spy
    parallel.build.fsdp_meshes = dp_mesh_spy
    for name in originals:
        setattr(dist, name, spy(name))
    # parallel/cp.py picked its collectives (torch 2.13's names or the older ones) at import.
    cp_collectives = {"_all_gather": cp._all_gather, "_reduce_scatter": cp._reduce_scatter}
    for attr, fn in cp_collectives.items():
        setattr(cp, attr, getattr(dist, fn.__name__))
    try:
        train_losses(argv)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        train.build_mesh, train.build_optimizer = build_mesh, build_optimizer
        train.build_expert_mesh = build_expert_mesh
        parallel.build.fsdp_meshes = fsdp_meshes
        for attr, fn in cp_collectives.items():
            setattr(cp, attr, fn)
    return {"sent": sent, "state": captured["state"]}


@pytest.mark.parametrize(
    ("nodes", "options"),
    [
        pytest.param(1, [], id="fsdp-1x4", marks=pytest.mark.slow),
        pytest.param(2, [], id="hsdp-2x2"),
        pytest.param(
            1,
            ["--parallel.reshard_after_forward=always", "--ac.mode=full", "--model.vocab_size=510"],
            id="fsdp-always-ac",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            2,
            ["--parallel.reshard_after_forward=never", "--ac.mode=op"],
            id="hsdp-never-op-ac",
            marks=pytest.mark.slow,
        ),
        # The tiny layers: all converted.
        pytest.param(2, [*FP8, "--fp8.filter=none"], id="hsdp-fp8", marks=pytest.mark.slow),
        # The embedding, blocks 0 and 1 of 3 and the final norm frozen: no reduction for
        # them; backward leaves out blocks 0 and 1, but prefetches (gathers) block 1. With
        # 'always' every block frees after forward.
        pytest.param(
            2,
            [
                "--train.freeze=tok_embeddings.*,layers.[01].*,norm.*",
                "--model.n_layers=3",
                "--parallel.reshard_after_forward=always",
            ],
            id="hsdp-freeze",
            marks=pytest.mark.slow,
        ),
        pytest.param(1, ["--lora.enabled=true"], id="fsdp-lora", marks=pytest.mark.slow),
        # Expert parallel: the experts' own unit over expert_shard (2 ranks), the all-to-alls;
        # on the test family, whose first block is dense: all-to-alls in the MoE block only.
        pytest.param(1, [*ZOO, "--parallel.ep=2"], id="fsdp-ep2-mixed-blocks"),
        pytest.param(
            2,
            [*MOE, "--parallel.ep=2", "--ac.mode=full"],
            id="hsdp-ep2-full-ac",
            marks=pytest.mark.slow,
        ),  # fmt: skip
        # Muon: each bucket of same-shaped matrices to its owners and back, two all-to-alls.
        pytest.param(
            2, ["--optim.name=muon", "--model.n_layers=3"], id="hsdp-muon", marks=pytest.mark.slow
        ),  # fmt: skip
        # Context parallel: FSDP over dp_shard 2 x cp 2, K/V all-gathered in every layer
        # (global batch 4: 2 micro-batches on the 2 dp ranks, as in the other cases).
        pytest.param(
            1,
            ["--parallel.cp=2", "--train.global_batch_size=4"],
            id="fsdp-cp2",
            marks=pytest.mark.slow,
        ),
        # Full AC: the recompute gathers K/V again.
        pytest.param(
            2,
            ["--parallel.cp=2", "--train.global_batch_size=4", "--ac.mode=full"],
            id="hsdp-cp2-full-ac",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_planner_matches_instrumented_collectives(
    tiny_dataset: str, tmp_path: Path, nodes: int, options: list[str], zoo_family: str
) -> None:
    """4 gloo ranks, one optimizer step of 2 micro-batches (bf16 gathers, fp32 reduction):
    bytes per mesh dim within 1% of the planner; sharded state within 10% of its estimate."""
    from configs import parse_config
    from launch.job import JobConfig
    from model import get_family

    argv = [
        f"--data.path={tiny_dataset}",
        f"--run.output_dir={tmp_path}",
        *TINY,
        "--train.steps=1",
        "--train.micro_batch_size=1",  # global batch 8 on 4 ranks: 2 micro-batches each
        *options,
    ]
    if nodes > 1:
        argv.append(f"--parallel.dp_replicate={nodes}")
    if FP8[0] in options:
        pytest.importorskip("torchao", reason="fp8 extra not installed")
    results = run_distributed(partial(call_registered, instrumented_step), 4, argv, nodes=nodes)
    job = parse_config(JobConfig, argv)
    family = get_family(job.model.name)
    shape = model_shape(family, family.build_args(job.model), job.fp8, job.lora, job.train.freeze)
    p = job.parallel
    rep, shard = nodes, 4 // nodes // p.cp
    muon = job.optim.muon.ns_dtype if job.optim.name == "muon" else None
    planned = plan_communication(
        shape, rep, shard, p.param_dtype, p.reduce_dtype,
        reshard_after_forward=p.reshard_after_forward, grad_accum_steps=2,
        tokens=job.data.seq_len, ac_mode=job.ac.mode, ac_every=job.ac.every, ep=p.ep, cp=p.cp,
        muon_dtype=muon,
    )  # fmt: skip
    for dim, collectives in planned.items():
        for collective, expected in collectives.items():
            measured = [r["sent"].get((dim, collective), 0) for r in results]
            if collective == "all_to_all":  # a rank's share follows its routing: the mean
                measured = [sum(measured) / len(measured)]
            for value in measured:
                assert value == pytest.approx(expected, rel=0.01), (dim, collective, results)
    mem = plan_memory(shape, shard, 1, job.data.seq_len, p.param_dtype, ep=p.ep, cp=p.cp,
                      muon_dtype=muon)  # fmt: skip
    if muon is not None:  # received whole, then orthogonalized: twice the largest receipt
        largest = max(r["sent"][("dp_shard", "largest_output")] for r in results)
        assert 2 * largest == pytest.approx(mem["muon_owner"], rel=0.01)
    for result in results:
        for key, measured in result["state"].items():
            assert measured == pytest.approx(mem[key], rel=0.10), (key, result["state"], mem)


@pytest.mark.parametrize("reference", ["copy", "lora"])
def test_planner_counts_the_dpo_references_gathers(tmp_path: Path, reference: str) -> None:
    """DPO on HSDP 2x2, 2 micro-batches of pairs per rank: the reference's forward (the frozen
    copy's every unit, or the LoRA policy's units its forward frees) all-gathers what the dry
    run adds to the policy's, within 1%."""
    from configs import parse_config
    from launch.check import _reference_gathers
    from launch.job import JobConfig
    from tests.test_dpo_data import prepared

    pairs = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
             for i in range(16)]  # fmt: skip
    lora = ["--lora.enabled=true"] if reference == "lora" else []
    argv = [f"--data.path={prepared(tmp_path, pairs)}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.steps=1", "--train.micro_batch_size=1", "--parallel.dp_replicate=2",
            "--dpo.enabled=true", f"--dpo.reference={reference}", *lora]  # fmt: skip
    results = run_distributed(instrumented_step, 4, argv, nodes=2)
    job, p = parse_config(JobConfig, argv), parse_config(JobConfig, argv).parallel
    family = get_family(job.model.name)
    shape = model_shape(family, family.build_args(job.model), job.fp8, job.lora, [])
    plan = SimpleNamespace(dp_shard=2, cp=1, tp=1, ep=1, pp=1, grad_accum_steps=2)
    policy = plan_communication(shape, 2, 2, p.param_dtype, p.reduce_dtype,
                                grad_accum_steps=2)["dp_shard"]["all_gather"]  # fmt: skip
    extra = _reference_gathers(job, plan, shape)  # type: ignore[arg-type]
    assert extra > 0
    for result in results:
        measured = result["sent"][("dp_shard", "all_gather")]
        assert measured == pytest.approx(policy + extra, rel=0.01), (measured, policy, extra)


def test_planner_counts_passes_and_ring_factors() -> None:
    """Closed forms on 8B: FSDP gathers (N-1)/N of the bf16 weights per pass (the root once,
    every block twice but the last); HSDP all-reduces 2(R-1)/R of its fp32 gradient shard."""
    args = llama.FLAVORS["8B"]
    shape = model_shape(llama, args)
    fsdp = plan_communication(shape, 1, 128)
    hsdp = plan_communication(shape, 16, 8)
    root = 2 * args.vocab_size * args.dim + args.dim  # embeddings, output, final norm
    kv = args.n_kv_heads * args.head_dim
    block = 2 * args.dim * (args.dim + kv) + 3 * args.dim * args.ffn_hidden_dim + 2 * args.dim
    passes = root + block * (2 * args.n_layers - 1)
    assert fsdp["dp_shard"]["all_gather"] == pytest.approx(127 / 128 * passes * 2, rel=1e-6)
    assert hsdp["dp_shard"]["all_gather"] == pytest.approx(7 / 8 * passes * 2, rel=1e-6)
    n = root + block * args.n_layers
    assert hsdp["dp_shard"]["reduce_scatter"] == pytest.approx(7 / 8 * n * 4, rel=1e-6)
    assert hsdp["dp_replicate"]["all_reduce"] == pytest.approx(2 * 15 / 16 * n / 8 * 4, rel=1e-6)
    assert fsdp["dp_replicate"]["all_reduce"] == 0
    assert math.isclose(n, 8.03e9, rel_tol=0.01)
    fp8 = plan_communication(model_shape(llama, args, Float8Config(enabled=True)), 16, 8)
    assert fp8["dp_shard"]["all_gather"] < 0.6 * hsdp["dp_shard"]["all_gather"]
    assert fp8["dp_shard"]["reduce_scatter"] == hsdp["dp_shard"]["reduce_scatter"]


def test_activation_estimate_shrinks_with_ac() -> None:
    shape = model_shape(llama, llama.FLAVORS["8B"])
    act = {m: plan_memory(shape, 8, 1, 8192, ac_mode=m, ac_every=2)["activations"] for m in
           ("none", "op", "selective", "full")}  # fmt: skip
    assert act["none"] > act["op"] > act["full"] and act["none"] > act["selective"] > act["full"]


def test_cli_compares_fsdp_and_hsdp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "8B", "--nodes", "16", "--gpus-per-node", "8", "--ac", "full"]) == 0
    out = capsys.readouterr().out
    assert "FSDP 1x128" in out and "HSDP 16x8" in out
    assert "dp_replicate all_reduce" in out and "estimated memory per rank" in out
    assert "faster communication: HSDP 16x8" in out  # gathers stay on the 900 GB/s links
    assert "fits in 80 GB" in out
    assert "recommended: HSDP 16x8" in out  # TP 8 fits too, but moves ~170 GiB per step
    # Loss parallel: 1/8 of the 8192 x 128,256 logits per GPU (1.8 of the 3.8 GB).
    assert "FSDP 1x16 TP8: 3.8 GB fits" in out and "tp all_gather" in out
    assert "tp all_reduce" in out
    main(["--model", "70B", "--nodes", "8", "--gpus-per-node", "8", "--ac", "full"])
    out = capsys.readouterr().out
    assert "HSDP 8x8: 177.5 GB does NOT fit" in out  # the 70B state needs > 1 node of shards
    assert "faster communication: HSDP 8x8" in out
    # TP 8 inside each node: 1/8 of the weights and activations per GPU, its per-layer traffic
    # on NVLink; less time than FSDP over all 64 GPUs, whose gathers cross the 50 GB/s links.
    assert "FSDP 1x8 TP8: 22.4 GB fits" in out and "recommended: FSDP 1x8 TP8" in out
    main(["--model", "70B", "--nodes", "8", "--gpus-per-node", "8", "--ac", "full", "--tp"])
    assert "recommended: FSDP 1x64" in capsys.readouterr().out  # without TP, as before


def test_cli_expert_parallel_for_a_mixture_of_experts(capsys: pytest.CaptureFixture[str]) -> None:
    """The command of launch/plan.py's docstring: Qwen3-30B-A3B on 2 x 8 GPUs. EP 8 inside each
    node keeps FSDP's memory per GPU but gathers 16 of the 128 experts of a block, moving most
    of the traffic into the node's all-to-alls."""
    argv = ["--family", "qwen3_moe", "--model", "30B-A3B", "--nodes", "2", "--ep", "8"]
    assert main([*argv, "--ac", "full"]) == 0
    out = capsys.readouterr().out
    assert "(30.53B parameters, 3.35B active per token)" in out
    assert "FSDP 1x16 EP8" in out and "ep all_to_all" in out and "expert_shard all_gather" in out
    assert "recommended: FSDP 1x16 EP8" in out
    assert "FSDP 1x2 TP8 EP8: " in out  # attention split over the node, the experts too
    main(["--model", "8B", "--nodes", "2", "--ep", "8"])  # a dense family: no EP column
    assert "EP8" not in capsys.readouterr().out


def test_planner_counts_every_family_and_flavor(zoo_family: str) -> None:
    """Every flavor of every registered family (the test family with its dense first block,
    GeLU MLP and shared experts too): the planner's parameters are the model's own; a
    family's block_shapes (optional) hold for its blocks, and the FLOPs per token the planner
    derives from them are the family's own count (the convention of model/__init__.py)."""
    for name, family in FAMILIES.items():
        for flavor, args in family.FLAVORS.items():
            shape = model_shape(family, args)
            with torch.device("meta"):
                model = family.build_model(args)
            assert shape.numel() == count_params(model), (name, flavor)
            assert shape.n_layers == len(family.fsdp_units(model)), (name, flavor)
            if not hasattr(family, "block_shapes"):
                assert shape.missing.startswith("the family gives no block_shapes"), name
                continue
            assert shape.missing == "", (name, flavor, shape.missing)
            flops = family.flops_per_token(model, 4096)
            assert shape.flops_per_token(4096) == flops, (name, flavor)


def test_a_block_mix_is_planned_block_by_block(zoo_family: str) -> None:
    """The test family's debug flavor: 1 dense block (GeLU MLP of 512), 3 MoE blocks (8 SwiGLU
    experts of 64, top 2, a shared expert of 128). Expert parallel's all-to-alls count the 3
    MoE blocks only; the gathered blocks are the two largest; context parallel's K/V every
    block's."""
    family = get_family(zoo_family)
    args = family.FLAVORS["debug"]
    shape = model_shape(family, args)
    d, tokens = args.dim, 1024
    rows = tokens * args.top_k * d * 2  # bf16 rows of one MoE block's dispatch
    ep = plan_communication(shape, 1, 4, tokens=tokens, ep=2)["ep"]["all_to_all"]
    assert ep == 1 / 2 * 3 * (4 * rows + args.n_experts * 8)
    sizes = [u.numel() for u in shape.units[:-1]]
    assert sizes[0] != sizes[1] == sizes[2] == sizes[3]  # the dense block is another size
    # FSDP over 8: every block but the last freed after forward; at most two gathered at once.
    gathered = plan_memory(shape, 8, 1, tokens, "float32")["gathered_params"]
    assert gathered == (shape.units[-1].numel() + 2 * max(sizes)) * 4
    cp = plan_communication(shape, 1, 1, tokens=tokens, cp=2)["cp"]["all_gather"]
    assert cp == 2 * (tokens // 2) * 4 * (args.n_kv_heads * args.head_dim) * 2


@pytest.mark.parametrize("mode", ["none", "op"])
def test_activation_estimate_follows_what_every_familys_blocks_keep(
    zoo_family: str, mode: str
) -> None:
    """What the CPU allocator holds after a forward (fp32, 2 x 32 tokens, 4 blocks: the test
    family's first dense) is the planner's activations plus the logits, within 20% (measured:
    0.85-1.11 for each), for the families the formulas were measured on. The FFN, expert and
    shared-expert terms come from each family's block description."""
    from parallel.ac import ActivationCheckpointConfig, apply_ac
    from tests.test_ac_compile import forward_bytes

    own = {"qwen3": {"ffn_dim": 256}, "qwen3_moe": {"n_experts": 4, "moe_ffn_dim": 64},
           zoo_family: {"n_experts": 4, "ffn_dim": 256, "shared_ffn_dim": 128}}  # fmt: skip
    torch.set_num_threads(1)
    for name in ("llama3", "qwen3", "qwen3_moe", zoo_family):
        family = FAMILIES[name]
        cfg = ModelConfig(name, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128,
                          **own.get(name, {}))  # fmt: skip
        args = family.build_args(cfg)
        torch.manual_seed(0)
        model = family.build_model(args)
        apply_ac(model, family.fsdp_units(model), ActivationCheckpointConfig(mode=mode))
        model.init_weights(seed=0, rope_len=32)
        held = forward_bytes(model, torch.randint(0, 128, (2, 32)))["allocated"]
        kept = activation_bytes(model_shape(family, args), 64, "float32", mode, recompute=False)
        assert kept + 64 * 128 * 4 == pytest.approx(held, rel=0.2), (name, kept, held)


def _undescribed() -> SimpleNamespace:
    """llama3 as a fork might write it: the whole contract but block_shapes."""
    names = ["FLAVORS", "build_args", "build_model", "fsdp_units", "output_layer", "fp8_linears",
             "flops_per_token", "TP_PLAN"]  # fmt: skip
    return SimpleNamespace(**{n: getattr(llama, n) for n in names})


def test_a_family_without_block_shapes_is_planned_and_named_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its parameters, their shards, FSDP's and TP's traffic are the described family's; the
    activations and context parallel's K/V are n/a, said once for the family, and the
    recommendation still comes."""
    monkeypatch.setitem(FAMILIES, "undescribed", _undescribed())
    args = llama.FLAVORS["8B"]
    bare, described = model_shape(FAMILIES["undescribed"], args), model_shape(llama, args)
    assert bare.numel() == described.numel()
    assert bare.missing.startswith("the family gives no block_shapes(args)")
    mem, full = plan_memory(bare, 8, 1, 8192), plan_memory(described, 8, 1, 8192)
    assert math.isnan(mem["activations"]) and math.isnan(bare.flops_per_token(8192))
    assert {k: v for k, v in mem.items() if k != "activations"} == {
        k: v for k, v in full.items() if k != "activations"
    }
    comm = plan_communication(bare, 1, 8, tokens=8192, tp=2, cp=2)
    assert comm["tp"] == plan_communication(described, 1, 8, tokens=8192, tp=2, cp=2)["tp"]
    assert math.isnan(comm["cp"]["all_gather"])
    assert main(["--family", "undescribed", "--model", "8B", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("planner:")]
    assert notes == [f"planner: undescribed: {bare.missing}"]
    assert "n/a" in out and "(without the n/a terms) fits in 80 GB" in out
    assert "recommended: " in out and "FLOPs per token at" not in out


def test_a_description_its_blocks_contradict_is_named_not_used(
    zoo_family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test family described as if its dense block held a SwiGLU (3 matrices, not 2): the
    planner names block 0 and both counts, and leaves the block terms out."""
    from model.blocks import FFNShape

    family = get_family(zoo_family)
    described = family.block_shapes

    def swiglu_everywhere(args: Any) -> list:
        return [replace(b, ffn=FFNShape(b.ffn.hidden)) if b.ffn else b for b in described(args)]

    monkeypatch.setattr(family, "block_shapes", swiglu_everywhere)
    args = family.FLAVORS["debug"]
    shape = model_shape(family, args)
    gelu = 2 * args.dim * args.ffn_dim
    assert shape.blocks is None and shape.missing.startswith("block_shapes(args) gives block 0 ")
    said, held = (f"{n:,}" for n in (described(args)[0].matrix_numel(args.dim) + gelu // 2,
                                     described(args)[0].matrix_numel(args.dim)))  # fmt: skip
    assert f"{said} weights in matrices, the model's block holds {held}:" in shape.missing
    assert math.isnan(plan_memory(shape, 1, 1, 64)["activations"])


def test_dry_run_prints_the_config_then_the_plan_of_any_family(
    zoo_family: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """`train.py --dry-run` (no data): the test family's block mix gets its parameter count
    (the model's own) and FLOPs; a family without block_shapes gets the resolved config, the
    plan with n/a terms and one line saying why."""
    import tomllib

    from configs import parse_config
    from launch.check import check_config, dry_run
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    monkeypatch.setitem(FAMILIES, "undescribed", _undescribed())
    env = LaunchEnv(0, 0, 8, 8, 1)
    for name in (zoo_family, "undescribed"):
        job = parse_config(JobConfig, [f"--model.name={name}", "--dry-run",
                                       f"--run.output_dir={tmp_path}",
                                       "--train.micro_batch_size=1"])  # fmt: skip
        dry_run(job, check_config(job, env), env)
        out = capsys.readouterr().out
        assert tomllib.loads(out)["model"]["name"] == name  # the resolved config, first
        family, args = FAMILIES[name], FAMILIES[name].build_args(job.model)
        with torch.device("meta"):
            model = family.build_model(args)
        assert f"# parameters: {count_params(model):,}, trainable" in out
        notes = [line for line in out.splitlines() if line.startswith("# planner:")]
        if name == zoo_family:
            flops = family.flops_per_token(model, job.data.seq_len)
            assert f"# training FLOPs per token: {flops:,} at seq_len" in out and notes == []
        else:
            assert notes == [f"# planner: {name}: {model_shape(family, args).missing}"]
            assert "n/a" in out and "estimated memory per rank" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--family", "nope"], "argument --family: invalid choice: 'nope' (choose from 'llama3'"),
        (["--model", "9B"], "model.flavor: '9B' is not a llama3 flavor: debug, 1B"),
        (["--nodes", "0"], "argument --nodes: must be > 0, got 0"),
        (["--ac-every", "x"], "argument --ac-every: invalid int value: 'x'"),
        (["--tp", "8", "--bogus"], "unrecognized arguments: --bogus"),
        (["--freeze", "nothing.*"], "train.freeze: 'nothing.*' matches no parameter"),
    ],
    ids=["family", "flavor", "nodes", "int", "option", "freeze"],
)
def test_plan_cli_errors_are_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("config error: ")
    assert says in captured.err and captured.err.count("\n") == 1, captured.err


def test_cli_context_parallel_at_128k_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """8B at 131072 tokens on one node of 8 x 80 GB: each cp degree divides the activations and
    the logits per GPU; only cp 8 fits. Its K/V traffic in closed form: per layer and
    micro-batch, K and V (16384 local tokens x kv_dim 1024, bf16) sent to 7 ranks in forward and
    again in full AC's recompute, their gradients reduce-scattered once; 8 micro-batches keep
    FSDP's global batch."""
    argv = ["--model", "8B", "--seq-len", "131072", "--tp", "--cp", "2", "4", "8", "3"]
    assert main([*argv, "--ac", "full"]) == 0
    out = capsys.readouterr().out
    assert "CP3" not in out  # 2 x 3 does not divide 131072, nor 3 the node's 8 GPUs
    assert "FSDP 1x1 CP8: 56.6 GB fits" in out and "FSDP 1x2 CP4: 93.6 GB does NOT fit" in out
    assert "recommended: FSDP 1x1 CP8" in out and "cp reduce_scatter" in out
    shape = model_shape(llama, llama.FLAVORS["8B"])
    comm = plan_communication(shape, 1, 1, grad_accum_steps=8, tokens=131072, ac_mode="full", cp=8)
    kv = 7 * 16384 * 1024 * 2
    assert comm["cp"]["all_gather"] == 8 * 2 * (32 + 32) * kv
    assert comm["cp"]["reduce_scatter"] == 8 * 2 * 32 * kv
    mem = {cp: plan_memory(shape, 8 // cp, 1, 131072, cp=cp) for cp in (1, 8)}
    assert mem[8]["params"] == mem[1]["params"] and mem[8]["logits"] == mem[1]["logits"] / 8
    assert mem[1]["activations"] / 8 < mem[8]["activations"] < mem[1]["activations"] / 7
    # tp x cp: each pair inside the node; tp 4 x cp 2 splits the heads of half a sequence.
    assert main(["--model", "8B", "--seq-len", "131072", "--tp", "2", "4", "--cp", "2", "4"]) == 0
    out = capsys.readouterr().out
    names = ("FSDP 1x2 TP2 CP2:", "FSDP 1x1 TP2 CP4:", "FSDP 1x1 TP4 CP2:")
    assert all(name in out for name in names) and "TP4 CP4" not in out
    both = plan_communication(shape, 1, 1, grad_accum_steps=8, tokens=131072, tp=4, cp=2)
    assert both["cp"]["all_gather"] == 8 * 2 * 32 * 65536 * 1024 // 4 * 2
