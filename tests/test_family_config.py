"""A family's own `[model]` keys come from its args dataclass (model/__init__.py, ModelConfig):
set from TOML and the command line, checked against the family named anywhere in the config,
listed per family by --help, written back as plain `[model]` keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs import ConfigError, config_to_toml, parse_config
from configs.parse import help_text
from launch.job import JobConfig
from model import FAMILIES, ModelConfig, family_fields


def test_each_family_owns_its_fields_and_no_shared_key_is_one() -> None:
    own = {name: set(family_fields(family)) for name, family in FAMILIES.items()}
    assert {"multiple_of", "ffn_dim_multiplier", "rope_scaling"} <= own["llama3"]
    assert {"head_dim", "ffn_dim"} <= own["qwen3"]
    assert {"head_dim", "n_experts", "top_k", "moe_ffn_dim", "aux_loss_coef"} <= own["qwen3_moe"]
    shared = {"name", "flavor", "dim", "n_layers", "vocab_size", "rope_theta", "attention"}
    assert not shared & set().union(*own.values())


def test_family_keys_from_toml_and_command_line_in_any_order(tmp_path: Path) -> None:
    toml = tmp_path / "m.toml"
    toml.write_text('[model]\nname = "qwen3_moe"\nn_experts = 4\n')
    # The family is named in the file, its key on the command line before the file: any order.
    job = parse_config(JobConfig, ["--model.top_k=1", str(toml), "--model.norm_topk_prob"])
    assert job.model.extra == {"n_experts": 4, "top_k": 1, "norm_topk_prob": True}
    args = FAMILIES["qwen3_moe"].build_args(job.model)
    assert (args.n_experts, args.top_k, args.norm_topk_prob) == (4, 1, True)
    # Keywords in Python too, and both spellings are equal.
    assert job.model == ModelConfig(name="qwen3_moe", n_experts=4, top_k=1, norm_topk_prob=True)


def test_family_keys_round_trip_through_the_saved_config(tmp_path: Path) -> None:
    job = parse_config(JobConfig, ["--model.name=qwen3", "--model.head_dim=16"])
    text = config_to_toml(job)
    assert "\nhead_dim = 16\n" in text.split("[model]")[1].split("\n[")[0]
    saved = tmp_path / "config.toml"
    saved.write_text(text)
    assert parse_config(JobConfig, [str(saved)]) == job


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model.name=qwen3", "--model.multiple_of=3"],
         "model.multiple_of does not apply to qwen3 (a field of llama3; qwen3's own: head_dim"),
        (["--model.n_experts=4"], "model.n_experts does not apply to llama3 (a field of qwen3_moe"),
        (["--model.name=qwen3", "--model.hed_dim=8"],
         "unknown key 'model.hed_dim': did you mean 'model.head_dim'?"),
        (["--model.dimm=8"], "unknown key 'model.dimm': did you mean 'model.dim'?"),
        (["--model.name=qwen3", "--model.head_dim=x"], "model.head_dim: expected int, got 'x'"),
        (["--model.head_dim.x=1"], "'model.head_dim' is not a section"),
    ],
)  # fmt: skip
def test_wrong_family_keys_are_one_line_naming_the_key(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(JobConfig, argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_help_lists_each_familys_own_keys(zoo_family: str) -> None:
    """Every registered family, a fork's too (the test family, registered for this test)."""
    text = help_text(JobConfig)
    model = text[text.index("[model]") :]
    assert f"{zoo_family}'s own (model.name={zoo_family}):" in model
    for name, family in FAMILIES.items():
        section = model[model.index(f"{name}'s own") :]
        for key in family_fields(family):
            assert f"--model.{key}=<" in section, (name, key)
