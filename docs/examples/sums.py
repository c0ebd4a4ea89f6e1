"""A fine-tuning task a base model cannot do, and the models to start from: README's "Fine-tune a
Hugging Face model".

    python docs/examples/sums.py make outputs/sums          # models and data
    python docs/examples/sums.py score BASE_DIR TUNED_DIR ... --data outputs/data/sums

`make` writes, with `transformers` (random init, nothing downloaded), a tiny Llama 3
(`OUT/llama3`) and a tiny Qwen3 (`OUT/qwen3`) of the shapes that configs/sums_llama3.toml and
configs/sums_qwen3.toml give the trainer, with a vocabulary of the byte tokenizer's 258 ids;
and `OUT/sums.jsonl`, every sum of two two-digit numbers in a fixed random order, one
prompt/response example a line: {"prompt": "12+34=", "response": "46"}. `data.prepare` holds
some of them out as the validation split.

`score` runs each model folder with `transformers` on the held-out examples of a prepared
dataset, each example alone: the mean loss over the response tokens and their EOS (what the
trainer's validation loss measures), and the share of sums it answers exactly, greedily.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's modules

from data.loader import open_dataset  # noqa: E402
from data.tokenizer import ByteTokenizer  # noqa: E402

BYTES = ByteTokenizer()
# The fields configs/sums_*.toml sets under [model], as transformers names them; the rest are
# the families' defaults (model/llama.py, model/qwen3.py) written out.
SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=BYTES.vocab_size, max_position_embeddings=512,
             bos_token_id=BYTES.bos_id, eos_token_id=BYTES.eos_id)  # fmt: skip
# transformers draws weights with std 0.02 by default: then the logits of a random model stay
# within +-1.3, and LoRA, which leaves the output projection and the norms frozen, could not
# make any answer likely. A released model has no such problem.
INIT_STD = 0.2
FAMILIES = {
    # intermediate_size: Llama's own rule for dim 64 (2/3 of 4 x 64, rounded up to 256).
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(intermediate_size=256, rms_norm_eps=1e-5, rope_theta=500_000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(intermediate_size=192, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                   tie_word_embeddings=True)),
}  # fmt: skip


def make(out: Path, seed: int = 0) -> None:
    import transformers

    torch.manual_seed(seed)
    for family, (config_class, model_class, own) in FAMILIES.items():
        config = getattr(transformers, config_class)(**SHAPE, **own, initializer_range=INIT_STD)
        model = getattr(transformers, model_class)(config)  # transformers' random init
        model.save_pretrained(out / family)
        print(f"{out / family}: {model_class}, {model.num_parameters():,} parameters")
    sums = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(sums)
    lines = [json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) for a, b in sums]
    (out / "sums.jsonl").write_text("\n".join(lines) + "\n")
    print(f"{out / 'sums.jsonl'}: {len(lines):,} examples")


def held_out(data: Path, limit: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first `limit` examples of the validation split: (tokens with EOS, loss mask)."""
    index = open_dataset(data)
    tokens = np.concatenate([np.fromfile(s.file, dtype=index.dtype) for s in index.splits["val"]])
    mask = np.concatenate([np.fromfile(s.mask, dtype=np.uint8) for s in index.splits["val"]])
    ends = np.flatnonzero(tokens == index.eos_id) + 1
    return list(zip(np.split(tokens, ends[:-1]), np.split(mask, ends[:-1]), strict=True))[:limit]


@torch.no_grad()
def score(model_dir: Path, examples: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
    """(mean loss per target token, share answered exactly) of one model folder."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count, right = 0.0, 0, 0
    for tokens, mask in examples:
        ids = torch.from_numpy(tokens.astype(np.int64))[None]
        logits = model(ids).logits[0, :-1]
        targets = ids[0, 1:].masked_fill(torch.from_numpy(mask[1:] == 0), -100)
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += int((targets != -100).sum())
        prompt = int(np.argmax(mask))  # the answer starts at the first target
        answer = ids[:, prompt:]
        out = model.generate(ids[:, :prompt], max_new_tokens=answer.shape[1], do_sample=False,
                             eos_token_id=BYTES.eos_id, pad_token_id=BYTES.eos_id)  # fmt: skip
        right += torch.equal(out[:, prompt:], answer)
    return total / count, right / len(examples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python docs/examples/sums.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("make", help="write the tiny models and sums.jsonl")
    made.add_argument("out", type=Path)
    scored = commands.add_parser("score", help="val loss and exact answers of model folders")
    scored.add_argument("models", type=Path, nargs="+")
    scored.add_argument("--data", type=Path, required=True, help="a prepared dataset")
    scored.add_argument("--examples", type=int, default=200, help="held-out examples to score")
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.out)
        return
    examples = held_out(args.data, args.examples)
    for model_dir in args.models:
        loss, exact = score(model_dir, examples)
        print(f"{model_dir}: val loss {loss:.4f}, exact {exact:.1%} of {len(examples)} sums")


if __name__ == "__main__":
    main()
