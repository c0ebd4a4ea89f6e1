#!/usr/bin/env bash
# One node, any number of processes: one per GPU, or gloo ranks on CPU.
#   NPROC=4 ./launch/torchrun.sh configs/debug.toml --train.steps=100
# NPROC defaults to the number of visible GPUs, or 1 without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${NPROC:-}" ]]; then
    NPROC=$(python -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
# Share the cores between the processes: torchrun's default of 1 thread each leaves cores idle
# when there are fewer processes than cores, and more threads than cores thrash.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    OMP_NUM_THREADS=$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))
    export OMP_NUM_THREADS
fi

exec torchrun --standalone --nproc-per-node="$NPROC" train.py "$@"
