#!/usr/bin/env bash
# A real single-node Slurm on localhost, for tests, CI and trying kiln's Slurm doors without a cluster.
#
#   scripts/slurm-local.sh start    # munged + slurmctld + slurmd, idempotent; prints nothing else on success
#   scripts/slurm-local.sh status   # sinfo of the local cluster (exit 1 when it does not answer)
#   scripts/slurm-local.sh env      # `export SLURM_CONF=...`: eval "$(scripts/slurm-local.sh env)"
#   scripts/slurm-local.sh stop     # scontrol shutdown, then stop munged
#
# Needs root and Debian's `slurm-wlm` + `munge` (apt-get install -y slurm-wlm munge). No systemd:
# daemons are started by hand and everything they write lives under $KILN_SLURM_DIR (/tmp/kiln-slurm).
# Partitions: `cpu` (default) and `gpu`, the latter with two fake GPUs through GRES (character devices
# with /dev/null's numbers: enough for Slurm's bookkeeping, CUDA_VISIBLE_DEVICES and --gpus-per-node).
set -euo pipefail

STATE="${KILN_SLURM_DIR:-/tmp/kiln-slurm}"
CONF="$STATE/etc/slurm.conf"
MUNGE_DIR="$STATE/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
CTLD_PORT="${KILN_SLURMCTLD_PORT:-6817}"
SLURMD_PORT="${KILN_SLURMD_PORT:-6818}"
# Logical CPUs: at least 4 so that a 2-task job and an array task can be scheduled side by side on a
# 2-core CI runner (config_overrides makes slurmd trust this number instead of the hardware).
NCPUS="${KILN_SLURM_CPUS:-$(( $(nproc) > 4 ? $(nproc) : 4 ))}"

say() { echo "slurm-local: $*" >&2; }

answers() { # the controller answers and the node is usable (sinfo hangs while munge is down: hence timeout)
  local state
  state="$(SLURM_CONF="$CONF" timeout 5 sinfo -h -N -n localhost -o '%t' 2>/dev/null | head -1)" || return 1
  case "$state" in idle*|mix*|alloc*|comp*) return 0 ;; *) return 1 ;; esac
}

write_conf() {
  local mem
  mem="$(free -m | awk '/^Mem:/ {print int($2 * 0.8)}')"
  mkdir -p "$STATE"/{etc,ctld,spool,log,run,dev}
  for i in 0 1; do
    [ -e "$STATE/dev/fakegpu$i" ] || mknod "$STATE/dev/fakegpu$i" c 1 3
  done
  cat >"$CONF" <<EOF
# Written by scripts/slurm-local.sh: a single-node test cluster. Do not edit; edit the script.
ClusterName=kiln-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/log/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=30
KillWait=2
MessageTimeout=10
DefMemPerCPU=512
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$NCPUS RealMemory=$mem Gres=gpu:2 State=UNKNOWN
PartitionName=cpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=gpu Nodes=localhost MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  cat >"$STATE/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=localhost Name=gpu File=$STATE/dev/fakegpu[0-1]
EOF
}

start_munge() {
  if [ -S "$MUNGE_SOCKET" ] && timeout 3 munge -n -S "$MUNGE_SOCKET" </dev/null >/dev/null 2>&1; then
    return 0
  fi
  mkdir -p "$MUNGE_DIR"
  chown munge:munge "$MUNGE_DIR"
  chmod 0700 "$MUNGE_DIR"
  local key=/etc/munge/munge.key
  if [ ! -s "$key" ]; then  # a key of our own when the package did not leave one
    key="$MUNGE_DIR/munge.key"
    [ -s "$key" ] || { dd if=/dev/urandom of="$key" bs=1024 count=1 status=none; chown munge:munge "$key"; chmod 0400 "$key"; }
  fi
  rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
  runuser -u munge -- munged --force --socket="$MUNGE_SOCKET" --key-file="$key" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed"
  for _ in $(seq 50); do
    timeout 3 munge -n -S "$MUNGE_SOCKET" </dev/null >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  say "munged did not come up; see $MUNGE_DIR/munged.log"
  return 1
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  command -v slurmctld >/dev/null || { say "slurm-wlm is not installed (apt-get install -y slurm-wlm munge)"; exit 1; }
  if answers; then return 0; fi
  write_conf
  start_munge
  pid_alive "$STATE/run/slurmctld.pid" || slurmctld -f "$CONF"
  pid_alive "$STATE/run/slurmd.pid" || slurmd -f "$CONF" -N localhost
  for _ in $(seq 100); do
    answers && return 0
    # a node left DOWN by an earlier run of this script comes back once its slurmd answers
    SLURM_CONF="$CONF" timeout 5 scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true
    sleep 0.2
  done
  say "the cluster did not become ready; logs under $STATE/log"
  tail -n 20 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
  return 1
}

stop() {
  if [ -f "$CONF" ]; then
    SLURM_CONF="$CONF" timeout 10 scontrol shutdown >/dev/null 2>&1 || true
  fi
  for f in "$STATE/run/slurmd.pid" "$STATE/run/slurmctld.pid"; do
    for _ in $(seq 50); do pid_alive "$f" || break; sleep 0.1; done
    pid_alive "$f" && kill "$(cat "$f")" 2>/dev/null || true
  done
  if pid_alive "$MUNGE_DIR/munged.pid"; then
    kill "$(cat "$MUNGE_DIR/munged.pid")" 2>/dev/null || true
  fi
  rm -f "$STATE/run/"*.pid
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) answers && SLURM_CONF="$CONF" timeout 5 sinfo ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 {start|stop|status|env}" >&2; exit 2 ;;
esac
