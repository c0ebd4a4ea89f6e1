"""TRL's `DPOTrainer` on the tiny Llama 3 and pairs of docs/examples/preferences.py: the numbers
tests/test_dpo.py compares the trainer with (tests/golden/dpo_trl.json, this script's output).

    pip install -e ".[trl]" && python tests/golden/dpo_trl.py   # rewrites tests/golden/dpo_trl.json

Each step's loss, gradient norm (before clipping) and TRL's six reward metrics, for each case of
CASES, in float32 on CPU: one process, the pairs in file order (TRL's random sampler replaced by
a sequential one, as `data.shuffle = false` reads them), a constant learning rate. TRL's logged
loss is rounded to 4 digits, so the loss is taken from `compute_loss` instead. Then, after the
last step, TRL's evaluation (its eval_loss and eval_ metrics) on the first `eval_pairs` held-out
pairs: the pairs file's lines split as `python -m data.prepare --val-fraction` splits them
(`split`), so the trainer's val split holds the same pairs.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "examples"))
GOLDEN = Path(__file__).with_suffix(".json")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")  # fmt: skip
# Shared by both sides (tests/test_dpo.py turns them into the trainer's settings).
# 27 lines: 19 train pairs (the steps read the first 16), 8 held out at val_fraction 0.34.
SETTINGS = dict(pairs=27, val_fraction=0.34, eval_pairs=8, batch=8, steps=2, lr=5e-3, seq_len=32,
                max_grad_norm=1.0)  # fmt: skip
CASES = {
    "sigmoid": dict(loss_type="sigmoid", beta=0.1, label_smoothing=0.0),
    "ipo": dict(loss_type="ipo", beta=0.1, label_smoothing=0.0),
    "robust": dict(loss_type="robust", beta=0.1, label_smoothing=0.1),
}


def make_inputs(out: Path) -> tuple[Path, Path]:
    """The model folder and the pairs file, as the test prepares them too."""
    import preferences

    preferences.make_model(out / "llama3")
    rows = preferences.pairs(SETTINGS["pairs"], seed=1)
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out / "llama3", out / "pairs.jsonl"


def split(pairs_file: Path) -> tuple[list[dict], list[dict]]:
    """The file's (train, val) pairs, as data.prepare splits them at SETTINGS' val_fraction
    (by the hash of each line's key, "pairs.jsonl:LINE")."""
    sys.path.insert(0, str(ROOT))
    from data.inputs import is_val

    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    keys = [f"{pairs_file.name}:{i}" for i in range(1, len(rows) + 1)]
    held = [is_val(key, SETTINGS["val_fraction"]) for key in keys]
    train = [r for r, v in zip(rows, held, strict=True) if not v]
    return train, [r for r, v in zip(rows, held, strict=True) if v]


def run_trl(model_dir: Path, pairs_file: Path, case: dict[str, Any], work: Path) -> dict:
    """TRL's numbers of `case`: each step's ("steps"), and the evaluation's after them ("eval")."""
    import datasets
    import torch
    import transformers
    from trl import DPOConfig, DPOTrainer

    torch.use_deterministic_algorithms(True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(model_dir)
    train, val = split(pairs_file)
    s = SETTINGS
    args = DPOConfig(
        output_dir=str(work), per_device_train_batch_size=s["batch"], max_steps=s["steps"],
        per_device_eval_batch_size=s["eval_pairs"],
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=s["max_grad_norm"],
        max_length=s["seq_len"], beta=case["beta"], loss_type=[case["loss_type"]],
        label_smoothing=case["label_smoothing"], logging_steps=1, report_to="none",
        use_cpu=True, bf16=False, fp16=False, save_strategy="no", seed=0,
        dataloader_num_workers=0,
    )  # fmt: skip
    losses: list[float] = []

    class Trainer(DPOTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(*args, **kwargs)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    trainer = Trainer(model=model, args=args, processing_class=tokenizer,
                      train_dataset=datasets.Dataset.from_list(train),
                      eval_dataset=datasets.Dataset.from_list(val[: s["eval_pairs"]]))  # fmt: skip
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    steps = [
        {"loss": loss, "grad_norm": log["grad_norm"]} | {m: log[m] for m in METRICS}
        for loss, log in zip(losses, logs, strict=True)
    ]
    evaluated = trainer.evaluate()
    return {"steps": steps,
            "eval": {m: evaluated[f"eval_{m}"] for m in ("loss", *METRICS)}}  # fmt: skip


def main() -> None:
    import trl

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, pairs_file = make_inputs(Path(tmp))
        runs = {
            name: run_trl(model_dir, pairs_file, case, Path(tmp) / name)
            for name, case in CASES.items()
        }
    golden = {"trl": trl.__version__, "settings": SETTINGS, "cases": CASES,
              "steps": {name: run["steps"] for name, run in runs.items()},
              "eval": {name: run["eval"] for name, run in runs.items()}}  # fmt: skip
    GOLDEN.write_text(json.dumps(golden, indent=2) + "\n")
    print(f"{GOLDEN}: TRL {trl.__version__}, {len(runs)} cases")


if __name__ == "__main__":
    main()
