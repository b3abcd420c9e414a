"""Section `startup`: the start-up and the whole process, as the user feels them.

(5) seconds from launch to rank 0's first optimizer step, dpt (benchmarks/stamped_train.py)
against the plain loop, and the whole process's cost per extra step, from runs of N1 and N2 steps
(MLP, both loops at the default log_every_n_steps=10); (6) the cost of logging every step, in one
process, from `Trainer.fit`'s wall time. Report: benchmarks/report/startup.py (5) and
benchmarks/report/overhead.py (6).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.jobs import LOG_RARELY, Job, Results, Workload, child_env, run_rounds, throughputs
from benchmarks.runner import Say, Stat, paired_ratios


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """(5) time to the first optimizer step, and the whole process's cost per step, from runs
    of N1 and N2 steps (MLP, both loops at the default log_every_n_steps=10); (6) the cost of
    logging every step, in one process (MLP: its steps are the shortest, so any fixed per-step
    cost shows most; section 6's in-place timings cover two ranks)."""
    n1, n2 = (20, 40) if args.smoke else (50, 250) if args.quick else (100, 600)
    short = Workload("mlp", 64, warmup_steps=0, steps=n1, device=args.device)
    long = replace(short, steps=n2)
    steps = 40 if args.smoke else 120 if args.quick else 200
    every = Workload("mlp", 64, warmup_steps=20, steps=steps, log_every=1, device=args.device)
    rarely = replace(every, log_every=LOG_RARELY)
    worlds = [("single", 1)] if args.quick else [("single", 1), *(("ddp", n) for n in args.worlds)]
    pairs = {
        (s, n): [(Job("plain", s, n, w), Job("dpt", s, n, w, stamp_first_step=True))
                 for w in (short, long)]
        for s, n in worlds
    }  # fmt: skip
    logging = [[Job("plain", "single", 1, every), Job("dpt", "single", 1, every),
                Job("dpt", "single", 1, rarely)]]  # fmt: skip
    groups = [[job for pair in world for job in pair] for world in pairs.values()] + logging
    env = child_env(args, args.device)
    results = run_rounds(groups, args.rounds, tmp / "startup", env, say, args.retried)
    return {
        "startup": [startup_row(results, world) for world in pairs.values()],
        "marginal": [marginal_row(results, *world) for world in pairs.values()],
        "logging": [logging_row(results, g[1], g[2], g[0]) for g in logging],
    }


def startup_row(results: Results, pairs: Sequence[tuple[Job, Job]]) -> dict[str, object]:
    """Time from launch to the return of the first optimizer step, over every (plain, dpt) pair
    of runs made side by side."""
    p = [r.first_step_s() for plain, _ in pairs for r in results[plain]]
    d = [r.first_step_s() for _, dpt in pairs for r in results[dpt]]
    dpt = pairs[0][1]
    return {
        "strategy": dpt.strategy,
        "world": dpt.world,
        "plain": Stat.of(p),
        "dpt": Stat.of(d),
        "extra_s": Stat.of([a - b for a, b in zip(d, p, strict=True)]),
        "ratio": paired_ratios(d, p),
    }


def logging_row(results: Results, every_step: Job, rarely: Job, plain: Job) -> dict[str, object]:
    """Per-step cost of reading back and writing metrics at every step, from Trainer.fit's wall
    time at log_every_n_steps=1 against a run that never logs inside (same steps otherwise)."""
    steps = every_step.work.steps
    walls = [
        (a.fit_wall_s or 0.0, b.fit_wall_s or 0.0)
        for a, b in zip(results[every_step], results[rarely], strict=True)
    ]
    cost = [(a - b) / steps for a, b in walls]
    step_s = [b / steps for _, b in walls]
    return {
        "strategy": every_step.strategy,
        "world": every_step.world,
        "step_ms": Stat.of([s * 1e3 for s in step_s]),
        "cost_ms": Stat.of([c * 1e3 for c in cost]),
        "cost_pct": Stat.of([100 * c / s for c, s in zip(cost, step_s, strict=True)]),
        "ratio_at_1": paired_ratios(throughputs(results, every_step), throughputs(results, plain)),
    }


def marginal_row(
    results: Results, short: tuple[Job, Job], long: tuple[Job, Job]
) -> dict[str, object]:
    """The cost of one more step as the user feels it: whole-process wall time of a long and a
    short run, (wall(long) - wall(short)) / (steps(long) - steps(short)), per loop and round;
    start-up, teardown and everything else a run pays once cancel out. `short` and `long` are
    (plain, dpt) pairs of the same workload but for its steps."""
    extra = long[0].work.steps - short[0].work.steps

    def per_step_ms(small: Job, large: Job) -> list[float]:
        walls = zip(results[small], results[large], strict=True)
        return [1e3 * (b.wall_s - a.wall_s) / extra for a, b in walls]

    p, d = per_step_ms(short[0], long[0]), per_step_ms(short[1], long[1])
    dpt = short[1]
    return {
        "strategy": dpt.strategy,
        "world": dpt.world,
        "steps": (short[0].work.steps, long[0].work.steps),
        "log_every": dpt.work.log_every,
        "plain_wall_s": [Stat.of([r.wall_s for r in results[job]]) for job in (short[0], long[0])],
        "dpt_wall_s": [Stat.of([r.wall_s for r in results[job]]) for job in (short[1], long[1])],
        "plain_ms": Stat.of(p),
        "dpt_ms": Stat.of(d),
        "ratio": paired_ratios(d, p),
    }
