"""Export a training checkpoint to Hugging Face safetensors, on one CPU process.

    python -m checkpoint.export outputs/debug/checkpoints/step-200 outputs/debug/hf
    python -m checkpoint.export CHECKPOINT_DIR OUT_DIR --dtype float32 [--force]
    python -m checkpoint.export CHECKPOINT_DIR OUT_DIR --adapters-only   # a LoRA run's adapters

Reads only the "model" entry of the DCP checkpoint (not the optimizer state, which is twice as
large) into a plain model, whatever mesh saved it: DCP stores full shapes and reshards on load.
The model shape comes from the resolved config stored in the checkpoint itself. Then
`checkpoint.hf.save_hf_weights` writes the HF layout through the family's mapping
(`model.get_hf_mapping`); load it back with `load_hf_weights` or
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`. config.json's bos/eos token ids
come from the index.json of the run's data.path or first data.sources path (relative to the
current directory), when it is there. OUT_DIR must be new or empty; --force overwrites the
export files in it.

A LoRA run (`[lora]`) exports its adapters merged into the base weights (W + alpha/rank * B @ A,
in float32): a plain model of the family's HF class. With --adapters-only it writes the adapters
alone in PEFT's layout instead (checkpoint/peft.py; float32 unless --dtype says otherwise), to
load on top of the base model with `peft.PeftModel.from_pretrained`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError

from checkpoint.hf import INDEX_FILE, MAX_SHARD_BYTES, save_hf_weights
from checkpoint.layout import existing_ancestor
from checkpoint.peft import ADAPTER_FILES, save_peft_adapters
from checkpoint.state import MODEL, load_no_dist, read_run_config
from configs import ConfigError
from data.loader import read_index
from model import ModelConfig, get_family, get_hf_mapping
from parallel.lora import LoRAConfig, apply_lora, merge_lora

logger = logging.getLogger("checkpoint.export")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Adapters are written in float32 unless --dtype says otherwise, whatever the run's
# checkpoint.export_dtype: they are a few MB, and rounding them to bf16 moves the adapted
# model's logits by ~1e-4 (measured on the debug model) instead of ~1e-6, so PEFT's model would
# no longer give the trained model's logits.
ADAPTER_DTYPE = torch.float32


def _load(checkpoint_dir: Path, rope_len: int | None = None) -> tuple[torch.nn.Module, dict]:
    """The model of a complete DCP training checkpoint, ready for sequences up to `rope_len`
    (default: its max_seq_len), and the run's config. A LoRA run's model has its adapters."""
    if not checkpoint_dir.is_dir():
        raise ConfigError(f"checkpoint not found: {checkpoint_dir}")
    if not (checkpoint_dir / "COMPLETE").is_file():
        raise ConfigError(
            f"checkpoint {checkpoint_dir} is incomplete (no COMPLETE file): its save was "
            "interrupted or is still running"
        )
    try:
        metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    except FileNotFoundError as e:
        raise ConfigError(f"{checkpoint_dir} is not a DCP checkpoint: {e}") from e
    config, source = read_run_config(checkpoint_dir, set(metadata))
    try:
        model_config = ModelConfig(**config.get("model", {}))
        lora = LoRAConfig(**config.get("lora", {}))
    except TypeError as e:
        raise ConfigError(f"cannot read the [model] or [lora] config from {source}: {e}") from e
    family = get_family(model_config.name)
    if get_hf_mapping(model_config.name) is None:
        raise ConfigError(f"model family {model_config.name} has no Hugging Face mapping")
    args = family.build_args(model_config)
    # Meta then to_empty: memory for the weights only, no throwaway initialization. The
    # buffers (RoPE table, tied weights) are not in any checkpoint: the model rebuilds them.
    with torch.device("meta"):
        model = family.build_model(args)
        if lora.enabled:
            apply_lora(model, lora)
    model.to_empty(device="cpu")
    model.init_buffers(rope_len or args.max_seq_len)
    # Keys of the model entry; named_parameters() skips a tied output.weight (same tensor).
    wanted = {f"{MODEL}.{n}": p.detach() for n, p in model.named_parameters()}
    problems = []
    for key, param in wanted.items():
        if key not in metadata:
            problems.append(f"missing {key} {list(param.shape)}")
        elif list(getattr(metadata[key], "size", [])) != list(param.shape):
            problems.append(f"{key} is {list(metadata[key].size)}, config says {list(param.shape)}")
    if problems:
        raise ConfigError(f"{checkpoint_dir} does not match its config: " + "; ".join(problems))
    load_no_dist(wanted, checkpoint_dir)  # flat "model.<fqn>" keys name the same entries
    return model, config


def load_checkpoint_model(
    checkpoint_dir: str | Path, rope_len: int | None = None
) -> torch.nn.Module:
    """A plain CPU model holding the weights of a complete DCP training checkpoint, ready to run
    on up to `rope_len` positions (default: the model's max_seq_len, as in the HF export)."""
    model, _ = _load(Path(checkpoint_dir), rope_len)
    return model


def special_token_ids(config: dict) -> tuple[int | None, int | None]:
    """(bos, eos) ids of the tokenizer of the run's dataset (`config`'s data.path, or the first
    of its data.sources: they share one tokenizer), each None when unknown, with one log line
    that says which."""
    data = config.get("data", {})
    sources = [source.get("path") for _, source in sorted(data.get("sources", {}).items())]
    data_path = data.get("path") or next(iter(sources), None)
    key = "data.path" if data.get("path") else "first of data.sources"
    index_file = Path(data_path or ".") / "index.json"
    bos_id = eos_id = None
    if data_path is None:
        reason = "the run's config names no data.path or data.sources"
    elif not index_file.is_file():
        reason = f"{index_file} (the run's {key}) not found from this directory"
    else:
        try:
            index = read_index(data_path)
            bos_id, eos_id = index.bos_id, index.eos_id
            reason = f"{index_file} has eos_id null"  # documents not delimited: no EOS
        except ConfigError as e:
            reason = str(e)
    if eos_id is None:
        logger.warning("config.json: bos_token_id and eos_token_id are null: %s", reason)
    elif bos_id is None:  # a tokenizer without BOS
        logger.warning(
            "config.json: eos_token_id %d from %s, which records no bos_id: bos_token_id is null",
            eos_id, index_file,
        )  # fmt: skip
    else:
        logger.info(
            "config.json: bos_token_id %d, eos_token_id %d from %s", bos_id, eos_id, index_file
        )
    return bos_id, eos_id


def _check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    # Loading a large checkpoint takes minutes: find an unwritable target before, not after.
    where = existing_ancestor(out)
    if not where.is_dir():
        raise ConfigError(f"cannot create {out}: {where} is a file, not a directory")
    # os.access asks the kernel, so a read-only mount fails it even for root.
    if not os.access(where, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write into {where} (read-only or not permitted)")
    if not force and out.is_dir() and (entries := sorted(p.name for p in out.iterdir())):
        raise ConfigError(
            f"{out} is not empty ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}):"
            " export into a new or empty directory, or pass --force to overwrite"
        )


def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    force: bool = False,
    adapters_only: bool = False,
) -> list[Path]:
    """Write `checkpoint_dir`'s model to `out_dir` in its family's HF layout; returns the files.

    `dtype` defaults to the run's `checkpoint.export_dtype` (bfloat16 if it has none) for the
    whole model, and to float32 for `adapters_only` (see ADAPTER_DTYPE).
    A non-empty `out_dir` is an error unless `force`: then the weight files of an earlier export
    there are replaced (stale shards removed), and other files are left alone. A LoRA run's
    adapters are merged into the weights, or with `adapters_only` written alone (PEFT's layout).
    """
    out = Path(out_dir)
    _check_out_dir(out, force)
    model, config = _load(Path(checkpoint_dir))
    lora = LoRAConfig(**config.get("lora", {}))
    if adapters_only and not lora.enabled:
        raise ConfigError(
            f"--adapters-only: {checkpoint_dir} is not from a LoRA run (its lora.enabled is "
            "false), it has no adapters; export the whole model without --adapters-only"
        )
    mapping = get_hf_mapping(ModelConfig(**config.get("model", {})).name)
    if adapters_only:
        dtype = dtype or ADAPTER_DTYPE
        if out.is_dir():
            for stale in ADAPTER_FILES:
                (out / stale).unlink(missing_ok=True)
        files = save_peft_adapters(model, mapping, lora, out, dtype)
        # Says the dtype: the run's checkpoint.export_dtype does not apply here (ADAPTER_DTYPE).
        name = next(key for key, value in DTYPES.items() if value == dtype)
        logger.info("wrote the LoRA adapters (PEFT layout, %s) to %s", name, out)
        return files
    if dtype is None:
        dtype = DTYPES[config.get("checkpoint", {}).get("export_dtype", "bfloat16")]
    bos_id, eos_id = special_token_ids(config)
    if out.is_dir():  # with force: shards of an earlier, larger export must not linger
        for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
            stale.unlink(missing_ok=True)
    merge_lora(model)  # a LoRA run: W + alpha/rank * B @ A; nothing to do otherwise
    files = save_hf_weights(model, mapping, out, dtype, max_shard_bytes, bos_id, eos_id)
    logger.info("wrote %d file(s) and config.json to %s", len(files), out)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoint.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint_dir", help="a complete step directory, e.g. .../step-200")
    parser.add_argument("out_dir", help="where to write the safetensors and config.json")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=None,
        help="weight dtype (default: the run's checkpoint.export_dtype, else bfloat16; "
        "float32 for --adapters-only)",
    )  # fmt: skip
    parser.add_argument(
        "--force", action="store_true",
        help="write into a non-empty OUT_DIR, replacing the files of an earlier export",
    )  # fmt: skip
    parser.add_argument(
        "--adapters-only", action="store_true",
        help="a LoRA run: write only its adapters, in PEFT's layout (default: merged weights)",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        dtype = DTYPES[opts.dtype] if opts.dtype else None
        export_checkpoint(opts.checkpoint_dir, opts.out_dir, dtype, force=opts.force,
                          adapters_only=opts.adapters_only)  # fmt: skip
    except ConfigError as err:
        logger.error("export error: %s", err)
        return 2
    except (OSError, SafetensorError) as err:  # found while writing: a full disk, a lost mount
        logger.error("export error: writing %s failed: %s", opts.out_dir, err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
