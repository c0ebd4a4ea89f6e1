"""Tokenizers for data preparation: a file-free byte tokenizer and a local Hugging Face one.

Both expose the same small interface (``Tokenizer``). Nothing here ever downloads: the Hugging
Face tokenizer is read from a local ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NotRequired, Protocol, TypedDict

import numpy as np

from configs import ConfigError

logger = logging.getLogger(__name__)

# Tried in order when --eos-token is not given; these cover the common Hugging Face tokenizers.
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")


class TokenizerInfo(TypedDict):
    """What ``describe()`` returns, in this process (``index_entry`` is what a dataset
    records)."""

    kind: Literal["byte", "hf"]
    path: str | None
    """The tokenizer.json, resolved (None for bytes): workers rebuild the tokenizer from it."""
    vocab_size: int
    eos_id: int
    bos_id: int | None
    """None when the tokenizer has none of the usual BOS tokens."""
    sha256: NotRequired[str]
    """A Hugging Face tokenizer's canonical serialization, hashed: two tokenizers with the same
    size and special ids but other merges or vocabularies differ here (absent for bytes)."""


class Tokenizer(Protocol):
    """The interface data preparation and sampling scripts rely on."""

    vocab_size: int
    eos_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_documents(self, docs: Sequence[bytes]) -> list[np.ndarray]: ...

    def describe(self) -> TokenizerInfo: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS, 257 is EOS."""

    bos_id: int = 256
    eos_id: int = 257
    vocab_size: int = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        # Windows cut documents mid-character; "replace" keeps decoding total instead of raising.
        return data.decode("utf-8", errors="replace")

    def encode_documents(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        # A zero-copy view of the raw bytes: this is what keeps preparing the ~30 MB stdlib corpus
        # to seconds. Raw bytes (not decoded text) also keep files that are not valid UTF-8 exact.
        return [np.frombuffer(doc, dtype=np.uint8) for doc in docs]

    def describe(self) -> TokenizerInfo:
        return {
            "kind": "byte",
            "path": None,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
        }


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``."""

    def __init__(self, path: str, eos_token: str | None = None) -> None:
        try:
            # Imported here so the byte-level default works without the optional dependency.
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise ConfigError(
                f"data tokenizer: '{path}' needs the 'tokenizers' package: "
                "pip install 'fsdp2-trainer[hf]'"
            ) from e
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"data tokenizer: no tokenizer file at '{file}'")
        self.path = str(file.resolve())
        try:
            self._tok: Any = _HFTokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises a bare Exception: bad JSON, unknown model
            reason = " ".join(str(e).split())
            raise ConfigError(
                f"data tokenizer: '{file}' is not a valid tokenizer.json ({reason})"
            ) from e
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id: int = self._find_eos(eos_token)
        self.bos_id: int | None = next(
            (i for t in BOS_CANDIDATES if (i := self._tok.token_to_id(t)) is not None), None
        )

    def _find_eos(self, eos_token: str | None) -> int:
        if eos_token is not None:
            eos_id = self._tok.token_to_id(eos_token)
            if eos_id is None:
                raise ConfigError(
                    f"data tokenizer: --eos-token '{eos_token}' is not in the vocabulary of "
                    f"'{self.path}'"
                )
            return eos_id
        for token in EOS_CANDIDATES:
            eos_id = self._tok.token_to_id(token)
            if eos_id is not None:
                return eos_id
        raise ConfigError(
            f"data tokenizer: '{self.path}' has none of the usual end-of-document tokens "
            f"{', '.join(EOS_CANDIDATES)}; name its EOS token with --eos-token"
        )

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS from the tokenizer's post-processor: prepare adds exactly one EOS per document.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def encode_documents(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        texts = [doc.decode("utf-8", errors="replace") for doc in docs]
        # A batch runs in Rust (on all cores unless TOKENIZERS_PARALLELISM=false), far faster than
        # one document at a time. encode_batch_fast (recent tokenizers) skips the character
        # offsets, which prepare does not use: ~30% less time per token, the same ids.
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = encode_batch(texts, add_special_tokens=False)
        return [np.asarray(enc.ids, dtype=np.int64) for enc in encodings]

    def describe(self) -> TokenizerInfo:
        return {
            "kind": "hf",
            "path": self.path,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            # to_str(), not the file's bytes: the same tokenizer re-saved with other whitespace
            # or key order is still the same tokenizer.
            "sha256": hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest(),
        }


def index_entry(info: TokenizerInfo, dataset: Path) -> dict[str, Any]:
    """The tokenizer as the index.json of `dataset` records it, true wherever the dataset is
    copied: what identifies it (kind, vocab_size, eos_id, bos_id, and a tokenizer.json's
    sha256), a name for people (the file's folder and name, e.g. ``Qwen3-8B/tokenizer.json``),
    and ``relative_path``, the file relative to the dataset directory, when the two share a
    folder other than the file system's root (so it holds where both are copied together;
    None otherwise, and for bytes). Never the absolute path of the machine that prepared it."""
    entry: dict[str, Any] = {"kind": info["kind"], "name": "byte", "relative_path": None}
    if info["path"] is not None:
        file, root = Path(info["path"]), dataset.resolve()
        entry["name"] = f"{file.parent.name}/{file.name}"
        if os.path.commonpath([file, root]) != file.anchor:
            entry["relative_path"] = os.path.relpath(file, root)
    identity = ("vocab_size", "eos_id", "bos_id", "sha256")
    return entry | {key: value for key, value in info.items() if key in identity}


def build_tokenizer(path: str | None, eos_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for ``path`` (a local tokenizer.json or its directory); None gives bytes."""
    if path is None:
        if eos_token is not None:
            raise ConfigError(
                "data tokenizer: --eos-token only applies with --tokenizer; "
                "the byte tokenizer's EOS is fixed at id 257"
            )
        return ByteTokenizer()
    return HFTokenizer(path, eos_token=eos_token)
