"""Configuration: the shipped TOML files, and the parser every module's config goes through.

Each module owns its config as a `@dataclass` whose fields carry a docstring on the next line;
`launch/job.py` nests them into one tree (`JobConfig`), which `train.py` reads with
`parse_config(JobConfig, argv)`: defaults < TOML file < `--section.key=value`
(configs/parse.py). `config_to_toml` writes the resolved tree next to the run and into each
checkpoint (configs/write.py). This package imports nothing from the rest of the project, so
any module may import it.
"""

from __future__ import annotations

from pathlib import PurePath


class ConfigError(ValueError):
    """Bad user input (config, mesh, missing data file...): printed as one line, exit status 2."""


class HelpRequested(Exception):
    """`--help` was given: the caller prints `.text` on rank 0 and exits 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def check_folder_name(key: str, name: str, absolute: bool) -> None:
    """A folder setting that lives inside another folder: not empty (it would write into the
    parent itself) and without '..' (it would write outside it); `absolute` allows '/x/y'."""
    parts = PurePath(name).parts
    if not name.strip() or not parts:  # '' or '.': the parent folder itself
        raise ConfigError(f"{key}={name!r} names no folder of its own inside its parent")
    if ".." in parts:
        raise ConfigError(f"{key}={name!r} leaves its parent folder ('..'); name a folder inside")
    if PurePath(name).is_absolute() and not absolute:
        raise ConfigError(f"{key}={name!r} is an absolute path; name a folder inside its parent")


# The package's API (after the errors, which both modules import).
from configs.parse import help_text, parse_config  # noqa: E402
from configs.write import config_to_dict, config_to_toml, field_docs  # noqa: E402

__all__ = [
    "ConfigError",
    "check_folder_name",
    "HelpRequested",
    "config_to_dict",
    "config_to_toml",
    "field_docs",
    "help_text",
    "parse_config",
]
