from __future__ import annotations

import random
from pathlib import Path

import pytest

WORDS = (
    "the model shards every block over the mesh and gathers parameters before each forward "
    "gradients are reduced across ranks then the optimizer updates local shards of weights "
    "def return class import for while if else lambda yield self none true false"
).split()


def write_corpus(root: Path, n_docs: int = 40, words_per_doc: int = 400, seed: int = 0) -> Path:
    """Deterministic pseudo-text (Python's `random` stream is stable across versions)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words_per_doc))
        (root / f"doc{i:03d}.txt").write_text(text + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-tokenized dataset (~100k tokens) with a validation split."""
    from data.prepare import prepare

    root = tmp_path_factory.mktemp("corpus")
    corpus = write_corpus(root / "text")
    return str(prepare([str(corpus)], root / "tokens", val_fraction=0.1))
