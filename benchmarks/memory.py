"""Section `memory` (not run by default): memory per rank of the training state under ddp and
fsdp, and their throughput.

An MLP of about 105 M parameters (1024 -> 7 x 4096 -> 10) trained with Adam on N CPU ranks over
Gloo, wrapped by dpt's own strategies with their YAML defaults. Per rank: the bytes of parameters,
gradients and optimizer state that the rank holds (`dpt.observe.memory.MemoryUse`, what the
metrics log as `memory/*_mb`), and the process's peak resident memory; per world: samples/s
over timed steps, ddp and fsdp alternated round by round. Its section of docs/performance.md
sits between two markers and is replaced alone, so `--sections memory` leaves the rest of the
report as it was (benchmarks/report/memory.py).

    python -m benchmarks --sections memory --world-sizes 2,4
"""

from __future__ import annotations

import argparse
import functools
import itertools
import resource
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.runner import Say, alternate, spawn_world, step_seconds
from dpt.config.build import build
from dpt.distributed import DistEnv
from dpt.launch.cli import compose_from_argv
from dpt.models.mlp import MLP
from dpt.observe.memory import MemoryUse

INPUT_DIM, HIDDEN, CLASSES = 1024, [4096] * 7, 10
BATCH = 16  # per rank
STRATEGIES = ("ddp", "fsdp")


def parameters() -> int:
    dims = [INPUT_DIM, *HIDDEN, CLASSES]
    return sum(a * b + b for a, b in itertools.pairwise(dims))


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """(8) ddp against fsdp: the training state per rank, and samples/s."""
    worlds = args.worlds if args.world_sizes else [2] if args.smoke else [2, 4]
    return {"memory": measure_worlds(worlds, args.rounds, args.quick, args.threads, say)}


def measure(
    strategy: str, world: int, warmup: int, steps: int, threads: int
) -> list[dict[str, float]]:
    """One run of `world` CPU ranks; every rank's numbers, in rank order."""
    return spawn_world(world, _rank, (strategy, warmup, steps), threads)


def _rank(env: DistEnv, tmp: Path, strategy: str, warmup: int, steps: int) -> list[Any]:
    row = _train(strategy, env, warmup, steps)
    rows: list[Any] = [None] * env.world_size
    dist.all_gather_object(rows, row)
    return rows


def _train(strategy: str, env: DistEnv, warmup: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = MLP((INPUT_DIM,), CLASSES, HIDDEN)
    model = build(compose_from_argv([f"strategy={strategy}"]).strategy).wrap(model, env, "32")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs, labels = torch.randn(BATCH, INPUT_DIM), torch.randint(0, CLASSES, (BATCH,))

    def step() -> None:
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Adam's moments exist from the warm-up's first step on
    elapsed = step_seconds(step, warmup, steps) * steps
    # ru_maxrss: KiB on Linux.
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**MemoryUse(model, optimizer).scalars(), "peak_rss_mb": peak_rss_mb,
            "samples_per_s": BATCH * env.world_size * steps / elapsed}  # fmt: skip


def measure_worlds(
    worlds: list[int], rounds: int, quick: bool, threads: int, say: Say
) -> dict[str, Any]:
    """Every world size, ddp and fsdp alternated `rounds` times."""
    warmup, steps = (1, 1) if quick else (1, 3)
    results: dict[str, Any] = {"worlds": {}, "parameters": parameters(), "steps": steps}
    for world in worlds:

        def done(strategy: str, r: int, seconds: float, world: int = world) -> None:
            say(f"  {strategy} on {world} ranks, round {r + 1}/{rounds} done")

        contenders = {
            s: functools.partial(measure, s, world, warmup, steps, threads) for s in STRATEGIES
        }
        results["worlds"][world] = alternate(contenders, rounds, done=done)
    return results
