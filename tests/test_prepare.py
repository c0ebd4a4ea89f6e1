"""data.prepare at scale: every input format, N workers writing the same bytes as one, bad input
as one line that names the file, and a killed prepare that leaves no dataset behind."""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from configs import ConfigError
from data import prepare as prepare_module
from data.loader import open_dataset
from data.prepare import Progress, is_val, prepare
from tests.conftest import WORDS

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstd = pytest.importorskip("zstandard")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
VAL = 0.3


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + " héllo ✓\n"


def _jsonl(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _write_mixed_corpus(root: Path) -> list[tuple[str, bytes]]:
    """One file of each input format under ``root`` (plus extra/); the expected (key, document)
    list in the order prepare reads them."""
    rng = random.Random(0)
    docs: list[tuple[str, bytes]] = []
    root.mkdir()

    def texts(n: int) -> list[str]:
        return [_text(rng, rng.randint(1, 60)) for _ in range(n)]

    # Not valid UTF-8: a text file's raw bytes are kept exactly.
    (root / "a.txt").write_bytes(b"caf\xe9 in latin-1\n")
    docs.append(("a.txt", b"caf\xe9 in latin-1\n"))
    recs = texts(9)
    lines = [json.dumps({"body": t, "n": i}) for i, t in enumerate(recs)]
    (root / "b.jsonl").write_text("\n".join([*lines[:3], "", *lines[3:]]) + "\n")
    docs += [(f"b.jsonl:{i + 1 + (i >= 3)}", t.encode()) for i, t in enumerate(recs)]
    recs = texts(8)  # two gzip members back to back, as `cat a.gz b.gz` makes
    members = [_jsonl([{"body": t} for t in recs[:5]]), _jsonl([{"body": t} for t in recs[5:]])]
    (root / "c.jsonl.gz").write_bytes(b"".join(gzip.compress(m, mtime=0) for m in members))
    docs += [(f"c.jsonl.gz:{i + 1}", t.encode()) for i, t in enumerate(recs)]
    recs = texts(7)  # two zstd frames
    cctx = zstd.ZstdCompressor(write_checksum=True)
    frames = [_jsonl([{"body": t} for t in recs[:2]]), _jsonl([{"body": t} for t in recs[2:]])]
    (root / "d.jsonl.zst").write_bytes(b"".join(cctx.compress(f) for f in frames))
    docs += [(f"d.jsonl.zst:{i + 1}", t.encode()) for i, t in enumerate(recs)]
    recs = texts(10)  # three row groups; a second column that is not read
    table = pa.table({"id": list(range(10)), "body": recs})
    pq.write_table(table, root / "e.parquet", row_group_size=4)
    docs += [(f"e.parquet:{i}", t.encode()) for i, t in enumerate(recs)]
    (root / "f.md").write_text("# title\n" + recs[0])
    (root / "sub").mkdir()
    (root / "sub" / "g.py").write_text("x = 1\n")
    (root / "empty.txt").write_text("")  # skipped: no document
    docs += [("f.md", ("# title\n" + recs[0]).encode()), ("sub/g.py", b"x = 1\n")]
    # Not matched by the default pattern; named as an input of its own, read decompressed.
    (root.parent / "extra").mkdir()
    (root.parent / "extra" / "h.txt.zst").write_bytes(cctx.compress(b"zstd text file\n"))
    docs.append(("h.txt.zst", b"zstd text file\n"))
    return docs


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _byte_documents(out: Path, split: str) -> list[bytes]:
    index = open_dataset(out)
    tokens = np.concatenate([np.fromfile(s.file, dtype=index.dtype) for s in index.splits[split]])
    docs = np.split(tokens, np.flatnonzero(tokens == index.eos_id) + 1)[:-1]
    return [bytes(d[:-1].astype(np.uint8)) for d in docs]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[tuple[str, bytes]]]:
    root = tmp_path_factory.mktemp("mixed")
    docs = _write_mixed_corpus(root / "corpus")
    return [str(root / "corpus"), str(root / "extra" / "h.txt.zst")], docs


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small byte-level BPE tokenizer.json, trained here (nothing is downloaded)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = random.Random(1)
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    hf.train_from_iterator([_text(rng, 200) for _ in range(50)], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    hf.save(str(path))
    return str(path)


def test_every_format_is_read_and_workers_write_the_same_bytes(
    tmp_path: Path, mixed: tuple[list[str], list[tuple[str, bytes]]], monkeypatch
) -> None:
    inputs, docs = mixed
    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 4)  # many chunks: their order matters
    one = prepare(inputs, tmp_path / "w1", val_fraction=VAL, field="body", workers=1)
    assert _byte_documents(one, "train") == [d for k, d in docs if not is_val(k, VAL)]
    assert _byte_documents(one, "val") == [d for k, d in docs if is_val(k, VAL)] != []
    for workers in (2, 3):
        out = prepare(inputs, tmp_path / f"w{workers}", val_fraction=VAL, field="body",
                      workers=workers)  # fmt: skip
        assert _files(out) == _files(one), f"{workers} workers wrote other bytes than 1"


def test_a_tokenizer_json_on_two_workers_writes_the_same_bytes(
    tmp_path: Path, mixed: tuple[list[str], list[tuple[str, bytes]]], bpe: str, monkeypatch
) -> None:
    inputs, docs = mixed
    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 4)
    one = prepare(inputs, tmp_path / "w1", bpe, val_fraction=VAL, field="body", workers=1)
    two = prepare(inputs, tmp_path / "w2", bpe, val_fraction=VAL, field="body", workers=2)
    assert _files(two) == _files(one)
    index = open_dataset(two)
    assert index.tokenizer["kind"] == "hf" and index.vocab_size == 300
    # The documents as the tokenizer encodes them one by one, EOS after each.
    tok = tokenizers.Tokenizer.from_file(bpe)
    eos = [tok.token_to_id("<|endoftext|>")]
    want = [
        tok.encode(d.decode("utf-8", errors="replace"), add_special_tokens=False).ids + eos
        for k, d in docs
        if not is_val(k, VAL)
    ]
    got = np.concatenate([np.fromfile(s.file, dtype=np.uint16) for s in index.splits["train"]])
    assert got.tolist() == sum(want, [])


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m data.prepare ARGS`` as a user runs it, stderr not a terminal."""
    cmd = [sys.executable, "-m", "data.prepare", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: data ") and "Traceback" not in result.stderr
    return lines[0]


def _corrupt(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + 16] = bytes(b ^ 0x5A for b in data[at : at + 16])
    path.write_bytes(bytes(data))


def test_bad_input_is_one_line_naming_the_file_and_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(2)
    # ~1.4 MB, ~270 KB compressed: several pieces of PIECE_BYTES
    records = _jsonl([{"text": _text(rng, 300)} for _ in range(800)])
    (tmp_path / "in").mkdir()
    good = tmp_path / "in" / "ok.jsonl"
    good.write_bytes(b"".join(records.splitlines(keepends=True)[:3]))
    ds = tmp_path / "ds"
    ok = _cli("--input", str(good), "--out", str(ds), "--workers", "2")
    # Without a terminal there is no bar (no carriage returns), only the closing log line.
    assert ok.returncode == 0 and "\r" not in ok.stderr, ok.stderr[-3000:]
    assert ok.stderr.splitlines()[-1].startswith(f"prepared {ds} in ")
    before = _files(ds)

    gz = tmp_path / "in" / "bad.jsonl.gz"
    gz.write_bytes(gzip.compress(records, mtime=0))
    _corrupt(gz, 150_000)
    zst = tmp_path / "in" / "bad.jsonl.zst"
    zst.write_bytes(zstd.ZstdCompressor(write_checksum=True).compress(records))
    _corrupt(zst, 150_000)
    crc = tmp_path / "in" / "crc.jsonl.gz"  # the data intact, its checksum in the trailer not
    crc.write_bytes(gzip.compress(records, mtime=0))
    _corrupt(crc, crc.stat().st_size - 8)
    cut = tmp_path / "in" / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(records, mtime=0)[:-100])
    parquet = tmp_path / "in" / "rows.parquet"
    pq.write_table(pa.table({"content": ["a", "b"], "n": [1, 2]}), parquet)
    broken_tok = tmp_path / "tokenizer.json"
    broken_tok.write_text('{"version": "1.0", "model": ')
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    # Damaged compressed data is caught by the decoder, or decodes to garbage that is not JSON
    # (which depends on the zlib build): either way the line names the file and a byte offset.
    cases = {
        (str(gz),): rf"{gz}.*(?:corrupt|invalid JSON).*offsets? (?:\d+ and )?(\d+)",
        (str(zst),): rf"{zst}.*(?:corrupt|invalid JSON).*offsets? (?:\d+ and )?(\d+)",
        (str(crc),): rf"'{crc}' is corrupt: its gzip data between byte offsets \d+ and "
        rf"{crc.stat().st_size} does not decode \(.*incorrect data check\)",
        (str(cut),): rf"'{cut}' is corrupt: its gzip data ends unfinished at byte offset \d+",
        (str(parquet),): rf"'{parquet}' has no column 'text' \(its columns: content, n\); "
        "choose the column with --field",
        (str(good), "--tokenizer", str(broken_tok)): (
            rf"data tokenizer: '{broken_tok}' is not a valid tokenizer.json \(.*line 1"
        ),
    }
    listing = sorted(p.name for p in tmp_path.iterdir())
    for args, pattern in cases.items():
        line = _one_error_line(_cli("--input", args[0], "--out", str(ds), *args[1:]))
        match = re.search(pattern, line)
        assert match, line
        if match.groups():  # the damage is at byte 150,000: found there or later, never before
            assert int(match[1]) > 150_000, line
        # The dataset that was there is untouched, and nothing is left beside it.
        assert _files(ds) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == listing

    # An --out that is a file: refused before anything is written, the file as it was.
    line = _one_error_line(_cli("--input", str(good), "--out", str(a_file)))
    assert line == f"error: data prepare: --out '{a_file}' is a file; give a directory to write to"
    assert a_file.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == listing


def test_binary_files_are_skipped_and_text_that_is_not_utf8_is_named(
    tmp_path: Path, bpe: str
) -> None:
    """A corpus of source files with binary ones among them (random bytes named .py): each
    skipped, counted in the summary and named in one warning. A Latin-1 file is read by a
    tokenizer.json with its bad bytes as U+FFFD: one warning names it and the offset, the summary
    counts them. The byte tokenizer keeps such a file's bytes as they are: nothing to say."""
    src = tmp_path / "src"
    src.mkdir()
    noise = random.Random(3).randbytes(2000)
    assert b"\0" in noise  # what makes a file binary
    (src / "a.py").write_text("x = 1\n")
    (src / "b.py").write_bytes(noise)
    # Latin-1, and a U+FFFD of its own in UTF-8, which is not counted as replaced.
    (src / "c.py").write_bytes(b"# caf\xe9 and " + "\ufffd".encode() + b"\ny\n")
    (src / "d.txt").write_bytes(b"text\0with a NUL")
    (src / "e.md").write_text("# fine ✓\n")
    latin1_at = len("# caf")
    binary = f"2 binary files skipped (a NUL byte, which text never holds): {src}/b.py, {src}/d.txt"
    args = ("--input", str(src), "--val-fraction", "0", "--workers", "1")

    result = _cli(*args, "--out", str(tmp_path / "hf"), "--tokenizer", bpe)
    assert result.returncode == 0, result.stderr[-3000:]
    *warnings, summary = result.stderr.strip().splitlines()
    assert warnings == [
        binary,
        f"1 file not UTF-8: the tokenizer reads 1 character of it as U+FFFD (first: {src}/c.py "
        f"at byte offset {latin1_at}); convert to UTF-8 to keep the text (iconv -f latin1 -t "
        "utf-8)",
    ]
    assert summary.startswith(f"prepared {tmp_path / 'hf'} in ") and summary.endswith(
        "uint16, 2 binary files skipped, 1 character replaced by U+FFFD)"
    ), summary
    index = json.loads((tmp_path / "hf" / "index.json").read_text())
    assert index["sources"]["num_documents"] == {"train": 3, "val": 0}

    result = _cli(*args, "--out", str(tmp_path / "bytes"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[:-1] == [binary]
    texts = _byte_documents(tmp_path / "bytes", "train")
    assert sorted(texts) == sorted([b"x = 1\n", (src / "c.py").read_bytes(), "# fine ✓\n".encode()])

    only_binary = _one_error_line(_cli("--input", str(src / "b.py"), "--out", str(tmp_path / "x")))
    assert only_binary == (
        f"error: data prepare: no text found in {src / 'b.py'} (1 binary file skipped (a NUL "
        f"byte, which text never holds): {src}/b.py)"
    )


def test_field_chooses_the_jsonl_field_and_the_parquet_column(tmp_path: Path) -> None:
    (tmp_path / "recs.jsonl").write_text(_jsonl([{"body": "one", "text": "x"}]).decode())
    pq.write_table(pa.table({"body": ["two", None], "text": ["y", "z"]}), tmp_path / "t.parquet")
    out = prepare([str(tmp_path / "recs.jsonl")], tmp_path / "a", field="body", val_fraction=0)
    assert _byte_documents(out, "train") == [b"one"]
    prepare_module.main(["--input", str(tmp_path / "recs.jsonl"), "--field", "text",
                         "--out", str(tmp_path / "b"), "--val-fraction", "0"])  # fmt: skip
    assert _byte_documents(tmp_path / "b", "train") == [b"x"]
    with pytest.raises(ConfigError, match=r"t.parquet': row 1 has no 'body' \(null\)"):
        prepare([str(tmp_path / "t.parquet")], tmp_path / "c", field="body")
    with pytest.raises(ConfigError, match=r"recs.jsonl:1: no string field 'n' .*--field"):
        prepare([str(tmp_path / "recs.jsonl")], tmp_path / "c", field="n")
    pq.write_table(pa.table({"n": [1]}), tmp_path / "n.parquet")
    with pytest.raises(ConfigError, match="column 'n' holds int64, not text"):
        prepare([str(tmp_path / "n.parquet")], tmp_path / "c", field="n")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("module", "suffix"), [("zstandard", ".jsonl.zst"), ("pyarrow", ".parquet")]
)
def test_a_missing_reader_names_the_extra(tmp_path: Path, monkeypatch, module: str, suffix: str):
    (tmp_path / f"x{suffix}").write_bytes(b"")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    monkeypatch.setitem(sys.modules, f"{module}.parquet", None)
    with pytest.raises(ConfigError, match=rf"needs {module}: pip install 'fsdp2-trainer\[data\]'"):
        prepare([str(tmp_path / f"x{suffix}")], tmp_path / "out")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_log_lines_otherwise(caplog) -> None:
    terminal = _Terminal()
    bar = Progress(10_000_000, stream=terminal)
    bar.update(5_000_000, 2_000_000)
    bar.close()
    assert "\r" in terminal.getvalue() and re.search(
        r"5\.00M/10\.0MB? \[.*B/s.*tok/s\]", terminal.getvalue()
    )

    plain = io.StringIO()
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        logged = Progress(10_000_000, stream=plain, log_every=0)
        logged.update(5_000_000, 2_000_000)
        logged.close()
    assert plain.getvalue() == ""
    assert re.search(
        r"prepare: 5\.00MB of 10\.0MB read \(50%\), .*B/s, .* tok/s, eta ", caplog.text
    )


def test_leftovers_of_killed_runs_are_removed(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("text")
    dead, alive = tmp_path / ".ds.tmp-999999999", tmp_path / f".ds.tmp-{os.getppid()}"
    other = tmp_path / ".other.tmp-999999999"
    for d in (dead, alive, other):
        d.mkdir()
    prepare([str(tmp_path / "in.txt")], tmp_path / "ds", val_fraction=0)
    # Only this --out's directory of a process that is gone; a running prepare keeps its own.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [alive.name, other.name, "ds", "in.txt"]
    )


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    "signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["KILL", "TERM", "INT"]
)
def test_a_killed_prepare_leaves_no_dataset_and_no_workers(
    tmp_path: Path, bpe: str, signum: int
) -> None:
    rng = random.Random(3)
    # ~24 MB, ~6 s on 2 workers; stopped well before the end, once the first tokens are written.
    (tmp_path / "big.jsonl").write_bytes(
        _jsonl([{"text": _text(rng, 80)} for _ in range(1500)]) * 32
    )
    out = tmp_path / "ds"
    if signum == signal.SIGTERM:  # a dataset prepared earlier at --out: the stop keeps it
        (tmp_path / "old.txt").write_text("an earlier dataset\n")
        prepare([str(tmp_path / "old.txt")], out, val_fraction=0.0)
        old_index = (out / "index.json").read_text()
    cmd = [sys.executable, "-m", "data.prepare", "--input", str(tmp_path / "big.jsonl"),
           "--tokenizer", bpe, "--workers", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    tmp = tmp_path / f".ds.tmp-{proc.pid}"
    deadline = time.monotonic() + 60
    # Wait until tokens are being written, so the workers are up and busy.
    while not (tmp / "train-00000.bin").is_file() or (tmp / "train-00000.bin").stat().st_size == 0:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    workers = _children(proc.pid)
    assert len(workers) >= 2, workers  # the two workers (and multiprocessing's resource tracker)
    proc.send_signal(signum)  # to prepare's process alone, not to its workers
    _, stderr = proc.communicate(timeout=60)
    while not all(_gone(w) for w in workers):
        assert time.monotonic() < deadline + 10, [w for w in workers if not _gone(w)]
        time.sleep(0.05)
    assert not (tmp / "index.json").exists()  # the half-written directory is never complete
    if signum == signal.SIGTERM:
        assert proc.returncode == 143 and (out / "index.json").read_text() == old_index
        kept = f"interrupted by SIGTERM: nothing written to '{out}'; the dataset already there"
        assert "Traceback" not in stderr and stderr.splitlines()[-1] == f"{kept} is kept", stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "ds", "old.txt"]
        return
    # No dataset at --out, and the half-written directory is hidden.
    assert not out.exists()
    with pytest.raises(ConfigError, match="no prepared dataset"):
        open_dataset(out)
    if signum == signal.SIGKILL:
        # The next prepare to the same --out removes the leftover.
        assert tmp.is_dir()
        prepare([str(tmp_path / "big.jsonl")], out, workers=1)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "ds"]
    else:  # caught: the temporary directory is removed on the way out
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]
        assert proc.returncode == 1, stderr
        assert "Traceback" not in stderr, stderr
        assert stderr.splitlines()[-1] == f"interrupted by Ctrl-C: nothing written to '{out}'"
