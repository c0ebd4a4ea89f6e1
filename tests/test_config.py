"""Config system: precedence, CLI syntax, error messages, TOML round trip, docs and --help."""

# Postponed annotations on purpose: parse_config must resolve them with get_type_hints.
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

from configs import (
    ConfigError,
    HelpRequested,
    config_to_dict,
    config_to_toml,
    field_docs,
    help_text,
    parse_config,
)


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate schedule shape."""
    warmup: int = 10
    """Linear warmup steps."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps."""
    lr: float = 3e-4
    """Peak learning rate."""
    grad_clip: float | None = 1.0
    """Max gradient norm; none disables clipping."""
    compile: bool = False
    """Wrap blocks in torch.compile."""
    milestones: list[int] = field(default_factory=lambda: [10, 20])
    """Steps at which to log a sample."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""

    def __post_init__(self) -> None:
        if self.schedule.warmup > self.steps:
            raise ConfigError(f"warmup ({self.schedule.warmup}) must be <= steps ({self.steps})")


@dataclass
class DataConfig:
    path: str = "outputs/data"
    """Directory made by the prepare script."""
    tags: list[str] = field(default_factory=list)
    """Dataset tags to keep."""
    seed: Optional[int] = None  # noqa: UP045 -- the typing.Optional spelling must work too
    """Shuffle seed; none means the run seed."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("data.path must not be empty")


@dataclass
class ModelConfig:
    dim: int = 32
    """Hidden size."""
    norm: Literal["rms", "layer"] = "rms"
    """Normalization layer."""


@dataclass
class RunConfig:
    name: str = "debug"
    """Run name, used for the output directory."""
    dry_run: bool = False
    """Build everything, then exit before the first step."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(dim=64))
    """Model shape (default differs from the class default on purpose)."""

    def __post_init__(self) -> None:
        if self.name == "bad":
            raise ConfigError("name: 'bad' is reserved")


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(RunConfig, argv)
    return str(info.value)


def test_defaults() -> None:
    cfg = parse_config(RunConfig, [])
    assert cfg == RunConfig()
    assert (
        cfg.model.dim == 64
    )  # from the section's default_factory, not ModelConfig's class default
    assert cfg.train.milestones == [10, 20] and cfg.train.schedule.kind == "cosine"


def test_toml_overrides_defaults_and_cli_overrides_toml(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'name = "toml"\n[train]\nsteps = 50\nlr = 1\n[train.schedule]\nkind = "linear"\n'
        '[data]\ntags = ["a", "b"]\n[model]\nnorm = "layer"\n',
    )
    cfg = parse_config(RunConfig, [path])
    assert cfg.name == "toml" and cfg.train.steps == 50
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)  # int accepted for float
    assert cfg.train.schedule.kind == "linear" and cfg.data.tags == ["a", "b"]
    assert cfg.model == ModelConfig(dim=64, norm="layer")  # section default kept for other keys

    cfg = parse_config(RunConfig, [path, "--train.steps=70", "--name", "cli"])
    assert cfg.train.steps == 70 and cfg.name == "cli"
    assert cfg.train.schedule.kind == "linear"  # untouched TOML values survive

    # Launchers put their own overrides before the user's "CONFIG --x=y": the file may stand
    # anywhere, is applied first, and the command line still wins, last value last.
    cfg = parse_config(RunConfig, ["--train.steps=70", "--name", "cli", path, "--train.steps=80"])
    assert cfg.train.steps == 80 and cfg.name == "cli" and cfg.train.schedule.kind == "linear"


def test_cli_syntax() -> None:
    cfg = parse_config(
        RunConfig,
        [
            "--train.steps",
            "1_000",
            "--train.grad-clip=0.5",
            "--dry-run",
            "--train.compile",
            "false",
            "--train.milestones=1, 2,3",
            "--data.tags=",
            "--train.schedule.kind",
            "constant",
            "--train.steps=200",  # same key twice: last wins
        ],
    )
    assert cfg.train.steps == 200 and cfg.train.grad_clip == 0.5
    assert cfg.dry_run is True and cfg.train.compile is False
    assert cfg.train.milestones == [1, 2, 3] and cfg.data.tags == []
    assert cfg.train.schedule.kind == "constant"
    assert parse_config(RunConfig, ["--train.compile", "--dry_run=yes"]).train.compile is True


def test_none_and_optional_via_cli() -> None:
    cfg = parse_config(RunConfig, ["--train.grad_clip=none", "--data.seed", "3"])
    assert cfg.train.grad_clip is None and cfg.data.seed == 3
    assert parse_config(RunConfig, ["--data.seed=null"]).data.seed is None


def test_unknown_keys_suggest_and_list_valid(tmp_path: Path) -> None:
    msg = error(["--train.stpes=3"])
    assert "unknown key 'train.stpes'" in msg and "from --train.stpes" in msg
    assert "did you mean 'train.steps'?" in msg
    assert "valid keys in [train]: steps, lr, grad_clip, compile, milestones, schedule" in msg

    msg = error([write(tmp_path, "[trian]\nsteps = 1\n")])
    assert "unknown key 'trian'" in msg and "did you mean 'train'?" in msg
    assert "valid keys at top level: name, dry_run, train, data, model" in msg
    assert str(tmp_path / "run.toml") in msg

    msg = error(["--train.schedule.zzz=1"])
    assert "unknown key 'train.schedule.zzz'" in msg and "did you mean" not in msg
    assert "valid keys in [train.schedule]: kind, warmup" in msg


def test_wrong_types_name_the_source(tmp_path: Path) -> None:
    assert error(["--train.steps=abc"]) == (
        "train.steps: expected int, got 'abc' (from --train.steps)"
    )
    assert "expected int, got '1.5'" in error(["--train.steps=1.5"])
    path = write(tmp_path, '[train]\nsteps = "abc"\n')
    assert error([path]) == f"train.steps: expected int, got 'abc' (from {path})"
    assert "expected int, got True" in error([write(tmp_path, "[train]\nsteps = true\n")])
    assert "expected float, got 'x'" in error([write(tmp_path, '[train]\nlr = "x"\n')])
    assert "expected bool, got 'maybe'" in error(["--dry_run=maybe"])
    assert "train.milestones[1]: expected int, got 'x'" in error(["--train.milestones=1,x"])
    assert "expected float | none, got 'off'" in error(["--train.grad_clip=off"])
    # nan and inf parse as floats, from TOML as from the command line, and mean nothing here.
    assert "train.lr: expected a finite number, got nan (from --train.lr)" in error(
        ["--train.lr=nan"]
    )
    path = write(tmp_path, "[train]\nlr = inf\n")
    assert error([path]) == f"train.lr: expected a finite number, got inf (from {path})"


def test_bad_literal_lists_choices(tmp_path: Path) -> None:
    msg = error(["--train.schedule.kind=cosin"])
    assert "train.schedule.kind: 'cosin' is not one of: cosine, linear, constant" in msg
    msg = error([write(tmp_path, '[model]\nnorm = "batch"\n')])
    assert "model.norm: 'batch' is not one of: rms, layer" in msg


def test_file_and_argument_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    assert error([missing]) == f"config file not found: {missing}"
    assert "invalid TOML" in error([write(tmp_path, "steps = = 1\n")])
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("[train]\n# caf\u00e9\nsteps = 3\n".encode("latin-1"))
    assert error([str(latin1)]) == f"{latin1}: not UTF-8 text (byte 13); save it as UTF-8"
    assert error([str(tmp_path)]) == f"config file {tmp_path} is a directory; give a TOML file"
    assert "unexpected argument 'b.toml'" in error([write(tmp_path, ""), "b.toml"])
    assert "--train.steps needs a value" in error(["--train.steps"])


def test_section_scalar_mismatch(tmp_path: Path) -> None:
    msg = error([write(tmp_path, "train = 3\n")])
    assert "'train' is a section: expected a table [train], got 3" in msg
    msg = error([write(tmp_path, "[train.steps]\nx = 1\n")])
    assert "'train.steps' is a value of type int, not a section" in msg
    assert "'train' is a section, not a value" in error(["--train=3"])
    assert "'train.steps' is a value of type int, not a section" in error(["--train.steps.x=1"])


def test_post_init_errors_surface_as_config_error() -> None:
    assert error(["--train.steps=5"]) == "train: warmup (10) must be <= steps (5)"
    assert error(["--name=bad"]) == "name: 'bad' is reserved"
    assert error(["--data.path="]) == "data.path must not be empty"  # already named: no prefix
    # Each section is built once with its final values, so this valid combination passes.
    cfg = parse_config(RunConfig, ["--train.steps=5", "--train.schedule.warmup=5"])
    assert cfg.train.steps == 5


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = RunConfig(
        name='quote " and back\\slash\nnewline\ttab \x7f é',
        dry_run=True,
        train=TrainConfig(
            steps=5, lr=0.1, grad_clip=2.5, milestones=[], schedule=ScheduleConfig("linear", 5)
        ),
        data=DataConfig(path="C:\\data", tags=["x", 'y"z'], seed=7),
        model=ModelConfig(dim=8),
    )
    text = config_to_toml(cfg)
    assert "# Peak learning rate.\nlr = 0.1\n" in text
    assert "grad_clip = 2.5" in text and "[train.schedule]" in text
    assert parse_config(RunConfig, [write(tmp_path, text)]) == cfg
    # inf is written as TOML has it, and refused when read back (test_type_errors_name_the_key).
    assert "grad_clip = inf" in config_to_toml(RunConfig(train=TrainConfig(grad_clip=math.inf)))

    cfg = RunConfig(train=TrainConfig(lr=3e-4, grad_clip=None))
    text = config_to_toml(cfg)
    assert "lr = 0.0003" in text and "grad_clip" not in text and "seed" not in text
    assert config_to_dict(cfg)["train"]["lr"] == 3e-4 and "seed" not in config_to_dict(cfg)["data"]
    back = parse_config(RunConfig, [write(tmp_path, text)])
    assert back.train.lr == 3e-4 and back.data.seed is None


def test_docs_and_help() -> None:
    docs = field_docs(TrainConfig)
    assert docs["lr"] == "Peak learning rate." and docs["schedule"] == "Learning-rate schedule."
    with pytest.raises(HelpRequested) as info:
        parse_config(RunConfig, ["--train.steps=abc", "--help"])  # help wins over bad values
    text = info.value.text
    assert text == help_text(RunConfig)
    assert "--train.steps=<int> (default: 100)  Optimizer steps." in text
    assert '--train.schedule.kind=<cosine|linear|constant> (default: "cosine")' in text
    assert "--data.seed=<int | none> (default: none)  Shuffle seed" in text
    assert "--model.dim=<int> (default: 64)" in text
    assert "[train.schedule]  Learning-rate schedule." in text
    assert "# Run name, used for the output directory.\nname = " in config_to_toml(RunConfig())


@dataclass
class MixConfig:
    sources: dict[str, ScheduleConfig] = field(default_factory=dict)
    """Named schedules, one table each."""


@dataclass
class WithMap:
    mix: MixConfig = field(default_factory=MixConfig)


def test_named_sections_from_toml_and_command_line(tmp_path: Path) -> None:
    """`dict[str, Config]` fields: tables [mix.sources.NAME], keys --mix.sources.NAME.KEY."""
    path = write(tmp_path, '[mix.sources.a]\nkind = "linear"\n[mix.sources.b]\nwarmup = 3\n')
    cfg = parse_config(WithMap, [path, "--mix.sources.b.kind=constant", "--mix.sources.c.warmup=7"])
    assert cfg.mix.sources == {
        "a": ScheduleConfig("linear", 10), "b": ScheduleConfig("constant", 3),
        "c": ScheduleConfig("cosine", 7),
    }  # fmt: skip
    assert parse_config(WithMap, []).mix.sources == {}
    text = config_to_toml(cfg)
    assert "# Named schedules, one table each.\n[mix.sources.a]\n" in text
    assert parse_config(WithMap, [write(tmp_path, text)]) == cfg
    assert config_to_dict(cfg)["mix"]["sources"]["c"] == {"kind": "cosine", "warmup": 7}
    help_lines = help_text(WithMap)
    assert "[mix.sources.NAME]  Named schedules, one table each." in help_lines
    assert '--mix.sources.NAME.kind=<cosine|linear|constant> (default: "cosine")' in help_lines

    def fails(argv: list[str]) -> str:
        with pytest.raises(ConfigError) as info:
            parse_config(WithMap, argv)
        return str(info.value)

    assert "'mix.sources.a' is a section, not a value" in fails(["--mix.sources.a=1"])
    assert "set an entry's keys as --mix.sources.NAME.KEY=VALUE" in fails(["--mix.sources=1"])
    assert "valid keys in [mix.sources.a]: kind, warmup" in fails(["--mix.sources.a.knd=x"])
    assert "'mix.sources' holds named sections" in fails([write(tmp_path, "[mix]\nsources = 1\n")])
    assert "mix.sources.a.kind: 'x' is not one of" in fails(["--mix.sources.a.kind=x"])
