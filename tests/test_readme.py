"""The README as a front door, and docs/data.md's walk-through run as written.

The README's quick start is two commands that must not drift: CI (.ci/run) runs the second, and
users copy both. The README stays short and links every docs page, and every relative link in
the README and docs/ reaches a file (and heading) that exists. The walk-through: shards -> two
sources -> mixture with document masking -> annealed resume. Only the number of steps (and
evaluation to match) is appended, so that it costs seconds; a later `--key=value` overrides an
earlier one, as users rely on too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICK_START = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && "
    "python -m data.prepare && NPROC=4 ./launch/torchrun.sh configs/debug.toml",
    "python3 -m venv .venv && . .venv/bin/activate && "
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest',
)
DOCS = (
    "configuration",
    "data",
    "evaluation",
    "finetuning",
    "parallelism",
    "checkpoints",
    "launch",
    "forking",
)
WALKTHROUGH = ROOT / "docs" / "data.md"
SECTION = "## From shards to a mixture, step by step"


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_quick_start_is_the_two_commands_and_ci_runs_the_second() -> None:
    text = README.read_text()
    quick_start = text[text.index("## Quick start") :].split("\n## ", 1)[0]
    first, second = (block.strip() for block in bash_blocks(quick_start)[:2])
    assert (first, second) == QUICK_START, "the quick start's commands changed"
    # .ci/run installs quietly into the venv it made as command 2 does, then runs command 1's
    # data preparation and a short run of its config (a user runs command 1 first, in the same
    # checkout), then command 2's tests.
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n    ", "")
    ci = [line for line in text.splitlines() if line and not line.startswith("#")]
    install, tests = second.split(" && ")[2:]
    prepare, quick_start = first.split(" && ")[3:]
    short_run = quick_start.replace("NPROC=4", "NPROC=1") + " --train.steps=1"
    [run] = [i for i, line in enumerate(ci) if line.startswith(short_run)]
    assert ci.index(install.replace("pip install ", "pip install -q ")) < ci.index(prepare) < run
    assert ci[-1] == tests and run < len(ci) - 1


def test_readme_is_a_front_door() -> None:
    """At most 250 lines, linking every docs page and BENCHMARKS.md."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for page in DOCS:
        assert f"](docs/{page}.md)" in text, page
    assert "](BENCHMARKS.md)" in text


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors for the Markdown headings of `text`."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_relative_links_reach_files_and_headings() -> None:
    for page in [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor:
                assert anchor in heading_anchors(linked.read_text()), f"{page.name}: {target}"


def documented_commands() -> list[tuple[str, str]]:
    """(page, command line) of every bash block in the README and docs/, continuations joined
    and comments dropped."""
    found = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for block in bash_blocks(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                if command := line.split("  #")[0].strip():
                    found.append((page.name, command))
    return found


def test_documented_commands_leave_the_quick_starts_run_alone() -> None:
    """A reader runs the pages' commands in any order after the quick start, whose run
    (configs/debug.toml's run.name) ends at step 200 in outputs/debug: every other documented
    run of that config names its own run (the same name would resume the finished one, with
    nothing left to do), and every documented export writes a folder of its own (the exporter
    refuses one that is not empty). Both happened on docs pages before this test."""
    commands = documented_commands()
    quick_start = QUICK_START[0].split(" && ")[-1]
    trains = [(p, c) for p, c in commands if "configs/debug.toml" in c and not c.endswith(
        quick_start)]  # fmt: skip
    assert trains, "the pages train configs/debug.toml somewhere"
    for page, command in trains:
        assert "--run.name=" in command, f"{page}: {command}"
    exports = [(p, c.split()) for p, c in commands if "-m checkpoint.export " in c]
    folders = [words[words.index("checkpoint.export") + 2] for _, words in exports
               if "--force" not in words]  # fmt: skip
    assert len(exports) >= 2 and len(folders) == len(set(folders)), exports


def walkthrough_commands() -> list[str]:
    """The shell commands of the walk-through's bash blocks, continuation lines joined."""
    text = WALKTHROUGH.read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    blocks = bash_blocks(section)
    assert len(blocks) == 2, "the walk-through has a first run and an annealed resume"
    return [line for b in blocks for line in b.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.drill
def test_data_walkthrough_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    # The user's working copy (the commands run from the repo root), without the outputs,
    # corpus or environment of this checkout.
    repo = tmp_path / "repo"
    skip = shutil.ignore_patterns(".*", "outputs", "corpus", "__pycache__", "*.egg-info")
    shutil.copytree(ROOT, repo, ignore=skip)
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(repo)  # `python -m data...` imports this copy, as an editable install
    # `python` and `torchrun` are this environment's, as in the user's activated venv, also
    # when pytest runs as .venv/bin/python without activating it.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    runs = []
    for command in walkthrough_commands():
        if command.startswith("pip install"):
            continue  # the test environment has the extras; installing is the user's step
        if "torchrun.sh" in command:
            total = int(re.search(r"--train\.steps=(\d+)", command).group(1))
            # 100 and 200 steps become 2 and 4: the second still resumes the first.
            command += f" --train.steps={total // 50} --train.eval_interval=2"
            command += " --train.eval_batches=1"
        result = subprocess.run(
            command, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        if "torchrun.sh" in command:
            runs.append(result.stdout + result.stderr)

    first, annealed = runs
    data_line = "data: code 0.9 (outputs/data/code), prose 0.1 (outputs/data/prose); seq_len 256, "
    assert data_line + "document attention" in first, first[-3000:]
    assert re.search(r"val_loss/code [\d.]+  val_loss/prose [\d.]+", first), first[-3000:]
    for source in ("code", "prose"):
        assert list((repo / "outputs" / "data" / source).glob("train-*.bin"))
        assert (repo / "outputs" / "data" / source / "index.json").is_file()
    # The second command resumed the first at step 2 and applied the new weights from there.
    resumed = "resuming outputs/mixture/checkpoints/step-2 at step 2 of 4"
    assert resumed in annealed, annealed[-3000:]
    assert "data.sources.prose.weight: 0.1 -> 0.5" in annealed, annealed[-3000:]
    assert "mixture weights change at stream position 16" in annealed, annealed[-3000:]
    assert "done: step 4/4" in annealed, annealed[-3000:]
    tb = repo / "outputs" / "mixture" / "tensorboard"
    assert tb.is_dir() and any(tb.rglob("events.out.tfevents.*"))
