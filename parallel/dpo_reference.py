"""DPO's reference, built and checked: the objective of a run, the precomputed pass and its
fingerprint (parallel/dpo.py has the loss and the three kinds of reference).

`dpo.reference = "precomputed"`: before the first step, every rank scores its share of the
training pairs (and of the validation pairs, for the evaluations) with the starting model
(adapters off), the shares are summed over the ranks (each pair scored on one rank, zeros
elsewhere: exact), and rank 0 writes them to `dpo.reference_path` (default:
reference_logps.npy in the run folder; the validation pairs' beside it,
reference_logps.val.npy) with a JSON fingerprint beside it: the dataset's sha256
(data/preference.py), `data.seq_len` (the truncation) and what the starting weights are (the
family, its shape, the dtype, and the seed or the Hugging Face files). A later start or a
resume reads the files instead, after `check_reference` compared the fingerprints before any
process group exists: log-probs of another model or dataset are one
`config error:` line, never a silently wrong loss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from configs import ConfigError
from parallel.dpo import DPOConfig, DPOLoss
from parallel.loss import ChunkedLoss
from parallel.objective import LossFn, Objective, TokenLoss
from parallel.tp import loss_context

if TYPE_CHECKING:
    from data.loader import DatasetIndex

logger = logging.getLogger(__name__)
FILE = "reference_logps.npy"


def build_objective(
    cfg: DPOConfig,
    loss_fn: LossFn,
    copy: Callable[[], tuple[Any, nn.Module | None]],
    cp_group: dist.ProcessGroup | None = None,
) -> Objective:
    """The run's objective: the cross-entropy, or DPO (with `copy()`, the frozen reference
    model and its output projection, built only for dpo.reference = 'copy'; `cp_group`: context
    parallel's, cp > 1; `loss_fn` a ChunkedLoss: DPO's log-probs a chunk at a time too)."""
    if not cfg.enabled:
        return TokenLoss(loss_fn)
    reference, output = copy() if cfg.reference == "copy" else (None, None)
    chunked = loss_fn if isinstance(loss_fn, ChunkedLoss) else None
    return DPOLoss(cfg, reference, cp_group, chunked, output)


def reference_path(cfg: DPOConfig, run_dir: Path) -> Path:
    return Path(cfg.reference_path) if cfg.reference_path else run_dir / FILE


def split_paths(path: Path, index: DatasetIndex) -> dict[str, Path]:
    """The file of each split's log-probs: `path` for the training pairs, and beside it
    (name.val.npy) the validation pairs', where the dataset has a val split."""
    has_val = index.num_sequences("val", 1) > 0  # pairs, whatever the length
    val = {"val": path.with_name(f"{path.stem}.val.npy")} if has_val else {}
    return {"train": path} | val


def _complete(path: Path, index: DatasetIndex) -> bool:
    """Every split's file there, and the fingerprint, written last."""
    files = [*split_paths(path, index).values(), path.with_suffix(".json")]
    return all(f.is_file() for f in files)


def fingerprint(job: Any, index: DatasetIndex) -> dict[str, Any]:
    """What the precomputed log-probs depend on (see the module docstring)."""
    start: dict[str, Any] = {"seed": job.train.seed}
    if job.checkpoint.init_from_hf:  # the files' sizes and their headers (names, shapes)
        files = sorted(Path(job.checkpoint.init_from_hf).glob("*.safetensors"))
        start = {f.name: _file_digest(f) for f in files}
    model = {"name": job.model.name, "flavor": job.model.flavor, "dtype": job.parallel.param_dtype}
    return {
        "dataset": (index.examples or {}).get("sha256"),
        "seq_len": job.data.seq_len,
        "model": model
        | {"overrides": {k: v for k, v in asdict(job.model).items() if v is not None}},
        "start": start,
    }


def _file_digest(path: Path) -> str:
    """sha256 of a file's size and its first and last MiB (a whole hash of a large model's
    files would take minutes at every start; another model's differ there)."""
    digest, size = hashlib.sha256(str(path.stat().st_size).encode()), path.stat().st_size
    with path.open("rb") as f:
        digest.update(f.read(2**20))
        f.seek(max(size - 2**20, 0))
        digest.update(f.read(2**20))
    return digest.hexdigest()


def check_reference(job: Any, index: DatasetIndex, run_dir: Path, resuming: bool) -> None:
    """ConfigError, before any process group, when the precomputed reference cannot be used:
    its fingerprint is another model's or dataset's, or a resume finds none (the pass would
    score the resumed weights, not the starting ones)."""
    cfg = job.dpo
    if not (cfg.enabled and cfg.reference == "precomputed"):
        return
    path = reference_path(cfg, run_dir)
    sidecar = path.with_suffix(".json")
    if not _complete(path, index):
        if resuming:
            raise ConfigError(
                f"dpo.reference_path: the resumed run has no precomputed reference at '{path}' "
                "(it is written at the first start): restore the file, or start a new run"
            )
        return
    theirs = json.loads(sidecar.read_text())
    mine = fingerprint(job, index)
    if differ := [k for k in mine if theirs.get(k) != mine[k]]:
        raise ConfigError(
            f"dpo.reference_path: '{path}' holds reference log-probs of another "
            f"{' and '.join(differ)} than this run's (fingerprint in {sidecar.name}): delete it "
            "or name another file, and one pass over the pairs will write it anew"
        )


def reference_for_loader(run: Any, run_dir: Path) -> dict[str, np.ndarray]:
    """Every pair's reference log-probs (pairs, 2) of each split, for its loader: read, or
    computed now by one pass and written (dpo.reference = 'precomputed'); none for the other
    objectives."""
    cfg, index = run.job.dpo, run.plan.dataset
    if not (cfg.enabled and cfg.reference == "precomputed"):
        return {}
    path = reference_path(cfg, run_dir)
    paths = split_paths(path, index)
    if _complete(path, index):  # checked by check_reference
        return {split: np.load(file) for split, file in paths.items()}
    values = {split: precompute(run, split) for split in paths}
    if run.env.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)  # an earlier, incomplete set's
        for split, file in paths.items():
            tmp = file.with_name(file.name + ".tmp.npy")
            np.save(tmp, values[split])
            tmp.replace(file)
        # Last: its presence says the files are complete.
        sidecar = json.dumps(fingerprint(run.job, index), indent=2) + "\n"
        path.with_suffix(".json").write_text(sidecar)
        counts = " and ".join(f"{len(v)} {split}" for split, v in values.items())
        logger.info("dpo: reference log-probs of %s pairs written to %s", counts, path)
    return values


@torch.no_grad()
def precompute(run: Any, split: str) -> np.ndarray:
    """One pass of the starting model over the pairs of `split`: each data-parallel rank scores
    contiguous slices of micro_batch_size pairs, in as many forwards as every other rank."""
    from data.pairs import PreferencePairs

    pairs = PreferencePairs(run.plan.dataset, split, run.job.data.seq_len)
    n, rows, tp = len(pairs), run.job.train.micro_batch_size, run.plan.tp
    total = torch.zeros(n, 2, dtype=torch.float64, device=run.device)
    objective: DPOLoss = run.objective
    for step in range(math.ceil(n / (rows * run.dp_size))):
        first = (step * run.dp_size + run.dp_rank) * rows
        ids = torch.arange(first, first + rows)
        items = [pairs[i if i < n else 0] for i in ids.tolist()]  # past the end: scored, dropped
        batch = run.to_batch(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))
        with loss_context(tp):
            logps = objective.reference_logps(run.pipeline or run.model, run.model, batch)
        if logps is None:  # under pp, a rank without the last stage: it adds nothing
            continue
        keep = (ids < n).to(run.device)
        total.index_add_(0, ids.to(run.device)[keep], logps.view(rows, 2).double()[keep])
    # Each pair was scored on one data-parallel rank (zeros elsewhere) and one pp rank (the
    # last stage's); its tp and cp ranks each have the whole value: / (tp x cp).
    dist.all_reduce(total)
    return (total / (tp * run.plan.cp)).cpu().numpy()


def check_dpo_data(job: Any, sources: tuple) -> None:
    """ConfigError for DPO on a dataset that is not preference pairs (or a mixture), and for
    pairs without dpo.enabled: first of the data's checks, whose advice (document masking for
    examples, say) would otherwise answer the wrong question."""
    preference = [s for s in sources if s.index.preference]
    if not job.dpo.enabled:
        if preference:
            raise ConfigError(
                f"{preference[0].key}: '{preference[0].index.path}' holds preference pairs: "
                "train on them with dpo.enabled=true"
            )
        return
    if sources and (len(sources) > 1 or not preference):
        what = (sources[0].index.examples or {}).get("format", "documents")
        raise ConfigError(
            f"dpo.enabled needs one dataset of preference pairs (python -m data.prepare "
            f"--format preference), but {sources[0].key} holds {what}"
            + (f" ({len(sources)} sources)" if len(sources) > 1 else "")
        )


def check_dpo(job: Any, sources: tuple, run_dir: Path, resuming: bool, model_only: bool) -> None:
    """ConfigError, before any process group, for DPO with what it cannot train on (after
    `check_dpo_data`): a prompt that fills data.seq_len, the LoRA reference without [lora], a
    start from a checkpoint's weights, and a precomputed reference that is not this run's."""
    from data.pairs import check_pairs

    cfg = job.dpo
    if not cfg.enabled:
        return
    if cfg.reference == "lora" and not job.lora.enabled:
        raise ConfigError(
            "dpo.reference='lora' is the model with its adapters off, but lora.enabled=false: "
            "enable [lora], or use dpo.reference='copy' or 'precomputed'"
        )
    if model_only and cfg.reference != "lora":
        raise ConfigError(
            f"dpo.reference='{cfg.reference}' starts from checkpoint.init_from_hf or the seed, "
            "not a checkpoint's weights (checkpoint.load_model_only): export the checkpoint and "
            "start from the export with checkpoint.init_from_hf"
        )
    if sources:  # a dry run may have no data
        check_pairs(sources[0].index, job.data.seq_len, sources[0].key)
        check_reference(job, sources[0].index, run_dir, resuming)
