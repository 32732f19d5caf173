#!/bin/bash
# A one-node Slurm on this machine, for trying the batch scripts (and for the tests).
#
#   sudo tools/slurm/local_cluster.sh start     # prints the line to paste: export SLURM_CONF=...
#   export SLURM_CONF=/tmp/pf-slurm/slurm.conf
#   sbatch --wait tools/slurm/train_single_gpu.sbatch train.zip --epochs 2
#   sudo tools/slurm/local_cluster.sh stop
#   tools/slurm/local_cluster.sh status         # exit 0 when the node takes jobs
#
# It needs root and the distribution's packages (Debian/Ubuntu:
# apt-get install munge slurmctld slurmd slurm-client).  It touches nothing of a Slurm or
# munge already installed: its own munge key and socket, its own slurm.conf, state and logs,
# all under $PF_SLURM_DIR (default /tmp/pf-slurm).  One node with this machine's CPUs, one
# partition "debug", no time limit; cgroups are not used (proctrack/linuxproc, task/none), so
# --mem and --cpus-per-task are bookkeeping only.

set -euo pipefail

DIR=${PF_SLURM_DIR:-/tmp/pf-slurm}
CONF=$DIR/slurm.conf
NODE=$(hostname -s)

say() { echo "local_cluster.sh: $*" >&2; }

need() {
    if [ "$(id -u)" != 0 ]; then say "run it as root (slurmd starts jobs as their users)"; exit 3; fi
    local missing=()
    for program in munged slurmctld slurmd sbatch scontrol sinfo; do
        command -v "$program" >/dev/null || missing+=("$program")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "not installed: ${missing[*]} (apt-get install munge slurmctld slurmd slurm-client)"
        exit 3
    fi
}

write_config() {
    local cpus memory
    cpus=$(nproc --all)
    memory=$(awk '/MemTotal/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
    cat > "$CONF" <<EOF
# written by local_cluster.sh: a one-node Slurm on $NODE
ClusterName=pf-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldPort=${PF_SLURMCTLD_PORT:-16817}
SlurmdPort=${PF_SLURMD_PORT:-16818}
MinJobAge=600
KillWait=5
NodeName=$NODE CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
    if [ ! -f "$DIR/munge/munge.key" ]; then
        head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
        chmod 400 "$DIR/munge/munge.key"
    fi
    munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/seed"
}

running() {  # the daemon whose pid file is $1 runs
    [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

ready() {  # the node takes jobs
    SLURM_CONF=$CONF sinfo -h -n "$NODE" -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'
}

start() {
    need
    if running "$DIR/slurmctld.pid" && ready; then
        say "already running"
    else
        stop quietly
        write_config
        start_munge
        slurmctld -f "$CONF"
        slurmd -f "$CONF"
        for _ in $(seq 60); do ready && break; sleep 1; done
        if ! ready; then
            say "the node did not come up in 60 s; see $DIR/slurmctld.log and $DIR/slurmd.log"
            exit 1
        fi
    fi
    echo "export SLURM_CONF=$CONF"
}

stop() {
    local pid_file
    for pid_file in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
        if running "$pid_file"; then
            kill "$(cat "$pid_file")"
            for _ in $(seq 20); do running "$pid_file" || break; sleep 0.5; done
        fi
        rm -f "$pid_file"
    done
    # the queue and the jobs' state go with it: the next start is a fresh cluster
    rm -rf "$DIR/state" "$DIR/spool"
    [ "${1:-}" = quietly ] || say "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) ready ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
