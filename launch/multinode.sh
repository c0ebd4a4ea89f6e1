#!/usr/bin/env bash
# Several nodes without Slurm: run the same command on every node (see RDZV_BACKEND for NODE_RANK).
#   NNODES=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC=8 \
#       ./launch/multinode.sh configs/llama3_8b.toml --parallel.mesh=auto
# MASTER_ADDR:MASTER_PORT is the rendezvous endpoint, an address of node 0 every node can reach.
# With parallel.mesh=auto the run is HSDP: dp_replicate = NNODES, dp_shard = NPROC.
#
# Elastic: NNODES=MIN:MAX (say 1:2) starts with up to MAX nodes and goes on with as few as MIN.
# When a node is lost, torchrun on each node that remains restarts its workers (MAX_RESTARTS
# must be > 0) as a smaller world, which resumes from the newest checkpoint with the same global
# batch and more grad accumulation (launch/elastic.py; docs/launch.md, "Losing a node"). Needs
# RDZV_BACKEND=c10d, parallel.mesh=auto (or parallel.dp_replicate=-1), and the rendezvous
# endpoint's node must survive: it hosts the store.
#
# Optional:
#   NPROC          processes per node (default: the visible GPUs, or 1 without a GPU)
#   RDZV_BACKEND   c10d (default): nodes join in any order and ranks are assigned at
#                  rendezvous, NODE_RANK is not needed; static: NODE_RANK (0..NNODES-1) fixes
#                  the ranks and node 0 hosts the store at MASTER_ADDR:MASTER_PORT
#   RDZV_ID        job id shared by the nodes of one run (default: fsdp2)
#   RDZV_CONF      torchrun's --rdzv-conf, e.g. last_call_timeout=5,join_timeout=600 (default:
#                  torchrun's; see docs/launch.md for the settings that make a restart fast)
#   MAX_RESTARTS   times torchrun restarts all workers after a failure (default 0); each restart
#                  resumes from the latest checkpoint (checkpoint.resume=auto), so set
#                  --checkpoint.interval
#   TORCHRUN       the torchrun command (default: torchrun from PATH): the python beside it,
#                  PYTHON, checks the config and runs torchrun's agent (launch/agent.py)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the ranks get to save after a stop signal (default
#                  30; torch >= 2.12 reads it, 2.11 always gives 30)
# Fault-tolerant replica groups (FT=1; docs/launch.md, "Replica groups that survive a lost
# node"): each of the NNODES nodes is a replica group of its own, a torchrun job with its own
# world, and the groups meet through torchft's quorum (pip install -e ".[ft]"): a lost node stops
# no other, and comes back (MAX_RESTARTS, or the same command again) loading the live state from
# a peer. NODE_RANK (0..NNODES-1) is this node's group.
#   TORCHFT_LIGHTHOUSE  the lighthouse's address; unset, node 0 starts torchft_lighthouse at
#                  http://$MASTER_ADDR:$LIGHTHOUSE_PORT (default 29510), living as long as node
#                  0's launcher (for a run that must survive node 0, start it on a host of its own)
#   FT_MIN_GROUPS  fewest groups a step commits with (default 1); LIGHTHOUSE_ARGS: more options
#                  for torchft_lighthouse (e.g. --heartbeat_timeout_ms 2000)
# A config error (or missing data, a wrong *_SOCKET_IFNAME...) ends every node at once with one
# line and exit status 2, before torchrun starts: it is not retried.
# Stop: SIGTERM, SIGINT, SIGUSR1, SIGHUP or SIGQUIT to this script (it becomes torchrun's
# agent), on every node or on one only (a node drained), makes every rank finish the same step,
# save a checkpoint and exit; every node's launcher then exits 128 + the signal's number (143
# for SIGTERM, 129 SIGHUP), the others saying the signal went to another node.
set -euo pipefail
# No cd: relative paths (the config, data.path, run.output_dir) are the user's, from where the
# script is started. The trainer is found by its path; -P keeps a folder of that name in the
# current directory from shadowing the check's modules.
repo=$(cd "$(dirname "$0")/.." && pwd)

: "${NNODES:?set NNODES (number of nodes)}"
: "${MASTER_ADDR:?set MASTER_ADDR (address of node 0, reachable from every node)}"
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}

me=multinode.sh
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
# NNODES=MIN:MAX: an elastic range (torchrun --nnodes=MIN:MAX).
if [[ ${NNODES:-} == *:* ]]; then
    MIN_NNODES=${NNODES%%:*} MAX_NNODES=${NNODES#*:}
    check_number MIN_NNODES 1
    check_number MAX_NNODES 1
    if (( MIN_NNODES > MAX_NNODES )) || [[ $RDZV_BACKEND != c10d ]]; then
        echo "$me: NNODES=$NNODES must be MIN:MAX with MIN <= MAX, and RDZV_BACKEND=c10d" \
            "(a static rendezvous has a fixed number of nodes)" >&2
        exit 2
    fi
else
    check_number NNODES 1
    MIN_NNODES=$NNODES MAX_NNODES=$NNODES
fi
check_number NPROC 1
check_number MASTER_PORT 1 65535
check_number MAX_RESTARTS 0
check_number TORCH_ELASTIC_SHUTDOWN_TIMEOUT 0
if [[ $RDZV_BACKEND == static ]]; then check_number NODE_RANK 0 $(( MAX_NNODES - 1 )); fi
check_number FT 0 1
if [[ ${FT:-0} == 1 ]]; then
    if (( MIN_NNODES < MAX_NNODES )) || [[ -z ${NODE_RANK:-} ]]; then
        echo "$me: FT=1 needs a fixed NNODES (the replica groups) and NODE_RANK (this node's" \
            "group, 0..NNODES-1)" >&2
        exit 2
    fi
    check_number NODE_RANK 0 $(( NNODES - 1 ))
    check_number FT_MIN_GROUPS 1 "$NNODES"
    check_number LIGHTHOUSE_PORT 1 65535
fi
if (( MIN_NNODES < MAX_NNODES && ${MAX_RESTARTS:-0} == 0 )); then
    echo "$me: warning: NNODES=$NNODES with MAX_RESTARTS=0: a lost node ends the run instead" \
        "of going on with the nodes left (set MAX_RESTARTS)" >&2
fi

TORCHRUN=${TORCHRUN:-torchrun}
torchrun_path=$(command -v "${TORCHRUN%% *}" || true)
if [[ -z $torchrun_path ]]; then
    echo "multinode.sh: '${TORCHRUN%% *}' not found: activate the environment with torch," \
        "or set TORCHRUN" >&2
    exit 2
fi
PYTHON=${PYTHON:-$(dirname "$torchrun_path")/python}
[[ -x $PYTHON ]] || PYTHON=python3
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
# See torchrun.sh: share this node's cores between its processes.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    # The cores this process may use (affinity/cgroup), not OMP_THREAD_LIMIT, which GNU nproc
    # would also honour.
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    OMP_NUM_THREADS=$(( cores / NPROC > 0 ? cores / NPROC : 1 ))
    export OMP_NUM_THREADS
fi

# After a restart (MAX_RESTARTS), torchrun's c10d rendezvous hands the new workers the store
# of the first round, stale keys included: gloo then dials the dead workers' ports. With this
# set, each round gets a fresh store hosted by its rank 0.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# torchrun passes these on to the ranks and waits for them to save; by default it dies of
# SIGUSR1. An older torchrun ignores the variable.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

case "$RDZV_BACKEND" in
    c10d) rdzv=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
                --rdzv-id="${RDZV_ID:-fsdp2}" ${RDZV_CONF:+--rdzv-conf="$RDZV_CONF"}) ;;
    static) rdzv=(--node-rank="${NODE_RANK:?set NODE_RANK (0..NNODES-1) for static rendezvous}"
                  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT") ;;
    *) echo "RDZV_BACKEND must be c10d or static, got '$RDZV_BACKEND'" >&2; exit 2 ;;
esac

if [[ ${FT:-0} == 1 ]]; then
    ft=(--ft.enabled=true --ft.groups="$NNODES" --ft.group="$NODE_RANK"
        --ft.min_groups="${FT_MIN_GROUPS:-1}")
    if [[ -z ${TORCHFT_LIGHTHOUSE:-} && $NODE_RANK == 0 ]]; then
        lighthouse=$(dirname "$torchrun_path")/torchft_lighthouse
        [[ -x $lighthouse ]] || lighthouse=$(command -v torchft_lighthouse || true)
        if [[ -z $lighthouse ]]; then
            echo "$me: FT=1: torchft_lighthouse not found: pip install -e \".[ft]\"" >&2
            exit 2
        fi
        # It lives as long as this launcher (exec keeps the PID): a watcher ends it after.
        # shellcheck disable=SC2086
        # Warnings only: its info lines are a few per step (RUST_LOG=info shows them).
        RUST_LOG=${RUST_LOG:-warn} "$lighthouse" --min_replicas "${FT_MIN_GROUPS:-1}" \
            --bind "[::]:${LIGHTHOUSE_PORT:-29510}" ${LIGHTHOUSE_ARGS:-} &
        lighthouse_pid=$! launcher=$$
        (while kill -0 "$launcher" 2>/dev/null; do sleep 1; done; kill "$lighthouse_pid") \
            >/dev/null 2>&1 &
    fi
    export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-http://$MASTER_ADDR:${LIGHTHOUSE_PORT:-29510}}
    # One group per node, a world of its own: no rendezvous between the nodes.
    PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -P -m launch.check \
        --world-size="$NPROC" "$@" "${ft[@]}" || exit
    # torchrun's agent as torchrun.sh runs it (launch/agent.py): a stop is one line and
    # 128 + the signal, a rank's own error its line and status.
    exec "$PYTHON" -P "$repo/launch/agent.py" --standalone --nproc-per-node="$NPROC" \
        --max-restarts="${MAX_RESTARTS:-0}" "$repo/train.py" "$@" "${ft[@]}"
fi

# Deterministic failures end here, on every node, before any rank starts: for the largest world
# (a smaller one after a lost node is checked again by the restarted ranks, launch/elastic.py;
# the node counts in the range that could not hold the run are a warning now).
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -P -m launch.check \
    --world-size=$(( MAX_NNODES * NPROC )) --nnodes="$MAX_NNODES" --local-world-size="$NPROC" \
    --min-nnodes="$MIN_NNODES" "$@" || exit

# torchrun's agent through launch/agent.py, as torchrun.sh and hsdp.sbatch run it: a stop is
# one line and 128 + the signal on every node, the signaled ones and those whose ranks stopped
# with them. --keep-failure-report: a failed rank still gets torchrun's report (only rank 0
# logs why a run stopped; the other nodes would end with nothing said).
exec "$PYTHON" -P "$repo/launch/agent.py" --keep-failure-report --nnodes="$NNODES" \
    --nproc-per-node="$NPROC" "${rdzv[@]}" --max-restarts="${MAX_RESTARTS:-0}" \
    "$repo/train.py" "$@"
