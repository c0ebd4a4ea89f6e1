"""Initialization cost per rank for a big flavor on CPU: the whole model vs one rank's shard.

    python bench/init.py                       # llama3 8B, shards of 1/8 (one 8-GPU node)
    python bench/init.py --flavor 70B --shard 64 --threads 2

`init_weights` computes each value from (seed, parameter name, element index)
(model/random_init.py), so a rank can draw only the rows FSDP gives it. This times, on one
transformer block and on the root (embeddings, final norm, output), (a) the counter-based draw
of every whole parameter, what each rank would pay without region draws; (b) the same draw of one
rank's dim-0 shard of each parameter; and (c) torch's own generator (`normal_` then clamp, the
previous init), for scale. Block times are multiplied by the number of layers. The model is
built on meta; only one parameter's values exist at a time.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import ModelConfig, get_family, random_init  # noqa: E402


def time_draws(params: list[tuple[str, tuple[int, ...]]], shard: int) -> float:
    start = time.perf_counter()
    for name, shape in params:
        rows = math.ceil(shape[0] / shard)
        region = (slice(0, rows), *(slice(0, n) for n in shape[1:]))
        random_init.normal(0, name, shape, region, 0.02, True, torch.device("cpu"))
    return time.perf_counter() - start


def time_generator(params: list[tuple[str, tuple[int, ...]]]) -> float:
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _, shape in params:
        torch.empty(shape).normal_(0, 0.02, generator=gen).clamp_(-0.06, 0.06)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama3")
    p.add_argument("--flavor", default="8B")
    p.add_argument("--shard", type=int, default=8, help="ranks sharing each parameter")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    family = get_family(a.family)
    args = family.build_args(ModelConfig(name=a.family, flavor=a.flavor))
    with torch.device("meta"):
        model = family.build_model(args)
    units = family.fsdp_units(model)
    block = [(f"layers.0.{n}", tuple(t.shape)) for n, t in units[0].named_parameters()]
    in_units = {id(t) for u in units for t in u.parameters()}
    root = [(n, tuple(t.shape)) for n, t in model.named_parameters() if id(t) not in in_units]
    n_layers = len(units)
    rows = []
    for what, params, times in (("one block", block, n_layers), ("root", root, 1)):
        full, part = time_draws(params, 1), time_draws(params, a.shard)
        gen = time_generator(params)
        numel = sum(math.prod(s) for _, s in params)
        rows.append((what, numel, full, part, gen, times))
    print(f"{a.family} {a.flavor}: {n_layers} blocks; shard = 1/{a.shard}; "
          f"{a.threads} thread(s)")  # fmt: skip
    print("| part | parameters | whole (counter) | 1/N shard (counter) | whole (torch.Generator) |")
    print("|---|---|---|---|---|")
    totals = [0.0, 0.0, 0.0]
    for what, numel, full, part, gen, times in rows:
        print(f"| {what} | {numel / 1e6:,.0f}M | {full:.2f} s | {part:.2f} s | {gen:.2f} s |")
        totals = [t + v * times for t, v in zip(totals, (full, part, gen), strict=True)]
    print(f"| model ({n_layers} blocks + root) | {sum(r[1] * r[5] for r in rows) / 1e9:.2f}B | "
          f"{totals[0]:.0f} s | {totals[1]:.0f} s | {totals[2]:.0f} s |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
