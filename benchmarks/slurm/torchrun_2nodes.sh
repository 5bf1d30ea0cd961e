#!/usr/bin/env bash
# benchmarks/slurm/torchrun_2nodes.sh - run one torchrun per node of the two-node cluster (the namespaces fsdpn1 and
# fsdpn2 that `slurm_up.sh --nodes 2` / `netns.sh up` made), exactly as one would on two real machines:
#
#   bash benchmarks/slurm/torchrun_2nodes.sh NPROC SCRIPT [ARGS...]
#   bash benchmarks/slurm/torchrun_2nodes.sh 2 benchmarks/train_gpt.py --world-sizes 4 --out /tmp/train
#
# runs, in each node's namespace (own hostname, own address on the private bridge):
#
#   torchrun --nnodes 2 --nproc-per-node NPROC --rdzv-backend c10d --rdzv-endpoint fsdpn1:PORT \
#            --rdzv-id fsdp-$$ SCRIPT ARGS...
#
# The c10d rendezvous is hosted by the torchrun whose host is fsdpn1 (its address resolves in both namespaces);
# PORT is random in 20000-60000 (FSDP_TORCHRUN_PORT overrides). Exits non-zero if either node's torchrun does; each
# node's output is prefixed with its name. On a real cluster run the same torchrun line on every node (or
# `srun --nodes 2 --ntasks-per-node 1 torchrun ...`, see benchmarks/README.md).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 2 ] || { echo "usage: $0 NPROC SCRIPT [ARGS...]" >&2; exit 2; }
NPROC=$1; shift
PORT=${FSDP_TORCHRUN_PORT:-$((20000 + RANDOM % 40000))}
PY=$(command -v python)
# the namespaces belong to the cluster of whoever ran slurm_up.sh --nodes 2 (see slurm_up.sh: one cluster per caller)
OWNER=${FSDP_SLURM_OWNER:-$(cd "$HERE/../.." && pwd)}
OWNERS=${FSDP_SLURM_ROOT:-/var/spool/fsdp-slurm}/owners
if [ -s "$OWNERS" ] && ! grep -qxF "$OWNER" "$OWNERS"; then
  echo "the two-node namespaces belong to another caller's cluster ($(paste -sd, "$OWNERS")); not using them" \
       "silently: FSDP_SLURM_SHARE=1 bash benchmarks/slurm/slurm_up.sh --nodes 2 joins it. You are: $OWNER" >&2
  exit 4
fi
ip netns list 2>/dev/null | grep -qw fsdpn1 || { echo "no namespace fsdpn1: run 'bash benchmarks/slurm/slurm_up.sh --nodes 2' (or netns.sh up) first" >&2; exit 3; }
pids=()
for n in 1 2; do
  bash "$HERE/netns.sh" exec "$n" env PYTHONPATH="$(cd "$HERE/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m torch.distributed.run --nnodes 2 --nproc-per-node "$NPROC" --rdzv-backend c10d \
    --rdzv-endpoint "fsdpn1:$PORT" --rdzv-id "fsdp-$$" "$@" > >(sed -u "s/^/[fsdpn$n] /") 2>&1 &
  pids+=($!)   # torchrun's own status (the prefixing sed runs in a process substitution)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
