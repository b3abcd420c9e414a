#!/usr/bin/env bash
# torchrun_two_nodes.sh -- one ddp world across two machines, started by torchrun (c10d rendezvous).
#
# Run the same line on both machines; HEAD is an address of the first one that the second reaches:
#   scripts/torchrun_two_nodes.sh HEAD [overrides...]     e.g. ... 10.0.0.1 trainer.epochs=5
# Try it on one machine (both "nodes" here, on loopback; the two torchrun outputs interleave):
#   scripts/torchrun_two_nodes.sh local [overrides...]
#
# torchrun's c10d rendezvous numbers the nodes; ranks, local ranks and the world size reach dpt
# through torchrun's environment (launcher=torchrun). Global rank 0 runs Hydra and decides the run
# folder; every other rank writes its own logs/rank<k>.log and tb/rank<k>/ into that same path on
# its machine, so a shared file system ends up with one complete run folder.
#
# Environment: NPROC_PER_NODE (default: number of GPUs, else 2), NNODES (2), RDZV_PORT (29500),
# RDZV_ID (dpt: the same on all nodes, a new one per run if several share a head), PYTHON
# (python3), IFNAME (network interface for Gloo/NCCL when the hostname resolves to the wrong one).
set -euo pipefail

[[ $# -ge 1 ]] || {
    sed -n '2,17p' "$0" >&2
    exit 2
}
HEAD="$1"
shift
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
NNODES="${NNODES:-2}"
RDZV_PORT="${RDZV_PORT:-29500}"
RDZV_ID="${RDZV_ID:-dpt}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 2)')"
fi
if [[ -n "${IFNAME:-}" ]]; then
    export GLOO_SOCKET_IFNAME="$IFNAME" NCCL_SOCKET_IFNAME="$IFNAME"
fi

node() { # node RDZV_HOST [overrides...]: one torchrun agent = one node
    local host="$1"
    shift
    "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_backend=c10d --rdzv_endpoint="$host:$RDZV_PORT" --rdzv_id="$RDZV_ID" \
        train.py strategy=ddp launcher=torchrun "$@"
}

if [[ "$HEAD" != local ]]; then
    node "$HEAD" "$@"
    exit
fi
# Demo: all nodes on this machine, one thread per process so they share the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
pids=()
for ((n = 0; n < NNODES; n++)); do
    node 127.0.0.1 "$@" &
    pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=$?
done
exit "$status"
