#!/usr/bin/env bash
# The GPU issue's prepared checks for one device lease (about 15 minutes of GPU time, the
# machine's start included), each part one call of the device tool with its own budget, every
# case under its own time limit, so a failure or a hang costs only that case:
#
#   bash bench/gpu_lease.sh part1 [BUDGET_S]   # side by side with torchtitan: 8B blocks x 8
#                                              # bf16 (FSDP2's hooks, and compile.fsdp=graph as
#                                              # ours-8b8-x) and fp8 (graph: ours-8b8-fp8-x),
#                                              # 1B bf16 (.gpu/titan/run.sh)
#   bash bench/gpu_lease.sh part2 [BUDGET_S]   # tests/test_gpu.py, Muon's optimizer step
#                                              # alone, then bench/gpu.py: graph FSDP (CUDA
#                                              # graphs too), document masking (profiled;
#                                              # varlen too), chunked loss, Muon, LoRA in fp8
#                                              # (P2_SUITES, P2_CASES)
#   bash bench/gpu_lease.sh alloc [BUDGET_S]   # 8B blocks x 8 bf16, both trainers, under
#                                              # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#                                              # (part1 runs them with it unset)
#   bash bench/gpu_lease.sh smoke              # CPU: both harnesses end to end on the debug model
#
# From the project root, with ../shared/titan-side-by-side copied into .gpu/ as its README says
# (carry `.gpu`). Results land in $OUT (the device tool's folder; /tmp/gpu-lease-out elsewhere):
# part1: summary.{md,json}, kernels.md (each profiled step's kernel table), logs.tar.gz;
# part2: gpu.json, gpu.md, part2-logs.tar.gz, pytest.log.
set -uo pipefail
part=${1:?part1, part2, alloc or smoke}
budget=${2:-420}
OUT=${OUT:-/tmp/gpu-lease-out}
PY=${PY:-python3}
SITE=/tmp/site
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $(( start + budget - $(date +%s) )); }

wheels() {  # torchao and torchdata are not on the GPU machine: the carried wheels
  [ -d "$SITE/torchao" ] || "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl || echo "pip install FAILED"
}

kernel_tables() {  # WORK: one table per profiled step, then the logs without the traces
  local work=$1 trace
  : > "$OUT/kernels.md"
  for trace in $(find "$work" -name '*.json' \( -path '*profile_traces*' -o -path '*/profile/*' \) \
                   | sort); do
    { echo "## ${trace#"$work"/}"; echo '```'; timeout 60 "$PY" .gpu/titan/kernel_table.py \
        "$trace" 25; echo '```'; echo; } >> "$OUT/kernels.md" 2>&1
  done
  tar czf "$OUT/logs.tar.gz" -C "$work" --exclude='*trace*.json' --exclude='*/profile/*' --exclude='*.pickle' \
    logs titan ours 2>/dev/null
}

case "$part" in
  part1)
    # 30 steps, medians after 10; the last step profiled in both trainers (as at b141f65).
    work=/tmp/titan-gpu-work
    WORK=$work OUT_DIR=$OUT BUDGET_S=$(( budget - 40 )) CASE_MAX_S=150 MIN_CASE_S=60 \
      STEPS=30 WARMUP=10 \
      TITAN_EXTRA="--profiling.enable_profiling --profiling.profile_freq=30 --profiling.profiler_warmup=0" \
      OURS_EXTRA="--metrics.profile_step=30 --metrics.memory_snapshot_step=30 ${OURS_EXTRA:-}" \
      OURS_X=${OURS_X:---compile.fsdp=graph} \
      bash .gpu/titan/run.sh ${CASES:-titan-8b8 ours-8b8 ours-8b8-x ours-8b8-fp8 titan-1b ours-1b \
        titan-8b8-fp8 ours-8b8-fp8-x}
    kernel_tables "$work"
    ;;
  alloc)
    # The allocator lever (issue 59): the same pair as part1's first two, expandable segments
    # on; ours snapshots its allocator after the last step (memory/*.txt in logs.tar.gz).
    work=/tmp/titan-gpu-alloc
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      WORK=$work OUT_DIR=$OUT BUDGET_S=$(( budget - 40 )) CASE_MAX_S=150 MIN_CASE_S=60 \
      STEPS=30 WARMUP=10 OURS_EXTRA="--metrics.memory_snapshot_step=30 ${OURS_EXTRA:-}" \
      bash .gpu/titan/run.sh ${CASES:-titan-8b8 ours-8b8}
    tar czf "$OUT/alloc-logs.tar.gz" -C "$work" --exclude='*.pickle' . 2>/dev/null
    ;;
  part2|smoke)
    wheels
    export PYTHONPATH=$SITE
    work=/tmp/gpu-part2
    rm -rf "$work"
    smoke=(); [ "$part" = smoke ] && smoke=(--smoke) && budget=900
    # tests/test_gpu.py first (~210 s on an H100): a change it checks on CUDA outranks a number.
    if [ "$part" = part2 ] && [ "${P2_PYTEST:-1}" = 1 ]; then
      timeout "${P2_PYTEST_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -n 0 -rfEs \
        tests/test_gpu.py > "$OUT/pytest.log" 2>&1
      echo "pytest rc=$? at $(( $(date +%s) - start )) s"; tail -5 "$OUT/pytest.log"
    fi
    # Muon's optimizer step alone on the 1B (issue 59, part 2): what it adds to a step.
    if [ "$part" = part2 ]; then
      timeout 90 "$PY" bench/muon.py --parts step --device cuda --step-flavor 1B \
        --step-rounds 2 --out "$work/muon_step.json" > "$OUT/muon_step.md" 2>&1
      echo "bench/muon.py step rc=$? at $(( $(date +%s) - start )) s"
    fi
    # The 1B compiled baseline runs once and serves documents, loss and Muon (same command).
    # Last, while budget lasts: the MoE at ep 1 compiled in whole blocks and in EP's regions.
    # P2_SUITES / P2_CASES choose others (bench/gpu.py --suite / --cases).
    timeout $(( $(left) - 20 )) "$PY" bench/gpu.py \
      --suite ${P2_SUITES:-graph-fsdp documents loss muon lora-fp8 moe} \
      --cases "${P2_CASES:-^(graph-fsdp|documents|loss|lora-fp8)|muon: bf16 compile (adamw|muon)$|moe: bf16 compile}" \
      --steps 20 --warmup 10 --interval 2 --profile "${smoke[@]}" \
      --budget-s $(( $(left) - 60 )) --case-timeout 110 --min-case-s 50 \
      --out "$work/gpu.json" > "$OUT/gpu.md" 2> "$OUT/gpu.err"
    echo "bench/gpu.py rc=$? at $(( $(date +%s) - start )) s"
    cp "$work/gpu.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/part2-logs.tar.gz" -C "$work" --exclude='*/profile/*' . 2>/dev/null
    cat "$OUT/gpu.md"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
echo "$part: $(( $(date +%s) - start )) s"
