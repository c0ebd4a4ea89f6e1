"""Weights & Biases as its users already set it up: where a run logs (project, mode, entity,
group, folder) and where that came from, the login checked before any rank starts, and the run.

W&B's own order holds: its settings files < its WANDB_* variables < what wandb.init is given.
A [metrics] key that is set is given to wandb.init, so it wins; an unset one (None) is read
here as W&B reads it, from the environment, then its settings files, then a default. The
resolved values are what wandb.init receives, so the line logged at the start is the truth.
Nothing here asks W&B's server: the check reads variables and files only.
"""

from __future__ import annotations

import configparser
import importlib
import netrc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from configs import ConfigError

# W&B's names for its modes: 'dryrun' is an old name of 'offline', 'run' of 'online'; 'shared'
# is online with several writers. Only offline and disabled need no login.
MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")
NO_LOGIN = ("offline", "dryrun", "disabled")
DEFAULT_PROJECT = "fsdp2-trainer"


class WandbKeys(Protocol):
    """The [metrics] keys read here (launch/metrics.py's MetricsConfig, documented there;
    launch.metrics imports this module, so this module names the keys it reads instead)."""

    wandb: bool
    wandb_mode: str | None
    wandb_project: str | None
    wandb_entity: str | None
    wandb_group: str | None


@dataclass(frozen=True)
class Choice:
    value: str | None
    """The setting (None: W&B decides, e.g. the entity: the account's default)."""
    source: str
    """What decided it: a [metrics] key, a WANDB_* variable, a settings file, or a default."""

    def __str__(self) -> str:
        return f"{'not set' if self.value is None else self.value} ({self.source})"


@dataclass(frozen=True)
class WandbSetup:
    """Where a run logs: each setting with its source."""

    mode: Choice
    project: Choice
    entity: Choice
    group: Choice
    dir: Choice
    """The folder W&B writes under (its files go to <dir>/wandb/)."""

    def line(self) -> str:
        return (
            f"W&B: project {self.project}, mode {self.mode}, entity {self.entity}, "
            f"group {self.group}, files under {self.dir}"
        )


def settings_files(environ: Mapping[str, str]) -> list[tuple[Path, dict[str, str]]]:
    """W&B's settings files that exist, the one that wins first: the workspace's
    (<WANDB_DIR or the current folder>/wandb/settings, where `wandb offline` writes `mode`),
    then the global one ($WANDB_CONFIG_DIR/settings, default ~/.config/wandb/settings)."""
    root = Path(environ.get("WANDB_DIR") or Path.cwd()).expanduser()
    workspace = root / (".wandb" if (root / ".wandb").exists() else "wandb") / "settings"
    config_dir = environ.get("WANDB_CONFIG_DIR")
    home = Path(config_dir).expanduser() if config_dir else Path("~/.config/wandb").expanduser()
    found = []
    for path in (workspace, home / "settings"):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
            found.append((path, dict(parser.items("default"))))
        except (OSError, configparser.Error):  # none, or unreadable: W&B reads it as empty too
            continue
    return found


def choose(
    value: str | None,
    key: str,
    environ: Mapping[str, str],
    files: list[tuple[Path, dict[str, str]]],
    default: Choice,
) -> Choice:
    """One setting: its [metrics] key `wandb_<key>` if set, else W&B's WANDB_<KEY>, else the
    first settings file that names it, else `default`."""
    if value is not None:
        return Choice(value, f"metrics.wandb_{key}")
    name = "run_group" if key == "group" else key  # W&B's own name: WANDB_RUN_GROUP
    if environ.get(variable := f"WANDB_{name.upper()}"):
        return Choice(environ[variable], variable)
    for path, values in files:
        if values.get(name):
            return Choice(values[name], str(path))
    return default


def resolve_mode(
    cfg: WandbKeys, environ: Mapping[str, str], files: list[tuple[Path, dict[str, str]]]
) -> Choice:
    """The mode, or a ConfigError for one W&B does not know, naming where it came from."""
    mode = choose(cfg.wandb_mode, "mode", environ, files, Choice("online", "W&B's default"))
    if mode.value not in MODES:
        raise ConfigError(
            f"W&B mode {mode.value!r} (from {mode.source}) is not one of: online, offline, disabled"
        )
    return mode


def resolve_wandb(
    cfg: WandbKeys, run_name: str, run_dir: Path, environ: Mapping[str, str]
) -> WandbSetup:
    """Where a run of `run_name` in `run_dir` logs: each setting with its source."""
    files = settings_files(environ)
    project = Choice(DEFAULT_PROJECT, "the trainer's default")
    entity = Choice(None, "W&B uses the account's default")
    # The group is the job: every start of run.name (a restart, a requeue) joins it.
    group = Choice(run_name, "run.name")
    folder = Choice(environ["WANDB_DIR"], "WANDB_DIR") if environ.get("WANDB_DIR") else None
    return WandbSetup(
        mode=resolve_mode(cfg, environ, files),
        project=choose(cfg.wandb_project, "project", environ, files, project),
        entity=choose(cfg.wandb_entity, "entity", environ, files, entity),
        group=choose(cfg.wandb_group, "group", environ, files, group),
        dir=folder or Choice(str(run_dir), "the run folder"),
    )


def find_login(environ: Mapping[str, str], files: list[tuple[Path, dict[str, str]]]) -> str | None:
    """Where W&B would find its credentials, as it looks for them, without asking its server:
    WANDB_API_KEY (or WANDB_IDENTITY_TOKEN_FILE), the netrc entry of its server (`wandb login`
    writes it: $NETRC, else ~/.netrc or ~/_netrc), or api_key in a settings file. None if none."""
    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if environ.get(variable):
            return variable
    base_url = environ.get("WANDB_BASE_URL") or next(
        (values["base_url"] for _, values in files if values.get("base_url")),
        "https://api.wandb.ai",
    )
    host = urlsplit(base_url).netloc
    if environ.get("NETRC"):
        candidates = [Path(environ["NETRC"]).expanduser()]
    else:
        candidates = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    path = next((p for p in candidates if p.exists()), None)
    if path is not None and host:
        try:
            entry = netrc.netrc(path).authenticators(host)
        except (netrc.NetrcParseError, OSError):  # W&B warns and goes on without it
            entry = None
        if entry and entry[2]:
            return str(path)
    return next((str(path) for path, values in files if values.get("api_key")), None)


def import_wandb() -> Any:
    """The wandb package, or one ConfigError line: not installed, or installed but broken (a
    missing dependency raises from inside it), or a `wandb/` folder in the way (W&B creates
    such folders: without the package, Python imports one as an empty namespace)."""
    fix = "pip install -e '.[wandb]' (or set metrics.wandb=false)"
    try:
        wandb = importlib.import_module("wandb")
    except ModuleNotFoundError as err:
        if err.name != "wandb":  # a dependency of W&B's is missing, not W&B
            raise ConfigError(
                f"metrics.wandb=true but wandb cannot be imported ({err}): {fix}"
            ) from None
        raise ConfigError(f"metrics.wandb=true but wandb is not installed: {fix}") from None
    except Exception as err:  # noqa: BLE001 - a broken install raises anything at import
        first = (str(err).strip().splitlines() or [""])[0]  # one line, whatever it says
        raise ConfigError(
            f"metrics.wandb=true but wandb cannot be imported ({type(err).__name__}: {first}): "
            f"{fix}"
        ) from None
    if not hasattr(wandb, "init"):
        where = ", ".join(getattr(wandb, "__path__", [])) or "a module without wandb.init"
        raise ConfigError(f"metrics.wandb=true but 'wandb' is the folder {where}, not W&B: {fix}")
    return wandb


def check_wandb(cfg: WandbKeys, environ: Mapping[str, str]) -> None:
    """Before any rank starts, on every rank alike: W&B imports, its mode is one it knows, and
    an online run has a login. Otherwise one ConfigError line, instead of rank 0's traceback
    from wandb.init while the other ranks wait."""
    if not cfg.wandb:
        return
    import_wandb()
    files = settings_files(environ)
    mode = resolve_mode(cfg, environ, files)
    if mode.value in NO_LOGIN or find_login(environ, files):
        return
    raise ConfigError(
        f"metrics.wandb=true: W&B runs online (mode {mode.value!r} from {mode.source}) but "
        "finds no login (WANDB_API_KEY, a netrc entry, or api_key in its settings file): run "
        "`wandb login` once or set WANDB_API_KEY; or log offline with WANDB_MODE=offline (or "
        "--metrics.wandb_mode=offline) and upload later with `wandb sync <run dir>/wandb`"
    )


def start_info(step: int, world_size: int, nodes: int, environ: Mapping[str, str]) -> dict:
    """What this start of the run is, for the W&B config: the step it resumed from (0: a fresh
    start), the world it runs on, and the restarts behind it (torchrun's, Slurm's requeues)."""
    return {
        "step": step,
        "world_size": world_size,
        "nodes": nodes,
        "torchrun_restarts": int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
        "slurm_restarts": int(environ.get("SLURM_RESTART_COUNT") or 0),
    }


def start_wandb(
    cfg: WandbKeys, run_name: str, run_dir: Path, config: dict[str, Any], start: dict[str, int]
) -> Any:
    """A W&B run beside TensorBoard: the same scalars at the same steps. Each start of the
    trainer (a restart, a requeue, a resume) is a new W&B run in the run's group, since W&B
    cannot drop a failed attempt's steps past the checkpoint as TensorBoard's purge_step does;
    its config's `start` says where it began."""
    wandb = import_wandb()
    setup = resolve_wandb(cfg, run_name, run_dir, os.environ)
    name = run_name if start["step"] == 0 else f"{run_name} (from step {start['step']})"
    return wandb.init(
        project=setup.project.value, entity=setup.entity.value, mode=setup.mode.value,
        group=setup.group.value, dir=setup.dir.value, name=name, config=config | {"start": start},
        settings=wandb.Settings(console="off"),
    )  # fmt: skip
