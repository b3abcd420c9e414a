#!/usr/bin/env bash
# slurm_example.sh -- a ddp sweep on SLURM: one SLURM job per sweep job, one task per rank.
#
# On a cluster's login node (the repo on a shared file system, dpt installed in PYTHON's env):
#   NODES=2 TASKS_PER_NODE=4 GPUS_PER_NODE=4 PARTITION=gpu scripts/slurm_example.sh trainer.seed=1,2
# On this machine, against a real one-node SLURM cluster (root: scripts/slurm_local.sh, which this
# starts, and stops again if it was not running):
#   scripts/slurm_example.sh local [overrides...]
#
# The command it runs is plain Hydra multirun:
#   python train.py -m launcher=slurm launcher.nodes=N launcher.tasks_per_node=T strategy=ddp ...
# It waits for every job, then prints the sweep's table and writes <sweep>/summary.csv and
# summary.png (SLURM's own logs: <sweep>/.submitit/<job id>/). Exit status 1 if any job failed.
#
# Environment: NODES (1), TASKS_PER_NODE (2), GPUS_PER_NODE, CPUS_PER_TASK, PARTITION,
# TIME_MIN (60), PYTHON (python3).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOCAL=0
if [[ "${1:-}" == local ]]; then
    LOCAL=1
    shift
fi

args=(launcher=slurm "launcher.nodes=${NODES:-1}" "launcher.tasks_per_node=${TASKS_PER_NODE:-2}")
args+=("launcher.time=${TIME_MIN:-60}" strategy=ddp)
[[ -z "${GPUS_PER_NODE:-}" ]] || args+=("launcher.gpus_per_node=$GPUS_PER_NODE")
[[ -z "${CPUS_PER_TASK:-}" ]] || args+=("launcher.cpus_per_task=$CPUS_PER_TASK")
[[ -z "${PARTITION:-}" ]] || args+=("launcher.partition=$PARTITION")

if ((LOCAL == 0)); then
    exec "$PYTHON" train.py -m "${args[@]}" "$@"
fi

# Local demo: a small, quick sweep of two jobs unless overrides say otherwise.
was_up=0
scripts/slurm_local.sh status >/dev/null 2>&1 && was_up=1
eval "$(scripts/slurm_local.sh start)"
stop_cluster() { ((was_up)) || scripts/slurm_local.sh stop; }
trap stop_cluster EXIT
[[ $# -gt 0 ]] || set -- trainer.seed=1,2 trainer.max_steps=20 dataset.num_samples=2048
"$PYTHON" train.py -m "${args[@]}" launcher.cpus_per_task=1 "$@"
