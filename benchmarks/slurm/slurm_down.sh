#!/usr/bin/env bash
# benchmarks/slurm/slurm_down.sh - stop exactly what benchmarks/slurm/slurm_up.sh started: the "NAME PID" lines in
# $FSDP_SLURM_ROOT/started.pids, newest first (slurmd(s), slurmctld, slurmdbd, mariadbd, munged), then the two-node
# cluster's namespaces and bridge (netns.sh down removes only what netns.sh up recorded). A PID whose process is gone,
# or that now belongs to a process with another name, is left alone; daemons that were running before slurm_up.sh
# (it did not record them) keep running. Jobs still queued or running on a cluster whose slurmctld this script stops
# State (job history, database) is kept.
#
# One cluster per caller (see slurm_up.sh): the caller is FSDP_SLURM_OWNER, or the checkout this script is in. It
# cancels only the caller's jobs (those whose comment is "fsdp-owner=<caller>", which every job the benchmarks and
# tests submit carries), leaves the caller's name off the cluster's list of users, and stops the daemons only when
# no other caller is left on it.
set -uo pipefail
ROOT=${FSDP_SLURM_ROOT:-/var/spool/fsdp-slurm}
PIDS=$ROOT/started.pids
HERE=$(cd "$(dirname "$0")" && pwd)
OWNER=${FSDP_SLURM_OWNER:-$(cd "$HERE/../.." && pwd)}
OWNERS=$ROOT/owners
log() { echo "[slurm_down $(date +%T)] $*" >&2; }
mine() { squeue -h -o '%i|%k' 2>/dev/null | awk -F'|' -v tag="fsdp-owner=$OWNER" \
           '{ n = length(tag); if (length($2) >= n && substr($2, length($2) - n + 1) == tag) print $1 }' | tr '\n' ' '; }
if command -v squeue >/dev/null && squeue -h >/dev/null 2>&1; then
  jobs=$(mine)
  if [ -n "${jobs// /}" ]; then
    log "cancelling the jobs of $OWNER: $jobs"; scancel $jobs 2>/dev/null || true
    for _ in $(seq 60); do [ -z "$(mine | tr -d ' ')" ] && break; sleep 0.5; done
  fi
fi
if [ -s "$OWNERS" ]; then
  grep -vxF "$OWNER" "$OWNERS" > "$OWNERS.new" || true; mv "$OWNERS.new" "$OWNERS"
  if [ -s "$OWNERS" ]; then
    log "the cluster is still used by $(paste -sd, "$OWNERS" | sed 's/,/, /g'): daemons left running"
    exit 0
  fi
fi
# running PID NAME: alive (not a zombie waiting for PID 1 to reap it) and still called NAME
running() { [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
if [ -s "$PIDS" ]; then
  CTLD=$(awk '$1 == "slurmctld" {print $2}' "$PIDS" | tail -1)
  if [ -n "$CTLD" ] && running "$CTLD" slurmctld; then
    others=$(squeue -h -o '%i (%j, %k)' 2>/dev/null | paste -sd';' -)
    [ -n "$others" ] && log "jobs of no registered caller are still queued; they stop with the cluster: $others"
  fi
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
else
  log "no daemons recorded in $PIDS"
fi
FSDP_SLURM_ROOT=$ROOT bash "$HERE/netns.sh" down
