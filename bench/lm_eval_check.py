"""Score a trainer task file with lm-eval-harness itself, offline, on an exported checkpoint.

    pip install -e ".[eval]"
    python -m checkpoint.export outputs/debug/checkpoints/step-200 outputs/debug/hf32 \
        --dtype float32
    python bench/lm_eval_check.py outputs/debug/hf32 outputs/data/stdlib/next_line.jsonl --limit 100

The trainer scores tasks as lm-eval-harness does (docs/evaluation.md). This runs lm-eval's own
`HFLM` on the same file and prints its table: its acc and acc_norm are the run's
eval/<task>/acc and acc_norm at the exported step. tests/test_lm_eval.py checks that, and every
request's log-likelihood, on a tiny run.

The task file is read as it is: each choice (or target) appended to the context with no
delimiter (lm-eval's default target_delimiter is " "). Runs on the byte tokenizer only (the
quick start's; it has no tokenizer files, so `hf_byte_tokenizer` builds it for transformers).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

EOS = 257  # data/tokenizer.py's ByteTokenizer.eos_id


def hf_byte_tokenizer() -> Any:
    """data/tokenizer.py's ByteTokenizer as a `transformers` tokenizer, which HFLM needs: ids
    0..255 are the UTF-8 bytes, 256 and 257 the BOS and EOS. Encoding with special tokens puts
    the EOS first, as the trainer starts every request (a document starts after an EOS)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    # The byte-level pre-tokenizer writes byte b as a printable character (GPT-2's
    # bytes_to_unicode): b itself where printable, else the next code point from 256 on.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    vocab = {(chr(b) if b in printable else chr(next(shifted))): b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one byte, one token
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<bos>", "<eos>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<eos> $A", special_tokens=[("<eos>", EOS)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>"
    )


def lm_eval_task(name: str, file: Path, kind: str) -> dict[str, Any]:
    """An lm-eval task config for a trainer task file of `kind` (data/tasks.py's format)."""
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(file)}},
        "test_split": "test",
        "doc_to_text": "context",  # a field's name: its value, as written
        "target_delimiter": "",  # the trainer appends a continuation as written
    }
    if kind == "multiple_choice":
        metrics = [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                   for m in ("acc", "acc_norm")]  # fmt: skip
        return task | {"output_type": "multiple_choice", "doc_to_choice": "choices",
                       "doc_to_target": "gold", "metric_list": metrics}  # fmt: skip
    # lm-eval's perplexity is per example (exp of minus the mean summed log-likelihood), not
    # per token as the trainer's ppl: compare log-likelihoods (log_samples) instead.
    metrics = [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}]
    return task | {"output_type": "loglikelihood", "doc_to_target": "target",
                   "metric_list": metrics}  # fmt: skip


def evaluate(hf_dir: Path, tasks: list[dict[str, Any]], limit: int = 0, batch_size: int = 16):
    """lm-eval's results (with every request's log-likelihood under "samples") for `tasks`,
    scored by HFLM on the export in `hf_dir`, in float32, on the CPU, with nothing downloaded."""
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[offline] = "1"
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    if model.config.eos_token_id != EOS:  # null: export found no index.json for the run's data
        raise SystemExit(
            f"error: {hf_dir}/config.json has eos_token_id {model.config.eos_token_id}, not "
            f"the byte tokenizer's {EOS}: only byte-tokenizer runs are supported"
        )
    # add_bos_token: each context, and context + continuation, is encoded after the EOS.
    lm = HFLM(pretrained=model, tokenizer=hf_byte_tokenizer(), add_bos_token=True,
              prefix_token_id=EOS, batch_size=batch_size, device="cpu")  # fmt: skip
    return lm_eval.simple_evaluate(
        model=lm, tasks=tasks, limit=limit or None, log_samples=True, bootstrap_iters=0
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", type=Path, help="python -m checkpoint.export's output")
    parser.add_argument("task_file", type=Path, help="a task file (docs/evaluation.md)")
    parser.add_argument("--kind", default="multiple_choice",
                        choices=("multiple_choice", "completion"))  # fmt: skip
    parser.add_argument("--limit", type=int, default=0, help="the first N examples (0: all)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    from lm_eval.utils import make_table

    task = lm_eval_task(args.task_file.stem, args.task_file, args.kind)
    print(make_table(evaluate(args.hf_dir, [task], args.limit, args.batch_size)))


if __name__ == "__main__":
    main()
