"""Writing a config tree as TOML (next to each run and in each checkpoint; `parse_config` reads
it back), and the field docstrings that annotate it and `--help`."""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import math
import re
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written on the line after each field, read from the class source."""
    docs: dict[str, str] = {}
    # Base classes first so a subclass can re-document an inherited field.
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass):
            continue
        try:
            node = _class_nodes(inspect.getsourcefile(klass) or "")[klass.__qualname__]
        except (OSError, TypeError, KeyError, SyntaxError):  # a REPL's or exec()'s: no docs
            continue
        body = node.body
        for stmt, after in itertools.pairwise(body):  # `name: type = value` then a string
            match stmt, after:
                case ast.AnnAssign(target=ast.Name(id=name)), ast.Expr(ast.Constant(str(doc))):
                    docs[name] = inspect.cleandoc(doc)
    return docs


@functools.cache
def _class_nodes(path: str) -> dict[str, ast.ClassDef]:
    """The classes of one source file by qualified name, parsed once: `inspect.getsource` of
    a class parses its whole module again for each class (~0.35 s for a run's config)."""
    nodes: dict[str, ast.ClassDef] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                nodes[prefix + stmt.name] = stmt
                visit(stmt.body, f"{prefix}{stmt.name}.")
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(stmt.body, f"{prefix}{stmt.name}.<locals>.")

    visit(ast.parse(Path(path).read_text(encoding="utf-8")).body, "")
    return nodes


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of a config tree; None values are left out (TOML has no null)."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("inline"):  # an open section's other keys (e.g. a family's own)
            out |= {k: v for k, v in value.items() if v is not None}
            continue
        if not f.init or value is None:
            continue
        if isinstance(value, dict):  # named sections, e.g. data.sources
            out[f.name] = {k: config_to_dict(v) if is_dataclass(v) else v for k, v in value.items()}
        else:
            out[f.name] = config_to_dict(value) if is_dataclass(value) else value
    return out


def config_to_toml(cfg: Any) -> str:
    """TOML text of a config tree, each key under a `# docstring`; `parse_config` reads it back.

    None values are omitted, so they read back as the field's default: exact when that default
    is None, which is how optional fields are meant to be declared.
    """
    lines: list[str] = []
    _toml_lines(cfg, "", lines)
    return "\n".join(lines).lstrip("\n") + "\n"


# TOML basic strings must escape the quote, backslash, control characters and DEL.
_ESCAPES = {c: f"\\u{c:04x}" for c in [*range(0x20), 0x7F]}
_ESCAPES |= {ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\t"): "\\t"}


def _toml_value(value: Any) -> str:
    if value is None:  # only for --help: the TOML writer leaves None keys out
        return "none"
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest string that parses back to the same float
    if isinstance(value, str):
        return '"' + value.translate(_ESCAPES) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _comment(doc: str | None) -> list[str]:
    return [f"# {line}".rstrip() for line in doc.splitlines()] if doc else []


def _toml_lines(cfg: Any, prefix: str, lines: list[str]) -> None:
    docs, sections = field_docs(type(cfg)), []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("inline"):  # an open section's other keys, as its plain keys
            lines += [f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None]
            continue
        if not f.init or value is None:
            continue
        # TOML needs a table's plain keys before its subtables.
        if is_dataclass(value):
            sections.append((f.name, value, docs.get(f.name)))
        elif isinstance(value, dict):  # named sections [name.ENTRY], the doc above the first
            for i, (entry, sub) in enumerate(value.items()):
                doc = docs.get(f.name) if i == 0 else None
                sections.append((f"{f.name}.{_toml_key(entry)}", sub, doc))
        else:
            lines += [*_comment(docs.get(f.name)), f"{f.name} = {_toml_value(value)}"]
    for name, sub, doc in sections:
        lines += ["", *_comment(doc), f"[{prefix}{name}]"]
        _toml_lines(sub, f"{prefix}{name}.", lines)
