"""Find the input files of ``data.prepare`` and stream their documents, one at a time.

The format follows the file name, so a directory may mix them:

- ``.jsonl``: one document per line, the string field ``--field`` of each JSON record;
  key ``relpath:LINE`` (1-based).
- ``.parquet``: one document per row, the string column ``--field``; key ``relpath:ROW`` (0-based).
- anything else (``.txt``, ``.py``, ``.md``, ...): the whole file is one document; key ``relpath``.
- a ``.gz`` or ``.zst`` suffix on top (``x.jsonl.gz``, ``x.txt.zst``) is decompressed on the fly.

With ``--format prompt_response`` or ``chat`` every JSONL line is an example (data/sft.py),
checked here and passed on as the line itself.

A file read whole that holds a NUL byte is binary, not text (the rule of git and grep): it is
skipped and counted, never tokenized (``NotText``; docs/data.md says why skipping, not refusing).
With a tokenizer that reads text, a file that is not valid UTF-8 is recorded with the offset of
its first bad byte and the characters the tokenizer will see replaced.

Keys name a document independently of where the corpus lives and of how many workers encode it,
so the hash-based train/val split is stable. Nothing is loaded whole except a single document:
JSONL is read in pieces, parquet one record batch at a time.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import importlib
import json
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol

from configs import ConfigError
from data.sft import Kind as ExampleKind
from data.sft import check_example

Codec = Literal["gzip", "zstd"]
Kind = Literal["jsonl", "parquet", "text"]
CODECS: dict[str, Codec] = {".gz": "gzip", ".zst": "zstd"}
DEFAULT_PATTERN = "*.txt,*.py,*.md,*.jsonl,*.jsonl.gz,*.jsonl.zst,*.parquet"
# Compressed and JSONL input is read in pieces of this size: small enough to keep memory flat,
# large enough that the per-piece Python work is noise.
PIECE_BYTES = 2**16
PARQUET_BATCH_ROWS = 1024
EXTRA = "pip install 'fsdp2-trainer[data]'"


def _has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _glob_root(raw: str) -> Path:
    """The directory before the first wildcard: the keys of ``docs/**/*.md`` are under ``docs``."""
    parts = Path(raw).parts
    fixed = next(i for i, part in enumerate(parts) if _has_glob(part))
    return Path(*parts[:fixed]) if fixed else Path(".")


def _walk(root: Path, patterns: list[str], excluded_dirs: frozenset[str]) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden directories (.git, .venv, our own .tmp outputs) are never corpus.
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs and not d.startswith(".")]
        for name in filenames:
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                files.append(Path(dirpath, name))
    return files


# Third-party packages are not the standard library and differ from machine to machine.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_val(doc_key: str, val_fraction: float) -> bool:
    """Hash-based split: stable per document, independent of corpus order and size."""
    return zlib.crc32(doc_key.encode("utf-8")) % 1_000_000 < val_fraction * 1_000_000


def find_files(
    inputs: list[str], pattern: str, excluded_dirs: frozenset[str] = frozenset()
) -> list[tuple[Path, str]]:
    """``(path, doc_key)`` for every input file, in deterministic order.

    The key is the path relative to its input (directory, glob base or the file's parent), so the
    train/val split does not depend on where the corpus lives on this machine.
    """
    patterns = [p.strip() for p in pattern.split(",") if p.strip()]
    found: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.is_dir():
            root, files = path, _walk(path, patterns, excluded_dirs)
            if not files:
                raise ConfigError(
                    f"data prepare: --input '{raw}' has no files matching '{pattern}'"
                )
        elif path.is_file():
            root, files = path.parent, [path]
        elif _has_glob(raw):
            root = _glob_root(raw)
            files = [Path(p) for p in glob.glob(raw, recursive=True)]
            files = [p for p in files if p.is_file()]
            if not files:
                raise ConfigError(f"data prepare: --input '{raw}' matched no files")
        else:
            raise ConfigError(f"data prepare: --input '{raw}' does not exist")
        keyed = sorted((p.relative_to(root).as_posix(), p) for p in files)
        for key, p in keyed:
            if p.resolve() not in seen:  # the same file named by two inputs is read once
                seen.add(p.resolve())
                found.append((p, key))
    return found


def file_format(path: Path) -> tuple[Codec | None, Kind]:
    """How ``path`` is read, from its name: ``x.jsonl.zst`` is ``("zstd", "jsonl")``."""
    codec = CODECS.get(path.suffix)
    stem = path.stem if codec else path.name
    kind: Kind = "jsonl" if stem.endswith(".jsonl") else "text"
    if stem.endswith(".parquet"):
        if codec:
            raise ConfigError(f"data prepare: '{path}': parquet compresses inside the file; "
                              "give the .parquet itself")  # fmt: skip
        kind = "parquet"
    return codec, kind


def _import(module: str, path: Path) -> ModuleType:
    """The optional dependency reading ``path``, or one line naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise ConfigError(f"data prepare: reading '{path}' needs {package}: {EXTRA}") from e


def check_inputs(
    files: list[tuple[Path, str]], field: str, examples: ExampleKind | None = None
) -> None:
    """Fail before any work on what can be checked up front: missing readers, parquet columns,
    examples (`examples`: a data.sft kind) in a file that is not JSONL."""
    for path, _ in files:
        codec, kind = file_format(path)
        if examples is not None and kind != "jsonl":
            raise ConfigError(
                f"data prepare: '{path}': --format {examples} reads JSONL files (one example per "
                "line: .jsonl, .jsonl.gz, .jsonl.zst); choose the files with --input or --pattern"
            )
        if codec == "zstd":
            _import("zstandard", path)
        if kind == "parquet":
            _parquet_file(path, field)


class _Decoder(Protocol):
    eof: bool
    unused_data: bytes

    def decompress(self, data: bytes) -> bytes: ...


def _decoder(codec: Codec, path: Path) -> tuple[Callable[[], _Decoder], tuple[type[Exception]]]:
    """A factory of fresh decoders for ``codec``, and the error its decoders raise."""
    if codec == "gzip":
        # wbits 16 + MAX_WBITS: expect the gzip header, and check the gzip trailer's CRC.
        return lambda: zlib.decompressobj(wbits=16 + zlib.MAX_WBITS), (zlib.error,)
    zstd = _import("zstandard", path)
    return lambda: zstd.ZstdDecompressor().decompressobj(), (zstd.ZstdError,)


def _pieces(path: Path, codec: Codec | None) -> Iterator[tuple[bytes, int]]:
    """``(data, bytes of the file read so far)``, decompressing a .gz or .zst file as it goes."""
    with path.open("rb") as f:
        if codec is None:
            while piece := f.read(PIECE_BYTES):
                yield piece, f.tell()
            return
        new, errors = _decoder(codec, path)
        decoder, offset = new(), 0
        while piece := f.read(PIECE_BYTES):
            try:
                out = decoder.decompress(piece)
                # A file may hold several gzip members or zstd frames back to back.
                while decoder.eof and decoder.unused_data:
                    rest, decoder = decoder.unused_data, new()
                    out += decoder.decompress(rest)
            except errors as e:
                raise ConfigError(
                    f"data prepare: '{path}' is corrupt: its {codec} data between byte offsets "
                    f"{offset} and {offset + len(piece)} does not decode ({e})"
                ) from e
            offset += len(piece)
            yield out, offset
        if offset and not decoder.eof:
            raise ConfigError(
                f"data prepare: '{path}' is corrupt: its {codec} data ends unfinished at byte "
                f"offset {offset} (a truncated file?)"
            )


def _lines(path: Path, codec: Codec | None) -> Iterator[tuple[int, bytes, int]]:
    """``(line number, line, bytes of the file read so far)``, reading the file in pieces."""
    lineno, head, offset = 0, [], 0  # head: the pieces of a line not finished yet
    for data, offset in _pieces(path, codec):
        lines = data.split(b"\n")
        if len(lines) == 1:  # a long line: join its pieces once, not piece by piece
            head.append(data)
            continue
        lines[0] = b"".join([*head, lines[0]])
        head = [lines.pop()]
        for line in lines:
            lineno += 1
            yield lineno, line, offset
    if last := b"".join(head):
        yield lineno + 1, last, offset


def _jsonl_documents(
    path: Path, key: str, codec: Codec | None, field: str, examples: ExampleKind | None
) -> Iterator[tuple[str, bytes, int]]:
    for lineno, line, offset in _lines(path, codec):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            # Damaged compressed data often decodes to garbage before the checksum catches it.
            hint = f"; it was decoded from bytes before offset {offset}: a corrupt file?"
            raise ConfigError(
                f"data prepare: {path}:{lineno}: invalid JSON ({e}){hint if codec else ''}"
            ) from e
        if examples is not None:  # checked here, to name the line; rendered by the workers
            check_example(record, examples, f"{path}:{lineno}")
            yield f"{key}:{lineno}", line, offset
            continue
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError(
                f"data prepare: {path}:{lineno}: no string field '{field}' "
                "(choose the field with --field)"
            )
        # "replace": JSON may escape lone surrogates, which UTF-8 cannot encode.
        yield f"{key}:{lineno}", text.encode("utf-8", errors="replace"), offset


def _parquet_file(path: Path, field: str) -> Any:
    """The opened ``pyarrow.parquet.ParquetFile``, once its column ``field`` is known to be text."""
    pa, pq = _import("pyarrow", path), _import("pyarrow.parquet", path)
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"data prepare: '{path}' is not a readable parquet file ({e})") from e
    schema = file.schema_arrow
    if field not in schema.names:
        raise ConfigError(
            f"data prepare: '{path}' has no column '{field}' (its columns: "
            f"{', '.join(schema.names)}); choose the column with --field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(
            f"data prepare: '{path}': column '{field}' holds {kind}, not text; "
            "choose the column with --field"
        )
    return file


def _parquet_documents(path: Path, key: str, field: str) -> Iterator[tuple[str, bytes, int]]:
    pa = _import("pyarrow", path)
    file = _parquet_file(path, field)
    size, rows, row = path.stat().st_size, max(file.metadata.num_rows, 1), 0
    try:
        for batch in file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            column = batch.column(0)
            if column.null_count:
                null = row + column.is_null().to_pylist().index(True)
                raise ConfigError(f"data prepare: '{path}': row {null} has no '{field}' (null)")
            # As binary, the column's UTF-8 bytes come out without a round trip through str.
            texts = column.cast(pa.large_binary()).to_pylist()
            offset = size * (row + len(texts)) // rows  # parquet has no offset per row: pro rata
            for i, text in enumerate(texts):
                yield f"{key}:{row + i}", text, offset
            row += len(texts)
    except pa.ArrowException as e:
        raise ConfigError(f"data prepare: '{path}': row {row} and after do not read ({e})") from e


@dataclass
class NotText:
    """Files read whole (``.txt``, ``.py``, ...) whose bytes are not UTF-8 text, as
    ``iter_documents`` meets them; ``data.prepare`` reports them once, at the end."""

    decodes: bool
    """The tokenizer decodes UTF-8 (a tokenizer.json): bytes that are not UTF-8 reach it as
    U+FFFD. The byte tokenizer keeps every byte as it is, so then nothing is replaced."""
    binary: list[str] = dataclasses.field(default_factory=list)
    """Files skipped for a NUL byte, in corpus order."""
    not_utf8: list[str] = dataclasses.field(default_factory=list)
    """Each file that is not UTF-8, with the offset of its first bad byte (decodes only)."""
    replaced: int = 0
    """Characters of those files the tokenizer sees as U+FFFD."""

    def admit(self, path: Path, data: bytes, codec: Codec | None) -> bool:
        """False for a binary file (recorded); else record what decoding would replace."""
        if b"\0" in data:
            self.binary.append(str(path))
            return False
        if self.decodes and not data.isascii():
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                where = f"{path} at byte offset {e.start}" + (" (decompressed)" if codec else "")
                self.not_utf8.append(where)
                # Every U+FFFD the tokenizer will see, less those the file itself spells.
                text = data.decode("utf-8", errors="replace")
                self.replaced += text.count("\ufffd") - data.count("\ufffd".encode())
        return True

    def summary(self) -> str:
        """For the end of prepare's summary line: ', 2 binary files skipped', or ''."""
        text = f", {_count(len(self.binary), 'binary file')} skipped" if self.binary else ""
        if self.not_utf8:
            text += f", {_count(self.replaced, 'character')} replaced by U+FFFD"
        return text

    def warnings(self, named: int = 3) -> list[str]:
        """One line per kind of file that is not text, naming the first `named` of them."""
        lines = []
        if files := self.binary:
            more = f" and {len(files) - named} more" if len(files) > named else ""
            lines.append(
                f"{_count(len(files), 'binary file')} skipped (a NUL byte, which text never "
                f"holds): {', '.join(files[:named])}{more}"
            )
        if files := self.not_utf8:
            more = f" and {len(files) - 1} more" if len(files) > 1 else ""
            lines.append(
                f"{_count(len(files), 'file')} not UTF-8: the tokenizer reads "
                f"{_count(self.replaced, 'character')} of {'it' if len(files) == 1 else 'them'} "
                f"as U+FFFD (first: {files[0]}{more}); convert to UTF-8 to keep the text "
                "(iconv -f latin1 -t utf-8)"
            )
        return lines


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def iter_documents(
    files: list[tuple[Path, str]],
    field: str,
    examples: ExampleKind | None = None,
    not_text: NotText | None = None,
) -> Iterator[tuple[str, bytes, int]]:
    """``(doc_key, utf-8 bytes, input bytes read so far)`` for every document, in order. With
    `examples` (a data.sft kind), every line of the JSONL files is an example of that kind,
    checked, and the document is the line itself. With `not_text`, a binary file read whole is
    skipped and recorded there, and one that is not UTF-8 recorded.

    The byte count (over all files, compressed sizes for compressed files) drives the progress bar.
    """
    done = 0
    for path, key in files:
        codec, kind = file_format(path)
        size = path.stat().st_size
        if kind == "jsonl":
            docs = _jsonl_documents(path, key, codec, field, examples)
        elif kind == "parquet":
            docs = _parquet_documents(path, key, field)
        else:  # raw bytes, not decoded text: files that are not valid UTF-8 stay exact
            data = b"".join(d for d, _ in _pieces(path, codec)) if codec else path.read_bytes()
            text = not_text is None or not_text.admit(path, data, codec)
            docs = iter([(key, data, size)] if text else [])
        for doc_key, doc, offset in docs:
            yield doc_key, doc, done + offset
        done += size
