"""Copies between model families stay in step (docs/forking.md, "Copies").

A family file reads top to bottom on its own, so what it shares with another family is a copy,
marked on the line above it:

    # Copied from model.llama.TransformerBlock with LlamaArgs->QwenArgs

This test fails when a marked copy differs from its source after the renames: fix the copy, or
remove its mark where the family means to differ. It compares code, not layout: the syntax tree
and the comments (`normalized`), so a copy that ruff rewraps (a rename that pushes a line past
100 columns becomes a call over several lines, with a trailing comma) is still the same copy.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import io
import re
import textwrap
import tokenize
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


def normalized(code: str) -> tuple[str, list[str]]:
    """What a copy must keep: its syntax tree (no layout: line breaks inside brackets,
    parentheses, trailing commas) and its comments, in order, but ruff's `# fmt:` markers."""
    tokens = tokenize.generate_tokens(io.StringIO(code).readline)
    comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
    return ast.dump(ast.parse(code)), [c for c in comments if not c.startswith("# fmt:")]


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
    assert normalized(actual) == normalized(expected), f"the copy drifted from {source}:\n{diff}"


# model.llama.output_layer with Transformer->RENAMED, as `ruff format` (line length 100) wraps
# it: the signature over three lines, with a trailing comma.
RENAMED = "TransformerWithAnEvenLongerNameThatPushesItsSignaturePast100Columns"
WRAPPED = f'''def output_layer(
    model: {RENAMED},
) -> nn.Module:
    """The output projection that `forward(..., hidden_only=True)` leaves out."""
    return model.output'''


def test_a_copy_ruff_wrapped_is_the_same_and_a_drifted_one_is_caught() -> None:
    """Layout is not a difference; a changed name, expression or comment is."""
    renamed = source_of("model.llama.output_layer").replace("Transformer", RENAMED)
    assert max(len(line) for line in renamed.splitlines()) > 100  # ruff wraps it
    assert normalized(WRAPPED) == normalized(renamed) and WRAPPED != renamed
    for drift in [("model.output", "model.norm"), ("hidden_only=True", "hidden_only=False")]:
        assert normalized(WRAPPED.replace(*drift)) != normalized(WRAPPED), drift
    original = copy_source(MODEL / "llama.py", _line_of("model/llama.py", "class RMSNorm"))
    assert normalized(original.replace("eps", "epsilon", 1)) != normalized(original)
    # A comment says why the code is so: part of the copy (ruff's own markers are not).
    why = "# F.rms_norm runs aten::_fused_rms_norm"
    assert normalized(original.replace(why, "# rms_norm")) != normalized(original)
    assert normalized(original.replace("self.eps = eps", "self.eps = eps  # fmt: skip")) == (
        normalized(original)
    )


def _line_of(file: str, start: str) -> int:
    lines = (MODEL.parent / file).read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.startswith(start))
