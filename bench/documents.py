"""Training throughput on CPU with document masking against causal attention, debug shape.

    python bench/documents.py            # ~10 minutes on an idle 2-core machine
    python bench/documents.py --pairs 1 --kernels chunked

Each run is `train.py` under torchrun on the torchtitan debug shape of bench/throughput.py's
`titan` case (dim 256, 6 layers, 16 heads, vocab 2048, seq 512, 8 sequences per rank on 2 gloo
ranks, bf16 params / fp32 reduce) on the stdlib corpus (`python -m data.prepare`), once with
`data.attention_mask=causal` and once with `document`, for each CPU attention kernel
(`model.attention`: sdpa, chunked). The two masks alternate (A B A B) so slow drift of the
machine hits both alike. Prints tok/s per rank (median of the logged intervals after warm-up)
and the document/causal ratio of each pair; JSON with every command and sample to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from throughput import TITAN, Schedule, machine_facts, run_once, torchrun  # noqa: E402

# Shorter than the titan case's 28 steps: 8 runs fit in ~10 minutes, each with 5 samples.
SCHEDULE = Schedule(steps=16, warmup=6, interval=2)
MASKS = ("causal", "document")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=2, help="causal/document run pairs per kernel")
    p.add_argument("--kernels", default="sdpa,chunked", help="model.attention values to run")
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/documents.json")
    opts = p.parse_args(argv)
    # What throughput.run_once reads from its options.
    opts.out, opts.quick, opts.schedules = opts.out.resolve(), False, {"documents": SCHEDULE}
    if not (REPO / "outputs/data/stdlib/index.json").exists():
        sys.exit("no stdlib corpus: run `python -m data.prepare` first")
    threads = max(1, (os.cpu_count() or 1) // 2)  # as launch/torchrun.sh: cores / ranks
    report: dict = {"machine": machine_facts(), "schedule": vars(SCHEDULE), "results": []}
    for kernel in opts.kernels.split(","):
        runs: dict[str, list[dict]] = {mask: [] for mask in MASKS}
        for i in range(opts.pairs):
            for mask in MASKS:
                args = [*TITAN, f"--model.attention={kernel}", f"--data.attention_mask={mask}"]
                label = f"documents-{kernel}-{mask}-{i}"
                runs[mask].append(run_once("documents", label, torchrun(2), args, threads, opts))
        ratios = [
            d["tok_s"] / c["tok_s"] for c, d in zip(runs["causal"], runs["document"], strict=True)
        ]
        report["results"].append(
            {
                "kernel": kernel,
                "causal_tok_s_per_rank": statistics.median(
                    r["tok_s_per_rank"] for r in runs["causal"]
                ),
                "document_tok_s_per_rank": statistics.median(
                    r["tok_s_per_rank"] for r in runs["document"]
                ),
                "ratios": ratios,
                "runs": runs,
            }
        )
    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        "| model.attention | causal tok/s/rank | document tok/s/rank | document/causal, per pair |"
    )
    print("|---|---|---|---|")
    for r in report["results"]:
        print(
            f"| {r['kernel']} | {r['causal_tok_s_per_rank']:,.0f} | "
            f"{r['document_tok_s_per_rank']:,.0f} | {', '.join(f'{x:.3f}' for x in r['ratios'])} |"
        )
    print(f"\nJSON: {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
