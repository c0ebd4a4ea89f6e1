"""Preference pairs for DPO: `python -m data.prepare --format preference`.

Reads JSONL (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`) or parquet in TRL's layouts, one pair per line
or row:

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
- conversational: ``prompt``, ``chosen`` and ``rejected`` as message lists
  (``[{"role": ..., "content": ...}]``), rendered with the tokenizer's chat template as
  `--format chat` renders a conversation (data/sft.py): the prompt with the generation prompt,
  each completion as what the template adds after it.

Each pair becomes two sequences that share the prompt, chosen then rejected, each the prompt's
tokens, the completion's, then EOS; the completion and its EOS are the targets. Unlike
examples, pairs are not packed: each sequence is one row of its own, padded to `data.seq_len`
at load time (`PreferencePairs`), so a chosen and its rejected always sit in the same sample
(one position of the global stream), hence the same micro-batch on the same rank.

A split's files: ``{split}.bin`` (the tokens, pair after pair), ``{split}.pairs.bin`` (int64,
one row per pair: chosen start, rejected start, rejected end, prompt tokens) and
``{split}.keys.txt`` (``file:LINE`` of each pair, to name it in messages). index.json is
version 3: a trainer that reads only versions 1 and 2 refuses it instead of packing the
sequences as documents.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from configs import ConfigError
from data.inputs import _lines, file_format, is_val
from data.sft import ExampleFormat, _compiled, load_format
from data.tokenizer import build_tokenizer, index_entry

logger = logging.getLogger(__name__)

FORMAT = "preference"
INDEX_VERSION = 3
FIELDS = ("prompt", "chosen", "rejected")
PAIR_COLUMNS = 4  # chosen start, rejected start, rejected end, prompt tokens


def check_pair(record: Any, where: str) -> bool:
    """ConfigError naming `where` (file:line) unless `record` is a pair in one of TRL's layouts;
    returns whether it is conversational."""
    if not isinstance(record, dict) or any(f not in record for f in FIELDS):
        missing = [f for f in FIELDS if not isinstance(record, dict) or f not in record]
        raise ConfigError(
            f"data prepare: {where}: no field {' or '.join(map(repr, missing))} (--format "
            'preference reads {"prompt": ..., "chosen": ..., "rejected": ...})'
        )
    if all(isinstance(record[f], str) for f in FIELDS):
        for f in ("chosen", "rejected"):
            if not record[f]:
                raise ConfigError(f"data prepare: {where}: the {f} completion is empty")
        return False
    if not all(isinstance(record[f], list) for f in FIELDS):
        raise ConfigError(
            f"data prepare: {where}: prompt, chosen and rejected must all be strings (the "
            "standard layout) or all message lists (the conversational layout)"
        )
    for f in FIELDS:
        for i, m in enumerate(record[f]):
            if not isinstance(m, dict) or not all(
                isinstance(m.get(k), str) for k in ("role", "content")
            ):
                raise ConfigError(
                    f"data prepare: {where}: {f} message {i} is not an object with string "
                    "'role' and 'content'"
                )
    for f in ("chosen", "rejected"):
        if not record[f]:
            raise ConfigError(f"data prepare: {where}: the {f} completion is empty")
    return True


def pair_texts(record: dict, fmt: ExampleFormat, where: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) text of a checked pair. A conversational prompt is its
    messages rendered with the generation prompt, and a completion what the template adds to
    it when rendering prompt + completion (as TRL splits them)."""
    if isinstance(record["prompt"], str):
        return record["prompt"], record["chosen"], record["rejected"]
    prompt = _render(record["prompt"], True, fmt, where)
    completions = []
    for f in ("chosen", "rejected"):
        full = _render([*record["prompt"], *record[f]], False, fmt, where)
        if not full.startswith(prompt):
            raise ConfigError(
                f"data prepare: {where}: the chat template ({fmt.template_from}) renders the "
                f"prompt otherwise than as the start of prompt + {f}, so the {f} completion "
                "cannot be located"
            )
        if not full[len(prompt) :]:
            raise ConfigError(f"data prepare: {where}: the {f} completion renders as no text")
        completions.append(full[len(prompt) :])
    return prompt, completions[0], completions[1]


def _render(messages: list[dict], generation_prompt: bool, fmt: ExampleFormat, where: str) -> str:
    from jinja2 import TemplateError

    try:
        return _compiled(fmt.template).render(
            messages=messages, add_generation_prompt=generation_prompt,
            **dict(fmt.special_tokens),
        )  # fmt: skip
    except TemplateError as e:  # also the template's raise_exception
        raise ConfigError(
            f"data prepare: {where}: the chat template ({fmt.template_from}) does not render "
            f"this pair: {e}"
        ) from e


def read_pairs(files: list[tuple[Path, str]]) -> Iterator[tuple[str, dict]]:
    """(key file:LINE, record) of every pair, in order, each checked."""
    for path, key in files:
        codec, kind = file_format(path)
        if kind == "parquet":
            import pyarrow.parquet as pq

            try:
                rows = pq.read_table(path).to_pylist()
            except Exception as e:  # pyarrow's errors on a damaged file
                raise ConfigError(
                    f"data prepare: '{path}' is not a readable parquet file ({e})"
                ) from e
            for row, record in enumerate(rows, start=1):
                check_pair(record, f"{path}:{row}")
                yield f"{key}:{row}", record
            continue
        if kind != "jsonl":
            raise ConfigError(
                f"data prepare: '{path}': --format preference reads JSONL or parquet files"
            )
        for lineno, line, _ in _lines(path, codec):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"data prepare: {path}:{lineno}: invalid JSON ({e})") from e
            check_pair(record, f"{path}:{lineno}")
            yield f"{key}:{lineno}", record


def prepare_pairs(
    files: list[tuple[Path, str]],
    tmp: Path,
    out: Path,
    tokenizer_path: str | None,
    eos_token: str | None,
    val_fraction: float,
) -> dict[str, Any]:
    """Tokenize the pairs of `files` into `tmp` (to be renamed to `out`); returns index.json."""
    tok = build_tokenizer(tokenizer_path, eos_token)
    fmt = load_format("chat", tokenizer_path)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    splits: dict[str, tuple[list[np.ndarray], list[list[int]], list[str]]] = {
        s: ([], [], []) for s in ("train", "val")
    }
    layouts = set()
    for key, record in read_pairs(files):
        layouts.add("conversational" if isinstance(record["prompt"], list) else "standard")
        texts = pair_texts(record, fmt, key)
        prompt, chosen, rejected = tok.encode_documents([t.encode("utf-8") for t in texts])
        tokens, rows, keys = splits["val" if is_val(key, val_fraction) else "train"]
        start = sum(len(t) for t in tokens)
        eos = np.array([tok.eos_id])
        tokens += [prompt, chosen, eos, prompt, rejected, eos]
        c_len, r_len = len(prompt) + len(chosen) + 1, len(prompt) + len(rejected) + 1
        rows.append([start, start + c_len, start + c_len + r_len, len(prompt)])
        keys.append(key)
    if not splits["train"][1]:
        raise ConfigError("data prepare: no preference pair in the train split")
    entries, digest = {}, hashlib.sha256()
    for split, (tokens, rows, keys) in splits.items():
        flat = np.concatenate(tokens).astype(dtype) if tokens else np.zeros(0, dtype)
        pairs = np.array(rows, dtype=np.int64).reshape(-1, PAIR_COLUMNS)
        flat.tofile(tmp / f"{split}.bin")
        pairs.tofile(tmp / f"{split}.pairs.bin")
        (tmp / f"{split}.keys.txt").write_text("".join(k + "\n" for k in keys))
        digest.update(flat.tobytes() + pairs.tobytes())
        entries[split] = [{"file": f"{split}.bin", "num_tokens": len(flat),
                           "pairs": f"{split}.pairs.bin", "num_pairs": len(pairs),
                           "keys": f"{split}.keys.txt"}]  # fmt: skip
        logger.info("%s: %d pairs, %d tokens", split, len(pairs), len(flat))
    tokenizer = index_entry(tok.describe(), out)
    examples = {"format": FORMAT, "layouts": sorted(layouts), "sha256": digest.hexdigest()}
    if "conversational" in layouts:
        examples["chat_template"] = fmt.template_from
    return {"version": INDEX_VERSION, "dtype": dtype.name, "tokenizer": tokenizer,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
            "splits": entries, "examples": examples}  # fmt: skip
