#!/usr/bin/env bash
# benchmarks/slurm/slurm_down.sh - stop exactly the daemons benchmarks/slurm/slurm_up.sh started: the "NAME PID" lines
# in $FSDP_SLURM_ROOT/started.pids, newest first (slurmd, slurmctld, slurmdbd, mariadbd, munged). A PID whose process
# is gone, or that now belongs to a process with another name, is left alone. Nothing else is touched: daemons that
# were already running before slurm_up.sh (it did not record them) keep running. State (job history, database) is
# kept, so slurm_up.sh can start the cluster again quickly.
set -uo pipefail
ROOT=${FSDP_SLURM_ROOT:-/var/spool/fsdp-slurm}
PIDS=$ROOT/started.pids
log() { echo "[slurm_down $(date +%T)] $*" >&2; }
# running PID NAME: alive (not a zombie waiting for PID 1 to reap it) and still called NAME
running() { [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
[ -s "$PIDS" ] || { log "nothing recorded in $PIDS"; exit 0; }
tac "$PIDS" | while read -r name pid; do
  if running "$pid" "$name"; then
    kill -TERM "$pid" && log "sent TERM to $name pid $pid"
    for _ in $(seq 120); do running "$pid" "$name" || break; sleep 0.25; done
    if running "$pid" "$name"; then kill -KILL "$pid" && log "$name pid $pid ignored TERM for 30 s; sent KILL"; fi
  else
    log "$name pid $pid is not running (or the PID now belongs to something else): left alone"
  fi
done
: > "$PIDS"
