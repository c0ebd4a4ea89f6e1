"""Data: prepare (text -> shards), the dataset reader, and the global-stream sampler and loader."""

from __future__ import annotations

import itertools
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from configs import ConfigError, parse_config
from data.loader import (
    DataConfig,
    SourceConfig,
    TokenSequences,
    build_dataloader,
    check_eval_split,
    check_token_ids,
    open_dataset,
    open_sources,
)
from data.prepare import find_files, is_val, main, prepare, stdlib_dir
from data.stream import GlobalStream, GlobalStreamBatchSampler
from data.tokenizer import ByteTokenizer, HFTokenizer

# torchdata 0.11 calls torch.set_vital, which newer torch marks deprecated; not our warning.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

SEQ = 16


def _text(i: int) -> str:
    return f"# document {i} héllo ✓\n" + "".join(f"line {j} of file {i}\n" for j in range(60))


def _write_corpus(root: Path, n: int = 40) -> dict[str, str]:
    """Files under ``root`` (plus ignored ones); returns {doc_key: text} of the corpus."""
    docs = {}
    for i in range(n):
        key = f"{'sub/' if i % 3 else ''}doc{i:02d}.{('txt', 'md', 'py')[i % 3]}"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_text(_text(i))
        docs[key] = _text(i)
    (root / "skip.bin").write_text("not matched by the pattern")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD.txt").write_text("hidden directories are skipped")
    (root / "empty.txt").write_text("")
    return docs


def _documents(out: Path, split: str) -> list[str]:
    """Decode a split's shards back into EOS-separated documents."""
    index = json.loads((out / "index.json").read_text())
    tokens = np.concatenate(
        [np.fromfile(out / s["file"], dtype=index["dtype"]) for s in index["splits"][split]]
        or [np.zeros(0, dtype=np.uint16)]
    )
    assert len(tokens) == 0 or tokens[-1] == index["eos_id"]
    ends = np.flatnonzero(tokens == index["eos_id"])
    starts = np.concatenate([[0], ends[:-1] + 1])
    tok = ByteTokenizer()
    return [tok.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, _write_corpus(root)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory, corpus: tuple[Path, dict]) -> Path:
    # Small shards so samples come from several files and the shard-boundary rule matters.
    out = tmp_path_factory.mktemp("data") / "ds"
    return prepare([str(corpus[0])], out, val_fraction=0.2, shard_tokens=20_000)


# --- prepare ---------------------------------------------------------------------------------


def test_prepare_round_trips_text_and_splits_by_document(
    dataset: Path, corpus: tuple[Path, dict[str, str]]
) -> None:
    docs = corpus[1]
    index = json.loads((dataset / "index.json").read_text())
    assert index["version"] == 1 and index["dtype"] == "uint16"
    assert index["tokenizer"] == {
        "kind": "byte", "name": "byte", "relative_path": None, "vocab_size": 258, "eos_id": 257,
        "bos_id": 256,
    }  # fmt: skip
    assert (index["vocab_size"], index["eos_id"], index["bos_id"]) == (258, 257, 256)
    train, val = _documents(dataset, "train"), _documents(dataset, "val")
    # Each split holds exactly the documents whose key hashes there, in sorted-key order.
    want_val = [docs[k] for k in sorted(docs) if is_val(k, 0.2)]
    assert val == want_val and len(val) > 0
    assert train == [docs[k] for k in sorted(docs) if not is_val(k, 0.2)]
    assert index["sources"]["num_documents"] == {"train": len(train), "val": len(val)}
    for split in ("train", "val"):
        for shard in index["splits"][split]:
            assert 0 < shard["num_tokens"] <= 20_000
            assert (dataset / shard["file"]).stat().st_size == 2 * shard["num_tokens"]
    names = [s["file"] for s in index["splits"]["train"]]
    assert names[:2] == ["train-00000.bin", "train-00001.bin"]


def test_prepare_is_deterministic_and_replaces_its_output(
    tmp_path: Path, corpus: tuple[Path, dict], dataset: Path
) -> None:
    out = prepare([str(corpus[0])], tmp_path / "again", val_fraction=0.2, shard_tokens=20_000)
    files = sorted(p.name for p in dataset.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    assert all((dataset / f).read_bytes() == (out / f).read_bytes() for f in files)
    # Re-running over an existing dataset swaps it whole and leaves no temporary directories.
    prepare([str(corpus[0])], out, val_fraction=0.0)
    assert json.loads((out / "index.json").read_text())["splits"]["val"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]


def test_prepare_jsonl_and_val_fallback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lines = [json.dumps({"body": f"record {i}", "id": i}) for i in range(5)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "recs.jsonl").write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n")
    with caplog.at_level(logging.WARNING):
        out = prepare(
            [str(tmp_path / "in" / "*.jsonl")], tmp_path / "out", field="body",
            val_fraction=1e-6,
        )  # fmt: skip
    # No record hashes into val at this fraction, so the last one becomes val, with a warning.
    assert _documents(out, "train") == [f"record {i}" for i in range(4)]
    assert _documents(out, "val") == ["record 4"]
    assert "recs.jsonl:6" in caplog.text
    with pytest.raises(ConfigError, match="--field"):
        prepare([str(tmp_path / "in")], tmp_path / "out2")  # default field "text" is absent


def test_prepare_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.bin").write_text("x")
    (tmp_path / "notdata").mkdir()
    (tmp_path / "notdata" / "keep.txt").write_text("precious")
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "bin"): "no files matching",
        str(tmp_path / "*.nothing"): "matched no files",
        str(tmp_path / "empty"): "no text found",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            prepare([path], tmp_path / "out")
    with pytest.raises(ConfigError, match="is not a prepared dataset"):
        prepare([str(tmp_path / "notdata")], tmp_path / "notdata")
    with pytest.raises(ConfigError, match="val-fraction"):
        prepare([str(tmp_path / "notdata")], tmp_path / "out", val_fraction=1.0)
    with pytest.raises(SystemExit, match="^error: data prepare: --input .* does not exist"):
        main(["--input", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "empty", "notdata"]


def test_default_corpus_is_the_stdlib(tmp_path: Path) -> None:
    # The CLI with no --input: this Python's stdlib *.py (~2 s for ~31M byte tokens).
    main(["--out", str(tmp_path / "stdlib")])
    index = json.loads((tmp_path / "stdlib" / "index.json").read_text())
    assert index["sources"]["inputs"] == [str(stdlib_dir())]
    files = find_files([str(stdlib_dir())], "*.py", frozenset({"site-packages", "dist-packages"}))
    keys = [key for _, key in files]
    assert "json/decoder.py" in keys and keys == sorted(keys)
    assert not any({"site-packages", "dist-packages"} & set(k.split("/")) for k in keys)
    non_empty = sum(1 for path, _ in files if path.stat().st_size > 0)
    assert sum(index["sources"]["num_documents"].values()) == non_empty
    assert open_dataset(tmp_path / "stdlib").num_tokens("train") > 1_000_000
    # And the next-line task that configs/debug.toml scores (docs/evaluation.md).
    assert len((tmp_path / "stdlib" / "next_line.jsonl").read_text().splitlines()) == 200


# --- reading ---------------------------------------------------------------------------------


def _copy(dataset: Path, to: Path) -> Path:
    to.mkdir()
    for f in dataset.iterdir():
        (to / f.name).write_bytes(f.read_bytes())
    return to


def test_open_dataset_errors(tmp_path: Path, dataset: Path) -> None:
    with pytest.raises(ConfigError, match=r"python -m data.prepare --out .*nowhere"):
        open_dataset(tmp_path / "nowhere")
    broken = _copy(dataset, tmp_path / "broken")
    (broken / "train-00001.bin").unlink()
    with pytest.raises(ConfigError, match="train-00001.bin' listed in index.json is missing"):
        open_dataset(broken)
    (broken / "train-00001.bin").write_bytes(b"\0\0")
    with pytest.raises(ConfigError, match="train-00001.bin' has 2 bytes"):
        open_dataset(broken)


def test_corrupt_index_json_names_the_file_and_the_problem(tmp_path: Path, dataset: Path) -> None:
    ds = _copy(dataset, tmp_path / "ds")
    index_file = ds / "index.json"
    good = json.loads(index_file.read_text())
    cases = {
        '{"version": 1,': r"is not valid JSON \(Expecting property name .*line 1 column 15",
        "[1, 2]": "is not a JSON object",
        json.dumps({k: v for k, v in good.items() if k not in ("eos_id", "splits")}): (
            "has no eos_id, splits"
        ),
        json.dumps(good | {"splits": {"train": [{"file": "train-00000.bin"}]}}): (
            r"is malformed \(a shard entry has no key 'num_tokens'\)"
        ),
        json.dumps(good | {"vocab_size": "many"}): r"is malformed \(invalid literal for int",
        # bos_id is recorded even when null (a tokenizer without BOS).
        json.dumps({k: v for k, v in good.items() if k != "bos_id"}): "has no bos_id;",
        # A Hugging Face tokenizer's hash tells tokenizers of one size and ids apart.
        json.dumps(good | {"tokenizer": good["tokenizer"] | {"kind": "hf"}}): (
            "has no tokenizer.sha256;"
        ),
    }
    for text, problem in cases.items():
        index_file.write_text(text)
        with pytest.raises(ConfigError) as err:
            open_dataset(ds)
        message = str(err.value)
        assert message.startswith(f"data.path: '{index_file}' ") and "\n" not in message
        assert re.search(problem, message), message
        assert message.endswith(f"re-create it with: python -m data.prepare --out {ds}")
    index_file.write_text(json.dumps(good | {"bos_id": None}))
    assert open_dataset(ds).bos_id is None and open_dataset(dataset).bos_id == 256


# --- the validation split, checked at startup ---------------------------------------------------


def test_check_eval_split(dataset: Path) -> None:
    index = open_dataset(dataset)
    available = index.num_sequences("val", SEQ)
    assert available == len(TokenSequences(index, "val", SEQ)) > 16
    check_eval_split(index, SEQ, global_batch_size=8, eval_batches=available // 8)  # all fit
    # One more batch would wrap around and repeat the split's first sequences.
    with pytest.raises(ConfigError) as err:
        check_eval_split(index, SEQ, global_batch_size=8, eval_batches=available // 8 + 1)
    assert str(err.value) == (
        f"train.eval_batches={available // 8 + 1} x train.global_batch_size=8 = "
        f"{(available // 8 + 1) * 8} sequences per evaluation, but the val split of "
        f"'{dataset}' holds {available} sequences of data.seq_len={SEQ} "
        f"(at most {available // 8} eval_batches): set train.eval_batches <= {available // 8}"
    )
    with pytest.raises(ConfigError, match=r"at most 0 eval_batches\): lower train.global_batch"):
        check_eval_split(index, SEQ, global_batch_size=available + 1, eval_batches=1)
    # Shorter than seq_len + 1 tokens: not one sequence, found before the first step.
    longest = max(shard.num_tokens for shard in index.splits["val"])
    check_eval_split(index, longest - 1, global_batch_size=1, eval_batches=1)
    with pytest.raises(ConfigError, match=rf"no shard of it holds one sequence of data.seq_len="
                       rf"{longest} \(\+1 target token\).*train.eval_interval=0"):  # fmt: skip
        check_eval_split(index, longest, global_batch_size=1, eval_batches=1)


def test_token_ids_beyond_the_model_vocabulary_name_the_shard(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An id >= the model's embedding rows would fail inside every rank ("index out of range"):
    one config error naming the shard when the data is opened, before any rank trains. A split
    up to FULL_SCAN_TOKENS is read whole; a larger one is sampled in blocks."""
    import data.loader as loader
    from launch.check import check_config
    from launch.job import JobConfig
    from parallel.dims import LaunchEnv

    bad = _copy(dataset, tmp_path / "bad")
    index = open_dataset(bad)
    check_token_ids(index, index.vocab_size)  # as prepared
    shard = index.splits["train"][-1]
    tokens = np.memmap(shard.file, dtype=index.dtype, mode="r+")
    tokens[123] = 60000
    tokens.flush()
    expected = rf"data.path: shard '{shard.file}' \(train\) holds token id 60000 \(the first too "
    with pytest.raises(
        ConfigError, match=expected + r"large at token 123\), but the model has 512"
    ):
        check_token_ids(index, 512)
    # Sampled: blocks at both ends and evenly between; one bad id between them goes unseen.
    monkeypatch.setattr(loader, "FULL_SCAN_TOKENS", 0)
    monkeypatch.setattr(loader, "SAMPLE_BLOCK", 16)
    monkeypatch.setattr(loader, "SAMPLE_BLOCKS", 4)
    check_token_ids(index, 512)
    tokens[shard.num_tokens - 1] = 60000
    tokens.flush()
    at = shard.num_tokens - 1
    with pytest.raises(ConfigError, match=rf"first too large at token {at}\)"):
        check_token_ids(index, 512)
    # As the trainer opens it: check_config, on every rank before the process group.
    monkeypatch.undo()
    job = parse_config(JobConfig, [f"--data.path={bad}", "--model.vocab_size=512",
                                   f"--run.output_dir={tmp_path}"])  # fmt: skip
    with pytest.raises(ConfigError, match=expected):
        check_config(job, LaunchEnv(0, 0, 1, 1, 1))


def test_trainer_rejects_too_many_eval_batches_at_startup(tmp_path: Path, dataset: Path) -> None:
    """The check wired into train.py: one config error line, exit 2, before any step."""
    too_many = open_dataset(dataset).num_sequences("val", SEQ) // 8 + 1
    tiny = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=2"]
    result = subprocess.run(
        [
            sys.executable, "train.py", "configs/debug.toml", f"--data.path={dataset}",
            f"--train.eval_batches={too_many}", f"--data.seq_len={SEQ}",
            f"--run.output_dir={tmp_path}", "--train.steps=1", "--metrics.tensorboard=false",
            *tiny,
        ],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "config error:" in line]
    assert result.returncode == 2, output[-2000:]
    assert len(errors) == 1 and f"train.eval_batches={too_many}" in errors[0], output[-2000:]
    assert "Traceback" not in output and "loss" not in output  # no step ran


def test_sequences_are_shifted_windows_within_shards(dataset: Path) -> None:
    index = open_dataset(dataset)
    seqs = TokenSequences(index, "train", SEQ)
    maps = [np.fromfile(s.file, dtype=np.uint16) for s in index.splits["train"]]
    assert len(seqs) == sum((len(m) - 1) // SEQ for m in maps)
    in_shard0 = (len(maps[0]) - 1) // SEQ
    # (sample, shard, window start): the first, the last of shard 0, the first of shard 1.
    cases = [(0, 0, 0), (in_shard0 - 1, 0, (in_shard0 - 1) * SEQ), (in_shard0, 1, 0)]
    for i, shard, start in cases:
        x, y = seqs[i]
        window = torch.from_numpy(maps[shard][start : start + SEQ + 1].astype(np.int64))
        assert x.dtype == torch.int64 and torch.equal(x, window[:-1]) and torch.equal(y, window[1:])
    with pytest.raises(IndexError):
        seqs[len(seqs)]
    with pytest.raises(ConfigError, match="'val' split .* too few for one sequence"):
        TokenSequences(index, "val", 10**7)
    with pytest.raises(ConfigError, match="seq_len"):
        DataConfig(seq_len=0)


# --- the global stream -----------------------------------------------------------------------


def _sampler(
    n: int, d: int, r: int, b: int, shuffle: bool = True, seed: int = 7, name: str = "ds"
) -> GlobalStreamBatchSampler:
    """One source of n samples, as the loader streams a dataset in a folder called `name`."""
    stream = GlobalStream({name: n}, {name: 1.0}, seed, shuffle)
    return GlobalStreamBatchSampler(stream, dp_rank=r, dp_size=d, micro_batch_size=b)


def _micro_batches(n: int, d: int, r: int, b: int, steps: int, seed: int = 7) -> list[list[int]]:
    batches = itertools.islice(iter(_sampler(n, d, r, b, seed=seed)), steps)
    return [[sample for source, sample in batch if source == 0] for batch in batches]


def test_ranks_are_disjoint_slices_of_the_global_stream() -> None:
    n, steps = 1000, 6
    ranks = [_micro_batches(n, 4, r, 2, steps) for r in range(4)]
    single = _micro_batches(n, 1, 0, 8, steps)
    for j in range(steps):
        # Rank r takes the r-th contiguous slice of micro-step j: concatenation = the D=1 stream.
        assert sum((ranks[r][j] for r in range(4)), []) == single[j]
    seen = [set(itertools.chain(*batches)) for batches in ranks]
    assert all(seen[a].isdisjoint(seen[b]) for a in range(4) for b in range(a + 1, 4))
    assert set().union(*seen) == set(itertools.chain(*single))


@pytest.mark.parametrize(("d", "b"), [(2, 4), (4, 1), (2, 1), (8, 1)])
def test_optimizer_steps_see_the_same_samples_for_any_mesh(d: int, b: int) -> None:
    n, global_batch, steps = 50, 8, 10  # crosses an epoch boundary on the way
    accum = global_batch // (d * b)
    ref = _micro_batches(n, 1, 0, global_batch, steps)
    ranks = [_micro_batches(n, d, r, b, steps * accum) for r in range(d)]
    for s in range(steps):
        got = [i for j in range(s * accum, (s + 1) * accum) for r in range(d) for i in ranks[r][j]]
        assert sorted(got) == sorted(ref[s])


def test_epochs_reshuffle_and_unshuffled_is_identity() -> None:
    n = 12
    stream = sum(_micro_batches(n, 1, 0, 5, 6), [])  # 30 positions: 2.5 epochs, split batches
    epochs = [stream[:n], stream[n : 2 * n]]
    assert all(sorted(e) == list(range(n)) for e in epochs) and epochs[0] != epochs[1]
    assert epochs[0] != list(range(n)) and stream != sum(_micro_batches(n, 1, 0, 5, 6, 8), [])
    plain = itertools.islice(iter(_sampler(n, 2, 1, 5, shuffle=False)), 3)
    assert [[i for _, i in batch] for batch in plain] == [
        [5, 6, 7, 8, 9], [3, 4, 5, 6, 7], [1, 2, 3, 4, 5]
    ]  # fmt: skip


# --- the loader ------------------------------------------------------------------------------


def _loader(
    path: Path, d: int, r: int, b: int, workers: int = 0, split: Literal["train", "val"] = "train"
) -> StatefulDataLoader:
    cfg = DataConfig(path=str(path), seq_len=SEQ, num_workers=workers)
    return build_dataloader(cfg, split, dp_rank=r, dp_size=d, micro_batch_size=b, seed=3)


def _take(loader: StatefulDataLoader, k: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it)[0] for _ in range(k)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_exactly(dataset: Path, workers: int) -> None:
    ref = _take(_loader(dataset, 1, 0, 4, workers), 9)
    loader = _loader(dataset, 1, 0, 4, workers)
    it = iter(loader)
    head = [next(it)[0] for _ in range(4)]  # with workers, more batches are already prefetched
    state = loader.state_dict()
    resumed = _loader(dataset, 1, 0, 4, workers)
    resumed.load_state_dict(state)
    tail = _take(resumed, 5)
    assert all(torch.equal(a, b) for a, b in zip(head + tail, ref, strict=True))


@pytest.mark.parametrize(("d", "b", "workers"), [(2, 4, 0), (1, 8, 0), (4, 1, 0), (2, 4, 2)])
def test_resume_on_another_mesh_continues_the_global_stream(
    dataset: Path, d: int, b: int, workers: int
) -> None:
    ref = _take(_loader(dataset, 1, 0, 8), 8)  # global batches of 8 samples
    states = []
    for r in range(4):  # saved by 4 ranks with micro-batch 2 after 3 micro-steps each
        loader = _loader(dataset, 4, r, 2, workers)
        it = iter(loader)
        got = [next(it)[0] for _ in range(3)]
        assert torch.equal(got[1], ref[1][2 * r : 2 * r + 2])
        states.append(loader.state_dict())
    accum = 8 // (d * b)
    loaders = [_loader(dataset, d, r, b, workers) for r in range(d)]
    for loader in loaders:
        loader.load_state_dict(states[0])  # identical on every rank: any rank's copy will do
    nexts = [_take(loader, 4 * accum) for loader in loaders]
    for s in range(4):
        got = [nexts[r][j] for j in range(s * accum, (s + 1) * accum) for r in range(d)]
        assert torch.equal(torch.cat(got), ref[3 + s])


def test_loaders_leave_torchs_rng_alone(dataset: Path) -> None:
    """Neither a train loader resumed from a state nor every evaluation's iter() of the val
    loader draws from torch's global RNG: a checkpoint restores that RNG before the resumed
    run's first iter(), and a draw there would leave the resumed run one draw off the run
    that never stopped (as each evaluation would shift the training's RNG stream)."""
    loader = _loader(dataset, 1, 0, 4, 2)
    _take(loader, 2)
    state = loader.state_dict()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    resumed = _loader(dataset, 1, 0, 4, 2)
    resumed.load_state_dict(state)
    _take(resumed, 2)
    val = _loader(dataset, 2, 1, 3, split="val")
    _take(val, 1)
    _take(val, 1)
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_with_indivisible_global_batch_is_an_error(dataset: Path) -> None:
    loader = _loader(dataset, 4, 0, 2)
    _take(loader, 3)  # 24 positions consumed
    state = loader.state_dict()
    other = _loader(dataset, 1, 0, 16)
    other.load_state_dict(state)
    with pytest.raises(ConfigError, match="position 24: it is not a multiple of .* 1 \\* 16"):
        iter(other)


def test_val_loader_is_ordered_and_restarts(dataset: Path) -> None:
    loader = _loader(dataset, 2, 1, 3, split="val")
    seqs = TokenSequences(open_dataset(dataset), "val", SEQ)
    first = _take(loader, 3)
    assert torch.equal(first[0], torch.stack([seqs[i][0] for i in (3, 4, 5)]))
    assert all(torch.equal(a, b) for a, b in zip(first, _take(loader, 3), strict=True))


def test_loader_batches_match_the_sampler(dataset: Path) -> None:
    seqs = TokenSequences(open_dataset(dataset), "train", SEQ)
    indices = _micro_batches(len(seqs), 2, 1, 3, 2, seed=3)  # the loaders' seed
    batches = itertools.islice(iter(_loader(dataset, 2, 1, 3)), 2)
    for (x, y), batch in zip(batches, indices, strict=True):
        assert x.shape == (3, SEQ) and torch.equal(x, torch.stack([seqs[i][0] for i in batch]))
        assert torch.equal(y, torch.stack([seqs[i][1] for i in batch]))


# --- tokenizers ------------------------------------------------------------------------------


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert max(ids) < 256 and tok.decode([tok.bos_id, *ids, tok.eos_id]) == "héllo ✓"
    assert tok.decode(ids[:2]) == "h\ufffd"  # a cut character decodes, it does not raise


def test_hf_tokenizer_needs_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ConfigError, match=r"pip install 'fsdp2-trainer\[hf\]'"):
        HFTokenizer("tokenizer.json")


def test_prepare_with_local_hf_tokenizer(tmp_path: Path, corpus: tuple[Path, dict]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    hf.train_from_iterator(corpus[1].values(), trainer)
    hf.save(str(tmp_path / "tokenizer.json"))

    out = prepare([str(corpus[0])], tmp_path / "out", str(tmp_path), val_fraction=0.2)
    index = open_dataset(out)
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert index.dtype == "uint16" and index.tokenizer["kind"] == "hf"
    assert index.eos_id == tok.eos_id == hf.token_to_id("<|endoftext|>")
    assert index.bos_id is None and index.tokenizer["bos_id"] is None  # it has no BOS token
    # The hash names the tokenizer, not its file: re-saved pretty-printed it is the same; with
    # two tokens' ids swapped (same size, same special ids) it is another.
    assert index.tokenizer["sha256"] == tok.describe()["sha256"]
    # Nothing of this machine's file system: the file's folder and name, and where it is from
    # the dataset (true where both are copied together).
    assert index.tokenizer["name"] == f"{tmp_path.name}/tokenizer.json"
    assert index.tokenizer["relative_path"] == "../tokenizer.json" and "path" not in index.tokenizer
    assert str(tmp_path) not in json.dumps(index.tokenizer)
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    (tmp_path / "pretty").mkdir()
    (tmp_path / "pretty" / "tokenizer.json").write_text(json.dumps(raw, indent=4))
    assert HFTokenizer(str(tmp_path / "pretty")).describe()["sha256"] == index.tokenizer["sha256"]
    vocab = raw["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (tmp_path / "swapped").mkdir()
    (tmp_path / "swapped" / "tokenizer.json").write_text(json.dumps(raw))
    swapped = HFTokenizer(str(tmp_path / "swapped")).describe()
    assert swapped["vocab_size"] == tok.vocab_size and swapped["eos_id"] == tok.eos_id
    assert swapped["sha256"] != index.tokenizer["sha256"]
    tokens = np.fromfile(index.splits["train"][0].file, dtype=np.uint16)
    first_doc = tokens[: np.flatnonzero(tokens == index.eos_id)[0]].tolist()
    assert tok.decode(first_doc) == corpus[1][min(k for k in corpus[1] if not is_val(k, 0.2))]
    assert HFTokenizer(str(tmp_path), eos_token="<pad>").eos_id == hf.token_to_id("<pad>")
    with pytest.raises(ConfigError, match="--eos-token 'nope' is not in the vocabulary"):
        HFTokenizer(str(tmp_path), eos_token="nope")
    with pytest.raises(ConfigError, match="no tokenizer file at"):
        HFTokenizer(str(tmp_path / "missing.json"))

    # A dataset prepared before relative_path (its index.json holds the tokenizer's absolute
    # path on the machine that prepared it) still loads, and mixes with one prepared now.
    old = tmp_path / "old"
    old.mkdir()
    for shard in out.glob("*.bin"):
        (old / shard.name).symlink_to(shard)
    written = json.loads((out / "index.json").read_text())
    before = {key: written["tokenizer"][key] for key in ("kind", "vocab_size", "eos_id",
              "bos_id", "sha256")} | {"path": "/elsewhere/tokenizer.json"}  # fmt: skip
    (old / "index.json").write_text(json.dumps(written | {"tokenizer": before}))
    assert open_dataset(old).tokenizer["path"] == "/elsewhere/tokenizer.json"
    both = {"old": SourceConfig(str(old)), "new": SourceConfig(str(out))}
    assert [s.name for s in open_sources(DataConfig(sources=both, seq_len=16))] == ["new", "old"]
