"""Check a launch before any rank starts: this node's network interface and the config.

    python -m launch.check --world-size 16 --nnodes 2 configs/llama3_8b.toml --train.steps=10

Every launch script runs this before torchrun (hsdp.sbatch: once, in the batch shell, before
srun). A deterministic failure (a config error, missing data, a mesh that does not divide the
world, a run folder in use, a *_SOCKET_IFNAME that names no interface here) then ends the job
with one line and exit status 2, instead of every rank failing the same way, torchrun printing
its ChildFailedError and restarting them MAX_RESTARTS times. The arguments after the launch
options are train.py's, in any order.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger("launch.check")


def check_network(environ: dict[str, str], nodes: int) -> str | None:
    """Log the interface the ranks will use; returns the one-line problem, if any."""
    import socket

    from launch.preflight import describe_interfaces, missing_interfaces

    present = [name for _, name in socket.if_nameindex()]
    if problems := missing_interfaces(environ, present):
        return "; ".join(problems)
    logger.info("network: %s", describe_interfaces(environ, nodes))
    return None


def main(argv: list[str] | None = None) -> int:
    # No -h of our own and no abbreviations: everything we do not know is train.py's.
    parser = argparse.ArgumentParser(prog="python -m launch.check", add_help=False,
                                     allow_abbrev=False)  # fmt: skip
    parser.add_argument("--world-size", type=int, required=True, help="ranks in all")
    parser.add_argument("--nnodes", type=int, default=1, help="torchrun agents (nodes)")
    parser.add_argument("--local-world-size", type=int, help="ranks per node "
                        "(default world-size / nnodes)")  # fmt: skip
    args, train_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    import train  # after argument parsing: it imports torch, which takes seconds
    from parallel.dims import LaunchEnv

    train.setup_logging(0)
    if problem := check_network(dict(os.environ), args.nnodes):
        logger.error("network error: %s", problem)
        return 2
    env = LaunchEnv(
        rank=0,
        local_rank=0,
        world_size=args.world_size,
        local_world_size=args.local_world_size or args.world_size // max(1, args.nnodes),
        num_nodes=args.nnodes,
    )
    return train.validate(train_argv, env)


if __name__ == "__main__":
    sys.exit(main())
