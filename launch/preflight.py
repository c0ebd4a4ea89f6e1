"""Check a multi-node launch before training: rank layout, network interfaces, all-reduce speed.

    torchrun --nnodes=2 --nproc-per-node=8 ... -m launch.preflight          # every rank
    PREFLIGHT=1 sbatch launch/hsdp.sbatch ...                                # as a job step
    python -m launch.preflight --nccl-log slurm-123.out    # only read an NCCL_DEBUG=INFO log

Bandwidth is measured on the same (dp_replicate, dp_shard) mesh HSDP uses: dp_shard groups the
ranks of one node (intra-node: NVLink/PCIe), dp_replicate links one rank per node (inter-node:
InfiniBand/RoCE/Ethernet). busbw is reported as nccl-tests does, algbw x 2(n-1)/n, so numbers
compare with `all_reduce_perf` and with the link's line rate.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("launch.preflight")

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _wanted(var: str, value: str) -> tuple[bool, list[str]]:
    """(exact, names) of a *_SOCKET_IFNAME value. NCCL's syntax: a comma-separated list of name
    prefixes, `=name` for exact names, a leading `^` to exclude. gloo takes one exact name."""
    return var == "GLOO_SOCKET_IFNAME" or value.startswith("="), value.lstrip("=").split(",")


def _matches(name: str, want: str, exact: bool) -> bool:
    return name == want or (not exact and name.startswith(want))


def network_problem(environ: dict[str, str]) -> str | None:
    """The one-line problem with this node's *_SOCKET_IFNAME settings, if any."""
    present = [name for _, name in socket.if_nameindex()]
    return "; ".join(missing_interfaces(environ, present)) or None


def missing_interfaces(environ: dict[str, str], present: list[str]) -> list[str]:
    """One message per *_SOCKET_IFNAME entry that matches no interface of this node
    (exclusions, `^...`, cannot be missing)."""
    problems = []
    for var in IFNAME_VARS:
        value = environ.get(var, "")
        if not value or value.startswith("^"):
            continue
        exact, wanted = _wanted(var, value)
        for want in wanted:
            if not any(_matches(name, want, exact) for name in present):
                problems.append(
                    f"{var}={value}: no interface {'named' if exact else 'starting with'} "
                    f"'{want}' on {socket.gethostname()} (present: {', '.join(present)})"
                )
    return problems


def interface_addresses() -> dict[str, str]:
    """The IPv4 address of each interface of this node that has one (Linux SIOCGIFADDR)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()))
            except OSError:  # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def describe_interfaces(environ: dict[str, str], nodes: int = 2) -> str:
    """One line: the interfaces the *_SOCKET_IFNAME variables select here, with addresses, or
    (unset) the address gloo binds to: the one this node's hostname resolves to."""
    addresses = interface_addresses()
    parts = []
    for var in IFNAME_VARS:
        value = environ.get(var, "")
        if value and not value.startswith("^"):
            exact, wanted = _wanted(var, value)
            names = [n for n in addresses if any(_matches(n, w, exact) for w in wanted)]
            chosen = ", ".join(f"{n} {addresses[n]}" for n in names) or "no IPv4 address"
            parts.append(f"{var}={value} ({chosen})")
        elif value:
            parts.append(f"{var}={value}")
    if parts:
        return "; ".join(parts)
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return f"no *_SOCKET_IFNAME set and {host} does not resolve: set GLOO_SOCKET_IFNAME"
    name = next((n for n, a in addresses.items() if a == address), "not an interface here")
    if address.startswith("127.") and nodes > 1:
        name += ", loopback: other nodes cannot reach it"
    return (f"no *_SOCKET_IFNAME set: gloo binds to {host} = {address} ({name}), NCCL picks "
            "its own; set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to choose")  # fmt: skip


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for an all-reduce of `nbytes` over `ranks` (nccl-tests' formula:
    each rank sends and receives 2(n-1)/n of the buffer in a ring)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (ranks - 1) / ranks


@dataclass
class Transport:
    level: int
    message: str


def read_nccl_log(text: str) -> list[Transport]:
    """What an NCCL_DEBUG=INFO log says about the inter-node transport.

    NCCL logs `NET/IB : Using [0]mlx5_0:1/IB` or `NET/Socket : Using [0]eth0:...` when it picks a
    network plugin, and `via NET/IB/0` or `via NET/Socket/0` for each inter-node channel.
    Sockets between nodes usually mean IB was not found (no rdma-core in the container, wrong
    NCCL_IB_HCA, IB disabled) and cost several times the bandwidth.
    """
    socket_lines = re.findall(
        r".*(?:via NET/Socket|NET/Socket : Using|Using network Socket).*", text
    )
    ib_lines = re.findall(r".*(?:via NET/IB|NET/IB : Using|Using network IB).*", text)
    if socket_lines:
        return [Transport(logging.WARNING, (
            f"inter-node traffic goes over sockets (NET/Socket), not InfiniBand (NET/IB): "
            f"{len(socket_lines)} line(s), e.g. '{socket_lines[0].strip()}'. Check that the IB "
            "devices are visible (ibv_devices), rdma-core/libibverbs are installed, and "
            "NCCL_IB_DISABLE / NCCL_IB_HCA / NCCL_NET are not set against it"
        ))]  # fmt: skip
    if ib_lines:
        return [Transport(logging.INFO, f"inter-node traffic uses InfiniBand (NET/IB), "
                          f"{len(ib_lines)} line(s)")]  # fmt: skip
    return [Transport(logging.WARNING, (
        "no NCCL network transport lines in the log: run with NCCL_DEBUG=INFO (and "
        "NCCL_DEBUG_SUBSYS=INIT,NET), on more than one node"
    ))]  # fmt: skip


def time_all_reduce(
    group: dist.ProcessGroup, numel: int, iters: int, device: torch.device
) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of a float32 all-reduce over `group`; the slowest rank's time."""
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(buf, group=group)  # warm-up: connections are set up lazily
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return bus_bandwidth(buf.numel() * buf.element_size(), elapsed.item(), group.size())


def check_ranks(size_mb: float, iters: int, nodes: int | None) -> int:
    """The torchrun part: layout, interfaces and bandwidth. Returns the number of problems."""
    from parallel.dims import LaunchEnv
    from parallel.runtime import build_mesh, init_distributed, pick_device

    env = LaunchEnv.from_env()
    nodes = nodes or env.num_nodes
    per_node = env.world_size // nodes
    device = pick_device("auto", env)
    init_distributed(device, env, timeout_s=120)
    try:
        problems = missing_interfaces(dict(os.environ), [n for _, n in socket.if_nameindex()])
        layout: list[tuple[int, int, str, str] | None] = [None] * env.world_size
        me = (env.rank, env.local_rank, socket.gethostname(), str(device))
        dist.all_gather_object(layout, me)
        all_problems: list[list[str] | None] = [None] * env.world_size
        dist.all_gather_object(all_problems, problems)
        if env.rank == 0:
            logger.info("%d node(s) x %d ranks, %s", nodes, per_node, dist.get_backend())
            for node in range(nodes):
                ranks = layout[node * per_node : (node + 1) * per_node]
                hosts = sorted({host for _, _, host, _ in ranks})
                logger.info("node %d (%s): ranks %s on %s", node, ",".join(hosts),
                            [r for r, *_ in ranks], ", ".join(d for *_, d in ranks))  # fmt: skip
            for rank, found in enumerate(all_problems):
                for problem in found or []:
                    logger.error("rank %d: %s", rank, problem)

        mesh = build_mesh(device, nodes, per_node)
        numel = max(1, int(size_mb * 2**20) // 4)
        for dim, where in (("dp_shard", "intra-node"), ("dp_replicate", "inter-node")):
            group = mesh[dim].get_group()
            if group.size() == 1:
                continue
            algbw, busbw = time_all_reduce(group, numel, iters, device)
            if env.rank == 0:
                logger.info(
                    "all-reduce %s (%s, %d ranks, %.1f MB): algbw %.2f GB/s, busbw %.2f GB/s",
                    where, dim, group.size(), numel * 4 / 1e6, algbw, busbw,
                )  # fmt: skip
        return sum(len(p or []) for p in all_problems)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.preflight",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mb", type=float, default=256.0, help="all-reduce buffer (MiB)")
    parser.add_argument("--iters", type=int, default=10, help="timed all-reduces per mesh dim")
    parser.add_argument("--nccl-log", type=Path, help="an NCCL_DEBUG=INFO log to check")
    parser.add_argument("--nodes", type=int, help="treat the ranks as this many nodes (testing "
                        "on one machine); default: torchrun's GROUP_WORLD_SIZE")  # fmt: skip
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    problems = 0
    if "WORLD_SIZE" in os.environ or args.nccl_log is None:
        problems += check_ranks(args.size_mb, args.iters, args.nodes)
    if args.nccl_log is not None and rank == 0:
        for finding in read_nccl_log(args.nccl_log.read_text(errors="replace")):
            logger.log(finding.level, "%s: %s", args.nccl_log, finding.message)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
