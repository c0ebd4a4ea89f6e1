"""Hugging Face safetensors, both ways, for any model family with an `hf` mapping.

    save_hf_weights(model, mapping, out_dir)    # plain model -> safetensors + config.json
    load_hf_weights(model, mapping, hf_dir)     # safetensors -> plain or FSDP-sharded model
    check_hf_config(mapping, args, hf_dir)      # ConfigError if config.json is another shape

The family's mapping (`model.HFMapping`, in the family's files under model/) says how its
parameter names, row order and config.json translate; this module does the files: sharding
the output above 5 GB, reading an index, and loading without ever materializing a full tensor
on a rank: each rank reads, with `safe_open(...).get_slice(name)`, only its shard's rows.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from configs import ConfigError
from model import HFMapping, canonical_name, hf_split_names, persistent_buffers

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # the size HF's save_pretrained uses ("5GB")


def to_hf_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder rows from the adjacent-pair RoPE layout to HF's half-split one, inside each head
    of `head_dim` rows (a family's mapping says which weights need it)."""
    return weight.unflatten(0, (-1, head_dim // 2, 2)).transpose(1, 2).reshape(weight.shape)


def hf_tensors(
    model: nn.Module, mapping: HFMapping, exclude: Collection[str] = ()
) -> dict[str, tuple[str, torch.Tensor, int | None]]:
    """HF tensor name -> (our parameter name, the parameter, the row of dim 0 that tensor is,
    or None for all of it), for the parameters whose canonical names are not in `exclude`. A
    parameter the mapping splits (stacked experts, one HF tensor per expert:
    `model.hf_split_names`) gives one entry per row. A tied weight is listed once."""
    if buffers := persistent_buffers(model):  # state HF files would silently lose
        raise ConfigError(
            f"the model keeps state in persistent buffers ({', '.join(buffers)}) that Hugging "
            "Face weights do not carry (model/__init__.py, Buffers)"
        )
    tensors: dict[str, tuple[str, torch.Tensor, int | None]] = {}
    for name, param in model.named_parameters():
        if canonical_name(name) in exclude:
            continue
        rows = hf_split_names(mapping, name, model.args)
        if rows is None:
            tensors[mapping.hf_name(name)] = (name, param, None)
        else:
            tensors |= {key: (name, param, row) for row, key in enumerate(rows)}
    return tensors


def read_hf_config(mapping: HFMapping, hf_dir: str | Path) -> Any:
    """The family's args for `<hf_dir>/config.json`; ConfigError if the model cannot run it."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"Hugging Face config not found: {path}")
    return mapping.args_from_config_json(json.loads(path.read_text()), str(path))


def check_hf_config(mapping: HFMapping, args: Any, hf_dir: str | Path) -> None:
    """ConfigError listing every field where `args` and `<hf_dir>/config.json` disagree."""
    if diffs := mapping.mismatches(args, read_hf_config(mapping, hf_dir)):
        raise ConfigError(
            f"model config does not match {Path(hf_dir) / 'config.json'} (ours vs theirs): "
            + ", ".join(diffs)
        )


# ---- writing ----------------------------------------------------------------------------------


def _umask() -> int:
    """The process umask. Linux shows it in /proc; elsewhere setting and restoring it is the
    only way to read it (for an instant, files other threads create would ignore it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_hf_weights(
    model: nn.Module,
    mapping: HFMapping,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> list[Path]:
    """Write a plain (unsharded) model as HF safetensors plus config.json; returns the files.

    One `model.safetensors`, or, past `max_shard_bytes`, `model-0000i-of-0000n.safetensors`
    files and `model.safetensors.index.json`. A tied output projection is not written. Every
    file gets the mode the umask gives new files, like config.json.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # named_parameters() lists a tied weight once, under tok_embeddings: no lm_head.weight.
    shards: list[dict[str, tuple[str, torch.Tensor]]] = [{}]
    shard_bytes = total_bytes = 0
    for key, (name, param, row) in hf_tensors(model, mapping).items():
        tensor = param if row is None else param[row]
        nbytes = tensor.numel() * dtype.itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][key] = (name, tensor)
        shard_bytes += nbytes
        total_bytes += nbytes
    n = len(shards)
    files = (
        [SINGLE_FILE]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    for file, shard in zip(files, shards, strict=True):
        # Converted one file at a time, so a bf16 export never holds a second full copy.
        tensors = {}
        for key, (name, param) in shard.items():
            head_dim = mapping.rotated_head_dim(name, model.args)
            value = param if head_dim is None else to_hf_rows(param, head_dim)
            tensors[key] = value.detach().to(dtype).contiguous()
        save_file(tensors, out / file, metadata={"format": "pt"})
        # safetensors creates its files with mode 0600 whatever the umask, so a model exported
        # for a team would be readable by its owner only.
        (out / file).chmod(0o666 & ~_umask())
    if n > 1:
        weight_map = {key: file for file, shard in zip(files, shards, strict=True) for key in shard}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = mapping.config_json(model.args, dtype, bos_token_id, eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / file for file in files]


# ---- reading ----------------------------------------------------------------------------------


def _weight_files(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index when the weights are split, else the single file."""
    if not hf_dir.is_dir():
        raise ConfigError(f"Hugging Face model directory not found: {hf_dir}")
    if (hf_dir / INDEX_FILE).is_file():
        weight_map = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
        files = {name: hf_dir / file for name, file in weight_map.items()}
    elif (hf_dir / SINGLE_FILE).is_file():
        with safe_open(hf_dir / SINGLE_FILE, framework="pt", device="cpu") as f:
            files = dict.fromkeys(f.keys(), hf_dir / SINGLE_FILE)
    else:
        raise ConfigError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")
    if missing := sorted({str(f) for f in files.values() if not f.is_file()}):
        raise ConfigError(f"{hf_dir / INDEX_FILE} lists missing files: {', '.join(missing)}")
    return files


def local_ranges(param: torch.Tensor) -> list[tuple[int, int]] | None:
    """[start, end) of this rank's shard along every dimension of `param` (global indices);
    None when this rank is not on the parameter's mesh.

    A plain tensor is all local. For a DTensor, each Shard(d) placement splits dimension d the
    way torch.chunk does (equal chunks of ceil(n / k), the last ones shorter or empty), nested in
    placement order; Replicate() leaves it whole.
    """
    ranges = [(0, n) for n in param.shape]
    if not isinstance(param, DTensor):
        return ranges
    coordinate = param.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    if any(type(p) is not Shard and not isinstance(p, Replicate) for p in param.placements):
        # FSDP's shard of an expert-parallel (or TP) shard along the same dim, a strided
        # placement: DTensor's own chunk of it, the one DCP saves by, is still one block.
        chunks = param.__create_chunk_list__()
        if len(chunks) != 1:
            raise NotImplementedError(f"loading HF weights into {param.placements}")
        return [(o, o + n) for o, n in zip(chunks[0].offsets, chunks[0].sizes, strict=True)]
    for mesh_dim, placement in enumerate(param.placements):
        if type(placement) is Shard:  # exactly Shard: its subclasses (strided) split differently
            start, end = ranges[placement.dim]
            chunk = math.ceil((end - start) / param.device_mesh.size(mesh_dim))
            lo = min(start + coordinate[mesh_dim] * chunk, end)
            ranges[placement.dim] = (lo, min(lo + chunk, end))
    local_shape = tuple(end - start for start, end in ranges)
    if local_shape != tuple(param.to_local().shape):  # DTensor changed its chunking rule
        raise RuntimeError(
            f"computed local shape {local_shape}, DTensor has {param.to_local().shape}"
        )
    return ranges


def _read(tensor_slice, ranges: list[tuple[int, int]], head_dim: int | None) -> torch.Tensor:
    """Read exactly the rows (and columns) in `ranges`, in our row order.

    For wq/wk (`head_dim` given), our rows [a, b) of one head are HF rows of the same head:
    the even ones are a contiguous run in its first half, the odd ones in its second half.
    So a shard that starts or ends inside a head still reads only its own rows, in two runs.
    """
    (lo, hi), cols = ranges[0], tuple(slice(*r) for r in ranges[1:])
    if head_dim is None or lo == hi:
        return tensor_slice[(slice(lo, hi), *cols)]
    half, blocks = head_dim // 2, []
    for head_start in range(lo - lo % head_dim, hi, head_dim):
        a, b = max(lo, head_start) - head_start, min(hi, head_start + head_dim) - head_start
        even = tensor_slice[(slice(head_start + (a + 1) // 2, head_start + (b + 1) // 2), *cols)]
        odd = tensor_slice[(slice(head_start + half + a // 2, head_start + half + b // 2), *cols)]
        block = torch.empty((b - a, *even.shape[1:]), dtype=even.dtype)
        block[a % 2 :: 2], block[1 - a % 2 :: 2] = even, odd
        blocks.append(block)
    return torch.cat(blocks)


def _check_tensors(hf_dir: Path, tensors: dict, slices: dict, unexpected: set[str]) -> None:
    """One ConfigError naming every missing, mis-shaped and unexpected tensor (`tensors`:
    `hf_tensors` of the model)."""
    shapes = {
        key: list(p.shape if row is None else p.shape[1:]) for key, (_, p, row) in tensors.items()
    }
    problems = [f"missing {key} {shape}" for key, shape in shapes.items() if key not in slices]
    problems += [
        f"{key} has shape {list(sl.get_shape())}, model expects {shapes[key]}"
        for key, sl in slices.items()
        if list(sl.get_shape()) != shapes[key]
    ]
    # Some older exports store the RoPE table; it is a function of the config, not a weight.
    extra = sorted(k for k in unexpected if not k.endswith("rotary_emb.inv_freq"))
    problems += [f"unexpected {key}" for key in extra[:5]]
    if len(extra) > 5:
        problems.append(f"and {len(extra) - 5} more unexpected tensors")
    if problems:
        raise ConfigError(f"{hf_dir} does not match the model: " + "; ".join(problems))


@torch.no_grad()
def load_hf_weights(
    model: nn.Module,
    mapping: HFMapping,
    hf_dir: str | Path,
    rope_len: int | None = None,
    exclude: Collection[str] = (),
    partial: bool = False,
) -> int:
    """Fill every parameter of `model` from a local HF safetensors directory, except those
    whose canonical names are in `exclude` (LoRA's adapters: not part of the base model).
    Returns how many of the directory's tensors the model holds (each rank reads its slices).
    `partial`: the model is part of the whole (a pipeline rank's stages, parallel/pp.py): the
    directory's other tensors are other stages', not unexpected.

    A drop-in for `model.init_weights(seed, rope_len, assign)`: it also calls
    `model.init_buffers(rope_len)` (the RoPE table, ties).
    The model may be plain or sharded by `fully_shard` (DTensor parameters, Shard(0) on a 1D
    mesh or (Replicate(), Shard(0)) on a 2D one, after `to_empty`); each rank reads only the
    slices of its own shards. Missing tensors, unexpected ones and shape mismatches raise one
    ConfigError that names them all, before anything is read. Settings that are not shapes
    (rope_theta, norm_eps, rope scaling) are in config.json: compare them with
    `check_hf_config` first.
    """
    hf_dir = Path(hf_dir)
    files = _weight_files(hf_dir)
    # named_parameters() lists a tied weight once (tok_embeddings), so a tied model expects no
    # lm_head.weight, and one in the files is reported: it would be a different model.
    tensors = hf_tensors(model, mapping, exclude)
    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for file in set(files.values())
        }
        slices = {key: handles[files[key]].get_slice(key) for key in tensors if key in files}
        _check_tensors(hf_dir, tensors, slices, set() if partial else set(files) - set(tensors))
        for name, param in model.named_parameters():
            ranges = local_ranges(param)
            if ranges is None or canonical_name(name) in exclude:
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            if (rows := hf_split_names(mapping, name, model.args)) is None:
                head_dim = mapping.rotated_head_dim(name, model.args)
                local.copy_(_read(slices[mapping.hf_name(name)], ranges, head_dim))
            elif local.numel() > 0:  # one HF tensor per row: read this shard's rows
                (lo, hi), inner = ranges[0], ranges[1:]
                local.copy_(
                    torch.stack([_read(slices[rows[i]], inner, None) for i in range(lo, hi)])
                )
    model.init_buffers(rope_len or model.args.max_seq_len)
    return len(tensors)
