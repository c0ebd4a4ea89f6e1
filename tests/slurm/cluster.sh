#!/usr/bin/env bash
# A real Slurm 22.05 cluster on this one machine, for tests: a controller and two compute nodes,
# each in its own network and UTS namespace (own address and hostname), one munged for all.
#   tests/slurm/cluster.sh up      # prints the folder whose bin/ has sbatch, squeue, ... wrappers
#   tests/slurm/cluster.sh down
# Needs root, `ip netns`, nsenter/unshare and Debian's slurmctld slurmd slurm-client munge
# (installed with apt-get when missing). Exit code 3 means "cannot run here" (reason on stderr).
#
# Layout: the bridge lives inside the controller's namespace, so nothing is added to the root
# namespace and no route leads out; every address is in $SUBNET.0/24 and exists only in the
# namespaces created here. Each daemon runs in a private mount namespace too, only to bind a
# generated /etc/hosts (node names -> namespace addresses) over the real one.
# Env: SLURM_TEST_DIR (state folder, default /tmp/fsdp2-slurm), SLURM_TEST_NAME (namespace
# prefix, default fsdp2s), SLURM_TEST_SUBNET (default 10.213.47).
set -euo pipefail

DIR=${SLURM_TEST_DIR:-/tmp/fsdp2-slurm}
NAME=${SLURM_TEST_NAME:-fsdp2s}
SUBNET=${SLURM_TEST_SUBNET:-10.213.47}
NODES=(node1 node2)
CTL=slurmctl
# Every core this process may use. GNU nproc honours OMP_NUM_THREADS and OMP_THREAD_LIMIT,
# which many cluster shells export (=1): unset for the count, or each node gets 1 CPU.
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)

cannot() { echo "cluster.sh: cannot run here: $*" >&2; exit 3; }

# Run a command in a namespace with its own hostname and our /etc/hosts: the way every daemon
# starts. Plain `ip netns exec` remounts /sys and hides the cgroup mounts slurmd 22.05 needs.
in_ns() {  # in_ns NETNS HOSTNAME CMD...
    local ns=$1 host=$2; shift 2
    # exec: started with `&`, the function's subshell becomes the daemon, so $! is its PID.
    exec nsenter --net="/run/netns/$ns" -- unshare --uts --mount -- \
        sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' \
        "$DIR/hosts" "$host" "$@"
}

check_prereqs() {
    [[ $(id -u) == 0 ]] || cannot "needs root (network namespaces, daemons as root)"
    command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null \
        || cannot "ip (iproute2), nsenter and unshare (util-linux) are required"
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
        command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get"
        echo "cluster.sh: installing slurmctld slurmd slurm-client munge" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            slurmctld slurmd slurm-client munge; } >"${TMPDIR:-/tmp}/cluster-apt.log" 2>&1 \
            || cannot "apt-get install of Slurm failed (see ${TMPDIR:-/tmp}/cluster-apt.log)"
    fi
    ip netns add "${NAME}-probe" 2>/dev/null || cannot "ip netns add failed (no CAP_SYS_ADMIN?)"
    ip netns del "${NAME}-probe"
}

write_config() {
    mkdir -p "$DIR"/{munge,run,log,ctld,spool,bin}
    chmod 755 "$DIR" "$DIR/munge"  # munge clients need o+x on every folder above the socket
    local d=$DIR
    while [[ $d != / ]]; do d=$(dirname "$d"); chmod o+x "$d"; done
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 $CTL"
        for i in "${!NODES[@]}"; do echo "$SUBNET.$((i + 11)) ${NODES[$i]}"; done
    } >"$DIR/hosts"
    local nodes_line=""
    for i in "${!NODES[@]}"; do
        nodes_line+="NodeName=${NODES[$i]} NodeAddr=$SUBNET.$((i + 11)) CPUs=$CPUS"
        nodes_line+=" State=UNKNOWN"$'\n'
    done
    cat >"$DIR/slurm.conf" <<CONF
ClusterName=fsdp2test
SlurmctldHost=$CTL($SUBNET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (default 120 s) is also how long a requeued job waits before it may start again.
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=15
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=4
# A requeued job becomes eligible after cred_expire; look at pending jobs every 5 s, not 60.
SchedulerParameters=batch_sched_delay=0,sched_interval=5
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
$nodes_line
PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP \
    OverSubscribe=EXCLUSIVE
CONF
    # Client commands talk to the controller from inside its namespace.
    for cmd in sbatch srun squeue scontrol sinfo scancel sacct; do
        cat >"$DIR/bin/$cmd" <<WRAP
#!/bin/sh
export SLURM_CONF=$DIR/slurm.conf
exec nsenter --net=/run/netns/$NAME-ctl -- $cmd "\$@"
WRAP
        chmod +x "$DIR/bin/$cmd"
    done
}

make_network() {
    ip netns add "$NAME-ctl"
    ip -n "$NAME-ctl" link set lo up
    ip -n "$NAME-ctl" link add br0 type bridge
    ip -n "$NAME-ctl" addr add "$SUBNET.1/24" dev br0
    ip -n "$NAME-ctl" link set br0 up
    for i in "${!NODES[@]}"; do
        local ns="$NAME-${NODES[$i]}"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # Both veth ends are created inside the namespaces: nothing touches the root one.
        ip -n "$NAME-ctl" link add "v${NODES[$i]}" type veth peer name eth0 netns "$ns"
        ip -n "$NAME-ctl" link set "v${NODES[$i]}" master br0 up
        ip -n "$ns" addr add "$SUBNET.$((i + 11))/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

start_daemons() {
    [[ -f $DIR/munge/munge.key ]] || {
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 600 "$DIR/munge/munge.key"
    }
    munged -F --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" </dev/null >>"$DIR/log/munged.out" 2>&1 &
    echo $! >"$DIR/run/pids"
    for _ in $(seq 50); do [[ -S $DIR/munge/munge.socket.2 ]] && break; sleep 0.1; done
    chmod o+rwx "$DIR/munge/munge.socket.2" 2>/dev/null || true

    in_ns "$NAME-ctl" "$CTL" slurmctld -D -i -f "$DIR/slurm.conf" \
        </dev/null >>"$DIR/log/slurmctld.out" 2>&1 &
    echo $! >>"$DIR/run/pids"
    for node in "${NODES[@]}"; do
        mkdir -p "$DIR/spool/$node"
        in_ns "$NAME-$node" "$node" slurmd -D -N "$node" -f "$DIR/slurm.conf" \
            </dev/null >>"$DIR/log/slurmd-$node.out" 2>&1 &
        echo $! >>"$DIR/run/pids"
    done
    # Ready when every node is idle.
    for _ in $(seq 100); do
        local idle
        idle=$(timeout 5 "$DIR/bin/sinfo" -h -o '%t' -N 2>/dev/null | grep -c '^idle' || true)
        if [[ $idle == "${#NODES[@]}" ]]; then
            return 0
        fi
        sleep 0.2
    done
    echo "cluster.sh: nodes not idle after 20 s; logs in $DIR/log" >&2
    timeout 5 "$DIR/bin/sinfo" -N >&2 || true
    return 1
}

down() {
    # Only what `up` started: the PIDs it recorded and the namespaces it created.
    if [[ -f $DIR/run/pids ]]; then
        local pids; pids=$(tac "$DIR/run/pids")
        for pid in $pids; do kill "$pid" 2>/dev/null || true; done
        for _ in $(seq 50); do
            local alive=0
            for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
            [[ $alive == 0 ]] && break
            sleep 0.1
        done
        for pid in $pids; do kill -9 "$pid" 2>/dev/null || true; done
        rm -f "$DIR/run/pids"
    fi
    for ns in "$NAME-ctl" "${NODES[@]/#/$NAME-}"; do
        ip netns del "$ns" 2>/dev/null || true
    done
    # Job state of the last cluster would make the next one start with old jobs.
    rm -rf "$DIR/ctld" "$DIR/spool"
}

case "${1:-}" in
    up)
        check_prereqs
        down
        write_config
        make_network
        if ! start_daemons; then down; exit 1; fi
        echo "$DIR"
        ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
