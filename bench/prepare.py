"""Tokens/s per core of data.prepare against a plain `tokenizers` encode_batch, 1 and 2 workers.

    python bench/prepare.py                      # the stdlib corpus (~31 MB), 3 rounds: ~5 min
    python bench/prepare.py --rounds 1 --workers 1,2,4

The documents are the quick start's corpus (this Python's standard-library *.py files). Two
tokenizers: the byte tokenizer (prepare's default) and a byte-level BPE tokenizer.json with
`--vocab` ids, trained here on every 8th document (nothing is downloaded).

- `prepare, N workers`: `data.prepare.prepare(..., workers=N)` timed whole, as a user runs it:
  finding and reading the files, starting the workers, tokenizing, writing the shards. Per core
  divides by N, the processes that tokenize; prepare's own process (reading, writing) comes on
  top, so with N = all cores the machine is oversubscribed.
- `encode_batch, 1 thread`: the baseline. One `Tokenizer.encode_batch` call over all documents,
  already decoded in memory (reading is not timed), ids fetched, TOKENIZERS_PARALLELISM=false.
  `encode_batch_fast` is the same without character offsets (what prepare calls where the
  installed tokenizers has it); `encode_batch, all threads` lets Rayon use every core. For the
  byte tokenizer the baselines run a `tokenizers` BPE over the 256 byte symbols with no merges:
  one token per byte, as ours.

Every measurement runs in a fresh process. Cases alternate within each round (A B C A B C ...),
so slow drift of a shared machine falls on all alike; the table shows the median over rounds
and every sample. JSON goes to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.inputs import find_files  # noqa: E402
from data.prepare import STDLIB_EXCLUDED_DIRS, prepare, stdlib_dir  # noqa: E402

# (method, threads): the plain tokenizers baselines. encode_batch_fast skips character offsets;
# data.prepare uses it where the installed tokenizers has it.
BASELINES = [("encode_batch", "1"), ("encode_batch_fast", "1"), ("encode_batch", "all")]


def _documents() -> list[bytes]:
    files = find_files([str(stdlib_dir())], "*.py", STDLIB_EXCLUDED_DIRS)
    return [doc for path, _ in files if (doc := path.read_bytes())]


def _train_bpe(texts: list[str], vocab: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def _bytes_as_tokenizers_bpe(path: Path) -> None:
    """A `tokenizers` BPE with the 256 byte symbols and no merges: one token per byte."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.save(str(path))


def _encode_batch(path: str, method: str, threads: str) -> tuple[int, float, str]:
    from tokenizers import Tokenizer

    texts = [doc.decode("utf-8", errors="replace") for doc in _documents()]
    tok = Tokenizer.from_file(path)
    # tokenizers reads the variable at each call: "false" keeps the batch on this thread.
    os.environ["TOKENIZERS_PARALLELISM"] = "false" if threads == "1" else "true"
    start = time.perf_counter()
    ids = [e.ids for e in getattr(tok, method)(texts, add_special_tokens=False)]
    return sum(map(len, ids)), time.perf_counter() - start, ""


def _prepare(tokenizer: str | None, workers: int, out: str) -> tuple[int, float, str]:
    # One thread for prepare's own process too (workers set it themselves): one worker, one core.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    prepare(None, out, tokenizer, workers=workers)
    seconds = time.perf_counter() - start
    index = json.loads(Path(out, "index.json").read_text())
    tokens = sum(s["num_tokens"] for shards in index["splits"].values() for s in shards)
    digest = hashlib.sha256()
    for path in sorted(Path(out).iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return tokens, seconds, digest.hexdigest()


def _measure(case: dict) -> tuple[int, float, str]:
    """Run one case in a fresh interpreter: ``(tokens, seconds, digest of prepare's output)``.

    Each case gets a process of its own, so none inherits another's heap, threads or caches.
    """
    cmd = [sys.executable, __file__, "--case", json.dumps(case)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    tokens, seconds, digest = json.loads(result.stdout.splitlines()[-1])
    return tokens, seconds, digest


def machine_facts() -> dict:
    import tokenizers

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                if line.startswith("Model name")), "unknown")  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "tokenizers": tokenizers.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_avg_1m_start": os.getloadavg()[0],
    }


def markdown(report: dict) -> str:
    lines = [
        "| tokenizer | program | cores | tokens | tok/s | tok/s per core | samples (tok/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in report["cases"]:
        rates = [t / s for t, s in zip(case["tokens"], case["seconds"], strict=True)]
        median = statistics.median(rates)
        samples = ", ".join(f"{r / 1e6:.2f}M" for r in rates)
        lines.append(
            f"| {case['tokenizer']} | {case['program']} | {case['cores']} | "
            f"{case['tokens'][0]:,} | {median / 1e6:.2f}M | {median / case['cores'] / 1e6:.2f}M "
            f"| {samples} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default="1,2", help="prepare's worker counts, comma-separated")
    p.add_argument("--vocab", type=int, default=8192, help="ids of the BPE tokenizer trained here")
    p.add_argument("--out", type=Path, default=Path("outputs/bench/prepare.json"))
    p.add_argument("--case", help=argparse.SUPPRESS)  # one measurement, in a child process
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if opts.case:
        case = json.loads(opts.case)
        run = _encode_batch(*case["baseline"]) if "baseline" in case else _prepare(*case["prepare"])
        print(json.dumps(run))
        return 0
    work = opts.out.resolve().parent / "prepare"
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine_facts(), "rounds": opts.rounds, "cases": []}

    docs = _documents()
    texts = [doc.decode("utf-8", errors="replace") for doc in docs]
    start = time.perf_counter()
    bpe_path = work / "tokenizer.json"
    _train_bpe(texts[::8], opts.vocab, bpe_path)
    report["corpus"] = {"documents": len(docs), "bytes": sum(map(len, docs))}
    report["bpe"] = {"vocab": opts.vocab, "train_seconds": time.perf_counter() - start}
    print(f"corpus: {len(docs)} documents, {report['corpus']['bytes'] / 1e6:.1f} MB", flush=True)

    workers = [int(w) for w in opts.workers.split(",")]
    cores = os.cpu_count() or 1
    _bytes_as_tokenizers_bpe(work / "bytes.json")
    # name: (prepare's --tokenizer, the baselines' tokenizer.json)
    tokenizers = {"byte": (None, work / "bytes.json"), "bpe": (str(bpe_path), bpe_path)}
    for name, (path, baseline) in tokenizers.items():
        cases = [
            (f"{method}, {threads} thread{'s' * (threads != '1')}", 1 if threads == "1" else cores,
             {"baseline": [str(baseline), method, threads]})
            for method, threads in BASELINES
        ]  # fmt: skip
        cases += [
            (f"prepare, {n} worker{'s' * (n > 1)}", n, {"prepare": [path, n, str(work / name)]})
            for n in workers
        ]
        results = [
            {"tokenizer": name, "program": label, "cores": c, "tokens": [], "seconds": []}
            for label, c, _ in cases
        ]
        digests = set()
        for r in range(opts.rounds):
            for (label, _, case), result in zip(cases, results, strict=True):
                tokens, seconds, digest = _measure(case)
                result["tokens"].append(tokens)
                result["seconds"].append(seconds)
                digests.add(digest)
                print(f"round {r + 1} {name:4} {label:28} {tokens:>12,} tokens {seconds:7.2f} s "
                      f"{tokens / seconds / 1e6:6.2f}M tok/s", flush=True)  # fmt: skip
        # One digest for the baselines (""), one for prepare whatever the number of workers.
        assert len(digests - {""}) == 1, (
            f"{name}: prepare wrote other bytes for other worker counts"
        )
        report["cases"] += results

    report["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"\nJSON: {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
