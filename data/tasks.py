"""Downstream tasks scored during training: JSONL task files, tokenized with the run's tokenizer.

A task file holds one example per line (docs/evaluation.md):

    {"context": "...", "choices": ["...", "..."], "gold": 0}    kind = "multiple_choice"
    {"context": "...", "target": "..."}                          kind = "completion"

Each example becomes *requests*, a continuation scored given its context, as lm-eval-harness
scores them: the summed log-likelihood of the continuation's tokens. A multiple-choice example
is right (`acc`) when its gold choice has the highest log-likelihood, and (`acc_norm`) when it
has the highest log-likelihood per byte of the choice; a completion task reports the mean
negative log-likelihood per target token (`nll`) and its exponential (`ppl`).

Everything here is plain data and arithmetic: the model's forward and the all-reduce are
train.py's (`score_tasks`). Every task is read and tokenized by `launch.check.check_config`,
so a bad file is one config error before any process group exists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from configs import ConfigError
from data.loader import NO_TARGET
from data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from data.loader import DatasetIndex

TaskKind = Literal["multiple_choice", "completion"]
MAKE_HINT = "python -m data.make_eval_task"


@dataclass
class TaskConfig:
    path: str
    """A JSONL task file (docs/evaluation.md)."""
    kind: TaskKind = "multiple_choice"
    """multiple_choice ({context, choices, gold}: acc, acc_norm) or completion ({context,
    target}: nll, ppl)."""
    limit: int = 0
    """Score the file's first `limit` examples (0: all of them)."""

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ConfigError(f"limit must be >= 0 (0: every example), got {self.limit}")


@dataclass
class EvalConfig:
    tasks: dict[str, TaskConfig] = field(default_factory=dict)
    """Tasks scored at every train.eval_interval and at the end, beside the validation loss:
    tables [eval.tasks.NAME] with path, kind and limit."""
    batch_size: int = 0
    """Requests per forward on each rank (0: train.micro_batch_size). A forward without
    gradients keeps no activations, so more rows fit than in training; the float32 logits of
    batch_size x seq_len x vocab are the largest tensor. Fewer forwards: fewer all-gathers."""

    def __post_init__(self) -> None:
        if self.batch_size < 0:
            raise ConfigError(f"eval.batch_size must be >= 0, got {self.batch_size}")


class Request(NamedTuple):
    """One continuation to score: `tokens` = EOS + context + continuation, whose last
    `n_scored` tokens are the continuation's."""

    tokens: list[int]
    n_scored: int


@dataclass(frozen=True)
class Task:
    """A task file read and tokenized: its requests, in file order, and how they group."""

    name: str
    kind: TaskKind
    requests: tuple[Request, ...]
    choices: tuple[int, ...]
    """Requests per example (1 for a completion)."""
    gold: tuple[int, ...]
    """The right choice of each example (0 for a completion)."""
    choice_bytes: tuple[int, ...]
    """UTF-8 bytes of each request's continuation as written: acc_norm's divisor."""
    identical: tuple[int, ...] = ()
    """The file's lines whose examples have two or more choices, all the same."""
    path: str = ""
    """The task file, for the lines that name it."""


def dataset_tokenizer(index: DatasetIndex) -> Tokenizer:
    """The tokenizer the dataset was prepared with, found from its index.json (the byte
    tokenizer, or the tokenizer.json it records, checked by its sha256)."""
    info = index.tokenizer
    if info.get("kind") == "byte":
        return ByteTokenizer()
    relative = info.get("relative_path")
    file = index.path / relative if relative else Path(info.get("path") or "")
    if not file.is_file():
        raise ConfigError(
            f"eval.tasks: tasks are tokenized with the tokenizer of the training data, but "
            f"'{index.path / 'index.json'}' leads to no file ({info.get('name')} was not copied "
            "beside the dataset)"
        )
    tokenizer = HFTokenizer(str(file))
    if tokenizer.describe()["sha256"] != info.get("sha256"):
        raise ConfigError(
            f"eval.tasks: '{file}' is not the tokenizer '{index.path}' was prepared with "
            "(its sha256 differs)"
        )
    return tokenizer


def load_tasks(cfg: EvalConfig, index: DatasetIndex, seq_len: int) -> tuple[Task, ...]:
    """Every task of `cfg`, sorted by name, read and tokenized with the dataset's tokenizer."""
    if not cfg.tasks:
        return ()
    tokenizer = dataset_tokenizer(index)
    if index.eos_id is None:
        raise ConfigError(
            f"eval.tasks: each context starts after an EOS, as documents do in training, but "
            f"'{index.path / 'index.json'}' has eos_id null: prepare it with python -m "
            "data.prepare"
        )
    return tuple(
        load_task(name, task, tokenizer, index.eos_id, seq_len)
        for name, task in sorted(cfg.tasks.items())
    )


def load_task(name: str, cfg: TaskConfig, tokenizer: Tokenizer, eos_id: int, seq_len: int) -> Task:
    """ConfigError naming the file and line for anything that cannot be scored: a missing
    file, a line that is not UTF-8 or not an example of `cfg.kind`, a gold index out of range,
    an empty choice list, an empty continuation, a context and continuation longer than a
    sequence."""
    key, path = f"eval.tasks.{name}", Path(cfg.path)
    if not path.is_file():
        raise ConfigError(f"{key}.path: no task file '{path}' (the debug task: {MAKE_HINT})")
    requests: list[Request] = []
    choices, gold, choice_bytes, identical = [], [], [], []
    with path.open("rb") as lines:  # decoded line by line: an error names its line
        for number, raw in enumerate(lines, start=1):
            if cfg.limit and len(gold) == cfg.limit:
                break
            where = f"{key}: '{path}' line {number}"
            line = _decode(raw, where)
            if not line.strip():
                continue
            context, continuations, answer = _example(line, cfg.kind, where)
            for i, continuation in enumerate(continuations):
                what = "target" if cfg.kind == "completion" else f"choice {i}"
                requests.append(_request(tokenizer, eos_id, seq_len, context, continuation, what,
                                         where))  # fmt: skip
                choice_bytes.append(len(continuation.encode("utf-8")))
            choices.append(len(continuations))
            gold.append(answer)
            if len(continuations) > 1 and len(set(continuations)) == 1:
                identical.append(number)
    if not gold:
        raise ConfigError(f"{key}: '{path}' holds no examples")
    return Task(name, cfg.kind, tuple(requests), tuple(choices), tuple(gold), tuple(choice_bytes),
                tuple(identical), str(path))  # fmt: skip


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}): a "
            "task file is UTF-8 text; convert it, e.g. with iconv -t UTF-8"
        ) from None


def _request(
    tokenizer: Tokenizer,
    eos_id: int,
    seq_len: int,
    context: str,
    continuation: str,
    what: str,
    where: str,
) -> Request:
    """The request of one continuation, or ConfigError: empty as written (whatever the context
    ends with: acc_norm divides by its bytes, and a score of no text says nothing), no token
    of its own, or longer than a sequence."""
    if not continuation:
        raise ConfigError(f"{where}: {what} is empty: nothing to score")
    request = encode_request(tokenizer, eos_id, context, continuation)
    if request.n_scored == 0:  # a tokenizer merged it into the context's last token
        raise ConfigError(f"{where}: {what} adds no token to the context's: nothing to score")
    if len(request.tokens) > seq_len + 1:
        raise ConfigError(
            f"{where}: EOS + context + {what} are {len(request.tokens)} tokens, more than "
            f"data.seq_len + 1 = {seq_len + 1}: shorten the context"
        )
    return request


def task_warnings(tasks: tuple[Task, ...]) -> list[str]:
    """Valid examples that measure nothing, one warning per task: all of an example's choices
    identical score as right exactly when gold is 0 (ties go to the first choice)."""
    warnings = []
    for task in tasks:
        if not task.identical:
            continue
        lines = ", ".join(map(str, task.identical[:5])) + (", ..." * (len(task.identical) > 5))
        share = (
            "every example has"
            if len(task.identical) == len(task.gold)
            else f"{len(task.identical)} of {len(task.gold)} examples (lines {lines}) have"
        )
        warnings.append(
            f"eval.tasks.{task.name}: '{task.path}': {share} identical choices, scored right "
            "exactly when gold is 0 (ties go to the first choice): their acc and acc_norm "
            "measure the file, not the model"
        )
    return warnings


def _example(line: str, kind: TaskKind, where: str) -> tuple[str, list[str], int]:
    """(context, continuations, gold) of one JSONL line of a task of `kind`."""
    try:
        example = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(example, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(example).__name__}")
    fields = ("context", "choices", "gold") if kind == "multiple_choice" else ("context", "target")
    if missing := [f for f in fields if f not in example]:
        raise ConfigError(f"{where}: no {', '.join(missing)} (a {kind} example has {fields})")
    context = example["context"]
    if not isinstance(context, str):
        raise ConfigError(f"{where}: context must be a string")
    if kind == "completion":
        if not isinstance(example["target"], str):
            raise ConfigError(f"{where}: target must be a string")
        return context, [example["target"]], 0
    options, answer = example["choices"], example["gold"]
    if not isinstance(options, list) or not all(isinstance(c, str) for c in options):
        raise ConfigError(f"{where}: choices must be a list of strings")
    if not options:
        raise ConfigError(f"{where}: the choice list is empty")
    if type(answer) is not int or not 0 <= answer < len(options):
        raise ConfigError(
            f"{where}: gold must be an index into the {len(options)} choices, got {answer!r}"
        )
    return context, options, answer


def encode_request(tokenizer: Tokenizer, eos_id: int, context: str, continuation: str) -> Request:
    """EOS + context + continuation as lm-eval-harness splits them: the context's trailing
    whitespace (spaces, newlines, as str.rstrip() strips) moves to the continuation and is
    scored with it, the pair is encoded whole, and the continuation is what follows the
    context's own tokens (so a merge across the boundary stays one token)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    n_context = len(tokenizer.encode(context))
    # The EOS: a context starts where a document starts in training (data/documents.py).
    return Request([eos_id, *whole], len(whole) - n_context)


def task_batches(
    task: Task,
    dp_rank: int,
    dp_size: int,
    batch_size: int,
    seq_len: int,
    trim: bool = True,
    multiple: int = 16,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's (inputs, targets, request ids): request i is scored on rank
    i % dp_size, one per row (right-padded: causal attention keeps the padding out of the
    request's tokens). Every rank yields the same number of batches, rows past its requests
    padded with dummy ones (id -1, no target): FSDP's all-gathers need every rank in every
    forward. `trim`: rows as long as the batch's longest request, the longest first, as
    lm-eval-harness sorts them (the debug task's forwards then cost about half of rows of
    `seq_len`); else `seq_len`, the training shape, which compiled blocks are compiled for.
    Trimmed rows are a `multiple` of tokens long: 16 keeps a few shapes (and kernels) instead of
    one per length; context parallel needs a multiple of 2 x cp as well."""
    mine = sorted(range(dp_rank, len(task.requests), dp_size),
                  key=lambda i: -len(task.requests[i].tokens))  # fmt: skip
    per_rank = math.ceil(len(task.requests) / dp_size)
    for start in range(0, max(per_rank, 1), batch_size):
        rows = mine[start : start + batch_size]
        longest = max((len(task.requests[i].tokens) - 1 for i in rows), default=1)
        length = min(seq_len, math.ceil(longest / multiple) * multiple) if trim else seq_len
        inputs = torch.zeros(batch_size, length, dtype=torch.long)
        targets = torch.full((batch_size, length), NO_TARGET, dtype=torch.long)
        ids = torch.full((batch_size,), -1, dtype=torch.long)
        for row, i in enumerate(rows):
            tokens, n = task.requests[i]
            inputs[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
            # The target at position p is token p + 1: the continuation's n tokens are the
            # targets of the n positions before the last token.
            targets[row, len(tokens) - 1 - n : len(tokens) - 1] = torch.tensor(tokens[-n:])
            ids[row] = i
        yield inputs, targets, ids


def task_scores(task: Task, logliks: torch.Tensor) -> dict[str, float]:
    """The task's metrics from the summed log-likelihood of every request (float64)."""
    if task.kind == "completion":
        nll = -logliks.sum().item() / sum(n for _, n in task.requests)
        return {"nll": nll, "ppl": math.exp(min(nll, 700.0))}
    by_bytes = logliks / torch.tensor(task.choice_bytes, dtype=logliks.dtype)
    right = right_norm = 0
    for example, chunk in enumerate(zip(logliks.split(task.choices),
                                        by_bytes.split(task.choices), strict=True)):  # fmt: skip
        # argmax picks the first of equal values, as lm-eval-harness's np.argmax does.
        right += int(chunk[0].argmax()) == task.gold[example]
        right_norm += int(chunk[1].argmax()) == task.gold[example]
    return {"acc": right / len(task.gold), "acc_norm": right_norm / len(task.gold)}
