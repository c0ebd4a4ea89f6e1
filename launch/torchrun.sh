#!/usr/bin/env bash
# One node, any number of processes: one per GPU, or gloo ranks on CPU.
#   NPROC=4 ./launch/torchrun.sh configs/debug.toml --train.steps=100
#
# Optional:
#   NPROC          processes (default: the visible GPUs, or 1 without a GPU)
#   MAX_RESTARTS   times torchrun restarts all ranks after one fails (default 0); each restart
#                  resumes from the latest checkpoint (checkpoint.resume=auto), so set
#                  --checkpoint.interval. A config error is never retried (launch/check.py)
#   TORCHRUN       the torchrun command (default: torchrun from PATH): the python beside it,
#                  PYTHON, checks the config and runs torchrun's agent (launch/agent.py)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the ranks get to save after a stop signal (default
#                  30; torch >= 2.12 reads it, 2.11 always gives 30)
#   FAILURE_GRACE_S seconds the other ranks get to exit after one failed (a hang's timeout, a
#                  crash) before SIGKILL (default 5; torchrun alone waits 30, and so does
#                  torch 2.11): a frozen rank never exits by itself (launch/agent.py)
# Stop: SIGTERM, SIGINT, SIGUSR1, SIGHUP (the terminal closed) or SIGQUIT to this script (it
# becomes torchrun's agent) makes the ranks finish their step, save a checkpoint and exit 0; the
# script then exits 128 + the signal's number (143 for SIGTERM, 130 SIGINT, 138 SIGUSR1, 129
# SIGHUP, 131 SIGQUIT): stopped, neither finished (0) nor failed.
# A rank that stops the run itself (non-finite loss, disk full) ends it with its own line and
# exit status (1; 2 for a config error), with no torchrun report after it.
set -euo pipefail
# No cd: relative paths (the config, data.path, run.output_dir) are the user's, from where the
# script is started. The trainer is found by its path; -P keeps a folder of that name in the
# current directory from shadowing the check's modules.
repo=$(cd "$(dirname "$0")/.." && pwd)

me=torchrun.sh
# Numbers from the environment, checked before anything uses them: one line, instead of a bash
# arithmetic error or torchrun's usage text. The same function is in torchrun.sh, multinode.sh
# and hsdp.sbatch (tests/test_launch.py keeps the copies equal).
check_number() {  # check_number NAME MIN [MAX]: $NAME, if set, is a whole number in MIN..MAX
    local value=${!1:-} max=${3:-999999999} range=">= $2"
    if [[ -z $value || ($value =~ ^(0|[1-9][0-9]{0,8})$ && $value -ge $2 && $value -le $max) ]]; then
        return 0
    fi
    [[ -z ${3:-} ]] || range="in $2..$3"
    echo "$me: $1 must be a whole number $range, got '$value'" >&2
    exit 2
}
check_number NPROC 1
check_number MAX_RESTARTS 0
check_number TORCH_ELASTIC_SHUTDOWN_TIMEOUT 0
check_number FAILURE_GRACE_S 0

TORCHRUN=${TORCHRUN:-torchrun}
torchrun_path=$(command -v "${TORCHRUN%% *}" || true)
if [[ -z $torchrun_path ]]; then
    echo "torchrun.sh: '${TORCHRUN%% *}' not found: activate the environment with torch," \
        "or set TORCHRUN" >&2
    exit 2
fi
PYTHON=${PYTHON:-$(dirname "$torchrun_path")/python}
[[ -x $PYTHON ]] || PYTHON=python3
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
# Share the cores between the processes: torchrun's default of 1 thread each leaves cores idle
# when there are fewer processes than cores, and more threads than cores thrash.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    # The cores this process may use (affinity/cgroup), not OMP_THREAD_LIMIT, which GNU nproc
    # would also honour.
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    OMP_NUM_THREADS=$(( cores / NPROC > 0 ? cores / NPROC : 1 ))
    export OMP_NUM_THREADS
fi

# A config error (or missing data, a run folder in use...): one line, exit status 2, no rank
# started and nothing to retry.
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -P -m launch.check \
    --world-size="$NPROC" "$@" || exit
# A restart gets a fresh rendezvous store: with the store of the first round, gloo dials the
# dead ranks' ports ("Gloo connectFullMesh failed").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# torchrun passes these on to the ranks and waits for them to save; by default it dies of
# SIGUSR1. An older torchrun ignores the variable.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

# torchrun's agent, run by launch/agent.py in the same python: a run a rank stops itself (a
# non-finite loss, a full disk) ends with that rank's line and exits with its status, without
# torchrun's ChildFailedError report after it. -P: nothing of the current directory shadows it.
exec "$PYTHON" -P "$repo/launch/agent.py" --standalone --nproc-per-node="$NPROC" \
    --max-restarts="${MAX_RESTARTS:-0}" "$repo/train.py" "$@"
