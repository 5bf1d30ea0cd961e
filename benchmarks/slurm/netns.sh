#!/usr/bin/env bash
# benchmarks/slurm/netns.sh - the private network of the two-node cluster: a bridge on this machine and two network
# namespaces plugged into it, one per SLURM node. Used by slurm_up.sh / slurm_down.sh (`--nodes 2`); runs alone too:
#
#   bash benchmarks/slurm/netns.sh check     # can this machine make them? (prints the missing capability, exit 1)
#   bash benchmarks/slurm/netns.sh up        # create bridge, namespaces, veth pairs, addresses, hosts files
#   bash benchmarks/slurm/netns.sh down      # remove exactly what `up` created (recorded in $FSDP_SLURM_ROOT/netns.created)
#   bash benchmarks/slurm/netns.sh exec N CMD...   # run CMD in node N's namespace with node N's hostname (UTS ns)
#
#   host side   bridge $BR   10.77.0.1/24   (slurmctld's address: SlurmctldHost)
#   node 1      netns fsdpn1, hostname fsdpn1, 10.77.0.11/24 on its veth (plus its own loopback)
#   node 2      netns fsdpn2, hostname fsdpn2, 10.77.0.12/24
#
# Each node has its own /etc/hosts (`exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts in its mount namespace)
# naming
# the controller and both nodes, so node names resolve there (torch's MASTER_ADDR is the first node's name) without
# touching this machine's /etc/hosts. The subnet is link-local to the bridge: no route, NAT or forwarding to any other
# interface is set up, so the cluster's traffic (slurmctld <-> slurmd, srun I/O, the ranks' gloo/TCP store) stays on
# it. Override the subnet with FSDP_SLURM_SUBNET=10.x.y (a /24 prefix) if 10.77.0 is taken.
set -euo pipefail
ROOT=${FSDP_SLURM_ROOT:-/var/spool/fsdp-slurm}
NET=${FSDP_SLURM_SUBNET:-10.77.0}
BR=${FSDP_SLURM_BRIDGE:-fsdpbr0}
NODES=(fsdpn1 fsdpn2)
CREATED=$ROOT/netns.created            # one line per object this script made: "bridge NAME" / "netns NAME" / "hosts DIR"
log() { echo "[netns $(date +%T)] $*" >&2; }

addr_of() { echo "$NET.$((10 + $1))"; }   # node index (1-based) -> address

check() { # prints nothing and returns 0 when namespaces, veth and bridges can be made here; else names what is missing
  [ "$(id -u)" = 0 ] || { echo "not root: creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN"; return 1; }
  command -v ip >/dev/null || { echo "no 'ip' command (iproute2 is not installed)"; return 1; }
  command -v unshare >/dev/null || { echo "no 'unshare' command (util-linux): needed for each node's own hostname"; return 1; }
  local probe="fsdpprobe$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "cannot create a network namespace ('ip netns add' says: $err): this container lacks CAP_SYS_ADMIN/CAP_NET_ADMIN or unshare(CLONE_NEWNET) is blocked (seccomp)"; return 1
  fi
  if ! err=$(ip netns exec "$probe" unshare --uts true 2>&1); then
    ip netns del "$probe"; echo "cannot create a UTS namespace ('unshare --uts' says: $err): nodes cannot have their own hostnames"; return 1
  fi
  ip netns del "$probe"
  if ! err=$(ip link add "${probe}b" type bridge 2>&1); then
    echo "cannot create a bridge ('ip link add type bridge' says: $err)"; return 1
  fi
  ip link del "${probe}b"
  if ! err=$(ip link add "${probe}a" type veth peer name "${probe}z" 2>&1); then
    echo "cannot create a veth pair ('ip link add type veth' says: $err)"; return 1
  fi
  ip link del "${probe}a"
  return 0
}

created() { grep -qx "$1 $2" "$CREATED" 2>/dev/null; }
record() { echo "$1 $2" >> "$CREATED"; }

up() {
  local why; why=$(check) || { log "cannot make the two-node cluster's network: $why"; exit 3; }
  mkdir -p "$ROOT"; touch "$CREATED"
  if ! ip link show "$BR" >/dev/null 2>&1; then
    # refuse a subnet that this machine already uses elsewhere: traffic must stay on our bridge
    if ip -4 addr | grep -q "inet $NET\."; then log "subnet $NET.0/24 is already in use here; set FSDP_SLURM_SUBNET"; exit 1; fi
    ip link add "$BR" type bridge; record bridge "$BR"
    ip addr add "$NET.1/24" dev "$BR"
    ip link set "$BR" up
    log "bridge $BR $NET.1/24"
  fi
  local i=0 ns veth
  for ns in "${NODES[@]}"; do
    i=$((i + 1)); veth="fsdpv$i"
    if ! ip netns list | grep -qw "^$ns"; then ip netns add "$ns"; record netns "$ns"; fi
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name eth0 netns "$ns"   # the link is deleted with its namespace
      ip link set "$veth" master "$BR"; ip link set "$veth" up
      ip -n "$ns" addr add "$(addr_of $i)/24" dev eth0
      ip -n "$ns" link set eth0 up; ip -n "$ns" link set lo up
      log "node $ns: $(addr_of $i)/24 on $veth"
    fi
    [ -d /etc/netns ] || { mkdir /etc/netns; record hostsroot /etc/netns; }
    mkdir -p "/etc/netns/$ns"
    created hosts "/etc/netns/$ns" || record hosts "/etc/netns/$ns"
    { echo "127.0.0.1 localhost"; echo "$NET.1 $(hostname -s)"
      local j=0 n; for n in "${NODES[@]}"; do j=$((j + 1)); echo "$(addr_of $j) $n"; done; } > "/etc/netns/$ns/hosts"
  done
  # the nodes must reach each other and the controller over the bridge (a TCP connect to a closed port: "refused"
  # means the packet got there and back; a timeout means it did not)
  reach fsdpn1 "$(addr_of 2)" || { log "fsdpn1 cannot reach fsdpn2 ($(addr_of 2)) over $BR"; exit 1; }
  reach fsdpn2 "$NET.1" || { log "fsdpn2 cannot reach the controller address $NET.1 over $BR"; exit 1; }
}

reach() { # reach NS ADDR
  local out; out=$(ip netns exec "$1" timeout 3 bash -c "exec 3<>/dev/tcp/$2/9" 2>&1) && return 0
  grep -q "refused" <<<"$out"
}

down() { # remove only what up() recorded, newest first
  [ -s "$CREATED" ] || { log "nothing recorded in $CREATED"; return 0; }
  tac "$CREATED" | while read -r kind name; do
    case "$kind" in
      netns)
        local left; left=$(ip netns pids "$name" 2>/dev/null | tr '\n' ' ')
        [ -z "$left" ] || log "netns $name still has processes ($left); they are removed with it only when they exit"
        ip netns del "$name" 2>/dev/null && log "removed netns $name" ;;
      bridge) ip link del "$name" 2>/dev/null && log "removed bridge $name" ;;
      hosts) rm -f "$name/hosts"; rmdir "$name" 2>/dev/null || true ;;
      hostsroot) rmdir "$name" 2>/dev/null || true ;;   # only if empty: someone else's files stay
    esac
  done
  : > "$CREATED"
}

case "${1:-}" in
  check) check ;;
  up) up ;;
  down) down ;;
  exec) # nsenter + unshare rather than `ip netns exec`: the latter remounts /sys for the namespace, which hides
        # /sys/fs/cgroup, and slurmd refuses to start without it. The node's own mount namespace gets its hosts file.
        shift; n=$1; shift; ns=${NODES[$((n - 1))]}
        exec nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c \
          'mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec "$@"' "$ns" "$@" ;;
  *) echo "usage: $0 check|up|down|exec N CMD..." >&2; exit 2 ;;
esac
