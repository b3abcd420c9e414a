"""Section `loops`: dpt against the hand-written loop (benchmarks/plain_loop.py), and dpt's
strategies against each other.

(1) samples/s of dpt and of the plain loop, as subprocesses, at every logging cadence of
LOG_EVERY (10 and 50 steps), single and ddp; (2) single vs dp vs ddp and ddp's weak-scaling
efficiency (at the first cadence). ResNet-18's pairs also run "out of the box" (each loop with
the heap settings it gets when nothing is set). Report: benchmarks/report/loops.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.jobs import Job, Results, Workload, child_env, run_rounds, throughputs
from benchmarks.runner import Say, Stat, paired_ratios

LOG_EVERY = (10, 50)  # the logging cadences of the throughput targets, both loops alike


def workloads(quick: bool, device: str, smoke: bool = False) -> list[Workload]:
    """The throughput workloads, each at every cadence of LOG_EVERY. The MLP times 10 windows
    of 50 steps (~1 ms each); on 2 CPU cores ResNet-18 (32 px images, batch 8, ~0.1 s a step
    on an idle machine) times 8 windows of 10 steps and 3 windows of 50 steps, after a first
    window of warmup (with 2 windows, one step's hiccup moved the median by percents). The
    data sets hold 200 (MLP) and 100 (ResNet-18) batches, so that epochs end on logging steps
    in one process and in two: dpt also logs at an epoch's end, and a window cut there would
    hold two of its logs and other steps than the plain loop's."""
    mlp = Workload(
        "mlp", batch_size=64, warmup_steps=50, steps=550, device=device, num_samples=64 * 200
    )
    if smoke:  # the machinery only: three windows
        return [replace(mlp, warmup_steps=10, steps=40, log_every=LOG_EVERY[0])]
    if quick:  # a smoke run of every code path: one cadence is enough
        return [replace(mlp, warmup_steps=50, steps=150, log_every=LOG_EVERY[0])]
    resnet = Workload(
        "resnet18", 8, warmup_steps=10, steps=90, image_size=32, device=device,
        num_samples=8 * 100,
    )  # fmt: skip
    return [
        *(replace(mlp, log_every=every) for every in LOG_EVERY),
        resnet,
        replace(resnet, log_every=50, warmup_steps=50, steps=200),
    ]


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """(1) dpt / plain throughput at every cadence; (2) single vs dp vs ddp, scaling
    efficiency (at the first cadence). `--smoke`: single only."""
    loops, strategies, groups = [], [], []
    plans = []
    models = args.models.split(",")
    works = [w for w in workloads(args.quick, args.device, args.smoke) if w.model in models]
    worlds = [] if args.smoke else args.worlds
    for work in works:
        pairs = [(Job("plain", "single", 1, work), Job("dpt", "single", 1, work))]
        pairs += [(Job("plain", "ddp", n, work), Job("dpt", "ddp", n, work)) for n in worlds]
        first = work.log_every == LOG_EVERY[0]  # the strategies are compared at this cadence
        dp = Job("dpt", "dp", 1, work) if first and not args.smoke else None
        groups += [[*pairs[0], *([dp] if dp else [])], *(list(pair) for pair in pairs[1:])]
        plans.append((pairs, dp, first))
    # Each loop as it runs out of the box (the heap): ResNet-18, whose steps free large blocks.
    as_is = [
        tuple(replace(job, out_of_the_box=True) for job in pair)
        for pairs, _, _ in plans
        for pair in pairs
        if pair[0].work.model != "mlp" and pair[0].work.log_every == LOG_EVERY[0]
    ]
    groups += [list(pair) for pair in as_is]
    env = child_env(args, args.device)
    results = run_rounds(groups, args.rounds, tmp / "loops", env, say, args.retried)
    for pairs, dp, first in plans:
        loops += [loop_ratio_row(results, *pair) for pair in pairs]
        if first:
            others = [*([dp] if dp else []), *(dpt for _, dpt in pairs[1:])]
            strategies += strategy_rows(results, pairs[0][1], others)
    out_of_the_box = [loop_ratio_row(results, *pair) for pair in as_is]
    return {
        "loops": loops,
        "strategies": strategies,
        "workloads": works,
        "out_of_the_box": out_of_the_box,
    }


def loop_ratio_row(results: Results, plain: Job, dpt: Job) -> dict[str, object]:
    """dpt against the plain loop on one model, strategy and world size."""
    p, d = throughputs(results, plain), throughputs(results, dpt)
    n = dpt.work.steps
    loss_gap = max(
        abs(a.losses[n] - b.losses[n]) for a, b in zip(results[dpt], results[plain], strict=True)
    )
    return {
        "model": dpt.work.model,
        "strategy": dpt.strategy,  # the Job's (`dpt` here is a Job, not the package)
        "world": dpt.world,
        "batch": dpt.work.batch_size,
        "log_every": dpt.work.log_every,
        "plain": Stat.of(p),
        "dpt": Stat.of(d),
        "ratio": paired_ratios(d, p),
        "ratio_all_steps": paired_ratios(
            throughputs(results, dpt, all_steps=True), throughputs(results, plain, all_steps=True)
        ),
        "loss_gap": loss_gap,
    }


def strategy_rows(results: Results, single: Job, others: Sequence[Job]) -> list[dict[str, object]]:
    """Samples/s of each strategy; weak-scaling efficiency against `single` with the same
    per-process batch, paired round by round."""
    base = throughputs(results, single)
    rows = []
    for job in (single, *others):
        t = throughputs(results, job)
        rows.append(
            {
                "model": job.work.model,
                "strategy": job.strategy,
                "world": job.world,
                "batch": job.work.batch_size,
                "global_batch": job.samples_per_step,
                "log_every": job.work.log_every,
                "samples_s": Stat.of(t),
                "efficiency": Stat.of([a / (job.world * b) for a, b in zip(t, base, strict=True)]),
            }
        )
    return rows
