#!/bin/bash
# A one-node Slurm on this machine, for trying the batch scripts (and for the tests).
#
#   tools/slurm/local_cluster.sh start          # prints the line to paste: export SLURM_CONF=...
#   export SLURM_CONF=/tmp/pf-slurm/slurm.conf
#   JOB=$(sbatch --parsable ... tools/slurm/train_single_gpu.sbatch train.zip ...)
#   tools/slurm/local_cluster.sh wait $JOB      # until it ends; its states and pending reasons meanwhile
#   tools/slurm/local_cluster.sh stop
#   tools/slurm/local_cluster.sh status         # exit 0 when the node takes jobs
#
# start and stop need root (slurmd starts jobs as their users): run by another user, the script runs
# itself again with sudo.  It needs the distribution's packages (Debian/Ubuntu:
# apt-get install munge slurmctld slurmd slurm-client).  It touches nothing of a Slurm or
# munge already installed: its own munge key and socket, its own slurm.conf, state and logs,
# all under $PF_SLURM_DIR (default /tmp/pf-slurm).  One node with this machine's CPUs, one
# partition "debug", no time limit; cgroups are not used (proctrack/linuxproc, task/none), so
# --mem and --cpus-per-task are bookkeeping only.
#
# wait JOB [--requeued] follows a job (or every task of an array) until it ends, printing each change
# of state with Slurm's reason; exit 0 when every task COMPLETED, 1 otherwise.  A job that cannot start
# on this one node (it asks for more nodes, CPUs or memory than the node has) is reported at once,
# with its reason, instead of waiting for ever.  With --requeued: until the job is back in the queue
# after a requeue (exit 1 if it ends instead).

set -euo pipefail

DIR=${PF_SLURM_DIR:-/tmp/pf-slurm}
CONF=$DIR/slurm.conf
NODE=$(hostname -s)

say() { echo "local_cluster.sh: $*" >&2; }

as_root() {  # run this script again as root, with sudo, when it is not (start and stop need root)
    [ "$(id -u)" = 0 ] && return 0
    if ! command -v sudo >/dev/null; then
        say "$1 needs root (slurmd starts jobs as their users): run it as root, or install sudo"
        exit 3
    fi
    say "$1 needs root: running it with sudo"
    exec sudo env PF_SLURM_DIR="$DIR" PF_SLURMCTLD_PORT="${PF_SLURMCTLD_PORT:-16817}" \
        PF_SLURMD_PORT="${PF_SLURMD_PORT:-16818}" bash "$(readlink -f "$0")" "$@"
}

need() {
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

# Pending reasons that this one node never clears by itself: the job asks for more than it has.
NEVER_HERE='PartitionConfig|PartitionNodeLimit|PartitionTimeLimit|BadConstraints'

states() {  # one line per task of job $1: ID STATE REASON RESTARTS EXITCODE
    SLURM_CONF=$CONF scontrol show job -o "$1" | awk '{
        id = ""; task = ""; state = ""; reason = ""; restarts = ""; code = ""
        for (i = 1; i <= NF; i++) {
            split($i, kv, "=")
            if (kv[1] == "JobId") id = kv[2]
            else if (kv[1] == "ArrayJobId") id = kv[2]
            else if (kv[1] == "ArrayTaskId") task = "_" kv[2]
            else if (kv[1] == "JobState") state = kv[2]
            else if (kv[1] == "Reason") reason = kv[2]
            else if (kv[1] == "Restarts") restarts = kv[2]
            else if (kv[1] == "ExitCode") code = kv[2]
        }
        print id task, state, reason, restarts, code
    }'
}

wait_job() {  # wait JOB [--requeued]: see the top of this file
    local job=${1:?usage: $0 wait JOBID [--requeued]} until=${2:-} shown="" now id state reason restarts code
    local running ended ok back
    if [ -n "$until" ] && [ "$until" != --requeued ]; then echo "usage: $0 wait JOBID [--requeued]" >&2; exit 2; fi
    while true; do
        now=$(states "$job") || { say "no job $job (see squeue)"; exit 1; }
        running=0 ended=0 ok=1 back=1
        while read -r id state reason restarts code; do
            case $state in
                PENDING) [ "$restarts" -ge 1 ] || back=0 ;;
                *) back=0 ;;
            esac
            case $state in
                COMPLETED) ended=$((ended + 1)) ;;
                FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE)
                    ended=$((ended + 1)); ok=0 ;;
                *) running=$((running + 1)) ;;
            esac
            if [ "$state" = PENDING ] && [[ $reason =~ ^($NEVER_HERE)$ ]]; then
                say "job $id cannot start on this one-node cluster: PENDING ($reason): it asks for more nodes," \
                    "CPUs, memory or time than the node has; override those on the sbatch line" \
                    "(tools/slurm/README.md shows how), and scancel $job"
                exit 1
            fi
        done <<< "$now"
        if [ "$now" != "$shown" ]; then  # print what changed
            while read -r id state reason restarts code; do
                if [ "$state" = PENDING ]; then
                    echo "job $id: $state ($reason), restarts $restarts"
                elif [ "$running" = 0 ]; then
                    echo "job $id: $state, restarts $restarts, exit code $code"
                else
                    echo "job $id: $state, restarts $restarts"
                fi
            done < <(comm -13 <(sort <<< "$shown") <(sort <<< "$now"))
            shown=$now
        fi
        if [ "$until" = --requeued ]; then
            [ "$back" = 1 ] && exit 0
            [ "$running" = 0 ] && { say "job $job ended without being requeued"; exit 1; }
        elif [ "$running" = 0 ]; then
            [ "$ok" = 1 ] && exit 0
            exit 1
        fi
        sleep 1
    done
}

case "${1:-}" in
    start) as_root "$@"; start ;;
    stop) as_root "$@"; stop ;;
    status) ready ;;
    wait) shift; wait_job "$@" ;;
    *) echo "usage: $0 start|stop|status|wait JOBID [--requeued]" >&2; exit 2 ;;
esac
