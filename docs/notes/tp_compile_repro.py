"""torch.compile drops the gradient of an AsyncCollectiveTensor input (torch 2.13, CPU, gloo).

    python docs/notes/tp_compile_repro.py   # spawns 2 ranks

RowwiseParallel's reduce-scatter is async: `to_local()` hands on an AsyncCollectiveTensor. A
compiled function that receives it waits on it before tracing, and the waited tensor does
not require grad (since pytorch/pytorch#179849; fix proposed in #191113), so no gradient goes
back to the embedding: eager prints its grad norm, the compiled consumer a crash in the
DTensor backward that receives nothing (inside FSDP the gradient is silently wrong instead).
parallel/workarounds.py works around it (workaround 1: the embedding's output copied into a
plain tensor); tests/test_workarounds.py reproduces it on the trainer's own model.

Not reproduced here (tests/test_workarounds.py does, with a one-block Llama): a
checkpoint_wrapper'd block under TP, compiled, fails at its first forward with
"expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh" (workaround 2).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    RowwiseParallel,
    parallelize_module,
)


def embedding_grad(mesh, compiled: bool) -> str:
    torch.manual_seed(0)
    style = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    emb = parallelize_module(nn.Embedding(8, 4), mesh, style)
    scale = torch.ones(4, requires_grad=True)  # so the loss needs a backward either way

    def consumer(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    fn = torch.compile(consumer, backend="aot_eager") if compiled else consumer
    try:
        fn(emb(torch.arange(8).view(1, 8))).sum().backward()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:80]}"
    grad = emb.weight.grad
    return "None" if grad is None else f"{grad.full_tensor().norm().item():.4f}"


def main(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    eager, compiled = embedding_grad(mesh, False), embedding_grad(mesh, True)
    if rank == 0:
        print(f"torch {torch.__version__}")
        print(f"embedding grad norm: eager {eager}, compiled consumer {compiled}")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(main, nprocs=2)
