"""A LoRA run's adapters in PEFT's layout: `adapter_model.safetensors` + `adapter_config.json`.

    save_peft_adapters(model, mapping, lora_cfg, out_dir)   # `checkpoint.export --adapters-only`

then, with `peft` installed, on top of the base model in `transformers`:

    base = AutoModelForCausalLM.from_pretrained(BASE_DIR)
    model = PeftModel.from_pretrained(base, OUT_DIR)

PEFT names an adapter by the HF module it adapts: `base_model.model.<module>.lora_A.weight`
(rank x in_features) and `...lora_B.weight` (out_features x rank), our `lora_a` and `lora_b`;
its scale is lora_alpha / r, ours alpha / rank. `target_modules` lists each adapted module by
its full HF name, so exactly those layers get adapters (PEFT matches a name or its suffix).
Rows that the family's mapping reorders in the base weight (Llama's q/k RoPE layout) are
reordered in B, whose rows are the layer's output features; A's columns are its inputs, which
no mapping reorders.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from checkpoint.hf import _umask, to_hf_rows
from model import HFMapping
from parallel.lora import LoRAConfig, lora_layers

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
ADAPTER_FILES = (WEIGHTS_FILE, CONFIG_FILE)


def save_peft_adapters(
    model: nn.Module,
    mapping: HFMapping,
    cfg: LoRAConfig,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Path]:
    """Write the adapters of a plain (unsharded) LoRA model; returns the two files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, targets = {}, []
    for name, layer in lora_layers(model):
        weight_name = f"{name}.weight"  # the base weight's name: what the mapping knows
        module = mapping.hf_name(weight_name).removesuffix(".weight")
        head_dim = mapping.rotated_head_dim(weight_name, model.args)
        lora_b = layer.lora_b.weight
        if head_dim is not None:
            lora_b = to_hf_rows(lora_b, head_dim)
        tensors[f"base_model.model.{module}.lora_A.weight"] = layer.lora_a.weight
        tensors[f"base_model.model.{module}.lora_B.weight"] = lora_b
        targets.append(module)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    (out / WEIGHTS_FILE).chmod(0o666 & ~_umask())  # as the weights of a full export
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return [out / WEIGHTS_FILE, out / CONFIG_FILE]
