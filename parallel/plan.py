"""Back-of-the-envelope memory per rank, shown by `train.py --dry-run`."""

from __future__ import annotations

from model.llama import LlamaArgs

BYTES = {"bfloat16": 2, "float32": 4}


def estimate_memory(
    args: LlamaArgs,
    n_params: int,
    dp_shard: int,
    micro_batch: int,
    seq_len: int,
    param_dtype: str,
) -> dict[str, float]:
    """Bytes per rank for the sharded training state plus the largest transient buffers.

    fp32 master weights, gradients and AdamW's two moments are sharded over dp_shard (HSDP
    replicas each hold a full copy of their shard group's state). Activations follow
    Korthikanti et al. (2022) without the attention matrix, which SDPA never materializes:
    ~34 bytes per token per hidden unit per layer in 16-bit, doubled for float32.
    """
    pbytes = BYTES[param_dtype]
    per_block = n_params / max(1, args.n_layers)  # rough: blocks dominate the count
    tokens = micro_batch * seq_len
    return {
        "params": 4 * n_params / dp_shard,
        "grads": 4 * n_params / dp_shard,
        "optimizer": 8 * n_params / dp_shard,
        # One block gathered for compute plus one being prefetched.
        "gathered_params": 2 * per_block * pbytes,
        "activations": 34 * tokens * args.dim * args.n_layers * pbytes / 2,
        # Logits in compute dtype plus their float32 copy and its gradient for the loss.
        "logits": tokens * args.vocab_size * (pbytes + 8),
    }
