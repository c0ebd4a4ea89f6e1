"""Preference pairs and a model to start from: docs/finetuning.md's "Preference optimization
(DPO)" walkthrough, and the model and pairs tests/golden/dpo_trl.py runs TRL on.

    python docs/examples/preferences.py make outputs/prefs      # model, tokenizer, pairs
    python docs/examples/preferences.py margin MODEL_DIR ... --pairs outputs/prefs/heldout.jsonl

`make` writes, with `transformers` (nothing downloaded), a tiny Llama 3 (`OUT/llama3`: the shape
of configs/dpo_llama3.toml, a vocabulary of the byte tokenizer's 258 ids, weights drawn from a
seeded generator so they do not depend on the transformers version) with a `tokenizer.json`
that tokenizes as the byte tokenizer does (for TRL, which needs a Hugging Face tokenizer); and
pairs of two-digit sums whose chosen completion is the right sum and rejected one a near miss,
`{"prompt": "12+34=", "chosen": "46", "rejected": "47"}`: `OUT/pairs.jsonl` to train on and
`OUT/heldout.jsonl`, sums none of the training pairs holds.

`margin` prints, for each model folder, the mean over the held-out pairs of log p(chosen) -
log p(rejected) (each completion with its EOS, given the prompt), computed by `transformers`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

VOCAB, BOS, EOS = 258, 256, 257
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=500_000.0, bos_token_id=BOS, eos_token_id=EOS,
             pad_token_id=EOS, tie_word_embeddings=False)  # fmt: skip
INIT_STD = 0.2  # as docs/examples/sums.py: logits a random model can move


def byte_tokenizer_json() -> str:
    """A tokenizer.json whose ids are the byte tokenizer's (data/tokenizer.py): bytes 0-255 as
    GPT-2's byte-level characters, no merges, then BOS 256 and EOS 257."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        chars[b] = chr(b) if b in printable else chr(256 + (extra := extra + 1) - 1)
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    return tok.to_str()


def make_model(out: Path, seed: int = 0) -> None:
    """The tiny Llama 3, its weights from `seed` alone, and its byte-level tokenizer files."""
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=generator)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else INIT_STD * noise)
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(byte_tokenizer_json())
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def pairs(n: int, seed: int, exclude: set[tuple[int, int]] = frozenset()) -> list[dict]:
    """`n` sums of two two-digit numbers (none of `exclude`): chosen right, rejected off by 1
    or 10 either way."""
    rng, out, seen = random.Random(seed), [], set(exclude)
    while len(out) < n:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        out.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    return out


def make(out: Path, n_train: int = 256, n_heldout: int = 64) -> None:
    make_model(out / "llama3")
    train = pairs(n_train, seed=1)
    used = {tuple(map(int, p["prompt"][:-1].split("+"))) for p in train}
    for name, rows in (("pairs", train), ("heldout", pairs(n_heldout, 2, used))):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{out}: llama3/, pairs.jsonl ({n_train} pairs), heldout.jsonl ({n_heldout} pairs)")


@torch.no_grad()
def margin(model_dir: Path, rows: list[dict]) -> float:
    """Mean log p(chosen + EOS | prompt) - log p(rejected + EOS | prompt), in transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total = 0.0
    for row in rows:
        prompt = list(row["prompt"].encode())
        logps = []
        for completion in (row["chosen"], row["rejected"]):
            ids = torch.tensor([prompt + list(completion.encode()) + [EOS]])
            logits = model(ids).logits[0, :-1].log_softmax(-1)
            token_logps = logits.gather(1, ids[0, 1:, None])[:, 0]
            logps.append(token_logps[len(prompt) - 1 :].sum().item())
        total += logps[0] - logps[1]
    return total / len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("make").add_argument("out", type=Path)
    score = sub.add_parser("margin")
    score.add_argument("models", type=Path, nargs="+")
    score.add_argument("--pairs", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "make":
        make(args.out)
        return
    rows = [json.loads(line) for line in args.pairs.read_text().splitlines() if line.strip()]
    for model_dir in args.models:
        print(f"{model_dir}: held-out log-prob margin {margin(model_dir, rows):.4f}")


if __name__ == "__main__":
    main()
