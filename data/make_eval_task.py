"""A small multiple-choice task from held-out standard-library files: which line comes next?

    python -m data.make_eval_task [--out outputs/data/stdlib/next_line.jsonl] [--seed 0]

Each example's context is the lines of a Python file before a line and its gold choice that
line. Its distractors are, by default, that line with two of its names or symbols swapped,
the same bytes (`--distractors swapped`); with `--distractors other-files`, lines of other
files. The first asks whether the model has learned Python's syntax and the names around it,
which the debug model starts to within its 200 steps; the second whether it uses the context
to tell which line belongs, which takes a larger model and more tokens. The files are those
`python -m data.prepare` holds out for validation (the same hash of the same keys,
data/inputs.py `is_val`), so a model trained on the stdlib dataset has never seen them.
`python -m data.prepare` with no `--input` writes this task into the dataset it makes, where
configs/debug.toml scores it. The file is a function of the seed, the Python version's stdlib
and the arguments; the format is docs/evaluation.md's.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
from pathlib import Path

from configs import ConfigError
from data.inputs import STDLIB_EXCLUDED_DIRS, find_files, is_val, stdlib_dir

logger = logging.getLogger(__name__)

DEFAULT_OUT = "outputs/data/stdlib/next_line.jsonl"
# EOS + context + line fit in configs/debug.toml's data.seq_len = 256 byte tokens.
MAX_CONTEXT_BYTES = 160
MAX_LINE_BYTES = 64
MIN_LINE_CHARS = 8  # shorter lines ("else:", ")") say too little to tell apart
# The pieces a swapped distractor exchanges: names and numbers whole, symbols one by one.
PIECE = re.compile(r"\w+|[^\w\s]")
DISTRACTORS = ("swapped", "other-files")


def held_out_files(val_fraction: float) -> list[tuple[Path, str]]:
    """The stdlib files (path, key) that `python -m data.prepare` puts in its val split."""
    files = find_files([str(stdlib_dir())], "*.py", STDLIB_EXCLUDED_DIRS)
    return [(path, key) for path, key in files if is_val(key, val_fraction)]


def candidate_lines(lines: list[str]) -> list[int]:
    """Indices of lines worth asking about: code of a fitting length, after some context, with
    at least 3 distinct pieces (so 3 swaps of two of them differ from it and each other)."""
    return [
        i
        for i, line in enumerate(lines)
        if i >= 3
        and len(line.strip()) >= MIN_LINE_CHARS
        and len(line.encode("utf-8")) <= MAX_LINE_BYTES
        and not line.lstrip().startswith("#")
        and len(set(PIECE.findall(line))) >= 3
    ]


def swapped(line: str, rng: random.Random) -> str:
    """`line` with two of its distinct pieces swapped and the spaces between pieces where they
    were: the same bytes, so the choices' byte lengths (acc_norm) are equal."""
    pieces = PIECE.findall(line)
    gaps = PIECE.split(line)  # len(pieces) + 1: the indentation, the spaces, the end
    a, b = rng.sample(range(len(pieces)), 2)
    pieces[a], pieces[b] = pieces[b], pieces[a]
    return "".join(gap + piece for gap, piece in zip(gaps, [*pieces, ""], strict=True))


def context_before(lines: list[str], i: int) -> str:
    """The whole lines before line i that fit in MAX_CONTEXT_BYTES, each ending with '\\n'."""
    context = ""
    for line in reversed(lines[:i]):
        if len((line + "\n" + context).encode("utf-8")) > MAX_CONTEXT_BYTES:
            break
        context = line + "\n" + context
    return context


def wrong_choices(
    texts: dict[str, list[str]],
    pool: list[tuple[str, int]],
    key: str,
    i: int,
    n: int,
    distractors: str,
    rng: random.Random,
) -> list[str] | None:
    """`n` distinct lines unlike line i of file `key`: swaps in it, or lines of other files.
    None when the line has too few distinct orders (only with more than 4 choices)."""
    gold_line = texts[key][i]
    wrong: list[str] = []
    for _ in range(200):  # 3 distinct pieces make 3 distinct swaps: 200 draws find them
        if distractors == "swapped":
            line = swapped(gold_line, rng)
        else:
            other, j = rng.choice(pool)
            line = texts[other][j] if other != key else gold_line
        if line.strip() != gold_line.strip() and line not in wrong:
            wrong.append(line)
        if len(wrong) == n:
            return wrong
    return None


def make_examples(
    files: list[tuple[Path, str]],
    n_examples: int,
    n_choices: int,
    seed: int,
    distractors: str = "swapped",
) -> list[dict]:
    """Up to `n_examples` examples with `n_choices` choices each, drawn with `seed`."""
    rng = random.Random(seed)
    texts = {}
    for path, key in files:
        try:
            texts[key] = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:  # a few stdlib tests hold other encodings on purpose
            continue
    pool = [(key, i) for key in sorted(texts) for i in candidate_lines(texts[key])]
    if len(texts) < 2 or len(pool) < n_choices:
        raise ConfigError(
            f"make_eval_task: {len(texts)} held-out files with {len(pool)} usable lines: too "
            "few for distractors from other files (raise --val-fraction)"
        )
    examples = []
    for key, i in rng.sample(pool, min(n_examples, len(pool))):
        wrong = wrong_choices(texts, pool, key, i, n_choices - 1, distractors, rng)
        if wrong is None:
            continue
        gold = rng.randrange(n_choices)
        choices = [*wrong[:gold], texts[key][i], *wrong[gold:]]
        examples.append({"context": context_before(texts[key], i), "choices": choices,
                         "gold": gold, "source": f"{key}:{i + 1}"})  # fmt: skip
    return examples


def write_task(
    out: str | Path,
    val_fraction: float = 0.005,
    n_examples: int = 200,
    n_choices: int = 4,
    seed: int = 0,
    distractors: str = "swapped",
) -> Path:
    """Write the next-line task (JSONL) to `out`; returns it."""
    if n_examples < 1 or n_choices < 2:
        raise ConfigError("make_eval_task: --examples must be >= 1 and --choices >= 2")
    if distractors not in DISTRACTORS:
        raise ConfigError(f"make_eval_task: --distractors must be one of {DISTRACTORS}")
    files = held_out_files(val_fraction)
    examples = make_examples(files, n_examples, n_choices, seed, distractors)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the JSONL task file to write")
    parser.add_argument("--seed", type=int, default=0, help="which lines and distractors")
    parser.add_argument("--examples", type=int, default=200, help="at most this many examples")
    parser.add_argument("--choices", type=int, default=4, help="choices per example")
    parser.add_argument(
        "--val-fraction", type=float, default=0.005, help="data.prepare's, for its val files"
    )
    parser.add_argument(
        "--distractors",
        choices=DISTRACTORS,
        default="swapped",
        help="the gold line with two pieces swapped, or lines of other files (harder)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = write_task(
            args.out, args.val_fraction, args.examples, args.choices, args.seed, args.distractors
        )
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
