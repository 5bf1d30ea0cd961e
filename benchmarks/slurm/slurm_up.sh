#!/usr/bin/env bash
# benchmarks/slurm/slurm_up.sh - bring up a real Slurm cluster on this machine, for tests/test_slurm.py and for
# trying `--launcher slurm` without a cluster:
#
#   sudo bash benchmarks/slurm/slurm_up.sh --nodes 2   # two nodes: two network namespaces (netns.sh), each with its
#                                                       # own hostname (fsdpn1, fsdpn2), address and slurmd
#   sudo bash benchmarks/slurm/slurm_up.sh             # one node on 127.0.0.1 (machines that cannot make namespaces)
#   bash benchmarks/slurm/slurm_down.sh                # stops exactly what this script started (and the namespaces)
#
# --nodes 2 on a machine that cannot make network namespaces exits with status 3 and names the missing capability.
# One cluster per caller: the caller is FSDP_SLURM_OWNER, or the checkout this script is in. While a cluster another
# caller started is up, this script exits with status 4 and says whose it is, instead of silently sharing it;
# FSDP_SLURM_SHARE=1 joins it on purpose. Every job the benchmarks submit carries "fsdp-owner=<caller>" as its
# comment, and slurm_down.sh cancels only its caller's jobs (and stops the daemons only when no other caller is left).
# Switching between 1 and 2 nodes rewrites slurm.conf and restarts the daemons this script started.
# Cold machine: installs munge, slurmctld, slurmd, slurm-client, and (for accounting) slurmdbd + mariadb-server with
# apt, then starts munged, mariadbd, slurmdbd, slurmctld, slurmd by hand. Idempotent: run it again while the cluster
# is up and it changes nothing; after slurm_down.sh it starts it again. Every daemon it starts is appended as
# "NAME PID" to $FSDP_SLURM_ROOT/started.pids; slurm_down.sh stops exactly those, by PID, newest first.
#
# Why accounting (slurmdbd + MariaDB): submitit polls `sacct` for a job's state. Without it, a job that dies before
# writing its result (cancelled, timed out, killed) leaves job.result() waiting forever; with it, submitit raises.
# FSDP_SLURM_ACCOUNTING=0 skips it (the cluster still runs jobs).
#
# One node: everything talks over 127.0.0.1. Two nodes: slurmctld is at the bridge's address (10.77.0.1), the nodes
# at 10.77.0.11 and .12, so controller <-> node and rank <-> rank traffic stays on the private bridge; slurmdbd and
# MariaDB stay on 127.0.0.1 beside the controller.
# Based on the worked example in the project notes (shared/notes/SLURM.md); Slurm 22.05 as packaged by Debian 12.
set -euo pipefail

ROOT=${FSDP_SLURM_ROOT:-/var/spool/fsdp-slurm}      # ctld state, slurmd spool, pid files, logs
PARTITION=${FSDP_SLURM_PARTITION:-debug}
CLUSTER=${FSDP_SLURM_CLUSTER:-fsdpci}
ACCT=${FSDP_SLURM_ACCOUNTING:-1}
DBPASS=${FSDP_SLURM_DBPASS:-fsdpslurm}              # local-only MariaDB account for slurmdbd (127.0.0.1 only)
CONF=/etc/slurm/slurm.conf                            # Debian's compiled-in default location
DBDCONF=/etc/slurm/slurmdbd.conf
PIDS=$ROOT/started.pids
HOST=$(hostname -s)
HERE=$(cd "$(dirname "$0")" && pwd)
NODES=${FSDP_SLURM_NODES:-1}
OWNER=${FSDP_SLURM_OWNER:-$(cd "$HERE/../.." && pwd)}   # who this cluster is for (benchmarks/slurm_launch.py: owner())
OWNERS=$ROOT/owners                                   # the callers using the running cluster, one per line
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    *) echo "usage: $0 [--nodes 1|2]" >&2; exit 2 ;;
  esac
done
case "$NODES" in 1|2) ;; *) echo "slurm_up.sh: --nodes must be 1 or 2" >&2; exit 2 ;; esac
log() { echo "[slurm_up $(date +%T)] $*" >&2; }
T0=$(date +%s.%N)
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$T0" "$(date +%s.%N)" 2>/dev/null || echo "?"; }
[ "$(id -u)" = 0 ] || { log "run me as root (I install packages and start system daemons)"; exit 1; }
if [ "$NODES" = 2 ]; then   # fail before installing anything when the namespaces cannot be made
  WHY=$(bash "$HERE/netns.sh" check) || { log "cannot start the two-node cluster: $WHY (the one-node cluster, without --nodes 2, still works)"; exit 3; }
fi

# ---------------------------------------------------------------- 1. install (once)
PKGS=""
{ [ -x /usr/sbin/munged ] && [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/bin/sbatch ]; } \
  || PKGS="munge slurmctld slurmd slurm-client"
[ "$ACCT" = 1 ] && ! { [ -x /usr/sbin/slurmdbd ] && [ -x /usr/sbin/mariadbd ]; } && PKGS="$PKGS slurmdbd mariadb-server"
if [ -n "$PKGS" ]; then
  log "installing:$PKGS"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # --no-install-recommends: the slurm-wlm metapackage + recommends is ~43 packages (sview/GTK, mail...)
  apt-get install -y -q --no-install-recommends $PKGS
fi

# ---------------------------------------------------------------- helpers
alive() { # alive PID NAME: PID runs (not a zombie) and its comm is NAME (guards against a recycled PID)
  [ -n "${1:-}" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
pid_of_file() { [ -s "$1" ] && tr -dc '0-9' < "$1" || true; }
wait_for() { # wait_for SECONDS CMD... : poll every 0.25 s
  local t=$1; shift
  for _ in $(seq $((t * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  return 1
}
record() { echo "$1 $2" >> "$PIDS"; log "started $1 pid $2"; }
die() { log "$1"; [ -n "${2:-}" ] && tail -30 "$2" >&2; exit 1; }

mkdir -p "$ROOT"; touch "$PIDS" "$OWNERS"
while read -r n p; do alive "$p" "$n" && echo "$n $p"; done < "$PIDS" > "$PIDS.new" || true
mv "$PIDS.new" "$PIDS"                                 # forget recorded daemons that have since died
# ---------------------------------------------------------------- one cluster per caller
if [ ! -s "$PIDS" ]; then
  echo "$OWNER" > "$OWNERS"                           # nothing of an earlier cluster runs: this one is ours
elif ! grep -qxF "$OWNER" "$OWNERS"; then
  if [ "${FSDP_SLURM_SHARE:-0}" = 1 ]; then
    echo "$OWNER" >> "$OWNERS"; log "joining the running cluster of $(paste -sd, "$OWNERS") (FSDP_SLURM_SHARE=1)"
  else
    log "a SLURM cluster started by another caller is running here ($(paste -sd, "$OWNERS" | sed 's/,/, /g'));" \
        "not sharing it silently. Stop it with that checkout's slurm_down.sh, or set FSDP_SLURM_SHARE=1 to use it" \
        "too (each caller's slurm_down.sh cancels only its own jobs). You are: $OWNER"
    exit 4
  fi
fi
install -d -o slurm -g slurm -m 0755 "$ROOT/ctld" "$ROOT/log" "$ROOT/run"   # written by daemons running as slurm
install -d -o root -g root -m 0755 "$ROOT/d"                                 # slurmd runs as root

# ---------------------------------------------------------------- 2. munge
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge      # normally made by systemd (RuntimeDirectory=munge)
if [ ! -s /etc/munge/munge.key ]; then                # Debian's postinst normally creates it
  /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key   # munged refuses a group/other-readable key
if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "munged already answering; not starting another"
else
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged               # forks into the background, writes /run/munge/munged.pid
  wait_for 10 test -s /run/munge/munged.pid || die "munged did not start" /var/log/munge/munged.log
  record munged "$(pid_of_file /run/munge/munged.pid)"
  wait_for 10 sh -c 'munge -n </dev/null | unmunge' || die "munge round trip fails" /var/log/munge/munged.log
fi

# ---------------------------------------------------------------- 3. slurm.conf (before slurmdbd: sacctmgr needs it)
if [ "$ACCT" = 1 ]; then
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
fi
# Hardware line straight from `slurmd -C` (sockets/cores/threads must match what slurmd detects or the node is
# marked INVAL), with RealMemory cut to 90% (RealMemory above what slurmd sees drains it: "Low RealMemory").
HW=$(/usr/sbin/slurmd -C | head -1)
CPUS=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$HW")
MEM=$(( $(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$HW") * 9 / 10 / NODES ))   # the nodes share this machine
TOPO=$(grep -o 'Boards=[0-9]* SocketsPerBoard=[0-9]* CoresPerSocket=[0-9]* ThreadsPerCore=[0-9]*' <<<"$HW")
if [ "$NODES" = 2 ]; then
  NET=${FSDP_SLURM_SUBNET:-10.77.0}
  CTL_ADDR=$NET.1; NODE_NAMES="fsdpn1 fsdpn2"
  NODE_LINES="NodeName=fsdpn1 NodeAddr=$NET.11 CPUs=$CPUS $TOPO RealMemory=$MEM State=UNKNOWN
NodeName=fsdpn2 NodeAddr=$NET.12 CPUs=$CPUS $TOPO RealMemory=$MEM State=UNKNOWN"
else
  CTL_ADDR=127.0.0.1; NODE_NAMES=$HOST
  NODE_LINES="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS $TOPO RealMemory=$MEM State=UNKNOWN"
fi
NEWCONF=$(mktemp)
cat > "$NEWCONF" <<EOF
# written by benchmarks/slurm/slurm_up.sh - $NODES-node cluster ($NODE_NAMES)
ClusterName=$CLUSTER
SlurmctldHost=$HOST($CTL_ADDR)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=slurm
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$ROOT/ctld
SlurmdSpoolDir=$ROOT/d/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
# no cgroups anywhere
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
$ACCT_LINES
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
# start a submitted batch job on the next scheduler tick (<=1 s) instead of after the default 3 s batch_sched_delay
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# a DOWN node (not responding, slurmd restarted...) becomes usable again as soon as it registers
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MailProg=/bin/true
KillWait=5
MinJobAge=300
$NODE_LINES
PartitionName=$PARTITION Nodes=$(tr ' ' ',' <<<"$NODE_NAMES") Default=YES MaxTime=INFINITE State=UP
EOF
CHANGED=0
if ! cmp -s "$NEWCONF" "$CONF"; then CHANGED=1; install -m 0644 "$NEWCONF" "$CONF"; log "wrote $CONF"; fi
rm -f "$NEWCONF"
# No cgroup.conf is written or needed: proctrack/linuxproc + task/none load no cgroup code.

# ---------------------------------------------------------------- 4. (optional) MariaDB + slurmdbd
if [ "$ACCT" = 1 ]; then
  install -d -o mysql -g root -m 0755 /run/mysqld
  if mariadb -e 'select 1' >/dev/null 2>&1; then
    log "mariadb already answering; not starting another"
  else
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    # mariadbd does not fork: background it; $! is mariadbd itself (nohup execs it)
    nohup /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 \
      --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 >"$ROOT/log/mariadb.log" 2>&1 </dev/null &
    record mariadbd $!
    wait_for 60 mariadb -e 'select 1' || die "mariadb did not come up" "$ROOT/log/mariadb.log"
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
              CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  cat > "$DBDCONF" <<EOF
# written by benchmarks/slurm/slurm_up.sh
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=slurm
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$DBPASS
LogFile=$ROOT/log/slurmdbd.log
PidFile=$ROOT/run/slurmdbd.pid
EOF
  chown slurm:slurm "$DBDCONF"; chmod 0600 "$DBDCONF"   # slurmdbd insists on 0600, owned by SlurmUser
  DBD_PID=$(pid_of_file "$ROOT/run/slurmdbd.pid")
  if alive "$DBD_PID" slurmdbd; then
    log "slurmdbd already running (pid $DBD_PID)"
  else
    rm -f "$ROOT/run/slurmdbd.pid"
    /usr/sbin/slurmdbd                                   # daemonizes
    wait_for 20 test -s "$ROOT/run/slurmdbd.pid" || die "slurmdbd did not start" "$ROOT/log/slurmdbd.log"
    record slurmdbd "$(pid_of_file "$ROOT/run/slurmdbd.pid")"
  fi
  # the pid file appears before slurmdbd listens on 6819; wait until it answers
  wait_for 60 sacctmgr -n show cluster || die "slurmdbd not answering" "$ROOT/log/slurmdbd.log"
  # Slurm 22.05 does not create the cluster in the database by itself ("Table ..._job_table doesn't exist")
  [ -n "$(sacctmgr -n -P show cluster "$CLUSTER" format=cluster)" ] || sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# ---------------------------------------------------------------- 5. network, slurmctld, one slurmd per node
if [ "$CHANGED" = 1 ]; then   # config changed under running daemons: restart those we started (newest first)
  tac "$PIDS" | while read -r n p; do
    case "$n" in slurmd|slurmctld) ;; *) continue ;; esac
    alive "$p" "$n" || continue
    log "slurm.conf changed: stopping $n (pid $p)"; kill -TERM "$p"
    for _ in $(seq 120); do alive "$p" "$n" || break; sleep 0.25; done
    sed -i "/^$n $p\$/d" "$PIDS"
  done
  for n in slurmctld slurmd; do   # one we did not start would keep the old configuration: refuse
    for p in $(pgrep -x "$n"); do   # (zombies of stopped daemons, not yet reaped by PID 1, do not count)
      alive "$p" "$n" && die "slurm.conf changed but a $n this script did not start is running (pid $p); stop it yourself"
    done
  done
fi
if [ "$NODES" = 2 ]; then
  FSDP_SLURM_ROOT=$ROOT bash "$HERE/netns.sh" up || die "could not create the private network (netns.sh up)"
else   # back to one node: the namespaces of an earlier two-node run (only those netns.sh recorded) go
  FSDP_SLURM_ROOT=$ROOT bash "$HERE/netns.sh" down 2>/dev/null || true
fi
CTLD_PID=$(pid_of_file "$ROOT/run/slurmctld.pid")
if alive "$CTLD_PID" slurmctld; then
  log "slurmctld already running (pid $CTLD_PID)"
else
  rm -f "$ROOT/run/slurmctld.pid"
  /usr/sbin/slurmctld                                  # daemonizes, drops to SlurmUser
  wait_for 20 test -s "$ROOT/run/slurmctld.pid" || die "slurmctld did not start" "$ROOT/log/slurmctld.log"
  record slurmctld "$(pid_of_file "$ROOT/run/slurmctld.pid")"
fi
wait_for 30 scontrol ping || die "slurmctld not answering" "$ROOT/log/slurmctld.log"
i=0
for node in $NODE_NAMES; do
  i=$((i + 1))
  install -d -o root -g root -m 0755 "$ROOT/d/$node"
  D_PID=$(pid_of_file "$ROOT/run/slurmd-$node.pid")
  if alive "$D_PID" slurmd; then log "slurmd of $node already running (pid $D_PID)"; continue; fi
  rm -f "$ROOT/run/slurmd-$node.pid"
  if [ "$NODES" = 2 ]; then   # in the node's namespace, with the node's hostname; daemonizes
    FSDP_SLURM_ROOT=$ROOT bash "$HERE/netns.sh" exec "$i" /usr/sbin/slurmd -N "$node" \
      || die "slurmd of $node failed to start" "$ROOT/log/slurmd-$node.log"
  else
    /usr/sbin/slurmd -N "$node" || die "slurmd failed to start" "$ROOT/log/slurmd-$node.log"
  fi
  wait_for 20 test -s "$ROOT/run/slurmd-$node.pid" || die "slurmd of $node did not start" "$ROOT/log/slurmd-$node.log"
  record slurmd "$(pid_of_file "$ROOT/run/slurmd-$node.pid")"
done

# ---------------------------------------------------------------- 6. wait for every node to be idle
node_state() { # idle / down / drain / notresponding ...
  local raw st; raw=$(sinfo -h -N -n "$1" -o %T 2>/dev/null | head -1)   # e.g. idle, idle* (= not responding), down*
  st=$(tr -d '*~#!%$@^-' <<<"$raw")
  case "$raw" in *'*') [ "$st" = down ] || st=notresponding ;; esac
  echo "$st"
}
for i in $(seq 120); do
  ready=1
  for node in $NODE_NAMES; do
    st=$(node_state "$node")
    case "$st" in
      idle|mixed|allocated|completing) ;;
      down|drain|drained|draining|fail|inval)
        ready=0
        if [ "$i" -gt 8 ]; then   # give registration a few seconds, then clear a stale DOWN/DRAIN
          log "node $node is $st ($(sinfo -h -N -n "$node" -o %E)); resuming"
          scontrol update NodeName="$node" State=RESUME || true
        fi ;;
      *) ready=0 ;;
    esac
  done
  # with accounting: also wait until slurmctld has registered with slurmdbd (sacct works from then on)
  if [ "$ready" = 1 ] && { [ "$ACCT" != 1 ] || [ "$(sacctmgr -n -P show cluster "$CLUSTER" format=controlport 2>/dev/null)" = 6817 ]; }; then
    log "nodes $NODE_NAMES idle - cluster ready in $(elapsed) s (partition $PARTITION; stop it with slurm_down.sh)"; exit 0
  fi
  sleep 0.5
done
sinfo -N -l >&2 || true
die "the nodes never became idle" "$ROOT/log/slurmctld.log"
