"""The torch bugs parallel/workarounds.py works around, reproduced without their workaround.

Each test asserts that its bug is still there, and that the workaround gives eager's gradients.
Once a torch release fixes a bug, its test fails saying which workaround to remove (on a torch
older than 2.13, where the bugs were seen, it is skipped with that message instead: the
workaround stays while 2.13 is supported).

Workarounds 1 and 2: 2 gloo ranks, tp 2, a one-block Llama of dim 32; blocks are compiled with
the `aot_eager` backend: both bugs are in AOTAutograd, which it runs without Inductor's code
generation. tests/test_tp.py checks the trainer's own path, with Inductor. Workaround 3: one
Linear on 2 gloo ranks (tests/test_moe_trainer.py checks the trainer's HSDP with EP).
Workaround 4: the tiny qwen3_moe at ep 2 on 2 gloo ranks, built as the trainer builds it.
Workaround 5: a one-rank DeviceMesh pickled (tests/test_graph_fsdp.py checks the restart).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.distributed import run_distributed

Outcome = dict[str, torch.Tensor | None] | str  # gradients by parameter name, or the error


def _outcome(build: Callable[[], torch.nn.Module]) -> Outcome:
    """One forward and backward of the trainer's loss (loss parallel) on a fixed batch."""
    from data.documents import MicroBatch
    from model import canonical_name
    from parallel.objective import summed_loss
    from parallel.tp import loss_context

    torch._dynamo.reset()  # each case compiles anew
    try:
        model = build()
        tokens = torch.arange(16).view(2, 8)
        with loss_context(2):
            summed_loss(model, MicroBatch(tokens, tokens.roll(-1, dims=1))).backward()
    except Exception as err:  # noqa: BLE001 - the bug may be an error; which one may change
        text = str(err)  # the start and the end (where a type list names DeviceMesh)
        return f"{type(err).__name__}: {text[:150]} ... {text[-150:]}"
    return {
        canonical_name(n): None if p.grad is None else p.grad.full_tensor()
        for n, p in model.named_parameters()
    }


def tp_compile_cases() -> dict[str, Outcome]:
    """Each case on a fresh copy of the same model, eager first and the bugs last (an error in
    a collective's backward may leave it unwaited)."""
    from model import ModelConfig, get_family
    from parallel import replace_submodule
    from parallel.ac import ActivationCheckpointConfig, apply_ac
    from parallel.dims import LaunchEnv
    from parallel.runtime import build_mesh, init_distributed
    from parallel.tp import apply_tp
    from parallel.workarounds import tp_compile_workarounds

    init_distributed(torch.device("cpu"), LaunchEnv.from_env(), 60)
    tp_mesh = build_mesh(torch.device("cpu"), 1, 1, 2)["tp"]
    family = get_family("llama3")
    args = family.build_args(
        ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=16)
    )

    def build(copy: bool, ac: str = "none", compile_first: bool = False) -> Callable:
        """The tp 2 model, its blocks compiled; `copy`: workaround 1 (the embedding output
        copy); `compile_first`: workaround 2's order (compile, then AC), else AC, then compile."""

        def make() -> torch.nn.Module:
            model = eager()
            if copy:
                tp_compile_workarounds(model, family, 2, True, ac)
            if not compile_first:
                apply_ac(model, family.fsdp_units(model), ActivationCheckpointConfig(mode=ac))
            for block in family.fsdp_units(model):
                compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
                replace_submodule(model, block, compiled)
            if compile_first:
                apply_ac(model, family.fsdp_units(model), ActivationCheckpointConfig(mode=ac))
            return model

        return make

    def eager() -> torch.nn.Module:
        model = family.build_model(args)
        model.init_weights(seed=0, rope_len=8)
        apply_tp(model, family, tp_mesh)
        return model

    cases = {
        "eager": _outcome(eager),
        "copy": _outcome(build(copy=True)),
        "compile_then_ac": _outcome(build(copy=True, ac="full", compile_first=True)),
        "no_copy": _outcome(build(copy=False)),
        "ac_then_compile": _outcome(build(copy=True, ac="full")),
    }
    torch.distributed.destroy_process_group()
    return cases


@pytest.fixture(scope="module")
def cases() -> dict[str, Outcome]:
    return run_distributed(tp_compile_cases, 2)[0]


def _same(outcome: Outcome, reference: Outcome) -> bool:
    if isinstance(outcome, str) or isinstance(reference, str) or outcome.keys() != reference.keys():
        return False
    for name, grad in reference.items():
        got = outcome[name]
        if (got is None) != (grad is None):
            return False
        if grad is not None and not torch.allclose(got, grad, rtol=1e-5, atol=1e-7):
            return False
    return True


def still_needed(bug_seen: bool, workaround: str) -> None:
    """Fail (skip before torch 2.13) once the bug is gone: the workaround can go."""
    if bug_seen:
        return
    version = torch.__version__
    if version < "2.13":
        pytest.skip(
            f"torch {version} does not have the bug of workaround {workaround!r}, seen on torch "
            "2.13: keep the workaround while torch 2.13 is supported"
        )
    pytest.fail(
        f"torch {version} no longer needs workaround {workaround!r}: without it, the gradients "
        "are right. Remove it (parallel/workarounds.py and this test)."
    )


@pytest.mark.slow
def test_compiled_block_drops_the_tp_embeddings_gradient(cases: dict[str, Outcome]) -> None:
    """pytorch/pytorch#179849: the first compiled block, handed the embedding's async output,
    sends back no gradient for it (here DTensor's backward fails on it)."""
    assert isinstance(cases["eager"], dict) and cases["eager"]["tok_embeddings.weight"] is not None
    assert _same(cases["copy"], cases["eager"]), cases["copy"]
    still_needed(not _same(cases["no_copy"], cases["eager"]), "embedding output copy")


@pytest.mark.slow
def test_compiling_a_checkpointed_tp_block_fails(cases: dict[str, Outcome]) -> None:
    """Compiling a block that full AC recomputes, with DTensor ops inside (tp 2), fails: a
    DeviceMesh among AOTAutograd's saved tensors. The workaround's order (compile, then AC)
    gives eager's gradients."""
    assert _same(cases["compile_then_ac"], cases["eager"]), cases["compile_then_ac"]
    bug_seen = not _same(cases["ac_then_compile"], cases["eager"])
    still_needed(bug_seen, "compile before whole-block AC")


def divided_gradients() -> dict[str, float]:
    """The gradient of a 1x4 Linear of ones on HSDP (2 replicas x 1 shard rank), each rank's
    own gradient 1 per weight, reduced with a divide factor of 4: by torch's own calls with
    force-sum (workaround 3's bug) and by the workaround's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parallel.dims import LaunchEnv
    from parallel.runtime import init_distributed
    from parallel.workarounds import set_gradient_divide_factor

    init_distributed(torch.device("cpu"), LaunchEnv.from_env(), 60)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    grads = {}
    for case in ("force_sum", "workaround"):
        linear = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.ones_(linear.weight)
        fully_shard(linear, mesh=mesh)
        if case == "force_sum":
            linear.set_gradient_divide_factor(4.0)
            linear.set_force_sum_reduction_for_comms(True)
        else:
            set_gradient_divide_factor(linear, 4.0, mesh)
        linear(torch.ones(1, 4)).sum().backward()
        grads[case] = linear.weight.grad.full_tensor()[0, 0].item()
    torch.distributed.destroy_process_group()
    return grads


def test_force_sum_with_one_shard_rank_divides_gradients_twice() -> None:
    """Summed over 2 replicas and divided by 4, each weight's gradient is 0.5; torch 2.13's
    force-sum path gives 0.5 / 4 with a one-rank shard group."""
    grads = run_distributed(divided_gradients, 2, nodes=2)[0]
    assert grads["workaround"] == 0.5
    still_needed(grads["force_sum"] != 0.5, "gradients divided twice")


def op_ac_around_a_one_rank_unit() -> dict[str, str]:
    """One forward and backward of tests/test_moe_trainer.py's tiny qwen3_moe at ep 2 on 2
    ranks with op-level AC, whose blocks each hold their experts' FSDP unit of one rank:
    "ok" or the error, without workaround 4 (torch's own ignored ops) and with it."""
    import torch.utils.checkpoint as checkpoint

    from configs import parse_config
    from launch.job import JobConfig
    from model import get_family
    from parallel.build import build_model
    from parallel.dims import LaunchEnv
    from parallel.ep import build_expert_mesh
    from parallel.fsdp import assign_local_shard
    from parallel.runtime import build_mesh, init_distributed
    from tests.test_moe_trainer import MOE
    from tests.test_train import TINY

    cpu = torch.device("cpu")
    init_distributed(cpu, LaunchEnv.from_env(), 60)
    mesh, experts = build_mesh(cpu, 1, 2), build_expert_mesh(cpu, 1, 2, 2)
    job = parse_config(JobConfig, [*TINY, *MOE, "--parallel.ep=2", "--ac.mode=op"])
    family = get_family(job.model.name)
    torch_own = set(checkpoint.SAC_IGNORED_OPS)
    outcomes = {}
    for case in ("without", "with"):
        args = family.build_args(job.model)
        model = build_model(family, args, job.build_settings(), mesh, experts).model
        if case == "without":  # apply_ac added the workaround's ops: back to torch's own
            checkpoint.SAC_IGNORED_OPS.intersection_update(torch_own)
        model.to_empty(device=cpu)
        model.init_weights(seed=0, rope_len=32, assign=assign_local_shard)
        try:
            model(torch.arange(64).view(2, 32)).float().logsumexp(-1).mean().backward()
            outcomes[case] = "ok"
        except RuntimeError as err:
            outcomes[case] = str(err)
    torch.distributed.destroy_process_group()
    return outcomes


def test_op_ac_miscounts_profiler_ranges_of_a_nested_unit() -> None:
    """pytorch/torchtitan#3427: the experts' FSDP unit opens one more profiler range in the
    recompute than in forward, and op-level AC's replay fails on it; without counting those
    ranges (workaround 4) backward runs (tests/test_moe_trainer.py: the same losses as one
    process)."""
    outcomes = run_distributed(op_ac_around_a_one_rank_unit, 2)[0]
    assert outcomes["with"] == "ok", outcomes["with"]
    still_needed("not found in storage" in outcomes["without"], "profiler ranges in op-level AC")


def mesh_pickles() -> dict[str, bool]:
    """On one rank: whether a DeviceMesh whose hash was taken pickles that hash, by torch's
    own `__getstate__` and with workaround 5's reducer."""
    import copyreg
    import pickle

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from parallel.workarounds import pickle_meshes_without_their_hash

    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    taken = hash(mesh)
    torch_own = mesh.__getstate__().get("_hash") == taken
    pickle_meshes_without_their_hash()
    try:
        kept = pickle.loads(pickle.dumps(mesh)).__dict__.get("_hash") == taken
    finally:
        copyreg.dispatch_table.pop(DeviceMesh, None)
    torch.distributed.destroy_process_group()
    return {"torch": torch_own, "workaround": kept}


def test_a_mesh_pickles_its_per_process_hash() -> None:
    """A DeviceMesh pickles the hash it cached (str hashes of its dim names, randomized per
    process), which puts a per-process value in Inductor's cache keys; the workaround's reducer
    leaves it out (tests/test_graph_fsdp.py: a restart then finds its graphs)."""
    pickles = run_distributed(mesh_pickles, 1)[0]
    assert not pickles["workaround"]
    still_needed(pickles["torch"], "DeviceMesh pickles its cached hash")
