#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to try scripts/pretrain_slurm.sbatch on a laptop and for
# the test tier marked `slurm` (tests/test_slurm.py). Needs root (it installs packages and starts
# daemons); Debian/Ubuntu's packages.
#
#   sudo bash scripts/slurm_local_cluster.sh start   # install if missing, configure, start; idempotent
#   export SLURM_CONF=/tmp/megatron_zero_slurm/slurm.conf   # what the commands below need (printed)
#   sbatch --nodes 1 --ntasks-per-node 4 scripts/pretrain_slurm.sbatch <flags>
#   sudo bash scripts/slurm_local_cluster.sh stop    # stop the daemons this script started (munged too)
#
# The cluster's files live in SLURM_LOCAL_DIR (default /tmp/megatron_zero_slurm): its own slurm.conf,
# so an installed cluster's /etc/slurm is never touched. The node declares SLURM_LOCAL_CPUS CPUs
# (default 8, more than a small machine has) and slurmd accepts that (SlurmdParameters=config_overrides).
# Every step is bounded in time (apt 300 s, daemons 30 s); exit status 0 only when `sinfo` shows the
# node idle. munge uses the system's key (/etc/munge/munge.key, created if missing).
set -uo pipefail
dir="${SLURM_LOCAL_DIR:-/tmp/megatron_zero_slurm}"
conf="$dir/slurm.conf"
node="$(hostname -s)"
say() { echo "slurm_local_cluster: $*" >&2; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && return 0
    [ "$(id -u)" = 0 ] || { say "SLURM is not installed and installing it needs root"; return 1; }
    command -v apt-get >/dev/null || { say "SLURM is not installed and there is no apt-get to install it"; return 1; }
    say "installing slurmctld slurmd slurm-client munge (apt-get, at most 300 s)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 bash -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge' >"$dir/apt.log" 2>&1 \
        || { say "apt-get could not install SLURM (see $dir/apt.log)"; return 1; }
}

write_conf() {
    local cpus="${SLURM_LOCAL_CPUS:-8}" mem
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    mkdir -p "$dir/ctld" "$dir/d" "$dir/log"
    cat >"$conf" <<CONF
ClusterName=megatron_zero_local
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=${SLURM_LOCAL_PORT:-6817}
SlurmdPort=$(( ${SLURM_LOCAL_PORT:-6817} + 1 ))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=3600
KillWait=30
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

start_munge() {
    [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null >/dev/null 2>&1 && return 0
    [ -f /etc/munge/munge.key ] || mungekey --create --keyfile /etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key 2>/dev/null; chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- munged || { say "munged would not start"; return 1; }
    touch "$dir/munged.ours"  # stop ends only a munged this script started
    timeout 10 bash -c 'until munge -n </dev/null >/dev/null 2>&1; do sleep 0.5; done' \
        || { say "munge does not answer"; return 1; }
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    mkdir -p "$dir"
    install_packages || return 1
    export SLURM_CONF="$conf"
    if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" && sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
        say "already running; export SLURM_CONF=$conf"
        return 0
    fi
    write_conf
    start_munge || return 1
    alive "$dir/slurmctld.pid" || slurmctld -f "$conf" || { say "slurmctld would not start (see $dir/log)"; return 1; }
    alive "$dir/slurmd.pid" || slurmd -f "$conf" || { say "slurmd would not start (see $dir/log)"; return 1; }
    if ! timeout 30 bash -c "until sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mix|alloc'; do sleep 1; done"; then
        scontrol update nodename="$node" state=resume >/dev/null 2>&1
        timeout 15 bash -c "until sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mix|alloc'; do sleep 1; done" \
            || { say "the node did not come up: $(sinfo -h -N -o '%N %T %E' 2>&1) (see $dir/log)"; return 1; }
    fi
    say "one-node cluster up ($node, ${SLURM_LOCAL_CPUS:-8} CPUs declared); export SLURM_CONF=$conf"
}

stop() {
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
        alive "$pidfile" && kill "$(cat "$pidfile")"
    done
    if [ -f "$dir/munged.ours" ] && [ -f /run/munge/munged.pid ]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null
        rm -f "$dir/munged.ours"
    fi
    say "stopped slurmd and slurmctld (and munged, if this script started it)"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    *) say "usage: $0 start|stop"; exit 2 ;;
esac
