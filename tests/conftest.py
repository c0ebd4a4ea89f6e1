from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Inductor compiles in this process, not in a pool of worker processes: each compiling rank
# would start its own pool (processes importing torch), and the suite keeps both cores busy
# anyway. Set before any fork server or rank starts: Inductor reads it when imported.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# One intra-op thread in the test processes and every process they start (torchrun.sh and
# multinode.sh keep a set OMP_NUM_THREADS): two workers, each with ranks of its own, already
# keep both cores busy, and a second thread per process only waits for its turn (-15% CPU and
# wall on the in-process tests, BENCHMARKS.md). The ranks of tests/distributed.py set it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

WORDS = (
    "the model shards every block over the mesh and gathers parameters before each forward "
    "gradients are reduced across ranks then the optimizer updates local shards of weights "
    "def return class import for while if else lambda yield self none true false"
).split()


# No ordering of our own: xdist's file scheduling (--dist loadfile) starts the files with the
# most tests first, which here keeps the compiling files apart. Taking the longest files first
# instead (--no-loadscope-reorder) ran them side by side and took 763 s of tests against 689 s,
# with 10% more CPU (BENCHMARKS.md, "The test suite on 2 cores", 2026-11-28).


@pytest.fixture
def zoo_family() -> Iterator[str]:
    """tests/zoo.py registered in model.FAMILIES for the test: a family with every shape the
    contract allows (the contract's tests run on it too). Its name."""
    from tests import zoo

    with zoo.registered():
        yield zoo.NAME


# The checkout's outputs/ is the user's (the quick start's run, data, checkpoints): a test that
# reads it fails after the quick start (it resumes outputs/debug), one that writes it damages it.
# Every test gets its own run folder (--run.output_dir=tmp_path); the session fails when
# anything under outputs/ changed. .ci/run runs the suite after the quick start, for the reads.
CHECKOUT_OUTPUTS = Path(__file__).resolve().parents[1] / "outputs"
OUTPUTS_BEFORE = pytest.StashKey[set]()


def outputs_state() -> set[tuple[str, int, int]]:
    """Every path under the checkout's outputs/, with its size and modification time."""
    state = set()
    for folder, dirs, files in os.walk(CHECKOUT_OUTPUTS):
        for name in dirs + files:
            path = Path(folder) / name
            try:
                stat = path.lstat()
            except FileNotFoundError:
                continue
            state.add((str(path.relative_to(CHECKOUT_OUTPUTS)), stat.st_size, stat.st_mtime_ns))
    return state


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller: once per run
        session.config.stash[OUTPUTS_BEFORE] = outputs_state()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    before = session.config.stash.get(OUTPUTS_BEFORE, None)
    if before is None:
        return
    changed = sorted({entry[0] for entry in before ^ outputs_state()})
    if changed:
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        reporter.ensure_newline()
        reporter.write_line(
            f"the tests changed the checkout's outputs/ ({', '.join(changed[:5])}{more}): a test "
            "must write to its own run folder (--run.output_dir=tmp_path), or another process "
            "wrote there meanwhile",
            red=True,
        )  # fmt: skip
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def write_corpus(root: Path, n_docs: int = 40, words_per_doc: int = 400, seed: int = 0) -> Path:
    """Deterministic pseudo-text (Python's `random` stream is stable across versions)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words_per_doc))
        (root / f"doc{i:03d}.txt").write_text(text + "\n")
    return root


@pytest.fixture(scope="module")
def prefs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """TRL's golden model and pairs (tests/golden/dpo_trl.py), and the pairs prepared (byte
    tokenizer; held out as the golden holds them out): tests/test_dpo.py, tests/test_ft.py."""
    pytest.importorskip("transformers")
    import sys

    from data.prepare import prepare

    sys.path.insert(0, str(Path(__file__).parent / "golden"))
    import dpo_trl

    out = tmp_path_factory.mktemp("prefs")
    model_dir, pairs_file = dpo_trl.make_inputs(out)
    data = prepare([str(pairs_file)], out / "data", val_fraction=dpo_trl.SETTINGS["val_fraction"],
                   format="preference")  # fmt: skip
    return {"model": model_dir, "pairs": pairs_file, "data": data, "out": out}


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-tokenized dataset (~100k tokens) with a validation split."""
    from data.prepare import prepare

    root = tmp_path_factory.mktemp("corpus")
    corpus = write_corpus(root / "text")
    return str(prepare([str(corpus)], root / "tokens", val_fraction=0.1))


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level dataset of 400 documents of 1-6 words (6-40 tokens): most windows of
    32-40 tokens hold an EOS, so document masking changes most losses."""
    import json

    from data.prepare import prepare

    root = tmp_path_factory.mktemp("short_docs")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(400)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return str(prepare([str(root / "docs.jsonl")], root / "tokens", val_fraction=0.3))


@pytest.fixture(scope="session")
def saved_runs(
    tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[list[float], Path]]:
    """`saved_runs(family)`: the losses and output folder of the family's run 'sync' (2 ranks
    FSDP, 8 fp32 steps, checkpoints at steps 4 and 8, both kept), trained once per session.
    tests/test_families.py resumes it for every family; tests/test_checkpoint.py damages,
    reshapes and resumes llama3's."""
    from functools import partial

    from tests.distributed import run_distributed
    from tests.test_families import run_argv
    from tests.test_train import train_losses
    from tests.zoo import call_registered

    runs: dict[str, tuple[list[float], Path]] = {}

    def saved(family: str) -> tuple[list[float], Path]:
        if family not in runs:
            out = tmp_path_factory.mktemp(f"{family}_saved")
            argv = run_argv(tiny_dataset, out, family, "sync", "--train.steps=8",
                            "--checkpoint.interval=4", "--checkpoint.keep_last=0")  # fmt: skip
            # The ranks register the test family too (tests/zoo.py), if that is the one.
            runs[family] = run_distributed(partial(call_registered, train_losses), 2, argv)[0], out
        return runs[family]

    return saved
