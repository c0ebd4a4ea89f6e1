"""FSDP vs HSDP weak scaling on a simulated cluster: 1, 2 and 4 "nodes" on this one machine.

    sudo python bench/scaling.py               # ~8 min on 2 cores; writes docs/scaling.png
    python bench/scaling.py --plot-only        # redraw the plot from the last JSON

Each node is a network namespace with its own address, joined to the others through a bridge
by a veth pair whose two directions are rate-limited with `tc ... tbf` (default 1 Gbit/s, a
slow data-center link); ranks of one node talk over loopback, at memory speed. Every rank
also gets the same CPU budget in every case (a cgroup CPU quota: default 0.45 cores per node,
split between its ranks), so adding a node adds compute the way a real node does and perfect
weak scaling is reachable: whatever falls short of it is the network's doing. Every rank keeps
the same batch (weak scaling). Ranks are started directly with the environment torchrun would
give them (ranks numbered node by node), so that each rank sits in its own CPU group.

What is measured per case: tokens/s (median of per-step samples after warm-up) and the bytes
each node's link carried per step (the interface's tx counters, TCP/IP headers included). What
is predicted: the planner's bytes per rank and mesh dim (`parallel.plan.plan_communication`)
turned into bytes on one node's link by the ring algorithm gloo runs (a ring over nodes crosses
each node boundary with one rank's stream; a replica all-reduce sends every rank's), and from
them the step time if that transfer does not overlap compute, or overlaps it fully.

Needs root (namespaces, tc, cgroups), iproute2, a cgroup v1 `cpu` or v2 controller, and
matplotlib for the plot (`pip install -e ".[bench]"`). Nothing
is added to the root namespace and everything is removed at the end. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from throughput import STEP_RE, machine_facts, number  # noqa: E402  (bench/ is sys.path[0])

PREFIX = "fsdp2x"  # namespaces and cgroups created here start with this
SUBNET = "10.213.48"
HUB = f"{PREFIX}-hub"
# The planner counts what a ring reduce-scatter (NCCL's) sends: (N-1)/N of the gradients.
# Gloo's reduce_scatter_tensor all-reduces the whole buffer and keeps its chunk, which sends
# twice that; the study predicts the wire bytes of the backend it runs on.
GLOO_RS_FACTOR = 2
# A model where a step's traffic is a few hundred MB on 2 cores: dim 512, 8 layers = 29.4M
# parameters; per rank one SEQ_LEN-token sequence per micro-batch. Compute time and link time
# per step are then of the same order, as on real clusters (docs/scaling.md works it out).
SEQ_LEN = 128
MODEL = [
    "configs/debug.toml", "--model.dim=512", "--model.n_layers=8", "--model.n_heads=8",
    "--model.n_kv_heads=8", f"--data.seq_len={SEQ_LEN}", "--train.micro_batch_size=1",
    # The GPU default: bf16 parameters (all-gathers) and fp32 gradient reduction.
    "--parallel.param_dtype=bfloat16", "--parallel.reduce_dtype=float32",
    "--train.eval_interval=0", "--metrics.tensorboard=false",
    "--checkpoint.interval=0", "--checkpoint.resume=none",
]  # fmt: skip


def sh(*cmd: str, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        sys.exit(f"scaling: `{shlex.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def node_ns(i: int) -> str:
    return f"{PREFIX}-n{i}"


def node_ip(i: int) -> str:
    return f"{SUBNET}.{11 + i}"


class CpuGroups:
    """One cgroup per rank with a CPU quota; cgroup v1 `cpu` controller or v2 `cpu.max`.

    Per rank, not per node: a GPU waiting on the network cannot lend its compute to the GPU
    next to it, so neither may a rank here (with one quota per node, it would)."""

    def __init__(self, cores: float, ranks: int):
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        period = 100_000
        if (v1 / "cpu.cfs_quota_us").exists():
            self.root, files = v1, {"cpu.cfs_period_us": period, "cpu.cfs_quota_us": None}
        elif "cpu" in (v2 / "cgroup.controllers").read_text(errors="ignore").split():
            (v2 / "cgroup.subtree_control").write_text("+cpu")
            self.root, files = v2, {"cpu.max": None}
        else:
            sys.exit("scaling: no cgroup cpu controller (v1 /sys/fs/cgroup/cpu or v2 cpu.max)")
        quota = int(cores * period)
        self.paths = []
        for i in range(ranks):
            path = self.root / f"{PREFIX}-r{i}"
            path.mkdir(exist_ok=True)
            for name, value in files.items():
                text = f"{quota} {period}" if name == "cpu.max" else str(value or quota)
                (path / name).write_text(text)
            self.paths.append(path)

    def join(self, i: int) -> None:
        """Move the calling process (a child before exec) into rank i's group."""
        (self.paths[i] / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for path in self.paths:
            with contextlib.suppress(OSError):
                path.rmdir()


def network_down() -> None:
    for name in sh("ip", "netns", "list").split():
        if name.startswith(PREFIX + "-"):
            sh("ip", "netns", "del", name, check=False)


def network_up(nodes: int, rate: str) -> None:
    """A bridge in its own namespace, and per node a namespace whose eth0 reaches it through
    a veth pair shaped to `rate` in both directions (tbf on each end's egress)."""
    network_down()
    sh("ip", "netns", "add", HUB)
    sh("ip", "-n", HUB, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", HUB, "link", "set", "br0", "up")
    for i in range(nodes):
        ns, port = node_ns(i), f"n{i}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", HUB, "link", "add", port, "type", "veth", "peer", "name", "eth0",
           "netns", ns)  # fmt: skip
        sh("ip", "-n", HUB, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{node_ip(i)}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        if rate != "none":
            # burst must hold a full GSO segment (64 KiB) or tbf drops it; the queue holds
            # 50 ms of traffic, about what a switch buffers.
            for where, dev in ((ns, "eth0"), (HUB, port)):
                sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", rate, "burst", "256kb", "latency", "50ms")  # fmt: skip


def nsexec(i: int) -> list[str]:
    # nsenter (not `ip netns exec`, which remounts /sys) keeps the cgroup mounts visible.
    return ["nsenter", f"--net=/run/netns/{node_ns(i)}", "--"]


def tx_bytes(i: int) -> int:
    """Bytes node i's eth0 has sent (its namespace's counters, TCP/IP headers included)."""
    link = json.loads(sh("ip", "-n", node_ns(i), "-j", "-s", "link", "show", "dev", "eth0"))
    return int(link[0]["stats64"]["tx"]["bytes"])


def measure_link(megabytes: int = 64) -> float:
    """MB/s of one TCP stream from node 1 to node 0: the bandwidth the shaping gives."""
    recv = (
        "import socket,time;s=socket.create_server(('0.0.0.0',29700));c,_=s.accept();n=0;"
        "t=time.perf_counter()\nwhile (b:=c.recv(1<<20)): n+=len(b)\n"
        "print(n/(time.perf_counter()-t)/1e6)"
    )
    send = (
        "import socket,time\nfor _ in range(100):\n try: c=socket.create_connection("
        f"('{node_ip(0)}',29700));break\n except OSError: time.sleep(0.1)\n"
        f"c.sendall(bytes({megabytes << 20}));c.close()"
    )
    server = subprocess.Popen([*nsexec(0), sys.executable, "-c", recv], stdout=subprocess.PIPE)
    subprocess.run([*nsexec(1), sys.executable, "-c", send], check=True)
    return float(server.communicate(timeout=600)[0])


def run_case(nodes: int, mode: str, opts: argparse.Namespace, cgroups: CpuGroups, port: int):
    """Train on `nodes` nodes as FSDP (one shard group over all ranks) or HSDP (shard inside
    a node, replicate across): return rank 0's tok/s samples and the bytes per link."""
    ranks = nodes * opts.nproc
    mesh = [f"--parallel.dp_replicate={nodes}", f"--parallel.dp_shard={opts.nproc}"]
    if mode == "fsdp":
        mesh = ["--parallel.dp_replicate=1", f"--parallel.dp_shard={ranks}"]
    lighthouse = None
    if mode in ("ft", "diloco"):  # each node a replica group, a world of its own (parallel/ft.py)
        mesh = ["--parallel.dp_replicate=1", f"--parallel.dp_shard={opts.nproc}",
                "--ft.enabled=true", f"--ft.groups={nodes}", "--ft.compare_interval=0",
                f"--ft.lighthouse=http://{node_ip(0)}:{port + 1000}"]  # fmt: skip
        if mode == "diloco":  # parallel/diloco.py: the groups meet every sync_steps steps
            mesh.append(f"--ft.sync_steps={opts.sync_steps}")
        # On node 0; every step waits for all groups (min_replicas): the steady state.
        lighthouse = subprocess.Popen(
            [*nsexec(0), str(Path(sys.executable).parent / "torchft_lighthouse"),
             "--min_replicas", str(nodes), "--bind", f"[::]:{port + 1000}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    label = f"{mode}-{nodes}n"
    run_dir = opts.out.parent / "runs"
    # Weak scaling: every rank keeps grad_accum micro-batches of one sequence per step.
    args = [*MODEL, *mesh, f"--train.global_batch_size={ranks * opts.grad_accum}"]
    args += [f"--train.steps={opts.steps}"]
    args += [f"--metrics.warmup_steps={opts.warmup}", "--metrics.log_interval=1"]
    args += [f"--run.output_dir={run_dir}", f"--run.name={label}"]
    if opts.eval_batches:  # the validation loss after the last step, for equal tokens
        args += [f"--train.eval_interval={opts.steps}", f"--train.eval_batches={opts.eval_batches}"]
        # The debug config's task is longer than SEQ_LEN: the same config without it.
        text = (REPO / MODEL[0]).read_text()
        config = run_dir / "no_tasks.toml"
        config.write_text(text[: text.index("[eval.tasks.")])
        args[0] = str(config)
    before = [tx_bytes(i) for i in range(nodes)]
    procs, logs = [], []
    start = time.perf_counter()
    for rank in range(ranks):
        node, local = divmod(rank, opts.nproc)
        # What torchrun would set (one agent per node numbers ranks node by node); started
        # directly so that each rank, not an agent, sits in its own CPU group.
        env = os.environ | {
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(opts.nproc), "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nodes), "MASTER_ADDR": node_ip(0), "MASTER_PORT": str(port),
            # One thread per rank; gloo on the node's eth0 (same-node peers: loopback).
            "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
        }  # fmt: skip
        if mode in ("ft", "diloco"):  # the group's own world and store, on its node
            env |= {"RANK": str(local), "WORLD_SIZE": str(opts.nproc), "GROUP_RANK": "0",
                    "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": node_ip(node)}  # fmt: skip
        ft = [f"--ft.group={node}"] if mode in ("ft", "diloco") else []
        log = open(run_dir / f"{label}.rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            subprocess.Popen(
                [*nsexec(node), sys.executable, "train.py", *args, *ft],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda rank=rank: cgroups.join(rank),
            )  # fmt: skip
        )
        logs.append(log)
    try:
        codes = [p.wait(timeout=opts.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = ["timeout"]
    finally:
        for p in procs + ([lighthouse] if lighthouse else []):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    wall = time.perf_counter() - start
    text = (run_dir / f"{label}.rank0.log").read_text()
    if any(c != 0 for c in codes):
        tail = "\n".join(text.splitlines()[-15:])
        sys.exit(f"scaling: {label} failed ({codes}); logs in {run_dir}\n{tail}")
    samples = [number(tps) for step, tps, _ in STEP_RE.findall(text) if int(step) > opts.warmup]
    sent = [tx_bytes(i) - b for i, b in enumerate(before)]
    result = {
        "nodes": nodes,
        "mode": mode,
        "ranks": ranks,
        "tok_s": statistics.median(samples),
        "tok_s_samples": samples,
        # Every step moves the same bytes; start-up traffic (rendezvous, a few small
        # all-reduces) is a rounding error next to it.
        "link_bytes_per_step": max(sent) / opts.steps if nodes > 1 else 0.0,
        "wall_s": round(wall, 1),
    }
    if mode == "diloco":
        result["sync_steps"] = opts.sync_steps
    if val := re.search(r"val_loss ([\d.]+)", text):
        result["val_loss"] = float(val.group(1))
    print(f"  {label}: {result['tok_s']:,.0f} tok/s, {result['link_bytes_per_step'] / 1e6:.1f} "
          f"MB/step on the busiest link, {wall:.0f} s", file=sys.stderr)  # fmt: skip
    return result


def fault_case(opts: argparse.Namespace, cgroups: CpuGroups, port: int) -> dict:
    """Two nodes as replica groups (ft.enabled): node 1's ranks killed (SIGKILL) after its
    step 5, then started again. Seconds from the kill to node 0's first step without it, from
    the restart to its heal and first step, and the bytes node 0's link sent for the heal.

    The heal needs each node's host name to reach it (torchft's HTTP checkpoint transport
    advertises `socket.gethostname()`): these namespaces share the machine's name, which
    resolves to loopback, so here the heal fails and is reported as None (docs/scaling.md)."""
    run_dir = opts.out.parent / "runs"
    lighthouse = subprocess.Popen(
        [*nsexec(0), str(Path(sys.executable).parent / "torchft_lighthouse"),
         "--min_replicas", "1", "--bind", f"[::]:{port + 1000}", "--heartbeat_timeout_ms",
         "1000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    args = [*MODEL, "--parallel.dp_replicate=1", f"--parallel.dp_shard={opts.nproc}",
            "--ft.enabled=true", "--ft.groups=2", "--ft.compare_interval=0",
            f"--ft.lighthouse=http://{node_ip(0)}:{port + 1000}", "--train.steps=100000",
            f"--train.global_batch_size={2 * opts.nproc}", "--metrics.log_interval=1",
            f"--run.output_dir={run_dir}", "--run.name=ft-fault"]  # fmt: skip

    def start(node: int, label: str, store_port: int) -> list[subprocess.Popen]:
        procs = []
        for local in range(opts.nproc):
            env = os.environ | {
                "RANK": str(local), "LOCAL_RANK": str(local), "WORLD_SIZE": str(opts.nproc),
                "LOCAL_WORLD_SIZE": str(opts.nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                "MASTER_ADDR": node_ip(node), "MASTER_PORT": str(store_port),
                "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
            }  # fmt: skip
            log = open(run_dir / f"{label}.rank{local}.log", "w")  # noqa: SIM115
            procs.append(subprocess.Popen(
                [*nsexec(node), sys.executable, "train.py", *args, f"--ft.group={node}"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda i=node * opts.nproc + local: cgroups.join(i),
            ))  # fmt: skip
        return procs

    def seen(label: str, pattern: str, timeout: float = 600) -> float | None:
        log, deadline = run_dir / f"{label}.rank0.log", time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, log.read_text()):
                return time.monotonic()
            time.sleep(0.1)
        print(f"scaling: {pattern!r} not in {log} after {timeout} s", file=sys.stderr)
        return None

    procs = start(0, "fault-n0", port) + start(1, "fault-n1", port)
    try:
        seen("fault-n1", r"step 5/\d+  loss")
        for p in procs[opts.nproc :]:
            os.killpg(p.pid, signal.SIGKILL)
        killed = time.monotonic()
        failover = seen("fault-n0", r"1 of 2 replica groups; the step")
        sent, restarted = tx_bytes(0), time.monotonic()
        procs += start(1, "fault-n1-again", port + 1)  # a fresh store port
        healed = seen("fault-n1-again", "healed from a live replica group", timeout=180)
        stepped = healed and seen("fault-n1-again", r"step \d+/\d+  loss")

        def since(t: float | None, start: float) -> float | None:
            return None if t is None else round(t - start, 1)

        result = {"mode": "ft-fault", "kill_to_next_step_s": since(failover, killed),
                  "start_to_heal_s": since(healed, restarted),
                  "start_to_first_step_s": since(stepped, restarted),
                  "heal_link_bytes_node0": tx_bytes(0) - sent}  # fmt: skip
    finally:
        for p in [*procs, lighthouse]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    print(f"  ft-fault: {result}", file=sys.stderr)
    return result


def predicted_link_bytes(
    nodes: int, mode: str, nproc: int, grad_accum: int, sync_steps: int = 10
) -> float:
    """Planner bytes per rank and mesh dim -> bytes one node's link carries per step."""
    from configs import parse_config
    from launch.job import JobConfig
    from model import get_family
    from parallel.plan import model_shape, plan_communication

    job = parse_config(JobConfig, MODEL)
    rep, shard = (1, nodes * nproc) if mode == "fsdp" else (nodes, nproc)
    family = get_family(job.model.name)
    shape = model_shape(family, family.build_args(job.model))
    comm = plan_communication(
        shape, rep, shard, job.parallel.param_dtype, job.parallel.reduce_dtype,
        grad_accum_steps=grad_accum,
    )  # fmt: skip
    if nodes == 1:
        return 0.0
    if mode == "fsdp":  # a ring over all ranks: one rank's stream crosses each node boundary
        return comm["dp_shard"]["all_gather"] + GLOO_RS_FACTOR * comm["dp_shard"]["reduce_scatter"]
    every = sync_steps if mode == "diloco" else 1  # DiLoCo: fp32 pseudo-gradients, 1 in N
    return nproc * comm["dp_replicate"]["all_reduce"] / every  # every rank of the node


def predict(results: list[dict], link_mb_s: float, nproc: int, grad_accum: int) -> None:
    """Add the planner's link bytes and the tok/s they imply, from the 1-node step time."""
    base = next(r for r in results if r["nodes"] == 1)
    tokens_per_rank = SEQ_LEN * grad_accum  # one sequence per micro-batch
    t1 = base["ranks"] * tokens_per_rank / base["tok_s"]
    for r in results:
        link = predicted_link_bytes(r["nodes"], r["mode"], nproc, grad_accum,
                                    r.get("sync_steps", 1))  # fmt: skip
        comm_s = link / (link_mb_s * 1e6)
        tokens = r["ranks"] * tokens_per_rank
        r["planner_link_bytes_per_step"] = link
        r["predicted_tok_s_no_overlap"] = tokens / (t1 + comm_s)
        r["predicted_tok_s_full_overlap"] = tokens / max(t1, comm_s)
        r["efficiency"] = r["tok_s"] / (r["nodes"] * base["tok_s"])


def markdown(report: dict) -> str:
    lines = [
        "| nodes | mesh | ranks | tok/s | scaling efficiency | planner tok/s (no overlap - "
        "full overlap) | link MB/step: planner | link MB/step: measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if any("val_loss" in r for r in report["results"]):
        lines[0] += " val loss |"
        lines[1] += "---|"
    for r in report["results"]:
        per_node = r["ranks"] // r["nodes"]
        mesh = {"fsdp": f"FSDP 1x{r['ranks']}", "hsdp": f"HSDP {r['nodes']}x{per_node}",
                "ft": f"{r['nodes']} ft groups x FSDP 1x{per_node}",
                "diloco": f"{r['nodes']} DiLoCo groups x FSDP 1x{per_node}"}[r["mode"]]  # fmt: skip
        lines.append(
            f"| {r['nodes']} | {mesh} | {r['ranks']} | {r['tok_s']:,.0f} | {r['efficiency']:.0%} | "
            f"{r['predicted_tok_s_no_overlap']:,.0f} - {r['predicted_tok_s_full_overlap']:,.0f} | "
            f"{r['planner_link_bytes_per_step'] / 1e6:.1f} | {r['link_bytes_per_step'] / 1e6:.1f} |"
            + (f" {r['val_loss']:.4f} |" if "val_loss" in r else "")
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    base = next(r for r in results if r["nodes"] == 1)["tok_s"]
    nodes = sorted({r["nodes"] for r in results})
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    ax.plot(nodes, [n * base for n in nodes], color="gray", ls=":", label="perfect scaling")
    lines = (("fsdp", "tab:red", "FSDP"), ("hsdp", "tab:blue", "HSDP"),
             ("ft", "tab:green", "ft groups"))  # fmt: skip
    for mode, color, name in lines:
        rows = sorted((r for r in results if r["mode"] == mode or r["nodes"] == 1),
                      key=lambda r: r["nodes"])  # fmt: skip
        if len(rows) < 2:
            continue
        xs = [r["nodes"] for r in rows]
        ax.plot(xs, [r["tok_s"] for r in rows], "o-", color=color, label=f"{name} measured")
        # With transfers shorter than compute, full overlap is perfect scaling: only the
        # no-overlap prediction says something the dotted line does not.
        ax.plot(xs, [r["predicted_tok_s_no_overlap"] for r in rows], "--", color=color,
                alpha=0.6, label=f"{name} planner, no overlap")  # fmt: skip
    m = report["setup"]
    ax.set(
        xlabel="nodes", ylabel="tokens/s (all ranks)", xticks=nodes,
        title=f"Weak scaling: {m['nproc']} ranks/node, {m['node_cores']} cores/node, "
        f"links {m['rate']} ({m['link_mb_s']:.0f} MB/s), "
        f"{SEQ_LEN * m.get('grad_accum', 1)} tokens/rank/step",
    )  # fmt: skip
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", default="1,2,4", help="node counts; must include 1")
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("--rate", default="1gbit", help="tc rate of each link direction, or none")
    p.add_argument("--node-cores", type=float, default=0.45, help="CPU quota of each node, "
                   "split evenly between its ranks")  # fmt: skip
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank and step")
    p.add_argument("--modes", default="fsdp,hsdp", help="meshes of the multi-node cases: fsdp, "
                   "hsdp, ft (a replica group per node on torchft, parallel/ft.py), diloco "
                   "(the same groups meeting every --sync-steps, parallel/diloco.py)")  # fmt: skip
    p.add_argument("--sync-steps", type=int, default=10, help="ft.sync_steps of mode diloco")
    p.add_argument("--fault", action="store_true", help="only the replica groups' fault case: "
                   "node 1 killed and started again (fault_case)")  # fmt: skip
    p.add_argument("--eval-batches", type=int, default=0, help="> 0: the validation loss "
                   "after the last step (train.eval_batches), a column of its own")  # fmt: skip
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of tok/s")
    p.add_argument("--timeout", type=float, default=900, help="seconds per case")
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/scaling/scaling.json")
    p.add_argument("--png", type=Path, default=REPO / "docs/scaling.png")
    p.add_argument("--plot-only", action="store_true", help="redraw from --out, run nothing")
    opts = p.parse_args(argv)
    opts.nodes = sorted(map(int, opts.nodes.split(",")))
    if opts.nodes[0] != 1:
        p.error("--nodes must include 1: it is the baseline of every prediction")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.plot_only:
        report = json.loads(opts.out.read_text())
        setup = report["setup"]
        predict(report["results"], setup["link_mb_s"], setup["nproc"], setup.get("grad_accum", 1))
        print(markdown(report))
        plot(report, opts.png)
        return 0
    if os.geteuid() != 0:
        sys.exit("scaling: needs root (network namespaces, tc and cgroups)")
    if not (REPO / "outputs/data/stdlib").exists():
        subprocess.run([sys.executable, "-m", "data.prepare"], cwd=REPO, check=True)
    (opts.out.parent / "runs").mkdir(parents=True, exist_ok=True)
    n_max = max(opts.nodes)
    total = n_max * opts.node_cores
    if total > (os.cpu_count() or 1):
        sys.exit(f"scaling: {n_max} nodes x {opts.node_cores} cores = {total} > this machine's "
                 f"{os.cpu_count()} cores: lower --node-cores")  # fmt: skip
    report = {"machine": machine_facts(), "setup": {}, "results": []}
    # The SIGTERM of `timeout` or `kill` must still run the clean-up below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cgroups = CpuGroups(opts.node_cores / opts.nproc, n_max * opts.nproc)
    try:
        network_up(max(n_max, 2), opts.rate)
        link = measure_link()
        print(f"link node1 -> node0: {link:.1f} MB/s", file=sys.stderr)
        report["setup"] = {
            "nproc": opts.nproc, "rate": opts.rate, "node_cores": opts.node_cores,
            "link_mb_s": link, "grad_accum": opts.grad_accum, "steps": opts.steps,
            "warmup": opts.warmup, "model": MODEL,
            "command": shlex.join([sys.executable, "bench/scaling.py", *(argv or sys.argv[1:])]),
        }  # fmt: skip
        port = 29610
        if opts.fault:
            report["results"].append(fault_case(opts, cgroups, port))
            opts.out.write_text(json.dumps(report, indent=2) + "\n")
            return 0
        for nodes in opts.nodes:
            for mode in opts.modes.split(",") if nodes > 1 else ("fsdp",):
                port += 1  # a fresh port per case: no TIME_WAIT from the last one
                report["results"].append(run_case(nodes, mode, opts, cgroups, port))
    finally:
        network_down()
        cgroups.remove()
    predict(report["results"], report["setup"]["link_mb_s"], opts.nproc, opts.grad_accum)
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    plot(report, opts.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
