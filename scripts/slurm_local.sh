#!/usr/bin/env bash
# slurm_local.sh -- a real, single-machine SLURM cluster for tests, CI and demos.
#
# What: installs Debian's `slurm-wlm` + `munge` (if missing), writes a minimal slurm.conf
# under STATE_DIR and starts munged, slurmctld and slurmd directly (no systemd needed),
# so that `sbatch`/`srun`/submitit/hydra-submitit-launcher work against a genuine scheduler.
# Why: dpt's SLURM code paths (submitit executors, SLURM_* env based rank discovery) are only
# trustworthy if they are exercised against real slurmd-launched tasks, not mocks.
#
# Usage (as root, Debian/Ubuntu with apt):
#   eval "$(scripts/slurm_local.sh start [STATE_DIR])"   # default STATE_DIR=/tmp/dpt-slurm
#   sinfo; sbatch --wrap hostname; ...
#   scripts/slurm_local.sh status [STATE_DIR]
#   scripts/slurm_local.sh stop   [STATE_DIR]
# `start` prints (on stdout, progress goes to stderr) the lines a caller must apply:
#   export SLURM_CONF=STATE_DIR/slurm.conf
#   export PATH=<repo>/scripts/sacct_shim:$PATH
# They are also written to STATE_DIR/env.sh.
#
# Design notes / pitfalls:
# * Config location: slurm.conf lives in STATE_DIR and every client/daemon finds it through
#   SLURM_CONF. Jobs see it too: sbatch exports the submitter's environment (SLURM_CONF
#   included) and slurmd additionally sets SLURM_CONF for the tasks it launches, so `srun`
#   inside a batch script works. As a convenience for humans who did not `eval` the output,
#   /etc/slurm/slurm.conf is made a symlink to it *only if no such file exists*; `stop`
#   removes that symlink again if it still points into STATE_DIR.
# * No accounting daemon: real `sacct` fails ("accounting storage is disabled"), and submitit
#   polls `sacct -o JobID,State,NodeList --parsable2 -j ID...` to learn how a job ended.
#   scripts/sacct_shim/sacct answers that query from `squeue -t all`; ended jobs stay visible
#   for MinJobAge seconds (set to 3600 below). Put the shim first on PATH.
# * The node advertises DPT_SLURM_CPUS CPUs (default 8) regardless of the real core count
#   (SlurmdParameters=config_overrides), otherwise multi-task jobs stay PENDING on a 2-core box.
# * One cluster per machine: the daemons use the default ports 6817/6818 (override with
#   DPT_SLURM_CTLD_PORT / DPT_SLURM_SLURMD_PORT) and the system munge socket.
# * Package install never starts the Debian service scripts: a temporary
#   /usr/sbin/policy-rc.d (exit 101) is put in place; a pre-existing one is restored after.
#   If `apt-get install` fails (e.g. empty package lists on a fresh machine) it runs
#   `apt-get update` once and retries. apt output goes to /tmp/dpt-slurm-apt.log.
# * `start` is idempotent (prints the env lines if the cluster is already up); on failure it
#   prints the daemon log tails, stops what it started and exits 1. `stop` cancels remaining
#   jobs (so no slurmstepd/job processes outlive the daemons), then stops slurmd, slurmctld
#   (takes ~5 s) and munged (only if this script started it) by pid: SIGTERM, SIGKILL after
#   15 s. Controller state (job records, job id counter) is kept in STATE_DIR across restarts.
# * Keep STATE_DIR short: slurmd puts unix sockets in STATE_DIR/spool (108-byte path limit).
#
# Env knobs: DPT_SLURM_CPUS (8), DPT_SLURM_CTLD_PORT (6817), DPT_SLURM_SLURMD_PORT (6818),
#            DPT_SLURM_START_TIMEOUT (30 seconds).
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SHIM_DIR="$SCRIPT_DIR/sacct_shim"
DEFAULT_STATE_DIR=/tmp/dpt-slurm
CPUS="${DPT_SLURM_CPUS:-8}"
CTLD_PORT="${DPT_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT="${DPT_SLURM_SLURMD_PORT:-6818}"
START_TIMEOUT="${DPT_SLURM_START_TIMEOUT:-30}"
STOP_TIMEOUT=15
PACKAGES=(slurm-wlm munge)

log() { echo "[slurm_local] $*" >&2; }
die() {
    log "ERROR: $*"
    exit 1
}

usage() {
    cat >&2 <<EOF
usage: $0 {start|stop|status} [STATE_DIR]   (default STATE_DIR: $DEFAULT_STATE_DIR)
EOF
    exit 2
}

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
pid_alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

read_pid() { # read_pid FILE -> prints pid if file exists and process is alive
    local pid
    [[ -f "$1" ]] || return 1
    pid="$(tr -dc '0-9' <"$1")"
    pid_alive "$pid" || return 1
    echo "$pid"
}

tail_logs() {
    local f
    for f in "$STATE_DIR/log/slurmctld.log" "$STATE_DIR/log/slurmd.log" /var/log/munge/munged.log; do
        if [[ -f "$f" ]]; then
            log "---- last lines of $f ----"
            tail -n 15 "$f" >&2 || true
        fi
    done
}

have_binaries() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null
}

# ---------------------------------------------------------------------------------------------
# install
# ---------------------------------------------------------------------------------------------
POLICY=/usr/sbin/policy-rc.d
POLICY_BACKUP=""
POLICY_CREATED=0

restore_policy() {
    if [[ -n "$POLICY_BACKUP" ]]; then
        mv -f "$POLICY_BACKUP" "$POLICY"
        POLICY_BACKUP=""
    elif [[ "$POLICY_CREATED" == 1 ]]; then
        rm -f "$POLICY"
    fi
    POLICY_CREATED=0
}

install_packages() {
    if have_binaries; then
        return 0
    fi
    [[ "$(id -u)" == 0 ]] || die "slurm/munge not installed and not running as root (need apt-get)"
    command -v apt-get >/dev/null || die "slurm/munge not installed and apt-get is unavailable"
    log "installing ${PACKAGES[*]} (apt-get) ..."
    # keep the packages' init scripts from starting daemons with the default config
    if [[ -e "$POLICY" ]]; then
        POLICY_BACKUP="$(mktemp /usr/sbin/.policy-rc.d.dpt-backup.XXXXXX)"
        cp -p "$POLICY" "$POLICY_BACKUP"
    fi
    POLICY_CREATED=1
    trap restore_policy EXIT
    printf '#!/bin/sh\nexit 101\n' >"$POLICY"
    chmod 755 "$POLICY"
    export DEBIAN_FRONTEND=noninteractive
    local apt_opts=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confold)
    if ! apt-get install "${apt_opts[@]}" "${PACKAGES[@]}" >"/tmp/dpt-slurm-apt.log" 2>&1; then
        log "apt-get install failed, running apt-get update and retrying"
        apt-get update -q >>"/tmp/dpt-slurm-apt.log" 2>&1 ||
            log "apt-get update failed (see /tmp/dpt-slurm-apt.log)"
        apt-get install "${apt_opts[@]}" "${PACKAGES[@]}" >>"/tmp/dpt-slurm-apt.log" 2>&1 || {
            tail -n 30 /tmp/dpt-slurm-apt.log >&2
            die "apt-get install ${PACKAGES[*]} failed (full log: /tmp/dpt-slurm-apt.log)"
        }
    fi
    restore_policy
    trap - EXIT
    have_binaries || die "packages installed but slurmctld/slurmd/sbatch/munged not on PATH"
}

# ---------------------------------------------------------------------------------------------
# munge
# ---------------------------------------------------------------------------------------------
munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_works; then
        log "munged already running, reusing it"
        return 0
    fi
    id munge >/dev/null 2>&1 || die "user 'munge' does not exist (munge package broken?)"
    install -d -o munge -g munge -m 0700 /etc/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        elif command -v create-munge-key >/dev/null; then
            create-munge-key -f
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge
    install -d -o munge -g munge -m 0711 /var/lib/munge
    rm -f /run/munge/munged.pid
    local as_munge=(runuser -u munge --)
    command -v runuser >/dev/null || as_munge=(setpriv --reuid=munge --regid=munge --init-groups)
    "${as_munge[@]}" /usr/sbin/munged --pid-file=/run/munge/munged.pid ||
        die "munged failed to start (see /var/log/munge/munged.log)"
    local i
    for ((i = 0; i < 50; i++)); do
        munge_works && break
        sleep 0.2
    done
    munge_works || {
        tail_logs
        die "munged started but munge -n | unmunge fails"
    }
    # remember that we own this munged so that `stop` ends it
    cp /run/munge/munged.pid "$STATE_DIR/munged.pid"
}

# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
write_config() {
    local node mem
    node="$(hostname -s)"
    mem="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)"
    [[ -n "$mem" ]] || mem=1000
    mkdir -p "$STATE_DIR"/{ctld,spool,log}
    chmod 0755 "$STATE_DIR" "$STATE_DIR"/{ctld,spool,log}
    cat >"$STATE_DIR/slurm.conf.new" <<EOF
# generated by scripts/slurm_local.sh -- single-machine test cluster
ClusterName=dpt-local
SlurmctldHost=${node}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
KillWait=5
InactiveLimit=0
Waittime=0
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=${STATE_DIR}/ctld
SlurmdSpoolDir=${STATE_DIR}/spool
SlurmctldPidFile=${STATE_DIR}/slurmctld.pid
SlurmdPidFile=${STATE_DIR}/slurmd.pid
SlurmctldLogFile=${STATE_DIR}/log/slurmctld.log
SlurmdLogFile=${STATE_DIR}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=${node} NodeAddr=127.0.0.1 NodeHostname=${node} CPUs=${CPUS} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${node} Default=YES MaxTime=INFINITE State=UP
EOF
    mv -f "$STATE_DIR/slurm.conf.new" "$STATE_DIR/slurm.conf"
    # convenience for humans: make the default config location point here if it is free
    if [[ ! -e /etc/slurm/slurm.conf && ! -L /etc/slurm/slurm.conf ]] && [[ -w /etc ]]; then
        mkdir -p /etc/slurm
        ln -s "$STATE_DIR/slurm.conf" /etc/slurm/slurm.conf
    fi
    cat >"$STATE_DIR/env.sh" <<EOF
export SLURM_CONF=${STATE_DIR}/slurm.conf
export PATH=${SHIM_DIR}:\$PATH
EOF
}

fail_start() { # show the logs, stop whatever did come up, exit non-zero
    tail_logs
    log "start failed, stopping the daemons that did start"
    cmd_stop || true
    die "$1 (logs above, full logs in $STATE_DIR/log)"
}

node_state() { sinfo -h -N -n "$(hostname -s)" -o '%T' 2>/dev/null | head -n1; }

# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------
cmd_start() {
    local t0=$SECONDS
    install_packages
    mkdir -p "$STATE_DIR"
    export SLURM_CONF="$STATE_DIR/slurm.conf"
    local state=""
    if read_pid "$STATE_DIR/slurmctld.pid" >/dev/null && read_pid "$STATE_DIR/slurmd.pid" >/dev/null; then
        state="$(node_state)"
    fi
    if [[ "$state" =~ ^(idle|mixed|allocated|completing)$ ]]; then
        log "cluster already running in $STATE_DIR"
        cat "$STATE_DIR/env.sh"
        return 0
    fi
    # partial leftovers (e.g. a crashed daemon): clean slate for the daemons
    cmd_stop >/dev/null 2>&1 || true
    write_config
    start_munge
    log "starting slurmctld"
    slurmctld -i || fail_start "slurmctld failed to start"
    log "starting slurmd"
    slurmd -N "$(hostname -s)" || fail_start "slurmd failed to start"
    local deadline=$((SECONDS + START_TIMEOUT)) t_daemons=$SECONDS name
    state=""
    while ((SECONDS < deadline)); do
        state="$(node_state)"
        [[ "$state" == idle ]] && break
        sleep 0.5
        for name in slurmctld slurmd; do
            # a daemon that died (or never wrote its pid file) will not come back: fail fast
            if [[ -f "$STATE_DIR/$name.pid" ]] || ((SECONDS - t_daemons > 5)); then
                read_pid "$STATE_DIR/$name.pid" >/dev/null ||
                    fail_start "$name exited during startup"
            fi
        done
    done
    [[ "$state" == idle ]] ||
        fail_start "node not idle after ${START_TIMEOUT}s (state: '${state:-none}')"
    log "cluster up in $((SECONDS - t0))s: node $(hostname -s) idle with ${CPUS} CPUs;" \
        "state dir $STATE_DIR"
    cat "$STATE_DIR/env.sh"
}

stop_pidfile() { # stop_pidfile NAME PIDFILE
    local name=$1 file=$2 pid i
    if pid="$(read_pid "$file")"; then
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < STOP_TIMEOUT * 5; i++)); do
            pid_alive "$pid" || break
            sleep 0.2
        done
        if pid_alive "$pid"; then
            log "$name did not exit after ${STOP_TIMEOUT}s, sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.2
        fi
    fi
    rm -f "$file"
}

cancel_jobs() { # end all jobs so that no slurmstepd/job processes outlive the daemons
    local ids i
    ids="$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ')" || return 0
    [[ -n "${ids// /}" ]] || return 0
    log "cancelling jobs: $ids"
    # shellcheck disable=SC2086
    scancel $ids 2>/dev/null || true
    for ((i = 0; i < STOP_TIMEOUT * 5; i++)); do
        [[ -z "$(squeue -h -o '%A' 2>/dev/null)" ]] && return 0
        sleep 0.2
    done
    log "jobs still listed after ${STOP_TIMEOUT}s: $(squeue -h -o '%A %T' 2>/dev/null | tr '\n' ' ')"
}

cmd_stop() {
    export SLURM_CONF="$STATE_DIR/slurm.conf"
    if [[ -f "$SLURM_CONF" ]] && read_pid "$STATE_DIR/slurmctld.pid" >/dev/null; then
        cancel_jobs
    fi
    # slurmd first (it also ends running job steps), then the controller, then munge
    stop_pidfile slurmd "$STATE_DIR/slurmd.pid"
    stop_pidfile slurmctld "$STATE_DIR/slurmctld.pid"
    stop_pidfile munged "$STATE_DIR/munged.pid"
    if [[ -L /etc/slurm/slurm.conf && "$(readlink /etc/slurm/slurm.conf)" == "$STATE_DIR/slurm.conf" ]]; then
        rm -f /etc/slurm/slurm.conf
    fi
    log "stopped (state dir $STATE_DIR kept)"
}

cmd_status() {
    export SLURM_CONF="$STATE_DIR/slurm.conf"
    local rc=0 name pid
    for name in slurmctld slurmd munged; do
        if pid="$(read_pid "$STATE_DIR/$name.pid")"; then
            echo "$name: running (pid $pid)"
        elif [[ "$name" == munged ]] && munge_works 2>/dev/null; then
            echo "munged: running (not started by this script)"
        else
            echo "$name: not running"
            rc=1
        fi
    done
    if ((rc == 0)); then
        sinfo -N -l || rc=1
    fi
    return "$rc"
}

# ---------------------------------------------------------------------------------------------
[[ $# -ge 1 && $# -le 2 ]] || usage
STATE_DIR="${2:-$DEFAULT_STATE_DIR}"
[[ "$1" == start ]] && mkdir -p "$STATE_DIR"
if [[ -d "$STATE_DIR" ]]; then
    STATE_DIR="$(cd "$STATE_DIR" && pwd)"
fi
case "$1" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
*) usage ;;
esac
