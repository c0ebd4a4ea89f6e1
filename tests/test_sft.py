"""Supervised fine-tuning data (data/sft.py): prompt/response and chat JSONL become tokens with a
loss mask, byte-identical on any number of workers; a packed batch's loss is the mean over the
targets of each example run alone; the loader resumes with its masks on another mesh; the
trainer's loss counts only targets, the same on any mesh and micro-batching; bad input is one
line."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train
from configs import ConfigError, parse_config
from data.documents import MicroBatch, micro_batch
from data.loader import DataConfig, TokenSequences, build_dataloader, open_dataset
from data.prepare import is_val, prepare
from data.sft import PLAIN_TEMPLATE
from launch.job import JobConfig
from model import ModelConfig, get_family
from tests.test_train import FP32, TINY, assert_close, run

ROOT = Path(__file__).resolve().parents[1]
EOS = 257  # the byte tokenizer's
CPU = torch.device("cpu")
SEQ = 40
DOCUMENT = DataConfig(attention_mask="document")
# A ChatML template, as Qwen's tokenizers carry one in tokenizer_config.json.
CHATML = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a conversation starts with "
    "the user') }}{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] "
    "+ '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def additions(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    return [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in pairs]


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def sums(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 prompt/response examples of 9-11 byte tokens: about 4 to a window of SEQ."""
    root = tmp_path_factory.mktemp("sums")
    jsonl = write_jsonl(root / "sums.jsonl", additions(300))
    return prepare([jsonl], root / "tokens", val_fraction=0.2, format="prompt_response")


def conversations(n: int) -> list[dict]:
    rng = random.Random(1)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        messages = [{"role": "user", "content": f"{a}+{b}?"},
                    {"role": "assistant", "content": f"{a + b}"},
                    {"role": "user", "content": "thanks ✓"}]  # fmt: skip
        if i % 2:  # every other ends with the assistant: its EOS is then a target
            messages.append({"role": "assistant", "content": "you're welcome"})
        out.append({"messages": [{"role": "system", "content": "add"}, *messages]})
    return out


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small BPE tokenizer.json with ChatML's special tokens, and a tokenizer_config.json
    holding its chat template, as a Hugging Face model folder has them (nothing downloaded)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    hf.train_from_iterator([json.dumps(c) for c in conversations(40)], trainer)
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    hf.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|endoftext|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def tokens_and_mask(dataset: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    index = open_dataset(dataset)
    [shard] = index.splits[split]
    tokens = np.fromfile(shard.file, dtype=index.dtype)
    return tokens, np.fromfile(shard.mask, dtype=np.uint8)


# ---- data.prepare ------------------------------------------------------------------------------


def test_prompt_response_tokens_and_mask(sums: Path) -> None:
    """Each example: its prompt's bytes, its response's, EOS; the mask marks the response and
    the EOS. Version 2 of index.json, with the format and the target counts."""
    index = json.loads((sums / "index.json").read_text())
    assert index["version"] == 2 and index["examples"]["format"] == "prompt_response"
    expected = [e for i, e in enumerate(additions(300)) if not is_val(f"sums.jsonl:{i + 1}", 0.2)]
    tokens, mask = tokens_and_mask(sums, "train")
    want_tokens = [
        t for e in expected for t in [*e["prompt"].encode(), *e["response"].encode(), EOS]
    ]
    want_mask = [
        m for e in expected for m in [0] * len(e["prompt"]) + [1] * (len(e["response"]) + 1)
    ]
    assert tokens.tolist() == want_tokens and mask.tolist() == want_mask
    assert index["examples"]["num_targets"]["train"] == sum(want_mask)


def test_chat_template_render_mask_and_workers(
    chat_tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chat examples with the tokenizer's own template: the text is what `transformers`
    renders, the targets are each assistant message with its end-of-turn markup (and the EOS
    after a conversation that ends with the assistant), and 2 workers write 1 worker's bytes."""
    from transformers import PreTrainedTokenizerFast

    from data import prepare as prepare_module

    monkeypatch.setattr(prepare_module, "CHUNK_DOCS", 3)  # many chunks: their order matters
    chats = conversations(12)
    jsonl = write_jsonl(tmp_path / "chat.jsonl", chats)
    one = prepare([jsonl], tmp_path / "w1", str(chat_tokenizer), val_fraction=0, format="chat",
                  workers=1)  # fmt: skip
    two = prepare([jsonl], tmp_path / "w2", str(chat_tokenizer), val_fraction=0, format="chat",
                  workers=2)  # fmt: skip
    for name in ("index.json", "train-00000.bin", "train-00000.mask.bin"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    index = open_dataset(one)
    assert index.examples["chat_template"] == str(chat_tokenizer / "tokenizer_config.json")

    hf = PreTrainedTokenizerFast(tokenizer_file=str(chat_tokenizer / "tokenizer.json"))
    tokens, mask = tokens_and_mask(one, "train")
    ends = np.flatnonzero(tokens == index.eos_id) + 1
    for chat, ids, flags in zip(chats, np.split(tokens, ends[:-1]), np.split(mask, ends[:-1]),
                                strict=True):  # fmt: skip
        messages = chat["messages"]
        text = hf.apply_chat_template(messages, tokenize=False, chat_template=CHATML)
        assert hf.decode(ids[:-1].tolist()) == text
        answers = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        ends_answered = messages[-1]["role"] == "assistant"
        assert hf.decode(ids[flags == 1].tolist()) == "".join(answers) + (
            "<|endoftext|>" if ends_answered else ""
        )


def test_plain_template_without_a_chat_template(tmp_path: Path) -> None:
    """The byte tokenizer (or a tokenizer.json without a template) renders PLAIN_TEMPLATE:
    'role: content' lines, the targets after 'assistant: '."""
    chat = {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    }
    out = prepare([write_jsonl(tmp_path / "c.jsonl", [chat])], tmp_path / "out", val_fraction=0,
                  format="chat")  # fmt: skip
    tokens, mask = tokens_and_mask(out, "train")
    assert bytes(tokens[:-1].tolist()) == b"user: 2+2?\nassistant: 4\n" and tokens[-1] == EOS
    assert bytes(tokens[mask == 1][:-1].tolist()) == b"4\n" and mask[-1] == 1
    assert (
        "assistant: " in PLAIN_TEMPLATE and open_dataset(out).examples["chat_template"] == "plain"
    )


def test_an_example_cut_by_a_shard_boundary(tmp_path: Path) -> None:
    """Shards cut the token stream anywhere: the first window of a shard that begins inside an
    example has no targets in that example, as a window cut inside one."""
    jsonl = write_jsonl(tmp_path / "sums.jsonl", additions(40))
    out = prepare([jsonl], tmp_path / "out", val_fraction=0, shard_tokens=105,
                  format="prompt_response")  # fmt: skip
    index = open_dataset(out)
    shards = index.splits["train"]
    seqs = TokenSequences(index, "train", 24)
    first = seqs.starts[1]  # shard 1's first window
    x, y = seqs[first]
    assert np.fromfile(shards[0].file, dtype=np.uint16)[-1] != EOS  # shard 0 ends mid-example
    head = int(np.flatnonzero(x.numpy() == EOS)[0])
    mask = np.fromfile(shards[1].mask, dtype=np.uint8)[1 : head + 1]
    assert mask.any() and (y[:head] == -100).all()
    assert (y[head + 1 :] != -100).any()


# ---- the loss of a packed batch ----------------------------------------------------------------


def tiny_model(name: str) -> torch.nn.Module:
    family = get_family(name)
    cfg = ModelConfig(name, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260)
    model = family.build_model(family.build_args(cfg))
    model.init_weights(seed=0, rope_len=64)
    return model


def token_losses(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    logits = model(batch.inputs, document_ids=batch.document_ids, positions=batch.positions)
    return F.cross_entropy(logits.transpose(1, 2).float(), batch.targets, reduction="none")


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_packed_batch_loss_is_the_mean_over_each_example_alone(sums: Path, name: str) -> None:
    """fp32: the loss of 6 packed windows (document masking, prompts masked) equals the mean,
    over the targets the windows hold, of each example run alone, within 1e-5. An example cut
    by the window's start has no targets there (its prompt is not in the window); one cut by
    its end keeps the targets it holds, with their whole context."""
    model = tiny_model(name)
    seqs = TokenSequences(open_dataset(sums), "train", SEQ)
    rows = range(3, 9)
    inputs, targets = (torch.stack(t) for t in zip(*(seqs[i] for i in rows), strict=True))
    batch = micro_batch(inputs, targets, DOCUMENT, EOS, CPU)
    tokens, mask = tokens_and_mask(sums, "train")
    starts = [0, *(np.flatnonzero(tokens == EOS) + 1).tolist()]
    total, count, cut_heads, cut_tails = 0.0, 0, 0, 0
    with torch.no_grad():
        packed = token_losses(model, batch)
        for row, i in enumerate(rows):
            begin = i * SEQ
            cut_heads += begin not in starts
            for s, e in zip(starts, starts[1:], strict=False):
                if not begin <= s < begin + SEQ:
                    continue  # wholly outside the window, or begun before it
                cut_tails += e > begin + SEQ + 1
                example = torch.from_numpy(tokens[s:e].astype(np.int64))[None]
                wanted = torch.from_numpy(mask[s + 1 : e].astype(bool))[None]
                alone = MicroBatch(example[:, :-1], example[:, 1:].masked_fill(~wanted, -100))
                losses = token_losses(model, alone)[0]
                # Its positions inside the window, and the targets there.
                held = slice(0, min(e - 1, begin + SEQ) - s)
                here = slice(s - begin, s - begin + held.stop)
                assert torch.equal(batch.targets[row, here], alone.targets[0, held])
                total += losses[held].sum().item()
                count += int((alone.targets[0, held] != -100).sum())
    assert cut_heads >= 3 and cut_tails >= 3
    assert count == int((batch.targets != -100).sum()) > 30
    got = packed.sum().item() / count
    assert got == pytest.approx(total / count, rel=1e-5)


# ---- the loader --------------------------------------------------------------------------------


def test_loader_resumes_with_masks_on_another_mesh(sums: Path) -> None:
    """Saved by 2 ranks of micro-batch 2 after 2 micro-steps, resumed on 1 rank of 4: the same
    inputs and targets (masks included) as an uninterrupted run."""
    data = DataConfig(path=str(sums), seq_len=SEQ, attention_mask="document")

    def loader(dp_size: int, dp_rank: int, micro: int):
        return build_dataloader(data, "train", dp_rank=dp_rank, dp_size=dp_size,
                                micro_batch_size=micro, seed=5)  # fmt: skip

    reference = iter(loader(1, 0, 4))
    ref = [next(reference) for _ in range(4)]
    states = []
    for rank in range(2):
        it = iter(two := loader(2, rank, 2))
        for step in range(2):
            x, y = next(it)
            assert torch.equal(y, ref[step][1][2 * rank : 2 * rank + 2])
        states.append(two.state_dict())
    resumed = loader(1, 0, 4)
    resumed.load_state_dict(states[1])
    it = iter(resumed)
    for step in (2, 3):
        x, y = next(it)
        assert torch.equal(x, ref[step][0]) and torch.equal(y, ref[step][1])
    assert (ref[2][1] == -100).any() and (ref[2][1] != -100).any()


# ---- the trainer -------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_loss_counts_targets_on_any_mesh(sums: Path, tmp_path: Path) -> None:
    """Through the real config parser and train(): the first step's loss is the mean over the
    targets of the first global batch computed here without the trainer, and 1 process with 4
    accumulation micro-steps = FSDP over 2 ranks with 1 (fp32, 1e-5)."""
    steps = [*FP32, "--train.steps=3", "--data.attention_mask=document", f"--data.seq_len={SEQ}"]
    single = run(str(sums), tmp_path / "one", 1, 1, [*steps, "--train.micro_batch_size=2"])
    fsdp = run(str(sums), tmp_path / "two", 2, 1, [*steps, "--train.micro_batch_size=4"])
    assert_close(fsdp, single, rtol=1e-5)

    job = parse_config(JobConfig, [f"--data.path={sums}", *TINY, *steps])
    family = get_family(job.model.name)
    model = family.build_model(family.build_args(job.model))
    model.init_weights(seed=job.train.seed, rope_len=SEQ)
    t = job.train
    first = build_dataloader(job.data, "train", dp_rank=0, dp_size=1,
                             micro_batch_size=t.global_batch_size, seed=t.seed)  # fmt: skip
    batch = micro_batch(*next(iter(first)), job.data, EOS, CPU)
    with torch.no_grad():
        expected = token_losses(model, batch).sum() / (batch.targets != -100).sum()
    assert single[0] == pytest.approx(expected.item(), rel=1e-5)


# ---- bad input ---------------------------------------------------------------------------------


BAD_EXAMPLES = [
    ("prompt_response", {"prompt": "1+1="}, "no string field 'response'"),
    ("prompt_response", {"prompt": 3, "response": "x"}, "no string field 'prompt'"),
    ("chat", {"messages": []}, "no list 'messages'"),
    ("chat", {"messages": [{"role": "user"}]}, "message 0 is not an object with string"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "no message has role 'assistant'"),
]


@pytest.mark.parametrize(("kind", "record", "message"), BAD_EXAMPLES)
def test_a_bad_example_names_its_line(tmp_path: Path, kind: str, record: dict, message: str):
    good = additions(1)[0] if kind == "prompt_response" else conversations(1)[0]
    jsonl = write_jsonl(tmp_path / "x.jsonl", [good, good, record])
    with pytest.raises(ConfigError, match=f"x.jsonl:3: {message}"):
        prepare([jsonl], tmp_path / "out", format=kind)
    assert not (tmp_path / "out").exists()


def test_template_errors_name_the_line(chat_tokenizer: Path, tmp_path: Path) -> None:
    """A template that refuses a conversation (raise_exception), and one that renders a
    conversation's start otherwise than the whole: one error naming the line, on a worker
    too."""
    chats = conversations(3)
    chats[2]["messages"] = chats[2]["messages"][2:]  # starts with the assistant: refused
    jsonl = write_jsonl(tmp_path / "chat.jsonl", chats)
    with pytest.raises(ConfigError, match="chat.jsonl:3: the chat template .* does not render "
                       "this conversation: a conversation starts with the user"):  # fmt: skip
        prepare([jsonl], tmp_path / "out", str(chat_tokenizer), format="chat", workers=2)
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((chat_tokenizer / "tokenizer.json").read_bytes())
    # Numbers each message by how many there are: the start of a conversation changes.
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ messages|length }}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(ConfigError, match="chat.jsonl:1: the chat template .*chat_template.jinja"
                       r"\) renders messages 0-2 otherwise"):  # fmt: skip
        prepare([jsonl], tmp_path / "out", str(folder), format="chat")


def test_wrong_files_and_options_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("text")
    jsonl = write_jsonl(tmp_path / "x.jsonl", additions(3))
    cases = [
        (["--input", str(tmp_path / "notes.txt"), "--format", "chat"], "reads JSONL files"),
        (["--input", jsonl, "--format", "prompt_response", "--field", "body"], "--field names"),
        (["--format", "chat"], "--format chat needs --input"),
    ]
    for args, message in cases:
        command = [sys.executable, "-m", "data.prepare", *args, "--out", str(tmp_path / "out")]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert lines[0].startswith("error: data prepare: ") and message in lines[0], lines[0]


def test_examples_need_document_masking_and_intact_masks(
    sums: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A dataset of examples trained with causal attention (each example would see the ones
    packed before it) is one `config error:` line and exit 2; so is a truncated mask file."""
    argv = [f"--data.path={sums}", f"--run.output_dir={tmp_path}", *TINY]
    with caplog.at_level(logging.ERROR, logger="train"):
        assert train.main(argv) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.startswith("config error: data.path: ") and "\n" not in error
    assert "set data.attention_mask='document'" in error
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in sums.iterdir():
        data = f.read_bytes()
        (copy / f.name).write_bytes(data[:-1] if f.name == "val-00000.mask.bin" else data)
    with pytest.raises(ConfigError, match="val-00000.mask.bin' has .* bytes, index.json expects"):
        open_dataset(copy)
