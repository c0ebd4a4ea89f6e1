"""Hugging Face export and import: bitwise round trips, logits equal to `transformers`, and
sharded loading in which every rank reads only the rows of its own shards."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from checkpoint import hf
from checkpoint.export import export_checkpoint, load_checkpoint_model, main
from checkpoint.hf import check_hf_config, load_hf_weights, save_hf_weights, to_hf_rows
from configs import ConfigError, config_to_toml
from model import ModelConfig, llama_hf
from model.llama import LlamaArgs, Transformer, build_args
from tests.distributed import run_distributed

# transformers must never reach for the network. huggingface_hub reads these when it is first
# imported (inside the tests below, never at collection), so setting them here is early enough.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

SEQ = 128


def small_config(**overrides: Any) -> ModelConfig:
    """The 1B flavor (Llama 3.2: rope scaling with factor 32, tied embeddings) shrunk to a
    GQA model with 4 query heads sharing 2 kv heads."""
    shape = dict(flavor="1B", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128)
    return ModelConfig(**(shape | overrides))


def random_model(args: LlamaArgs, seed: int = 0) -> Transformer:
    """Weights of unit-scale activations: init_weights' std 0.02 makes attention nearly
    uniform, so a wrong RoPE layout or q/k permutation would hardly move the logits."""
    model = Transformer(args)
    model.init_weights(rope_len=SEQ)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)  # unit-variance outputs
    return model


def empty_model(args: LlamaArgs) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    if args.tie_embeddings:  # to_empty unties a plain model (FSDP2's to_empty keeps the tie)
        model.output.weight = model.tok_embeddings.weight
    return model


@dataclass
class _Run:
    model: ModelConfig


def write_checkpoint(
    model: Transformer, cfg: ModelConfig, run_dir: Path, config: bool = True, more_toml: str = ""
) -> Path:
    """A step directory in the layout checkpoint/state.py writes (model + config entries)."""
    step_dir = run_dir / "checkpoints" / "step-10"
    state: dict[str, Any] = {"model": model.state_dict()}
    if config:
        state["config"] = config_to_toml(_Run(cfg)) + more_toml
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=step_dir, no_dist=True)
    (step_dir / "COMPLETE").touch()
    return step_dir


def hf_rows(our_rows: list[int], head_dim: int) -> list[int]:
    """HF rows holding our wq/wk rows: our row 2i+p of a head is HF row p*head_dim/2+i."""
    half = head_dim // 2
    return [r - r % head_dim + (r % 2) * half + (r % head_dim) // 2 for r in our_rows]


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_bitwise_in_float32(tmp_path: Path, tied: bool) -> None:
    args = build_args(small_config(tie_embeddings=tied))
    model = random_model(args)
    # Small files for the tied case, to go through model.safetensors.index.json.
    limit = 10**6 if not tied else 200_000
    files = save_hf_weights(model, llama_hf, tmp_path, torch.float32, max_shard_bytes=limit)
    assert len(files) == (1 if not tied else 3)
    assert (tmp_path / "model.safetensors.index.json").exists() == tied
    assert all(sum(t.nbytes for t in load_file(f).values()) <= limit for f in files)
    names = set().union(*(safe_open(f, framework="pt").keys() for f in files))
    layer = {
        f"model.layers.{i}.{n}"
        for i in range(2)
        for n in [
            *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
            *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ]
    }
    top = {"model.embed_tokens.weight", "model.norm.weight"} | (
        {"lm_head.weight"} if not tied else set()
    )
    assert names == layer | top

    loaded = empty_model(args)
    load_hf_weights(loaded, llama_hf, tmp_path, rope_len=SEQ)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    assert torch.equal(model(tokens), loaded(tokens))  # the RoPE table was built too


def test_export_cli_writes_hf_layout_in_bfloat16(tmp_path: Path) -> None:
    cfg = small_config(tie_embeddings=False, rope_scaling=True)
    args = build_args(cfg)
    model = random_model(args)
    assert main([str(write_checkpoint(model, cfg, tmp_path / "run")), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 131_072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    assert {k: config[k] for k in expected} == expected
    check_hf_config(llama_hf, args, tmp_path / "hf")  # reads back as the same shape
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    wq = model.layers["1"].attention.wq.weight
    assert torch.equal(
        weights["model.layers.1.self_attn.q_proj.weight"], to_hf_rows(wq, 16).bfloat16()
    )
    assert torch.equal(
        weights["model.layers.1.mlp.up_proj.weight"],
        model.layers["1"].feed_forward.w3.weight.bfloat16(),
    )


@pytest.mark.parametrize("tied", [False, True])
def test_exported_logits_equal_transformers_with_rope_scaling(tmp_path: Path, tied: bool) -> None:
    """The export CLI's files of a checkpoint with Llama 3.1 RoPE scaling (the 1B flavor's) give
    transformers' logits (fp32); the checkpoint's model, as loaded, runs as is; what
    transformers writes back loads bitwise. The test can fail: without the q/k permutation the
    logits are far apart. (Without scaling, both ways, for every family: test_families.py.)"""
    transformers = pytest.importorskip("transformers")
    cfg = small_config(rope_scaling=True, tie_embeddings=tied)
    args = build_args(cfg)
    model = random_model(args)
    checkpoint = write_checkpoint(model, cfg, tmp_path / "run")
    assert main([str(checkpoint), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, local_files_only=True
    ).eval()
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, logits = model(tokens), theirs(tokens).logits
        torch.testing.assert_close(logits, ours, atol=1e-5, rtol=1e-5)
        # The checkpoint's model, as loaded, runs as is: the trained model's logits, exactly.
        assert torch.equal(load_checkpoint_model(checkpoint)(tokens), ours)
    # And back: what transformers itself writes (its own config keys) loads into our model.
    theirs.save_pretrained(tmp_path / "saved")
    check_hf_config(llama_hf, args, tmp_path / "saved")
    loaded = empty_model(args)
    load_hf_weights(loaded, llama_hf, tmp_path / "saved")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():
        for i, layer in enumerate(theirs.model.layers):
            layer.self_attn.q_proj.weight.copy_(model.layers[str(i)].attention.wq.weight)
            layer.self_attn.k_proj.weight.copy_(model.layers[str(i)].attention.wk.weight)
        assert (theirs(tokens).logits - ours).abs().max() > 0.1


def test_export_refuses_missing_and_incomplete_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "run" / "checkpoints" / "step-5"
    assert main([str(missing), str(tmp_path / "hf")]) == 2
    assert caplog.records[-1].getMessage() == f"export error: checkpoint not found: {missing}"

    cfg = small_config()
    step_dir = write_checkpoint(random_model(build_args(cfg)), cfg, tmp_path / "run")
    (step_dir / "COMPLETE").unlink()
    assert main([str(step_dir), str(tmp_path / "hf")]) == 2
    message = caplog.records[-1].getMessage()
    assert str(step_dir) in message and "incomplete (no COMPLETE file)" in message
    assert "\n" not in message and not (tmp_path / "hf").exists()

    # The module entry point: one line on stderr, exit status 2.
    result = subprocess.run(
        [sys.executable, "-m", "checkpoint.export", str(missing), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ERROR export error: checkpoint not found: {missing}"
    ]


def test_export_of_a_checkpoint_without_its_config_entry_is_one_error(tmp_path: Path) -> None:
    """Every checkpoint train.py saves holds the run's config; the run's config.toml beside
    one that does not is not read instead."""
    cfg = small_config(n_layers=3)
    step_dir = write_checkpoint(random_model(build_args(cfg)), cfg, tmp_path / "run", config=False)
    (tmp_path / "run" / "config.toml").write_text(config_to_toml(_Run(cfg)))
    with pytest.raises(ConfigError) as err:
        export_checkpoint(step_dir, tmp_path / "hf")
    assert str(err.value) == f"{step_dir} has no config entry: not a checkpoint of this trainer"
    assert not (tmp_path / "hf").exists()


def test_import_errors_name_keys_and_shapes(tmp_path: Path) -> None:
    args = build_args(small_config(tie_embeddings=False))
    save_hf_weights(random_model(args), llama_hf, tmp_path, torch.float32)
    with pytest.raises(ConfigError, match="not found: .*nowhere"):
        load_hf_weights(empty_model(args), llama_hf, tmp_path / "nowhere")

    bigger = build_args(small_config(tie_embeddings=False, vocab_size=130))
    with pytest.raises(ConfigError) as err:
        load_hf_weights(empty_model(bigger), llama_hf, tmp_path)
    assert str(err.value) == (
        f"{tmp_path} does not match the model: "
        "model.embed_tokens.weight has shape [128, 64], model expects [130, 64]; "
        "lm_head.weight has shape [128, 64], model expects [130, 64]"
    )
    with pytest.raises(ConfigError, match=r"vocab_size 130 vs 128, tie_embeddings True vs False"):
        check_hf_config(llama_hf, build_args(small_config(vocab_size=130)), tmp_path)

    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight \[256, 64\]"
    ):
        load_hf_weights(empty_model(args), llama_hf, tmp_path)
    tied = build_args(small_config(tie_embeddings=True))  # would ignore the trained lm_head
    with pytest.raises(ConfigError, match=r"unexpected lm_head\.weight"):
        load_hf_weights(empty_model(tied), llama_hf, tmp_path)


# ---- sharded loading on real gloo ranks ------------------------------------------------------

# head_dim 10: the 4-way shards of wq (15 rows) and wk (30 rows -> 8, 8, 8, 6) start inside
# heads, and the vocabulary (130 -> 33, 33, 33, 31) and FFN (161) do not split evenly.
UNEVEN = dict(
    flavor="debug",
    dim=60,
    n_layers=2,
    n_heads=6,
    n_kv_heads=3,
    vocab_size=130,
    multiple_of=1,
    ffn_dim_multiplier=1.01,
)


@contextlib.contextmanager
def _recording_safe_open(*args: Any, reads: dict[str, list[int]], **kwargs: Any):
    """safe_open whose slices log every row they hand out, by tensor name."""

    class Slice:
        def __init__(self, inner: Any, name: str) -> None:
            self.inner, self.name = inner, name

        def get_shape(self) -> list[int]:
            return self.inner.get_shape()

        def __getitem__(self, index: Any) -> torch.Tensor:
            rows = index[0] if isinstance(index, tuple) else index
            reads[self.name] += range(rows.start, rows.stop)
            return self.inner[index]

    class File:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_slice(self, name: str) -> Slice:
            return Slice(self.inner.get_slice(name), name)

    with safe_open(*args, **kwargs) as f:
        yield File(f)


def _load_sharded(hf_dir: str, step_dir: str, dp_replicate: int, reference: dict) -> dict:
    from functools import partial

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import distribute_tensor

    from model.llama import fsdp_units
    from parallel.dims import LaunchEnv, ParallelConfig
    from parallel.fsdp import apply_fsdp
    from parallel.runtime import build_mesh, dp_mesh, init_distributed

    launch = LaunchEnv.from_env()
    init_distributed(torch.device("cpu"), launch, 60)
    mesh = build_mesh(torch.device("cpu"), dp_replicate, launch.world_size // dp_replicate)
    cfg = ModelConfig(**UNEVEN, tie_embeddings=dp_replicate == 2)
    with torch.device("meta"):
        model = Transformer(build_args(cfg))
    apply_fsdp(model, fsdp_units(model), dp_mesh(mesh), ParallelConfig(param_dtype="float32"))
    model.to_empty(device="cpu")

    reads: dict[str, list[int]] = defaultdict(list)
    hf.safe_open = partial(_recording_safe_open, reads=reads)  # this rank's process only
    load_hf_weights(model, llama_hf, hf_dir, rope_len=SEQ)
    local_rows = {}
    for name, param in model.named_parameters():
        # DTensor's own answer for this rank's shard of the original.
        expected = distribute_tensor(
            reference[name], param.device_mesh, param.placements, src_data_rank=None
        )
        assert torch.equal(param.to_local(), expected.to_local()), name
        chunks = torch.arange(param.shape[0]).chunk(mesh["dp_shard"].size())
        shard = mesh["dp_shard"].get_local_rank()
        local_rows[llama_hf.hf_name(name)] = chunks[shard].tolist() if shard < len(chunks) else []

    # Save it as training does, for the export test in the parent process.
    dcp.save(
        {"model": get_model_state_dict(model), "config": config_to_toml(_Run(cfg))},
        checkpoint_id=step_dir,
    )
    dist.barrier()
    if launch.rank == 0:
        (Path(step_dir) / "COMPLETE").touch()
    dist.destroy_process_group()
    return {"reads": dict(reads), "local_rows": local_rows}


@pytest.mark.slow
@pytest.mark.parametrize("dp_replicate", [1, 2], ids=["fsdp1x4", "hsdp2x2"])
def test_sharded_import_reads_only_local_rows(tmp_path: Path, dp_replicate: int) -> None:
    cfg = ModelConfig(**UNEVEN, tie_embeddings=dp_replicate == 2)
    args = build_args(cfg)
    model = random_model(args)
    save_hf_weights(model, llama_hf, tmp_path / "hf", torch.float32, max_shard_bytes=50_000)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    step_dir = tmp_path / "run" / "checkpoints" / "step-1"
    results = run_distributed(
        _load_sharded,
        4,
        str(tmp_path / "hf"),
        str(step_dir),
        dp_replicate,
        reference,
        nodes=dp_replicate,
    )

    starts_inside_a_head = False
    for result in results:
        for key, rows in result["local_rows"].items():
            rotated = key.endswith(("q_proj.weight", "k_proj.weight"))
            wanted = hf_rows(rows, args.head_dim) if rotated else rows
            # Every row of the shard read once, and nothing else.
            assert sorted(result["reads"].get(key, [])) == sorted(wanted), key
            starts_inside_a_head |= rotated and bool(rows) and rows[0] % args.head_dim != 0
    assert starts_inside_a_head
    keys = results[0]["local_rows"]
    assert any(len({len(r["local_rows"][k]) for r in results}) > 1 for k in keys)  # uneven

    # What the 4 ranks saved exports, on one process, to the files we started from.
    export_checkpoint(step_dir, tmp_path / "export", torch.float32)
    exported = {}
    for f in (tmp_path / "export").glob("*.safetensors"):
        exported |= load_file(f)
    original = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        original |= load_file(f)
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(exported[key], value), key


def test_export_dtype_defaults_to_the_runs_checkpoint_export_dtype(tmp_path: Path) -> None:
    cfg = small_config(tie_embeddings=False)
    model = random_model(build_args(cfg))
    step_dir = tmp_path / "run" / "checkpoints" / "step-1"
    toml = config_to_toml(_Run(cfg)) + '\n[checkpoint]\nexport_dtype = "float32"\n'
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": model.state_dict(), "config": toml}, checkpoint_id=step_dir, no_dist=True
        )
    (step_dir / "COMPLETE").touch()
    assert main([str(step_dir), str(tmp_path / "hf")]) == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
    assert main([str(step_dir), str(tmp_path / "hf16"), "--dtype", "bfloat16"]) == 0  # CLI wins
    assert {w.dtype for w in load_file(tmp_path / "hf16" / "model.safetensors").values()} == {
        torch.bfloat16
    }


def test_load_checkpoint_model_runs_as_is(tmp_path: Path) -> None:
    cfg = small_config(rope_scaling=True)
    args = build_args(cfg)
    model = random_model(args)
    checkpoint = write_checkpoint(model, cfg, tmp_path / "run")
    loaded = load_checkpoint_model(checkpoint)
    assert loaded.rope.shape[0] == args.max_seq_len  # as long as the HF export declares
    tokens = torch.randint(0, args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))
        short = load_checkpoint_model(checkpoint, rope_len=SEQ)
        assert short.rope.shape[0] == SEQ and torch.equal(short(tokens), model(tokens))


def test_export_refuses_a_non_empty_out_dir_unless_forced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = small_config(tie_embeddings=False)
    old = random_model(build_args(cfg), seed=1)
    out = tmp_path / "hf"
    # An earlier export in several files, and a file of the user's.
    export_checkpoint(write_checkpoint(old, cfg, tmp_path / "old"), out, max_shard_bytes=100_000)
    (out / "README.md").write_text("mine")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    shards = sorted(name for name in before if name.endswith(".safetensors"))
    assert len(shards) > 1 and "model.safetensors.index.json" in before

    new = random_model(build_args(cfg), seed=2)
    step_dir = write_checkpoint(new, cfg, tmp_path / "new")
    caplog.clear()
    assert main([str(step_dir), str(out), "--dtype", "float32"]) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"export error: {out} is not empty (README.md, config.json, {shards[0]}, ...): "
        "export into a new or empty directory, or pass --force to overwrite"
    ]
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # untouched

    # --force: one file now; the earlier shards and their index are gone, the user's file stays.
    assert main([str(step_dir), str(out), "--dtype", "float32", "--force"]) == 0
    assert sorted(f.name for f in out.iterdir()) == [
        "README.md", "config.json", "model.safetensors"
    ]  # fmt: skip
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["model.norm.weight"], new.norm.weight)
    assert main([str(step_dir), str(tmp_path / "new" / "hf"), "--force"]) == 0  # new dirs too


def test_export_where_it_cannot_write_is_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only folder and a path under a file are found before the checkpoint is loaded; a
    disk that fills up while writing is one line too, not an OSError's traceback."""
    from tests.test_checkpoint import small_tmpfs

    cfg = small_config(tie_embeddings=False)
    step_dir = write_checkpoint(random_model(build_args(cfg), seed=1), cfg, tmp_path / "run")
    (tmp_path / "a-file").write_text("")
    under_a_file = tmp_path / "a-file" / "hf"
    with small_tmpfs(tmp_path / "ro", 1 << 20, read_only=True) as ro:
        for out, message in [
            (ro / "hf", f"export error: cannot write into {ro} (read-only or not permitted)"),
            (under_a_file, f"export error: cannot create {under_a_file}: {under_a_file.parent} "
             "is a file, not a directory"),
        ]:  # fmt: skip
            caplog.clear()
            assert main([str(step_dir), str(out)]) == 2
            assert [r.getMessage() for r in caplog.records] == [message]
    with small_tmpfs(tmp_path / "small", 64 << 10) as small:  # less than the weights
        caplog.clear()
        assert main([str(step_dir), str(small / "hf"), "--dtype", "float32"]) == 1
        [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert error.startswith(f"export error: writing {small / 'hf'} failed: "), error
        assert "\n" not in error


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_exported_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    cfg = small_config(tie_embeddings=False)
    step_dir = write_checkpoint(random_model(build_args(cfg)), cfg, tmp_path / "run")
    previous = os.umask(umask)
    try:
        export_checkpoint(step_dir, tmp_path / "hf", max_shard_bytes=100_000)
    finally:
        os.umask(previous)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert len(modes) > 3 and "model.safetensors.index.json" in modes  # shards, index, config
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


def test_config_json_takes_token_ids_from_the_runs_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from data.prepare import prepare

    monkeypatch.chdir(tmp_path)  # data.path is relative to where the run (and export) started
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some training text\n" * 20)
    prepare(["text"], "data/bytes", val_fraction=0.0)
    cfg = small_config()
    model = random_model(build_args(cfg))

    def export(data: str, name: str) -> tuple[dict, str]:
        step_dir = write_checkpoint(model, cfg, tmp_path / name, more_toml=data)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="checkpoint.export"):
            assert main([str(step_dir), str(tmp_path / name / "hf")]) == 0
        config = json.loads((tmp_path / name / "hf" / "config.json").read_text())
        ids = (config["bos_token_id"], config["eos_token_id"])
        lines = [r.getMessage() for r in caplog.records if "token_id" in r.getMessage()]
        assert len(lines) == 1, lines  # one line says where the ids came from, or why not
        return ids, lines[0]

    index = Path("data/bytes/index.json")
    ids, line = export('\n[data]\npath = "data/bytes"\n', "run")
    assert ids == (256, 257)  # the byte tokenizer's BOS and EOS
    assert line == f"config.json: bos_token_id 256, eos_token_id 257 from {index}"

    # A tokenizer without BOS (bos_id null): EOS only.
    index.write_text(json.dumps(json.loads(index.read_text()) | {"bos_id": None}))
    ids, line = export('\n[data]\npath = "data/bytes"\n', "old")
    assert ids == (None, 257)
    assert line == (
        f"config.json: eos_token_id 257 from {index}, which records no bos_id: bos_token_id is null"
    )

    ids, line = export('\n[data]\npath = "data/elsewhere"\n', "moved")
    assert ids == (None, None)
    assert line == (
        "config.json: bos_token_id and eos_token_id are null: data/elsewhere/index.json "
        "(the run's data.path) not found from this directory"
    )
    index.write_text("{")
    ids, line = export('\n[data]\npath = "data/bytes"\n', "corrupt")
    assert ids == (None, None) and f"'{index}' is not valid JSON" in line


def test_help_example_is_the_quick_start_checkpoint(capsys: pytest.CaptureFixture) -> None:
    """`--help` shows the export of the checkpoint that training configs/debug.toml leaves."""
    from checkpoint import checkpoint_folder, step_dir
    from configs import parse_config
    from launch.job import JobConfig

    job = parse_config(JobConfig, [str(Path(__file__).parents[1] / "configs" / "debug.toml")])
    run_dir = Path(job.run.output_dir) / job.run.name
    last = step_dir(checkpoint_folder(job.checkpoint, run_dir), job.train.steps)
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    assert last.as_posix() == "outputs/debug/checkpoints/step-200"  # as docs/checkpoints.md says
    example = f"python -m checkpoint.export {last.as_posix()} {(run_dir / 'hf').as_posix()}"
    assert example in capsys.readouterr().out
