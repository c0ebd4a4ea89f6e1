"""Export a training checkpoint to Hugging Face Llama safetensors, on one CPU process.

    python -m checkpoint.export outputs/debug/checkpoints/step-300 outputs/debug/hf
    python -m checkpoint.export CHECKPOINT_DIR OUT_DIR --dtype float32

Reads only the "model" entry of the DCP checkpoint (not the optimizer state, which is twice as
large) into a plain model, whatever mesh saved it: DCP stores full shapes and reshards on load.
The model shape comes from the resolved config stored in the checkpoint itself. Then
`checkpoint.hf.save_hf_weights` writes the HF layout; load it back with `load_hf_weights` or
`transformers.LlamaForCausalLM.from_pretrained(OUT_DIR)`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tomllib
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoint.hf import MAX_SHARD_BYTES, save_hf_weights
from configs import ConfigError
from model.llama import LlamaArgs, ModelConfig, Transformer, build_args

logger = logging.getLogger("checkpoint.export")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _dcp_load(state_dict: dict, checkpoint_dir: Path) -> None:
    # no_dist: one process, no process group. DCP warns that it assumes exactly that.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(state_dict, checkpoint_id=checkpoint_dir, no_dist=True)


def read_run_config(checkpoint_dir: Path, entries: set[str]) -> tuple[dict, str]:
    """The run's resolved config from the checkpoint's "config" entry, or from the run's
    config.toml (`<run>/checkpoints/step-N/../../config.toml`) if it has none."""
    if "config" in entries:
        state = {"config": ""}
        _dcp_load(state, checkpoint_dir)
        text, source = state["config"], f"{checkpoint_dir} (config entry)"
    else:
        path = checkpoint_dir.parent.parent / "config.toml"
        if not path.is_file():
            raise ConfigError(f"{checkpoint_dir} has no config entry and {path} does not exist")
        text, source = path.read_text(), str(path)
        logger.warning("checkpoint has no config entry; model shape read from %s", path)
    try:
        return tomllib.loads(text), source
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot read the config from {source}: {e}") from e


def read_model_args(checkpoint_dir: Path, entries: set[str]) -> LlamaArgs:
    """The model shape the checkpoint was trained with."""
    config, source = read_run_config(checkpoint_dir, entries)
    try:
        return build_args(ModelConfig(**config.get("model", {})))
    except TypeError as e:
        raise ConfigError(f"cannot read the [model] config from {source}: {e}") from e


def load_checkpoint_model(checkpoint_dir: str | Path) -> Transformer:
    """A plain CPU model holding the weights of a complete DCP training checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
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
    args = read_model_args(checkpoint_dir, set(metadata))
    # Meta then to_empty: memory for the weights only, no throwaway initialization.
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    if args.tie_embeddings:  # to_empty gives each module its own new tensor: tie them again
        model.output.weight = model.tok_embeddings.weight
    # Keys of the "model" entry; named_parameters() skips a tied output.weight (same tensor).
    wanted = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    problems = []
    for key, param in wanted.items():
        if key not in metadata:
            problems.append(f"missing {key} {list(param.shape)}")
        elif list(getattr(metadata[key], "size", [])) != list(param.shape):
            problems.append(f"{key} is {list(metadata[key].size)}, config says {list(param.shape)}")
    if problems:
        raise ConfigError(f"{checkpoint_dir} does not match its config: " + "; ".join(problems))
    _dcp_load(wanted, checkpoint_dir)  # flat "model.<fqn>" keys name the same entries
    return model


def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[Path]:
    """Write `checkpoint_dir`'s model to `out_dir` in the HF Llama layout; returns the files.

    `dtype` defaults to the run's `checkpoint.export_dtype` (bfloat16 if it has none).
    """
    out = Path(out_dir)
    if out.is_dir() and any(out.glob("*.safetensors*")):
        raise ConfigError(f"{out} already holds safetensors files; export into an empty directory")
    model = load_checkpoint_model(checkpoint_dir)
    if dtype is None:
        entries = set(dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata)
        config, _ = read_run_config(Path(checkpoint_dir), entries)
        dtype = DTYPES[config.get("checkpoint", {}).get("export_dtype", "bfloat16")]
    files = save_hf_weights(model, out, dtype, max_shard_bytes)
    logger.info("wrote %d file(s) and config.json to %s", len(files), out)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoint.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint_dir", help="a complete step directory, e.g. .../step-300")
    parser.add_argument("out_dir", help="where to write the safetensors and config.json")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=None,
        help="weight dtype (default: the run's checkpoint.export_dtype, else bfloat16)",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        dtype = DTYPES[opts.dtype] if opts.dtype else None
        export_checkpoint(opts.checkpoint_dir, opts.out_dir, dtype)
    except ConfigError as err:
        logger.error("export error: %s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
