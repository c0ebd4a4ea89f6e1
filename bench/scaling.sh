#!/usr/bin/env bash
# The whole FSDP-vs-HSDP study of docs/scaling.md, ~30 minutes on 2 idle cores, as root:
#   sudo bench/scaling.sh
# 1. one 128-token sequence per rank and step, links at 1 Gbit/s   -> docs/scaling.png
# 2. the same with 4 micro-batches per step (4x compute per step)   -> docs/scaling_accum4.png
# 3. control: case 1 with unshaped links, to show the simulated nodes themselves scale
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=outputs/bench/scaling
$PY bench/scaling.py --out $OUT/scaling.json --png docs/scaling.png
$PY bench/scaling.py --grad-accum 4 --steps 10 --warmup 3 \
    --out $OUT/accum4.json --png docs/scaling_accum4.png
$PY bench/scaling.py --rate none --out $OUT/unshaped.json --png $OUT/unshaped.png
