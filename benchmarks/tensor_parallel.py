"""Section `tensor_parallel` (not run by default): what splitting every layer over 2 ranks costs.

The GPT of section `pipeline_parallel` (6 blocks of width 256, 64 tokens, batch 16, SGD with
momentum) trained in one process (one thread), on 2 CPU ranks over Gloo with dpt's
`strategy.tensor_parallel=2` (ddp's wrap: a world of 2 is tp 2, dp 1; Megatron's column and
row splits with sequence parallelism, dpt/models/tensor_plans.py; the loss on the logits split
over the vocabulary, under loss_parallel) and on 2 ranks under ddp (each half the batch),
alternated round by round. Per run: the time per step and tokens/s; each rank's parameters,
gradients and optimizer state against the one process's, and its logits; the time each rank's
step spends in the collectives, from torch.profiler in a pass of its own after the timed steps
(its overhead stays out of the step time), by kind, each beside its floor: the same calls
issued alone, and an all-reduce of the same size. Its section of docs/performance.md sits
between two markers (benchmarks/report/tensor_parallel.py).

    python -m benchmarks --sections tensor_parallel --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import pipeline_parallel
from benchmarks.pipeline_parallel import BATCH, SHAPE, VOCAB, _batch, _loss, _model
from benchmarks.report.common import stamp
from benchmarks.runner import Say, alternate, spawn_world, step_seconds
from dpt.distributed import DistEnv
from dpt.loop.strategy import DDP
from dpt.observe.memory import MB, MemoryUse, local_bytes

DEGREE = 2  # ranks each layer is split over; the whole world (dp 1)
STATE = ("params", "grads", "optimizer")
# The collectives as the profiler names them inside a step (its thread): DTensor's functional
# ops, the c10d ops they call (nested in them: counted through them, not again), and the wait for
# a functional op's result. Gloo's own threads ("gloo:all_reduce", ...) run the transfers the
# step's thread waits for: counting them too would count that time twice.
COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d::")
STEP_EVENT = "tensor_parallel_step"  # marks a profiled step: what is summed runs inside one
GATHER = "_c10d_functional::all_gather_into_tensor"
SCATTER = "_c10d_functional::reduce_scatter_tensor"
REDUCE = "_c10d_functional::all_reduce"
KINDS = (GATHER, SCATTER, REDUCE)  # the collectives a step makes, each beside its floor
FLOOR_REPEATS = 20
# Each kind issued alone, on (its whole tensor, this rank's part): c10d's op that the functional
# one calls (torch 2.14's names; the older ones where torch has not renamed them yet).
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ISSUE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    GATHER: lambda whole, part: _GATHER(whole, part),
    SCATTER: lambda whole, part: _SCATTER(part, whole),
    REDUCE: lambda whole, part: dist.all_reduce(whole),
}


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    warmup, steps = (1, 2) if args.quick else (2, 8)
    contenders: dict[str, Any] = {
        "single": functools.partial(_single, warmup, steps),
        f"tp={DEGREE}": functools.partial(
            spawn_world, DEGREE, _rank, (warmup, steps), args.threads
        ),
        f"ddp={DEGREE}": functools.partial(
            spawn_world, DEGREE, _ddp_rank, (warmup, steps), args.threads
        ),
    }

    def done(key: str, r: int, seconds: float) -> None:
        say(f"  {key}, round {r + 1}/{args.rounds} done ({seconds:.0f} s)")

    started, load_before = time.time(), os.getloadavg()
    measured = alternate(contenders, args.rounds, done=done)
    return {"tensor_parallel": {"runs": measured, "steps": steps, "shape": SHAPE,
                                "batch": BATCH, "vocab": VOCAB, "degree": DEGREE,
                                "floor_repeats": FLOOR_REPEATS, **stamp(args, started),
                                "load": (load_before, os.getloadavg())}}  # fmt: skip


def _single(warmup: int, steps: int, shape: dict[str, int] = SHAPE) -> dict[str, Any]:
    """The whole model in this process, one thread (as each rank has): pipeline_parallel's, its
    state by kind."""
    return pipeline_parallel._single(warmup, steps, shape, _state_mb)


def _rank(env: DistEnv, tmp: Path, warmup: int, steps: int, shape: dict[str, int] = SHAPE) -> Any:
    """One rank of the tensor-parallel world: dpt's own wrap, loss context and gradient sync,
    as the trainer calls them; the timed steps, then as many again under the profiler."""
    strategy = DDP(None, False, tensor_parallel=DEGREE)
    strategy.split_logits = True  # a language model's loss, as dpt's task says
    model = strategy.wrap(_model(shape), env, "32")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    inputs, targets = _batch(shape)  # every rank of a tensor group reads the same batch
    logits: list[float] = []

    def step() -> None:
        with strategy.loss_context():  # the loss on the vocabulary's slices, and its backward
            output = model(inputs)
            _loss(output, targets).backward()
        logits.append(local_bytes(output) / MB)
        strategy.sync_gradients(model)  # the replicated layers' partial gradients summed
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_s = step_seconds(step, warmup, steps)
    profiled = _profiled(step, steps)
    row = {"step_s": step_s, **_state_mb(model, optimizer), **profiled,
           "replicated_mb": _replicated_mb(model), "logits_mb": max(logits),
           "floors": _floors(profiled.pop("sizes"))}  # fmt: skip
    rows: list[Any] = [None] * env.world_size
    dist.all_gather_object(rows, row)
    return {"step_s": max(r["step_s"] for r in rows), "ranks": rows}


def _ddp_rank(env: DistEnv, tmp: Path, warmup: int, steps: int,
              shape: dict[str, int] = SHAPE) -> Any:  # fmt: skip
    """One rank of plain ddp on the same model and global batch (each rank half of it)."""
    strategy = DDP(None, False)
    model = strategy.wrap(_model(shape), env, "32")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    inputs, targets = (t[env.rank :: env.world_size] for t in _batch(shape))

    def step() -> None:
        _loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {"step_s": step_seconds(step, warmup, steps)}


def _profiled(step: Callable[[], None], steps: int) -> dict[str, Any]:
    """`steps` more steps under torch.profiler (CPU): the seconds per step this thread spent in
    collectives, and by kind; their calls per step by name and size; the profiled step's own
    time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with record_function(STEP_EVENT):
                step()
        dist.barrier()
        elapsed = time.perf_counter() - start
    seconds, calls = collective_time(prof.events())
    sizes = collective_sizes(prof.events(), dist.get_world_size())
    return {"profiled_step_s": elapsed / steps, "collectives_s": seconds / steps,
            "calls": {name: n / steps for name, n in sorted(calls.items())},
            "sizes": {name: {numel: n / steps for numel, n in found.items()}
                      for name, found in sizes.items()}}  # fmt: skip


def is_collective(name: str) -> bool:
    return name.startswith(COLLECTIVE_PREFIXES)


def collective_time(events: Iterable[Any]) -> tuple[float, Counter[str]]:
    """Seconds in the outermost collective events inside the profiled steps (a c10d op inside
    a functional one is its body: counted once, through its caller; a barrier between steps is
    no part of one), and how many calls of each name. The events are the profiler's (`name`,
    `cpu_parent` on the same thread, `cpu_time_total` in us)."""
    total, calls = 0.0, Counter[str]()
    for event in events:
        if is_collective(event.name) and _outermost_in_step(event):
            total += event.cpu_time_total / 1e6
            calls[event.name] += 1
    return total, calls


def collective_sizes(events: Iterable[Any], world: int) -> dict[str, Counter[int]]:
    """The outermost collectives inside the profiled steps by name (waits left out), and their
    calls by the elements of the whole tensor each moves (an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor), from the profiler's input shapes."""
    sizes: dict[str, Counter[int]] = {}
    for event in events:
        if event.name in KINDS and _outermost_in_step(event) and event.input_shapes:
            numel = math.prod(event.input_shapes[0]) * (world if event.name == GATHER else 1)
            sizes.setdefault(event.name, Counter())[numel] += 1
    return sizes


def _floors(sizes: dict[str, dict[int, float]], repeats: int = FLOOR_REPEATS) -> dict[str, Any]:
    """Each kind's calls per step issued alone (c10d's op on the same group, fp32 tensors of the
    step's sizes) and its floor: an all-reduce of each call's whole tensor; ms per step, the
    median of `repeats` of each."""
    world, found = dist.get_world_size(), {}
    for name, calls in sorted(sizes.items()):
        alone = floor = 0.0
        for numel, per_step in calls.items():
            whole, part = torch.zeros(numel), torch.zeros(numel // world)
            issue = functools.partial(ISSUE[name], whole, part)
            alone += per_step * _median_s(issue, repeats)
            floor += per_step * _median_s(functools.partial(dist.all_reduce, whole), repeats)
        found[name] = {"calls": sum(calls.values()), "alone_ms": alone * 1e3,
                       "floor_ms": floor * 1e3,
                       "mb": sum(n * c for n, c in calls.items()) * 4 / MB}  # fmt: skip
    return found


def _median_s(call: Callable[[], Any], repeats: int) -> float:
    """The median seconds of `call` over `repeats` (every rank calls it in step)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _outermost_in_step(event: Any) -> bool:
    """Whether `event` runs inside a profiled step (the step's thread: Gloo's own threads'
    events have no step above them) with no collective above it."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == STEP_EVENT:
            return True
        if is_collective(parent.name):
            return False
        parent = parent.cpu_parent
    return False


def _state_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """This rank's training state by kind (`memory/*_mb`: DTensors' local parts), and its sum."""
    sizes = MemoryUse(model, optimizer).scalars()
    each = {f"{k}_mb": sizes[f"memory/{k}_mb"] for k in STATE}
    return {**each, "state_mb": sum(each.values())}


def _replicated_mb(model: nn.Module) -> float:
    """MB of the parameters every rank holds whole (no dimension of them split)."""
    from torch.distributed.tensor import DTensor, Replicate

    def whole(p: torch.Tensor) -> bool:
        return not isinstance(p, DTensor) or all(isinstance(s, Replicate) for s in p.placements)

    return sum(local_bytes(p) for p in model.parameters() if whole(p)) / MB
