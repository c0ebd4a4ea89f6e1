"""Benchmark files in their published layouts -> this trainer's multiple-choice task files.

    python -m data.convert_task hellaswag validation.jsonl outputs/tasks/hellaswag.jsonl
    python -m data.convert_task arc test-00000-of-00001.parquet outputs/tasks/arc_easy.jsonl

Reads the Hugging Face datasets' own rows (JSONL, or parquet with the `data` extra), never
downloads, and writes docs/evaluation.md's `{"context", "choices", "gold"}`, with the prompts
and continuations of lm-eval-harness's tasks of the same name, so the accuracies compare:

- hellaswag (Rowan/hellaswag): `activity_label: ctx_a Ctx_b` -> " ending", lm-eval's cleanup
  of the WikiHow brackets; gold `label`;
- arc (allenai/ai2_arc, Easy or Challenge): `Question: ...\\nAnswer:` -> " choice text"; gold
  the index of `answerKey` among `choices.label`;
- piqa (ybisk/piqa): `Question: goal\\nAnswer:` -> " sol1" | " sol2"; gold `label`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from configs import ConfigError

logger = logging.getLogger(__name__)


def _clean(text: str) -> str:
    """lm-eval-harness's hellaswag preprocess: WikiHow's '[title]' markers and brackets."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag(row: dict[str, Any]) -> dict[str, Any]:
    context = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return {
        "context": _clean(row["activity_label"] + ": " + context),
        "choices": [" " + _clean(ending) for ending in row["endings"]],
        "gold": int(row["label"]),
    }


def arc(row: dict[str, Any]) -> dict[str, Any]:
    choices = row["choices"]
    return {
        "context": f"Question: {row['question']}\nAnswer:",
        "choices": [" " + text for text in choices["text"]],
        "gold": list(choices["label"]).index(row["answerKey"]),
    }


def piqa(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "context": f"Question: {row['goal']}\nAnswer:",
        "choices": [" " + row["sol1"], " " + row["sol2"]],
        "gold": int(row["label"]),
    }


LAYOUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "hellaswag": hellaswag,
    "arc": arc,
    "piqa": piqa,
}


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for each row of a JSONL or parquet file; `where` is 'FILE line N' or
    'FILE row N', for messages."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ConfigError(f"{path}: parquet needs pyarrow: pip install -e '.[data]'") from e
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"'{path}' row {i}", row
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                where = f"'{path}' line {number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{where}: not JSON ({e.msg})") from None


def convert(layout: str, source: str | Path, out: str | Path) -> int:
    """Write `source`'s rows as a task file at `out`; returns the number of examples."""
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    source, examples = Path(source), []
    if not source.is_file():
        raise ConfigError(f"no file '{source}'")
    for where, row in read_rows(source):
        try:
            examples.append(LAYOUTS[layout](row))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where}: not a {layout} row ({type(e).__name__}: {e})") from None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(example) + "\n" for example in examples))
    return len(examples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", choices=list(LAYOUTS))
    parser.add_argument("source", help="the benchmark's JSONL or parquet file")
    parser.add_argument("out", help="the task file to write (JSONL)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        n = convert(args.layout, args.source, args.out)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    logger.info("wrote %d examples to %s", n, args.out)


if __name__ == "__main__":
    main()
