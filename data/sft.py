"""Supervised fine-tuning examples: prompt/response and chat JSONL, tokenized with a loss mask.

`python -m data.prepare --format prompt_response|chat` reads one example per JSONL line and
writes, beside each token shard, a mask with one byte per token: 1 where the token is a target
(part of a response), 0 where it is context (the prompt, the user's turns, the template's
markup). Every example ends with the dataset's EOS, a target when the example ends with a
response, so the model learns to stop. The rules (docs/data.md has the reasoning):

- ``prompt_response``: ``{"prompt": str, "response": str}``. The prompt's tokens, then the
  response's, then EOS; nothing is inserted between them, so put any separator in the prompt
  (``"12+34="``). Each is tokenized on its own: the prompt's tokens are those a user's prompt
  gives at inference.
- ``chat``: ``{"messages": [{"role": str, "content": str}, ...]}`` with at least one message
  of role ``assistant``. The conversation is rendered with the tokenizer's chat template
  (``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` beside the
  tokenizer.json, rendered with jinja2 as Hugging Face does) or, when it has none, with
  PLAIN_TEMPLATE. Each assistant message's text is what the template adds after the
  generation prompt of the messages before it, up to the end of that message (its end-of-turn
  markup included): that text is the target, the rest is context. Each piece is tokenized on
  its own, so the boundary between context and target falls between tokens.

Everything here runs in `data.prepare`'s worker processes: the output is the same for any
number of them.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np

from configs import ConfigError
from data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Kind = Literal["prompt_response", "chat"]
KINDS: tuple[Kind, ...] = ("prompt_response", "chat")
PATTERN = "*.jsonl,*.jsonl.gz,*.jsonl.zst"
ASSISTANT = "assistant"
REQUIRED = ("role", "content")  # of every message; templates may read other keys too
# The chat template of a tokenizer without one (and of the byte tokenizer): each message as
# "role: content" on its own line; the generation prompt is "assistant: ".
#     user: 12+34=
#     assistant: 46
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message.role + ': ' + message.content + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@dataclass(frozen=True)
class ExampleFormat:
    """How examples become text: sent to every worker, so plain data."""

    kind: Kind
    template: str = PLAIN_TEMPLATE
    """The chat template's jinja source (chat only)."""
    template_from: str = "plain"
    """Where it came from: a file, or 'plain' (PLAIN_TEMPLATE)."""
    special_tokens: tuple[tuple[str, str], ...] = ()
    """(name, text) of bos_token and eos_token, as templates use them."""

    def describe(self) -> dict[str, str]:
        """What index.json records of it."""
        out = {"format": self.kind}
        return out | ({"chat_template": self.template_from} if self.kind == "chat" else {})


def load_format(kind: Kind, tokenizer_path: str | None) -> ExampleFormat:
    """The format of `kind` examples; for chat, the chat template beside `tokenizer_path` (a
    tokenizer.json or its directory): chat_template.jinja, or tokenizer_config.json's."""
    if kind == "prompt_response" or tokenizer_path is None:
        return ExampleFormat(kind)
    folder = Path(tokenizer_path)
    folder = folder if folder.is_dir() else folder.parent
    config_file = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"data prepare: '{config_file}' is not valid JSON ({e})") from e
    special = tuple(
        (name, token if isinstance(token, str) else token.get("content", ""))
        for name in ("bos_token", "eos_token")
        if isinstance(token := config.get(name), str | dict)
    )
    if (jinja_file := folder / "chat_template.jinja").is_file():
        return ExampleFormat(kind, jinja_file.read_text(), str(jinja_file), special)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        logger.info("no chat template beside %s: using the plain template", tokenizer_path)
        return ExampleFormat(kind, special_tokens=special)
    if not isinstance(template, str):
        raise ConfigError(
            f"data prepare: '{config_file}': chat_template is neither a string nor a list "
            "with a template named 'default'"
        )
    return ExampleFormat(kind, template, str(config_file), special)


def check_example(record: Any, kind: Kind, where: str) -> None:
    """ConfigError naming `where` (file:line) unless `record` is a `kind` example."""
    if kind == "prompt_response":
        missing = [f for f in ("prompt", "response") if not isinstance(_get(record, f), str)]
        if missing:
            raise ConfigError(
                f"data prepare: {where}: no string field {' or '.join(map(repr, missing))} "
                '(--format prompt_response reads {"prompt": ..., "response": ...})'
            )
        return
    messages = _get(record, "messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"data prepare: {where}: no list 'messages' (--format chat reads "
            '{"messages": [{"role": ..., "content": ...}, ...]})'
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not all(isinstance(m.get(f), str) for f in REQUIRED):
            raise ConfigError(
                f"data prepare: {where}: message {i} is not an object with string 'role' and "
                "'content'"
            )
    if not any(m["role"] == ASSISTANT for m in messages):
        raise ConfigError(
            f"data prepare: {where}: no message has role '{ASSISTANT}', so nothing would be "
            "learned from it"
        )


def _get(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, dict) else None


def _raise(message: str) -> None:
    # Templates call raise_exception() to refuse a conversation (e.g. roles out of order).
    from jinja2 import TemplateError

    raise TemplateError(message)


@functools.cache
def _compiled(source: str) -> Any:
    """The template as Hugging Face compiles chat templates: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, raise_exception, strftime_now and a tojson that keeps
    non-ASCII text and does not escape HTML."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None, **kw: json.dumps(
        value, ensure_ascii=False, indent=indent, sort_keys=kw.get("sort_keys", False)
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def segments(example: dict[str, Any], fmt: ExampleFormat, key: str) -> list[tuple[str, bool]]:
    """The example's text in pieces, each (text, is target), in order."""
    if fmt.kind == "prompt_response":
        return [(example["prompt"], False), (example["response"], True)]
    from jinja2 import TemplateError

    messages = example["messages"]
    template = _compiled(fmt.template)

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return template.render(
                messages=messages[:upto], add_generation_prompt=generation_prompt,
                **dict(fmt.special_tokens),
            )  # fmt: skip
        except TemplateError as e:
            raise ConfigError(
                f"data prepare: {key}: the chat template ({fmt.template_from}) does not render "
                f"this conversation: {e}"
            ) from e

    full = render(len(messages), False)
    pieces: list[tuple[str, bool]] = []
    done = 0  # characters of `full` already in pieces
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        before, through = render(i, True), render(i + 1, False)
        if not (through.startswith(before) and full.startswith(through)):
            raise ConfigError(
                f"data prepare: {key}: the chat template ({fmt.template_from}) renders messages "
                f"0-{i} otherwise than as the start of the whole conversation, so the text of "
                f"assistant message {i} cannot be located"
            )
        pieces += [(full[done : len(before)], False), (full[len(before) : len(through)], True)]
        done = len(through)
    return [*pieces, (full[done:], False)]


def encode_examples(
    tok: Tokenizer, dtype: np.dtype, fmt: ExampleFormat, keys: list[str], lines: list[bytes]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Examples (their JSONL lines, checked by check_example) as one flat token array with EOS
    after each, each example's end offset, and the loss mask (1: target) of every token."""
    examples = [json.loads(line) for line in lines]
    pieces = [segments(e, fmt, key) for e, key in zip(examples, keys, strict=True)]
    # One batch for the whole chunk: a tokenizer.json encodes it in one call.
    flat = [text.encode("utf-8", errors="replace") for example in pieces for text, _ in example]
    ids = iter(tok.encode_documents(flat))
    eos = np.array([tok.eos_id])
    tokens: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    ends: list[int] = []
    for example, record in zip(pieces, examples, strict=True):
        parts = [next(ids) for _ in example]
        tokens += [*parts, eos]
        # The EOS ends the answer when the example ends with one: then it is learned too.
        answered = fmt.kind == "prompt_response" or record["messages"][-1]["role"] == ASSISTANT
        flags = [target for _, target in example]
        mask += [np.full(len(p), flag, np.uint8) for p, flag in zip(parts, flags, strict=True)]
        mask.append(np.array([answered], dtype=np.uint8))
        ends.append((ends[-1] if ends else 0) + sum(len(p) for p in parts) + 1)
    return (
        np.concatenate(tokens).astype(dtype, copy=False),
        np.array(ends, dtype=np.int64),
        np.concatenate(mask),
    )
