"""DPO's three references against supervised fine-tuning, on CPU: tokens/s and peak memory.

    python bench/dpo.py                  # ~3 minutes on an idle 2-core machine
    python bench/dpo.py --rounds 1 --cases sft,dpo-copy

Each case is `python train.py` (one process, 2 threads, fp32) on the same Llama of dim 256 and
4 layers (vocab 258, 3.3M parameters), 16 sequences of 64 tokens per step, on sums from
docs/examples/preferences.py: SFT on prompt/response examples (the chosen completions, packed
into windows), DPO on the pairs (8 pairs = 16 rows a step), full fine-tuning or LoRA rank 16 on
every Linear of the blocks:

| case | trains | reference |
|---|---|---|
| sft | everything | - |
| dpo-copy | everything | a frozen copy (a second set of weights, one more forward) |
| dpo-precomputed | everything | read with the batch (one pass before training, not timed) |
| sft-lora | adapters | - |
| dpo-lora | adapters | the model with its adapters off (one more forward, no copy) |
| dpo-lora-precomputed | adapters | read with the batch |

The cases alternate (`--rounds`); tok/s is the median of the per-step samples after warm-up
(rows x seq_len per step), peak RSS the trainer's `rss` (ru_maxrss) at the last log step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "docs" / "examples")]

MODEL = ["--model.dim=256", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=4",
         "--model.vocab_size=258", "--parallel.param_dtype=float32", "--data.seq_len=64",
         "--train.micro_batch_size=8", "--optim.warmup_steps=0", "--train.eval_interval=0",
         "--metrics.tensorboard=false", "--checkpoint.interval=0", "--train.steps=12",
         "--metrics.warmup_steps=4", "--metrics.log_interval=1"]  # fmt: skip
LORA = ["--lora.enabled=true", "--lora.rank=16", "--lora.targets=*.attention.*,*.feed_forward.*"]
SFT = ["--data.attention_mask=document", "--train.global_batch_size=16"]
DPO = ["--dpo.enabled=true", "--train.global_batch_size=8"]
CASES = {
    "sft": ("sft", SFT),
    "dpo-copy": ("pairs", [*DPO, "--dpo.reference=copy"]),
    "dpo-precomputed": ("pairs", [*DPO, "--dpo.reference=precomputed"]),
    "sft-lora": ("sft", [*SFT, *LORA]),
    "dpo-lora": ("pairs", [*DPO, *LORA, "--dpo.reference=lora"]),
    "dpo-lora-precomputed": ("pairs", [*DPO, *LORA, "--dpo.reference=precomputed"]),
}
TOKS_RE = re.compile(r"\btok/s ([\d,]+)")
RSS_RE = re.compile(r"\brss ([\d.]+)GiB")


def make_data(work: Path) -> dict[str, Path]:
    """The pairs, and the same prompts with their chosen completions as SFT examples."""
    import preferences

    from data.prepare import prepare

    rows = preferences.pairs(2048, seed=1)
    (work / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows]
    (work / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    return {
        "pairs": prepare([str(work / "pairs.jsonl")], work / "d-pairs", val_fraction=0.0,
                         format="preference"),
        "sft": prepare([str(work / "sft.jsonl")], work / "d-sft", val_fraction=0.0,
                       format="prompt_response"),
    }  # fmt: skip


def run(case: str, data: dict[str, Path], work: Path, label: str) -> dict:
    kind, extra = CASES[case]
    cmd = [sys.executable, "train.py", *MODEL, *extra, f"--data.path={data[kind]}",
           f"--run.output_dir={work / 'runs'}", f"--run.name={label}"]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode:
        raise SystemExit(f"{case} failed:\n{log[-3000:]}")
    samples = [float(x.replace(",", "")) for x in TOKS_RE.findall(log)]
    return {"tok_s": samples[-8:], "rss_gib": max(float(x) for x in RSS_RE.findall(log))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", type=Path, default=REPO / "outputs/bench/dpo.json")
    opts = p.parse_args(argv)
    names = opts.cases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work)
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for i in range(opts.rounds):
            for name in names:
                runs[name].append(run(name, data, work, f"{name}-{i}"))
    results = {
        n: {"tok_s": statistics.median(s for r in rs for s in r["tok_s"]),
            "peak_rss_gib": statistics.median(r["rss_gib"] for r in rs)}
        for n, rs in runs.items()
    }  # fmt: skip
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps({"results": results, "runs": runs}, indent=2) + "\n")
    print("| case | tok/s | vs sft | peak RSS GiB |\n|---|---|---|---|")
    for n, r in results.items():
        base = results.get("sft-lora" if "lora" in n else "sft")
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        print(f"| {n} | {r['tok_s']:,.0f} | {ratio} | {r['peak_rss_gib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
