"""Fault-tolerant replica groups (ft.enabled, parallel/ft.py) on real gloo groups, each a world
of its own, and a real torchft lighthouse: HSDP's numbers without faults, checkpoints that move
between ft and plain runs, a group killed and healed from a live peer, and the bad inputs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from configs import ConfigError, parse_config
from tests.distributed import run_distributed
from tests.test_families import scalars
from tests.test_launch import ENV, ROOT, Launched, alive, free_port
from tests.test_train import FP32, TINY, assert_close, train_losses

torchft = pytest.importorskip("torchft", reason="the [ft] extra: pip install -e '.[ft]'")

# Compiled blocks, activation checkpointing, the chunked loss and accumulation (global 8 over
# 4 data-parallel ranks of micro-batch 1: 2 micro-batches a step), as the issue asks of parity.
COMPOSED = ["--compile.enabled=true", "--compile.backend=aot_eager", "--ac.mode=full",
            "--train.loss_chunk_tokens=16", "--train.micro_batch_size=1"]  # fmt: skip


def lighthouse(min_groups: int) -> Any:
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=min_groups, join_timeout_ms=100)


def run_groups(argv: list[str], groups: int, ranks: int, address: str,
               per_group: dict[int, list[str]] | None = None,
               train: Callable[[list[str]], Any] = train_losses) -> dict[int, Any]:  # fmt: skip
    """Each group a run_distributed of `train` (its argv) of its own (its own store and world),
    all at once; {group: its ranks' results, or the AssertionError it raised}."""
    results: dict[int, Any] = {}

    def group(g: int) -> None:
        ft = ["--ft.enabled=true", f"--ft.group={g}", f"--ft.groups={groups}",
              f"--ft.lighthouse={address}", *(per_group or {}).get(g, [])]  # fmt: skip
        try:
            results[g] = run_distributed(train, ranks, argv + ft, timeout=240)
        except AssertionError as err:
            results[g] = err

    threads = [threading.Thread(target=group, args=(g,)) for g in range(groups)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.slow
def test_replica_groups_train_hsdp_losses_and_their_checkpoints_move_both_ways(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """HSDP 2x2 for 6 steps; two ft groups of 2 ranks resume its step 2 and equal its steps
    3-6; a plain FSDP run on 2 ranks resumes the ft run's step 4 and equals steps 5-6."""
    base = [f"--data.path={tiny_dataset}", *TINY, *FP32, *COMPOSED, "--checkpoint.interval=2",
            "--checkpoint.keep_last=0"]  # fmt: skip
    hsdp = run_distributed(train_losses, 4, [*base, f"--run.output_dir={tmp_path / 'hsdp'}",
                           "--parallel.dp_replicate=2", "--train.steps=6"], nodes=2)[0]  # fmt: skip
    server = lighthouse(2)  # every step with both groups: the parity is exact, not shrunk
    try:
        step2 = tmp_path / "hsdp" / "debug" / "checkpoints" / "step-2"
        ft = run_groups([*base, f"--run.output_dir={tmp_path / 'ft'}", "--train.steps=6",
                         f"--checkpoint.resume={step2}", "--metrics.tensorboard=true",
                         "--metrics.log_interval=2"], 2, 2, server.address())  # fmt: skip
    finally:
        server.shutdown()
    for g in (0, 1):
        assert not isinstance(ft[g], Exception), ft[g]
        assert ft[g][0] == ft[g][1], "the ranks of a group report the same global loss"
        assert_close(ft[g][0], hsdp[2:], rtol=1e-5)
    # One group writes (the first of the quorum), into the run's folder shared by the groups;
    # each group logs in a folder of its own.
    saved = sorted(p.name for p in (tmp_path / "ft" / "debug" / "checkpoints").glob("step-*"))
    assert saved == ["step-4", "step-6"]
    assert {p.name for p in (tmp_path / "ft" / "debug").glob("group*")} == {"group0", "group1"}
    # TensorBoard, each group's own: the groups of every logged step.
    for g in (0, 1):
        assert scalars(tmp_path / "ft" / "debug" / f"group{g}")["ft/groups"] == [2.0, 2.0]
    step4 = tmp_path / "ft" / "debug" / "checkpoints" / "step-4"
    plain = run_distributed(train_losses, 2, [*base, f"--run.output_dir={tmp_path / 'plain'}",
                            "--train.steps=6", f"--checkpoint.resume={step4}"])[0]  # fmt: skip
    assert_close(plain, hsdp[4:6], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.drill  # the llama case above runs by default
def test_replica_groups_train_hsdp_losses_with_experts(tiny_dataset: str, tmp_path: Path) -> None:
    """A mixture of experts (qwen3_moe, ep 1): the router's bias moves by the expert load
    summed over the groups, as over HSDP's replicas; 4 steps equal HSDP 2x2's."""
    from tests.test_families import run_argv

    def argv(name: str) -> list[str]:
        return run_argv(tiny_dataset, tmp_path, "qwen3_moe", name, "--train.steps=4",
                        "--train.micro_batch_size=1")  # fmt: skip

    hsdp = run_distributed(train_losses, 4, [*argv("hsdp"), "--parallel.dp_replicate=2"],
                           nodes=2)[0]  # fmt: skip
    server = lighthouse(2)
    try:
        ft = run_groups(argv("ft"), 2, 2, server.address())
    finally:
        server.shutdown()
    for g in (0, 1):
        assert not isinstance(ft[g], Exception), ft[g]
        assert_close(ft[g][0], hsdp, rtol=1e-5)


def diloco_run(argv: list[str]) -> tuple[list[float], list[int], list[tuple]]:
    """train_losses on this rank, with the cross-group all-reduces of each step counted and
    the groups' comparisons recorded (a difference raises)."""
    from torchft.manager import Manager

    import train
    from parallel import ft

    calls: list[int] = []
    per_step: list[int] = []
    compared: list[tuple] = []
    allreduce, step, compare = Manager.allreduce, train.train_step, ft.ReplicaGroups.compare

    def counted(self: Any, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.numel())
        return allreduce(self, tensor, *args, **kwargs)

    def stepped(*args: Any, **kwargs: Any) -> Any:
        before = len(calls)
        result = step(*args, **kwargs)
        per_step.append(len(calls) - before)
        return result

    def recorded(self: Any, at: int, keys: tuple = ft.COMPARED) -> None:
        compared.append((at, keys))
        compare(self, at, keys)

    Manager.allreduce, train.train_step, ft.ReplicaGroups.compare = counted, stepped, recorded
    return train_losses(argv), per_step, compared


@pytest.mark.slow
def test_replica_groups_train_dpo_to_trls_numbers(prefs: dict[str, Path], tmp_path: Path) -> None:
    """DPO on two replica groups of one rank, 2 micro-batches each: TRL's numbers, its
    evaluation's too (fp32, 1e-5), with the frozen copy and with the precomputed reference
    (each group scores the pairs into its own folder)."""
    from tests.test_dpo import assert_trl, dpo_argv, logged_run, trl_steps

    for ref in ("copy", "precomputed"):
        argv = dpo_argv(prefs, tmp_path / ref, "sigmoid", f"--dpo.reference={ref}",
                        "--train.micro_batch_size=2")  # fmt: skip
        server = lighthouse(2)
        try:
            results = run_groups(argv, 2, 1, server.address(), train=logged_run)
        finally:
            server.shutdown()
        for g in (0, 1):
            assert not isinstance(results[g], Exception), results[g]
            assert_trl(results[g][0], trl_steps(prefs, "sigmoid"))
    assert (tmp_path / "precomputed" / "sigmoid" / "group1" / "reference_logps.npy").is_file()


@pytest.mark.slow
def test_diloco_groups_meet_every_sync_steps_and_leave_it_bitwise_equal(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """ft.sync_steps=4: between syncs a step sends nothing across the groups (each group's
    own data, loss and gradients), every 4th step all-reduces the pseudo-gradient of every
    weight, and the run ends (on a sync) with the groups' weights equal bit for bit."""
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY, *FP32,
            "--train.steps=8", "--ft.sync_steps=4", "--train.micro_batch_size=4",
            "--ft.enabled=true", "--ft.groups=2"]  # fmt: skip
    n_weights = 2 * 9 + 3  # 2 blocks of 7 matrices and 2 norms, the embedding, norm, output
    server = lighthouse(2)
    results: dict[int, Any] = {}

    def group(g: int) -> None:
        ft = [f"--ft.group={g}", f"--ft.lighthouse={server.address()}"]
        results[g] = run_distributed(diloco_run, 1, argv + ft, timeout=240)[0]

    try:
        threads = [threading.Thread(target=group, args=(g,)) for g in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.shutdown()
    assert set(results) == {0, 1}, "a group failed: its traceback is above"
    for _, per_step, compared in results.values():
        assert per_step == [0, 0, 0, n_weights, 0, 0, 0, n_weights], per_step
        assert compared == [(8, ("model",))]
    assert results[0][0] != results[1][0], "each group trains its own part of the data"


@pytest.mark.slow
@pytest.mark.drill  # the groups' own mesh composes as FSDP does; the parity above is FSDP's
@pytest.mark.parametrize("inside", [["--parallel.tp=2"], ["--parallel.pp=2"]], ids=["tp", "pp"])
def test_replica_groups_with_tp_or_pp_inside_train_hsdp_losses(
    tiny_dataset: str, tmp_path: Path, inside: list[str]
) -> None:
    """Tensor parallel or pipeline stages inside each group of 2 ranks: the groups' losses
    are HSDP 2 x (the same inside)'s, 4 steps."""
    base = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY, *FP32,
            "--train.steps=4", "--train.micro_batch_size=2", *inside]  # fmt: skip
    hsdp = run_distributed(train_losses, 4, [*base, "--run.name=hsdp", "--parallel.dp_replicate=2"],
                           nodes=2)[0]  # fmt: skip
    server = lighthouse(2)
    try:
        ft = run_groups([*base, "--run.name=ft"], 2, 2, server.address())
    finally:
        server.shutdown()
    for g in (0, 1):
        assert not isinstance(ft[g], Exception), ft[g]
        assert_close(ft[g][0], hsdp, rtol=1e-5)


@pytest.mark.slow
def test_groups_with_different_settings_are_refused_at_the_first_quorum(
    tiny_dataset: str, tmp_path: Path
) -> None:
    base = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.steps=2", "--train.micro_batch_size=4"]  # fmt: skip
    server = lighthouse(2)
    try:
        results = run_groups(base, 2, 1, server.address(), {1: ["--train.seed=7"]})
    finally:
        server.shutdown()
    for g in (0, 1):  # both groups, with the setting's name
        assert isinstance(results[g], AssertionError)
        assert "ft: the replica groups differ in train.seed" in str(results[g])


def test_bad_replica_group_settings_are_one_line_each(monkeypatch, tmp_path: Path) -> None:
    from launch.check import check_replica_groups
    from launch.job import JobConfig
    from parallel.ft_config import check_ft

    with pytest.raises(ConfigError, match=r"ft.group=2 is out of range for ft.groups=2 \(0..1\)"):
        parse_config(JobConfig, ["--ft.enabled=true", "--ft.group=2"])
    job = parse_config(JobConfig, ["--ft.enabled=true"])
    with pytest.raises(ConfigError, match="ft.enabled with parallel.dp_replicate=2: the replica"):
        check_replica_groups(job, dp_replicate=2)
    job = parse_config(JobConfig, ["--ft.enabled=true", "--parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"ft.enabled with parallel.ep > 1"):
        check_replica_groups(job, dp_replicate=1)
    cfg = job.ft
    with pytest.raises(ConfigError, match="needs the lighthouse's address: set ft.lighthouse"):
        check_ft(cfg, {}, under_torchrun=True)
    closed = free_port()  # nothing listens there
    cfg.lighthouse, cfg.connect_timeout_s = f"http://127.0.0.1:{closed}", 0.5
    with pytest.raises(ConfigError, match=rf"ft.lighthouse http://127.0.0.1:{closed} cannot be "
                       r"reached within 0.5 s \(Connection refused\)"):  # fmt: skip
        check_ft(cfg, {}, under_torchrun=True)
    with pytest.raises(ConfigError, match="start each replica group with torchrun"):
        check_ft(cfg, {}, under_torchrun=False)
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r'ft.enabled needs torchft, an optional extra: pip '
                       r'install -e "\.\[ft\]"'):  # fmt: skip
        check_ft(cfg, {}, under_torchrun=True)


def test_an_unreachable_lighthouse_stops_multinode_sh_in_one_line(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """As a user starts a group: FT=1 multinode.sh with a lighthouse that is not there."""
    closed = free_port()
    env = ENV | {"FT": "1", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "NPROC": "1", "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{closed}"}  # fmt: skip
    args = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--ft.connect_timeout_s=1"]  # fmt: skip
    done = subprocess.run(["launch/multinode.sh", "configs/debug.toml", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].endswith(
        f"config error: ft.lighthouse http://127.0.0.1:{closed} cannot be reached within 1 s "
        "(Connection refused): start torchft_lighthouse there first (docs/launch.md)"
    ), done.stdout + done.stderr


# What a group logs: its steps, the groups of a step that had fewer, a heal, the comparison.
DEGRADED = re.compile(r"step (\d+): 1 of 2 replica groups; the step trained")
EQUAL = re.compile(r"step (\d+): the 2 replica groups hold bitwise-equal weights")


def group_env(group: int, port: int) -> dict[str, str]:
    # Node 0 starts the lighthouse (multinode.sh); a lost group leaves its quorum after 1 s
    # without a heartbeat (torchft's default is 5 s).
    return {"FT": "1", "NNODES": "2", "NODE_RANK": str(group), "MASTER_ADDR": "127.0.0.1",
            "NPROC": "1", "LIGHTHOUSE_PORT": str(port),
            "LIGHTHOUSE_ARGS": "--heartbeat_timeout_ms 1000"}  # fmt: skip


@pytest.mark.slow
def test_kill_9_of_a_group_stops_no_other_and_it_heals_from_a_live_peer(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """Two groups (multinode.sh FT=1, one rank each); every process of group 1 killed with
    SIGKILL mid-run: group 0 goes on without a restart, with the global batch it has; group 1
    started again loads group 0's live state (no checkpoint) and both compare bit for bit."""
    port = free_port()
    args = ["configs/debug.toml", f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}",
            *TINY, *FP32, "--train.steps=5000", "--metrics.log_interval=5",
            "--ft.compare_interval=10", "--checkpoint.interval=25",
            # A collective left waiting by the kill fails over within 10 s at worst (gloo
            # normally fails it at once: the peer's sockets close).
            "--ft.timeout_s=10"]  # fmt: skip
    cmd = ["launch/multinode.sh", *args]
    logs = [tmp_path / "group0.log", tmp_path / "group1.log", tmp_path / "group1-again.log"]
    first = Launched(logs[:1], [cmd], [group_env(0, port)])
    second = Launched(logs[1:2], [cmd], [group_env(1, port)])
    again = None
    try:
        second.wait_for(r"step 15/\d+  loss", timeout=120)
        survivor = first.worker_pids()
        victims = [*second.worker_pids().values(), second.procs[0].pid]
        for pid in victims:  # the agent and its rank at once: the node is gone
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        match = first.wait_for(DEGRADED.pattern, timeout=90)
        failover_s = time.monotonic() - killed
        lost_at = int(match.group(1))
        again = Launched(logs[2:], [cmd], [group_env(1, port)])
        healed = again.wait_for(r"healed from a live replica group", timeout=120)
        assert healed
        # After the heal, the next comparison: both groups, the same bits.
        equal = again.wait_for(EQUAL.pattern, timeout=60)
        step = int(equal.group(1))
        first.wait_for(rf"step {step}: the 2 replica groups hold bitwise-equal", timeout=30)
        first_log, again_log = first.text(), again.text()
        # The survivor: the same process all along, never resumed, never restarted.
        assert first.worker_pids() == survivor and all(alive(p) for p in survivor.values())
        assert "resuming" not in first_log and "restart" not in first_log
        # Its steps without group 1 trained half of each global batch, each said so.
        degraded = sorted({int(s) for s in DEGRADED.findall(first_log)})
        assert degraded[0] == lost_at and len(degraded) >= 2
        # The healed group read no checkpoint: it loaded a peer's live state.
        assert "resuming" not in again_log
        for launched in (first, again):  # a stop to each: the step in flight, then exit 143
            os.kill(launched.procs[0].pid, signal.SIGTERM)
        assert first.wait(60) == [143] and again.wait(60) == [143]
        print(f"ft: kill -9 to the survivor's first step without the group: {failover_s:.1f} s")
    finally:
        for launched in (first, second, again):
            if launched is not None:
                launched.end()


@pytest.mark.slow
@pytest.mark.drill  # the restart by hand runs by default (above); this is torchrun's own
def test_a_rank_restarted_by_torchrun_heals_from_a_live_peer(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """MAX_RESTARTS=1: group 1's rank killed, its torchrun starts it again in the same agent,
    and it loads group 0's live state at its first quorum."""
    port = free_port()
    args = ["launch/multinode.sh", "configs/debug.toml", f"--data.path={tiny_dataset}",
            f"--run.output_dir={tmp_path}", *TINY, *FP32, "--train.steps=5000",
            "--metrics.log_interval=5", "--ft.compare_interval=10",
            "--ft.timeout_s=10"]  # fmt: skip
    first = Launched([tmp_path / "group0.log"], [args], [group_env(0, port)])
    second = Launched([tmp_path / "group1.log"], [args],
                      [group_env(1, port) | {"MAX_RESTARTS": "1"}])  # fmt: skip
    try:
        second.wait_for(r"step 15/\d+  loss", timeout=120)
        agent = second.procs[0].pid
        for pid in second.worker_pids().values():
            os.kill(pid, signal.SIGKILL)
        # After the heal, the next comparison: the same bits as group 0's.
        second.wait_for(r"healed from a live replica group[\s\S]*" + EQUAL.pattern, timeout=120)
        assert alive(agent), second.text()[-3000:]
        assert "resuming" not in second.text()
    finally:
        first.end()
        second.end()


def test_a_digest_tells_equal_states_from_one_bit_apart() -> None:
    from parallel.ft import _digest

    state = {"w": torch.randn(64, 32), "m": [torch.zeros(5, dtype=torch.bfloat16)]}
    same = {"w": state["w"].clone(), "m": [state["m"][0].clone()]}
    assert _digest(state) == _digest(same)
    flipped = state["w"].clone()
    flipped.view(torch.int32)[3, 4] ^= 1 << 30  # one bit of one exponent
    assert _digest({"w": flipped, "m": state["m"]}) != _digest(state)


def test_the_dry_run_says_what_a_heal_moves(tmp_path: Path) -> None:
    """Each rank of a healing group receives its shard of the fp32 weights and of the
    optimizer state: the planner's two memory rows, summed."""
    env = ENV | {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    # Its own run folder: the checkout's outputs/ may hold the quick start's run (conftest.py).
    done = subprocess.run([sys.executable, "train.py", "configs/debug.toml", "--dry-run",
                           "--ft.enabled=true", "--ft.groups=3", "--train.global_batch_size=24",
                           f"--run.output_dir={tmp_path}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {
        m[0]: float(m[1]) * {"KiB": 2**-10, "MiB": 1, "GiB": 2**10}[m[2]]
        for m in re.findall(r"memory: (\w+) +([\d.]+) (KiB|MiB|GiB)", done.stdout)
    }
    heal = re.search(r"# ft: 3 replica groups of 4 ranks on torchft .* healing group "
                     r"([\d,.]+) MiB from its peer", done.stdout)  # fmt: skip
    assert heal, done.stdout
    assert float(heal.group(1).replace(",", "")) == pytest.approx(
        rows["params"] + rows["optimizer"], rel=0.01
    )
    assert "FT3 x FSDP 1x4" in done.stdout


def test_ft_settings_that_do_not_apply_are_said() -> None:
    from launch.check import unintended_settings
    from launch.job import JobConfig

    off = parse_config(JobConfig, ["--ft.groups=4", "--ft.sync_steps=10"])
    assert "ft.groups=4, ft.sync_steps=10 have no effect with ft.enabled=false" in "\n".join(
        unintended_settings(off)
    )
    sync = parse_config(JobConfig, ["--ft.enabled=true", "--ft.outer_lr=0.5"])
    assert (
        "ft.outer_lr=0.5 has no effect with ft.sync_steps=0: DiLoCo's outer optimizer runs "
        "with ft.sync_steps > 0 only"
    ) in unintended_settings(sync)
    assert not [w for w in unintended_settings(parse_config(JobConfig, [])) if "ft." in w]
