"""What a resume may change: this run's config compared with the checkpoint's.

`check_config` (launch/check.py) calls both, before any process group: `resume_changes` for the
checkpoint it resumes (a ConfigError for a change a resume cannot make, else the changes it
applies, logged), and `explain_misfit` when the checkpoint's parameters are not this model's
(the settings behind it, and the way that works).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from checkpoint.resume import ModelMismatch
from checkpoint.state import CONFIG, read_run_config
from configs import ConfigError, config_to_dict
from launch.job import JobConfig
from model import ModelConfig, get_family

logger = logging.getLogger(__name__)


# What a resume may change: everything not listed here is applied (and listed in the log).
# These would change the model's math, what trains (the optimizer holds state for exactly the
# trainable parameters), the optimizer (Muon's momentum is not AdamW's moments), the objective
# (dpo.enabled: the cross-entropy or DPO) or the data
# stream under a running optimizer, so a resume that changes
# them is an error (start a new run, or fine-tune with load_model_only). lora.dropout may change.
RESUME_FIXED = ("data.path", "data.seq_len", "data.num_workers", "data.attention_mask",
                "data.document_positions", "train.seed", "train.freeze", "lora.enabled",
                "lora.rank", "lora.alpha", "lora.targets", "optim.name",
                "dpo.enabled")  # fmt: skip
# Not settings of the run's math: where it lives and how it was started.
RESUME_IGNORED = ("run.", "dry_run", "checkpoint.resume", "checkpoint.load_model_only",
                  "checkpoint.init_from_hf")  # fmt: skip


def resume_changes(job: JobConfig, path: Path) -> list[str]:
    """Compare this run's config with the checkpoint's: ConfigError for a change a resume
    cannot make, else the list of changes ("optim.lr: 0.0003 -> 0.001") it will apply."""
    try:
        saved, _ = read_run_config(path, {CONFIG})
    except Exception as err:  # damaged: Checkpointer.load verifies it and falls back
        logger.warning("cannot read the config of %s (%s): changes not compared", path, err)
        return []
    old, new = flatten(saved), flatten(config_to_dict(job))
    changed = sorted(
        k for k in old.keys() | new.keys()
        if old.get(k) != new.get(k) and not k.startswith(RESUME_IGNORED)
    )  # fmt: skip
    # The model is compared as resolved (a flavor name and its explicit fields are the same
    # model); only the attention kernel, the same math, may change.
    old_cfg = ModelConfig(**saved.get("model", {}))
    old_args = replace(get_family(old_cfg.name).build_args(old_cfg), attention="sdpa")
    if old_args != replace(get_family(job.model.name).build_args(job.model), attention="sdpa"):
        fixed = [k for k in changed if k.startswith("model.")]
    else:
        fixed = []
    fixed += [k for k in changed if k in RESUME_FIXED]
    # So is which sources a mixture reads, and where (a source added or removed shows as its
    # path appearing or vanishing); their weights may change (annealing, data/stream.py).
    fixed += [k for k in changed if k.startswith("data.sources.") and k.endswith(".path")]
    if fixed:
        what = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in fixed)
        raise ConfigError(
            f"resuming {path} with a changed {what}: a resume cannot change the model, what "
            "trains, the optimizer or the data stream (see the checkpoint's config in its run "
            "folder); start a new run.name, or use checkpoint.load_model_only=true to start over "
            "from its weights"
        )
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed if not k.startswith("model.")]


# The [lora] keys that decide which adapter parameters a model has, and their shapes.
LORA_PARAMETERS = ("lora.enabled", "lora.rank", "lora.targets")


def explain_misfit(job: JobConfig, misfit: ModelMismatch) -> ConfigError:
    """A checkpoint whose parameters are not this model's: the settings that differ from the
    checkpoint's and the way that works, or the parameters themselves when no setting does."""
    try:
        saved, _ = read_run_config(misfit.path, {CONFIG})
    except Exception:  # noqa: BLE001 - without its config, the parameters say what differs
        return misfit
    old, new = flatten(saved), flatten(config_to_dict(job))
    model = sorted(
        k for k in old.keys() | new.keys()
        if k.startswith("model.") and k != "model.attention" and old.get(k) != new.get(k)
    )  # fmt: skip
    # With LoRA switched on or off, its rank and targets say nothing more.
    lora = [k for k in LORA_PARAMETERS if old.get(k) != new.get(k)]
    lora = lora[:1] if "lora.enabled" in lora else lora if job.lora.enabled else []
    if not model and not lora:
        return misfit
    what = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in model + lora)
    path, verb = misfit.path, "starting from" if misfit.model_only else "resuming"
    start = f"{verb} {path} with a changed {what} (parameters: {misfit.summary})"
    if model:
        return ConfigError(
            f"{start}: a checkpoint loads only into the model it was saved from; set the model.* "
            "keys as it has them (see its config.toml)"
        )
    # Neither a resume nor load_model_only can add, drop or reshape adapters; the export merges
    # a LoRA run's adapters into its weights, and a run from those starts its own adapters.
    where = "in place of checkpoint.resume" if misfit.model_only else "and a new run.name"
    return ConfigError(
        f"{start}: a checkpoint loads only into the model it was saved from, LoRA adapters "
        f"included; to train with these [lora] settings from its weights, start a new run from "
        f"its export: python -m checkpoint.export {path} DIR --dtype float32 (any adapters "
        f"merged in), then --checkpoint.init_from_hf=DIR {where}"
    )


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
