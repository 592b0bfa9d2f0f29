#!/usr/bin/env bash
# A real Slurm cluster on this one host, for the `slurm` tests and for trying
# slurm/*.sbatch without a cluster: munged, slurmctld and N slurmd daemons
# acting as nodes n1..nN on 127.0.0.1, all as root, no systemd, everything
# (keys, sockets, state, spool, logs, pid files) in one private directory.
# The system's munge and Slurm configuration are never touched.
#
#   scripts/slurm-local.sh up [DIR]       start (or check) the cluster; prints the env file to source
#   scripts/slurm-local.sh down [DIR]     stop the daemons started in DIR (and only those)
#   scripts/slurm-local.sh status [DIR]   sinfo of the cluster in DIR
#
# DIR defaults to /tmp/tessera-slurm (short, because PMIx puts Unix sockets
# below it). `source DIR/env` sets SLURM_CONF (so sbatch, srun, squeue find
# the cluster) and lets Open MPI run as root. Settings: SLURM_LOCAL_NODES
# (default 2), SLURM_LOCAL_PORT (slurmctld's port, default 6817; the slurmd
# ports follow it). Needs the Debian packages of scripts/install-deps.sh
# (slurm-wlm, munge).
set -euo pipefail

command=${1:-}
dir=${2:-/tmp/tessera-slurm}
nodes=${SLURM_LOCAL_NODES:-2}
ctld_port=${SLURM_LOCAL_PORT:-6817}

fail() {
  echo "slurm-local: $*" >&2
  exit 1
}

alive() {  # alive PID NAME: that process exists and is NAME (not a recycled pid)
  [[ $(cat "/proc/$1/comm" 2>/dev/null) == "$2" ]]
}

# The pid a daemon wrote, when that process is still the daemon.
running_pid() {  # running_pid PIDFILE NAME
  local pid
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  alive "$pid" "$2" || return 1
  echo "$pid"
}

daemons() {  # pid files and process names of everything `up` starts, slurmd first
  local n
  for ((n = 1; n <= nodes; n++)); do echo "$dir/run/slurmd-n$n.pid slurmd"; done
  echo "$dir/run/slurmctld.pid slurmctld"
  echo "$dir/run/munged.pid munged"
}

stop() {
  local pidfile name pid pids=()
  # Jobs still running in this cluster end first, so no slurmstepd outlives its slurmd.
  if running_pid "$dir/run/slurmctld.pid" slurmctld >/dev/null; then
    export SLURM_CONF=$dir/etc/slurm.conf
    scancel --quiet --full --state=RUNNING --user="$(id -un)" 2>/dev/null || true
    scancel --quiet --user="$(id -un)" 2>/dev/null || true
    local until=$((SECONDS + 40))
    while [[ -n $(squeue -h -t RUNNING,COMPLETING 2>/dev/null) ]] && ((SECONDS < until)); do sleep 0.2; done
  fi
  while read -r pidfile name; do
    if pid=$(running_pid "$pidfile" "$name"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid:$name")
    fi
  done < <(daemons)
  local deadline=$((SECONDS + 30)) entry
  for entry in "${pids[@]}"; do
    pid=${entry%%:*}
    while alive "$pid" "${entry#*:}" && ((SECONDS < deadline)); do sleep 0.1; done
    if alive "$pid" "${entry#*:}"; then
      echo "slurm-local: ${entry#*:} ($pid) ignored SIGTERM for 30 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

write_config() {
  # Node shape as slurmd detects it (a larger one would be drained), memory
  # 90% of it split over the nodes.
  local shape cpus boards sockets cores threads memory host
  shape=$(slurmd -C | head -1)
  field() { sed -n "s/.*\\b$1=\\([0-9]*\\).*/\\1/p" <<<"$shape"; }
  cpus=$(field CPUs) boards=$(field Boards) sockets=$(field SocketsPerBoard)
  cores=$(field CoresPerSocket) threads=$(field ThreadsPerCore) memory=$(field RealMemory)
  memory=$((memory * 9 / 10 / nodes))
  host=$(hostname -s)
  local last_port=$((ctld_port + nodes))
  cat >"$dir/etc/slurm.conf" <<EOF
# Written by scripts/slurm-local.sh: a single-host cluster of $nodes nodes.
ClusterName=tessera-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start
# again (default 120 s); 10 s keeps the requeue tests short.
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=pmix
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=60
# A requeued job becomes eligible by time, which no event announces: the
# scheduler passes (every 60 s, backfill every 30 s, by default) start it; every 2 s here.
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
KillWait=30
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((ctld_port + 1))-$last_port] CPUs=$cpus Boards=$boards SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP
EOF
  # One config directory per slurmd: the same slurm.conf, and an mpi.conf that
  # gives each its own PMIx client directory (they collide otherwise).
  local n
  for ((n = 1; n <= nodes; n++)); do
    mkdir -p "$dir/etc/n$n" "$dir/tmp/n$n" "$dir/spool/n$n"
    cp "$dir/etc/slurm.conf" "$dir/etc/n$n/slurm.conf"
    echo "PMIxCliTmpDirBase=$dir/tmp/n$n" >"$dir/etc/n$n/mpi.conf"
  done
  cat >"$dir/env" <<EOF
# source this: the clients (sbatch, srun, squeue, scontrol) find the cluster in $dir
export SLURM_CONF=$dir/etc/slurm.conf
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
EOF
}

wait_idle() {
  export SLURM_CONF=$dir/etc/slurm.conf
  local deadline=$((SECONDS + 60)) states
  while ((SECONDS < deadline)); do
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
    if [[ -n $states ]] && ! grep -qv ' idle$' <<<"$states"; then
      [[ $(wc -l <<<"$states") == "$nodes" ]] && return 0
    fi
    # A node left down or drained by earlier state comes back.
    local node
    for node in $(awk '$2 ~ /^(down|drain|drng|fail)\*?$/ { print $1 }' <<<"$states"); do
      scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
    done
    sleep 0.2
  done
  echo "slurm-local: the nodes did not become idle within 60 s:" >&2
  sinfo -N -l >&2 || true
  tail -n 20 "$dir"/log/*.log >&2 || true
  return 1
}

up() {
  ((EUID == 0)) || fail "run as root (the daemons run as SlurmUser=root)"
  for program in munged slurmctld slurmd sinfo sbatch; do
    command -v "$program" >/dev/null || fail "$program not found; run scripts/install-deps.sh (slurm-wlm, munge)"
  done
  local all=1 pidfile name
  while read -r pidfile name; do running_pid "$pidfile" "$name" >/dev/null || all=0; done < <(daemons)
  if ((all)); then
    wait_idle
    echo "$dir/env"
    return
  fi
  stop  # whatever is left of an earlier, partial start
  local port
  for ((port = ctld_port; port <= ctld_port + nodes; port++)); do
    if port_busy "$port"; then fail "port $port is in use; set SLURM_LOCAL_PORT to another base port"; fi
  done
  rm -rf "${dir:?}/state" "${dir:?}/spool" "${dir:?}/tmp" "${dir:?}/etc" "${dir:?}/run"
  mkdir -p "$dir"/{etc,munge,log,run,state,spool,tmp}
  chmod 0755 "$dir" "$dir/munge"
  write_config

  [[ -s $dir/munge/munge.key ]] || {
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$dir/munge/munge.key"
  }
  munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munge.seed" ||
    fail "munged did not start; see $dir/log/munged.log"
  slurmctld -f "$dir/etc/slurm.conf" -i || fail "slurmctld did not start; see $dir/log/slurmctld.log"
  local n
  for ((n = 1; n <= nodes; n++)); do
    slurmd -f "$dir/etc/n$n/slurm.conf" -N "n$n" || fail "slurmd n$n did not start; see $dir/log/slurmd-n$n.log"
  done
  wait_idle
  echo "$dir/env"
}

case $command in
  up) up ;;
  down) stop ;;
  status)
    [[ -f $dir/etc/slurm.conf ]] || fail "no cluster in $dir"
    SLURM_CONF=$dir/etc/slurm.conf sinfo -N -l
    ;;
  *)
    echo "usage: $0 up|down|status [DIR]" >&2
    exit 2
    ;;
esac
