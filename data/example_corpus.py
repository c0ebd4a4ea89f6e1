"""Write a small corpus in the layout real pretraining corpora come in, from local files only.

    python -m data.example_corpus --out corpus     # needs pip install -e ".[data]" (pyarrow)

Two sources, so that the README's data walk-through (shards -> two-source mixture -> document
masking) runs as written on any machine without downloading anything:

- ``corpus/code/part-0000N.parquet``: this Python's standard-library ``*.py`` files, one row per
  file, columns ``text`` and ``path``, split over ``--shards`` files (how parquet dumps of web
  and code corpora are published);
- ``corpus/prose/part-0000N.jsonl.gz``: the prose of ``pydoc``'s help topics (the language
  reference behind ``help('if')``), one JSON object per line with ``id`` and ``text``.

``python -m data.prepare --input corpus/code --field text`` then tokenizes a source, like any
other directory of shards.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from data.inputs import find_files
from data.prepare import STDLIB_EXCLUDED_DIRS, stdlib_dir


def _split(items: list, shards: int) -> list[list]:
    """Contiguous, nearly equal parts, in order (empty parts are dropped)."""
    size = -(-len(items) // shards)
    return [items[i : i + size] for i in range(0, len(items), size)]


def write_code(out: Path, shards: int) -> int:
    """The stdlib's ``*.py`` files as parquet shards; returns the number of documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = find_files([str(stdlib_dir())], "*.py", STDLIB_EXCLUDED_DIRS)
    # A few test files are deliberately not UTF-8; parquet strings must be, as in real dumps.
    rows = [(key, path.read_bytes().decode("utf-8", "replace")) for path, key in files]
    rows = [(key, text) for key, text in rows if text]
    out.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(_split(rows, shards)):
        table = pa.table({"text": [t for _, t in part], "path": [k for k, _ in part]})
        pq.write_table(table, out / f"part-{i:05d}.parquet")
    return len(rows)


def write_prose(out: Path, shards: int) -> int:
    """pydoc's help topics as gzipped JSONL shards; returns the number of documents."""
    from pydoc_data.topics import topics

    docs = [{"id": name, "text": text} for name, text in sorted(topics.items()) if text.strip()]
    out.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(_split(docs, shards)):
        with gzip.open(out / f"part-{i:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in part)
    return len(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="corpus", help="folder for code/ and prose/")
    parser.add_argument("--shards", type=int, default=4, help="files per source")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        # Shards from an earlier call with other --shards would silently join this corpus.
        print(f"error: --out {out} exists and is not empty", file=sys.stderr)
        return 2
    try:
        code = write_code(out / "code", args.shards)
    except ImportError:
        print('error: parquet needs pyarrow: pip install -e ".[data]"', file=sys.stderr)
        return 2
    prose = write_prose(out / "prose", args.shards)
    print(f"{out}/code: {code} documents (parquet), {out}/prose: {prose} documents (jsonl.gz)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
