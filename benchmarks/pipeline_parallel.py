"""Section `pipeline_parallel` (not run by default): what a pipeline of 2 stages costs.

A GPT (6 blocks of width 256, 64 tokens) trained with SGD on 2 CPU ranks over Gloo as dpt's
`strategy=pipeline` runs it (its stages, schedule and stage clock), for 1, 2 and 4 micro-batches
under gpipe and 1f1b, alternated round by round with the same model in one process. Per run:
the time per step; each stage's measured bubble (the share of the schedule's step it waits:
`pipeline/bubble` in TensorBoard) against the textbook (p - 1) / (m + p - 1); and each stage's
parameters, gradients and optimizer state against the one process's. Its section of
docs/performance.md sits between two markers (benchmarks/report/pipeline_parallel.py).

    python -m benchmarks --sections pipeline_parallel --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.report.common import stamp
from benchmarks.runner import Say, alternate, spawn_world, step_seconds
from dpt.distributed import DistEnv
from dpt.loop.pipeline import Pipeline
from dpt.models.gpt import GPT
from dpt.observe.memory import MemoryUse

SHAPE = {"n_layer": 6, "n_embd": 256, "n_head": 4, "block_size": 64}
VOCAB, BATCH, STAGES = 256, 16, 2
MICROBATCHES = (1, 2, 4)
SCHEDULES = ("gpipe", "1f1b")


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    warmup, steps = (1, 2) if args.quick else (2, 8)
    contenders: dict[str, Any] = {"single": functools.partial(_single, warmup, steps)}
    for schedule in SCHEDULES:
        # 1F1B runs a micro-batch per stage before its first backward: m >= p.
        counts = [m for m in MICROBATCHES if schedule == "gpipe" or m >= STAGES]
        for m in counts[-1:] if args.smoke else counts:
            contenders[f"{schedule} m={m}"] = functools.partial(
                spawn_world, STAGES, _rank, (schedule, m, warmup, steps), args.threads
            )

    def done(key: str, r: int, seconds: float) -> None:
        say(f"  {key}, round {r + 1}/{args.rounds} done ({seconds:.0f} s)")

    started, load_before = time.time(), os.getloadavg()
    measured = alternate(contenders, args.rounds, done=done)
    return {"pipeline_parallel": {"runs": measured, "steps": steps, "shape": SHAPE,
                                  "batch": BATCH, "stages": STAGES, **stamp(args, started),
                                  "load": (load_before, os.getloadavg())}}  # fmt: skip


def _model(shape: dict[str, int]) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, shape["block_size"], shape["n_layer"], shape["n_head"], shape["n_embd"],
               dropout=0.0, bias=True)  # fmt: skip


def _batch(shape: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, shape["block_size"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def _single(
    warmup: int, steps: int, shape: dict[str, int] = SHAPE, state: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """The whole model in this process, one thread (as each rank has); `state`: what its row
    says of the training state (its MB, by default)."""
    model = _model(shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    inputs, targets = _batch(shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def step() -> None:
            _loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step_s = step_seconds(step, warmup, steps)
    finally:
        torch.set_num_threads(threads)
    return {"step_s": step_s, "ranks": [(state or _state_mb)(model, optimizer)]}


def _rank(
    env: DistEnv, tmp: Path, schedule: str, m: int, warmup: int, steps: int,
    shape: dict[str, int] = SHAPE,
) -> Any:  # fmt: skip
    strategy = Pipeline(STAGES, schedule, m, 1, None, "none")
    model = strategy.wrap(_model(shape), env, "32")
    strategy.attach(_loss, contextlib.nullcontext, lambda t: t, grad_accum_steps=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batch = [(*_batch(shape), 0)]

    def step() -> None:
        strategy.forward_backward(batch, time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # the warm-up's times left out of the stages' own (rank_scalars reads and resets them)
    step_s = step_seconds(step, warmup, steps, after_warmup=strategy.rank_scalars)
    row = {"step_s": step_s, **strategy.rank_scalars(),
           **_state_mb(model, optimizer)}  # fmt: skip
    rows: list[Any] = [None] * env.world_size
    dist.all_gather_object(rows, row)
    return {"step_s": max(r["step_s"] for r in rows), "ranks": rows}


def _state_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    sizes = MemoryUse(model, optimizer).scalars()
    return {"state_mb": sum(sizes[f"memory/{k}_mb"] for k in ("params", "grads", "optimizer"))}
