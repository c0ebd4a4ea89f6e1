"""Copies between model families stay in step (docs/forking.md, "Copies").

A family file reads top to bottom on its own, so what it shares with another family is a copy,
marked on the line above it:

    # Copied from model.llama.TransformerBlock with LlamaArgs->QwenArgs

This test fails when a marked copy differs from its source after the renames: fix the copy, or
remove its mark where the family means to differ.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "model"
MARK = re.compile(r"^\s*# Copied from (model(?:\.\w+)+)(?: with (.+))?$")


def marks() -> list[tuple[Path, int, str, str]]:
    """(file, line of the copy, source path, renames) of every mark under model/."""
    found = []
    for path in sorted(MODEL.glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            if m := MARK.match(line):
                found.append((path, i + 1, m.group(1), m.group(2) or ""))
    return found


def copy_source(path: Path, line: int) -> str:
    """The source of the def or class that starts on `line` (its decorators included)."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first == line:
                lines = text.splitlines()[first - 1 : node.end_lineno]
                return textwrap.dedent("\n".join(lines))
    raise AssertionError(f"{path.name}:{line}: a '# Copied from' mark must stand on the line "
                         "above a def or class (above its decorators)")  # fmt: skip


def source_of(dotted: str) -> str:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return textwrap.dedent(inspect.getsource(obj)).rstrip("\n")
    raise AssertionError(f"{dotted}: no such module")


def test_copies_are_marked() -> None:
    # The families do share code this way; a refactor that drops every mark should say so.
    assert len(marks()) >= 5


@pytest.mark.parametrize(
    ("path", "line", "source", "renames"),
    marks(),
    ids=[f"{p.name}:{n}" for p, n, _, _ in marks()],
)
def test_marked_copy_equals_its_source(path: Path, line: int, source: str, renames: str) -> None:
    expected = source_of(source)
    for rename in filter(None, (r.strip() for r in renames.split(","))):
        old, _, new = rename.partition("->")
        expected = expected.replace(old.strip(), new.strip())
    actual = copy_source(path, line)
    diff = "\n".join(difflib.unified_diff(expected.splitlines(), actual.splitlines(),
                                          source, f"{path.name}:{line}", lineterm=""))  # fmt: skip
    assert actual == expected, f"the copy drifted from {source}:\n{diff}"


def test_a_drifted_copy_is_caught(tmp_path: Path) -> None:
    """The check itself: a changed line in a copy is a difference."""
    fake = tmp_path / "fake.py"
    original = copy_source(MODEL / "llama.py", _line_of("model/llama.py", "class RMSNorm"))
    fake.write_text(original.replace("eps", "epsilon", 1))
    assert copy_source(fake, 1) != original


def _line_of(file: str, start: str) -> int:
    lines = (MODEL.parent / file).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.startswith(start))
