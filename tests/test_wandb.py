"""Weights & Biases as its users set it up (launch/wandb_run.py): the WANDB_* variables and
W&B's own settings files decide what the config leaves unset, a key that is set wins, a missing
login or a broken install is one line before any rank starts, and the starts of one run form
one W&B group.

Nothing here reaches a network: W&B runs offline, or is stopped before it starts, with its home,
netrc and settings in the test's folder and its server on a closed port of this machine.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from configs import ConfigError
from launch.metrics import MetricsConfig
from launch.wandb_run import check_wandb, resolve_wandb
from tests.distributed import run_distributed
from tests.test_health import tensorboard_scalars
from tests.test_launch import ENV, ROOT, tiny_args
from tests.test_train import TINY

pytest.importorskip("wandb")

KEY = "0123456789abcdef0123456789abcdef01234567"  # a key's shape; never sent anywhere


def wandb_free(environ: dict[str, str], home: Path) -> dict[str, str]:
    """`environ` without any W&B setting or login of the machine's, with `home` as HOME, W&B's
    server on a closed local port and its error reports off: a mistake fails here, offline."""
    clean = {k: v for k, v in environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    home.mkdir(parents=True, exist_ok=True)
    return clean | {"HOME": str(home), "WANDB_BASE_URL": "http://127.0.0.1:9",
                    "WANDB_ERROR_REPORTING": "false", "WANDB_SILENT": "true"}  # fmt: skip


@pytest.fixture
def own_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process with wandb_free's environment, in a folder of its own (W&B reads the
    workspace settings of the current folder). Returns the folder."""
    for key in [k for k in os.environ if k.startswith("WANDB_") or k == "NETRC"]:
        monkeypatch.delenv(key)
    for key, value in wandb_free({}, tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def wandb_cli(*args: str) -> None:
    """W&B's own command line, as a user runs it, in this process's environment and folder."""
    done = subprocess.run([sys.executable, "-m", "wandb", *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_unset_keys_are_left_to_the_environment_and_set_keys_win(own_wandb: Path) -> None:
    run_dir = own_wandb / "out" / "job"
    unset = MetricsConfig(wandb=True)
    setup = resolve_wandb(unset, "job", run_dir, os.environ)
    assert [str(c) for c in (setup.mode, setup.project, setup.entity, setup.group, setup.dir)] == [
        "online (W&B's default)", "fsdp2-trainer (the trainer's default)",
        "not set (W&B uses the account's default)", "job (run.name)",
        f"{run_dir} (the run folder)",
    ]  # fmt: skip
    environ = os.environ | {"WANDB_MODE": "offline", "WANDB_PROJECT": "env-project",
                            "WANDB_ENTITY": "env-team", "WANDB_RUN_GROUP": "env-group",
                            "WANDB_DIR": str(own_wandb / "w")}  # fmt: skip
    setup = resolve_wandb(unset, "job", run_dir, environ)
    assert setup.line() == (
        "W&B: project env-project (WANDB_PROJECT), mode offline (WANDB_MODE), entity env-team "
        f"(WANDB_ENTITY), group env-group (WANDB_RUN_GROUP), files under {own_wandb / 'w'} "
        "(WANDB_DIR)"
    )
    keys = MetricsConfig(wandb=True, wandb_mode="online", wandb_project="key-project",
                         wandb_entity="key-team", wandb_group="key-group")  # fmt: skip
    setup = resolve_wandb(keys, "job", run_dir, environ)
    assert setup.line().startswith(
        "W&B: project key-project (metrics.wandb_project), mode online (metrics.wandb_mode), "
        "entity key-team (metrics.wandb_entity), group key-group (metrics.wandb_group)"
    )
    with pytest.raises(ConfigError, match=r"W&B mode 'ofline' \(from WANDB_MODE\) is not one of"):
        check_wandb(unset, os.environ | {"WANDB_MODE": "ofline"})


def test_wandb_offline_and_wandb_login_are_honoured(own_wandb: Path) -> None:
    """What W&B's own commands write (`wandb offline`: the folder's settings file; `wandb
    login`: ~/.netrc) is read as W&B reads it; a WANDB_* variable beats the settings file."""
    cfg = MetricsConfig(wandb=True)
    with pytest.raises(ConfigError, match="W&B runs online .* but finds no login"):
        check_wandb(cfg, os.environ)
    wandb_cli("offline")
    check_wandb(cfg, os.environ)  # offline needs no login
    mode = resolve_wandb(cfg, "job", own_wandb, os.environ).mode
    assert str(mode) == f"offline ({own_wandb / 'wandb' / 'settings'})"
    online = os.environ | {"WANDB_MODE": "online"}
    with pytest.raises(ConfigError, match=r"mode 'online' from WANDB_MODE\) but finds no login"):
        check_wandb(cfg, online)
    check_wandb(cfg, online | {"WANDB_API_KEY": KEY})
    wandb_cli("login", "--no-verify", KEY)
    check_wandb(cfg, online)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["no login", "wandb broken"])
def test_a_missing_login_or_a_broken_wandb_is_one_line_before_any_rank(
    tiny_dataset: str, tmp_path: Path, fault: str
) -> None:
    """launch/torchrun.sh with metrics.wandb=true: no W&B login (and no offline mode), or a
    wandb that raises at import (a dependency it cannot load), ends with one `config error:`
    line and status 2 before any rank starts."""
    env = wandb_free(ENV, tmp_path / "home") | {"NPROC": "2"}
    if fault == "wandb broken":
        (tmp_path / "shim" / "wandb").mkdir(parents=True)
        (tmp_path / "shim" / "wandb" / "__init__.py").write_text(
            "raise ImportError(\"cannot import name 'builder' from 'google.protobuf.internal'\")\n"
        )
        env |= {"PYTHONPATH": str(tmp_path / "shim"), "WANDB_MODE": "offline"}
    args = tiny_args(tiny_dataset, tmp_path, "--train.steps=2", "--metrics.wandb=true")
    done = subprocess.run(["launch/torchrun.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 2, log
    [line] = [line for line in log.splitlines() if "ERROR" in line]
    expected = {
        "no login": "config error: metrics.wandb=true: W&B runs online (mode 'online' from "
        "W&B's default) but finds no login",
        "wandb broken": "config error: metrics.wandb=true but wandb cannot be imported "
        "(ImportError: cannot import name 'builder' from 'google.protobuf.internal')",
    }[fault]
    assert expected in line, log
    assert "Traceback" not in log and "[rank1]" not in log, log
    assert not (tmp_path / "debug").exists()  # no rank started: not even the run folder


def train_in_env(argv: list[str], env: dict[str, str]) -> list[str]:
    """A rank of train.py in a shell whose W&B variables are exactly `env`'s; returns the lines
    naming W&B that rank 0 logged."""
    from tests.test_train import train_losses

    for key in [k for k in os.environ if k.startswith("WANDB_") or k == "NETRC"]:
        del os.environ[key]
    os.environ.update(env)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("train").addHandler(handler)
    logging.getLogger("train").setLevel(logging.INFO)
    train_losses(argv)
    return [line for line in seen if line.startswith("W&B:")]


@pytest.mark.slow
def test_the_environment_alone_decides_and_each_start_joins_the_run_group(
    tiny_dataset: str, tmp_path: Path
) -> None:
    """`WANDB_MODE=offline WANDB_PROJECT=from-env train.py --metrics.wandb=true` on 2 ranks,
    then the same run requeued (SLURM_RESTART_COUNT=1) on 1 rank for more steps: two offline
    W&B runs in project from-env and group run.name, each saying where it started."""
    env = wandb_free({}, tmp_path / "home") | {"WANDB_MODE": "offline",
                                               "WANDB_PROJECT": "from-env"}  # fmt: skip
    argv = tiny_args(tiny_dataset, tmp_path, "--metrics.wandb=true", "--checkpoint.interval=2",
                     "--parallel.device=cpu")  # fmt: skip
    [first] = run_distributed(train_in_env, 2, [*argv, "--train.steps=2"], env)[0]
    restarted = env | {"SLURM_RESTART_COUNT": "1"}
    [second] = run_distributed(train_in_env, 1, [*argv, "--train.steps=4"], restarted)[0]
    assert first == second, (first, second)
    assert first == (
        "W&B: project from-env (WANDB_PROJECT), mode offline (WANDB_MODE), entity not set (W&B "
        f"uses the account's default), group debug (run.name), files under {tmp_path / 'debug'}"
        " (the run folder)"
    )
    runs = [run_record(wandb_records(path)) for path in wandb_files(tmp_path / "debug")]
    assert [(r.project, r.run_group, r.display_name) for r in runs] == [
        ("from-env", "debug", "debug"), ("from-env", "debug", "debug (from step 2)")
    ]  # fmt: skip
    starts = [{i.key: json.loads(i.value_json) for i in r.config.update}["start"] for r in runs]
    assert starts == [
        {"step": 0, "world_size": 2, "nodes": 1, "torchrun_restarts": 0, "slurm_restarts": 0},
        {"step": 2, "world_size": 1, "nodes": 1, "torchrun_restarts": 0, "slurm_restarts": 1},
    ]


def wandb_files(run_dir: Path) -> list[Path]:
    """The offline W&B runs of a run folder, oldest first."""
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (run-*.wandb): wandb's record log, blocks of
    32 KiB holding records of <crc32, length, type> + a protobuf `Record` (no reader of it
    ships with wandb >= 0.19)."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, pending = path.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B", data[:7]
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in the block for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def run_record(records: list) -> object:
    """The run's own record: its project, entity, group, name and config."""
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return run


def wandb_history(records: list) -> list[dict]:
    """The history rows of a run's records."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


@pytest.mark.slow
def test_wandb_offline_gets_the_scalars_tensorboard_gets(tiny_dataset: str, tmp_path: Path) -> None:
    """Keys that are set beat the environment: WANDB_MODE=online (with no login here) and
    WANDB_PROJECT lose to metrics.wandb_mode=offline and metrics.wandb_project."""
    env = wandb_free({}, tmp_path / "home") | {"WANDB_MODE": "online",
                                               "WANDB_PROJECT": "from-env"}  # fmt: skip
    argv = [f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.steps=6", "--metrics.log_interval=2", "--metrics.tensorboard=true",
            "--metrics.wandb=true", "--metrics.wandb_mode=offline",
            "--metrics.wandb_project=from-config", "--train.eval_interval=6",
            "--train.eval_batches=1", "--train.micro_batch_size=4",
            "--parallel.device=cpu"]  # fmt: skip
    [line] = run_distributed(train_in_env, 2, argv, env)[0]
    assert line.startswith(
        "W&B: project from-config (metrics.wandb_project), mode offline (metrics.wandb_mode)"
    )
    tensorboard = tensorboard_scalars(tmp_path / "debug" / "tensorboard")
    [run_file] = wandb_files(tmp_path / "debug")
    records = wandb_records(run_file)
    assert run_record(records).project == "from-config"
    wandb: dict[str, dict[int, float]] = {}
    for row in wandb_history(records):
        for tag, value in row.items():
            if not tag.startswith("_"):
                wandb.setdefault(tag, {})[row["_step"]] = value
    assert set(wandb) == set(tensorboard) and "straggler/lag_s" in wandb and "loss/val" in wandb
    for tag, points in tensorboard.items():
        assert [step for step, _ in points] == sorted(wandb[tag]), tag
        # TensorBoard keeps float32.
        assert [v for _, v in points] == pytest.approx([wandb[tag][s] for s, _ in points], rel=1e-6)


def test_wandb_keys_with_wandb_off_are_warned_about(
    tiny_dataset: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """W&B's keys in a config file while W&B is off (switched off for one run): one warning on
    rank 0 naming them, as for fp8's keys with FP8 off; the run goes on. With W&B on, none."""
    import train

    config = tmp_path / "run.toml"
    config.write_text('[metrics]\nwandb_project = "team-runs"\nwandb_mode = "offline"\n')
    argv = [str(config), f"--data.path={tiny_dataset}", f"--run.output_dir={tmp_path}", *TINY,
            "--train.micro_batch_size=2", "--dry-run"]  # fmt: skip
    os.environ.pop("WORLD_SIZE", None)  # this process is a 1-rank launch
    with caplog.at_level(logging.WARNING, logger="train"):
        assert train.main(argv) == 0
        assert train.main([*argv, "--metrics.wandb=true"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "metrics.wandb_project='team-runs', metrics.wandb_mode='offline' have no effect with "
        "metrics.wandb=false"
    ]
