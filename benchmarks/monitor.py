"""Section `monitor` (not run by default): what the monitor of issue #28 (dpt/monitor) costs.

(1) The detectors at their defaults, timed in place: the monitor's calls at an agreement as
`Trainer.agree` and `Trainer.after_agreement` make them (`Monitor.payload`, `Monitor.step_values`,
`Monitor.judge` on the steps, then on the logging windows for the slowdown), on a decaying, noisy
loss curve, so that the detectors take their normal path (their levels taken again every
window // 10 values, no alarm). At the cadences of section 6 (an agreement per window of 10
steps; agreements at the loop's own cadence, one per 100 windows, at log_every_n_steps=1 and
10), in a 1-rank and a 2-rank Gloo world, per step, against the world's MLP step, alternated
block by block in the same processes. The monitor does no collective of its own; its payload
rides on the agreement's `all_gather`, which is timed with and without its floats. (2) End to
end: `python train.py` on the MLP with the monitor at its defaults against the monitor off,
alternated. (3) The gradient diagnostics (`GradDiagnostics.before_update` + `after_update`) and
(4) the gradient norm that grad_spike's reactions need without clipping (`Precision.norm`), per
call, against the step of the MLP and of ResNet-18 (32 px, batch 8). Report:
benchmarks/report/monitor.py, between its own markers, so `--sections monitor` leaves the rest of
the report as it was.

    python -m benchmarks --sections monitor
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.jobs import Job, RunResult, Workload, child_env, run_rounds
from benchmarks.runner import Say, Stat, alternate, paired_ratios, spawn_world, time_calls
from benchmarks.sync import SyncModel, _build, dpt_ddp_options
from dpt.config.monitor import MonitorConfig
from dpt.distributed import DistEnv, all_gather_floats
from dpt.launch import allocator
from dpt.loop.agreement import MAX_WINDOWS, Agreement, Payload
from dpt.loop.interrupt import StopRequest
from dpt.loop.precision import Precision
from dpt.loop.strategy import DDP
from dpt.monitor.grad_diagnostics import GradDiagnostics
from dpt.monitor.monitor import Monitor
from dpt.observe.metrics import SINCE, WINDOW

# Cadences, as section 6's: (log_every_n_steps, logging windows per agreement). An agreement per
# window of 10 steps; and the loop's own, where steps this short share one agreement among
# MAX_WINDOWS windows (dpt.loop.agreement.SPACING_S).
CADENCES = {"window_10": (10, 1), "every_1": (1, MAX_WINDOWS), "every_10": (10, MAX_WINDOWS)}
BLOCK_STEPS = 1000  # steps per timed block of agreements, at every cadence
HEADER = 3  # the floats `Agreement.agree` puts before the payload (flags and time)
BATCH = 64  # the MLP's, per rank
STEP_S = 1e-3  # a window's data wait and compute per step, as the slowdown detector reads it
DIAGNOSED_EVERY = (10, 100)  # monitor.grad_diagnostics_every shown in the report
# The monitor off, in the end-to-end runs; nonfinite stays (it is the trainer's, not a detector).
MONITOR_OFF = ("monitor.loss_spike.action=off", "monitor.grad_spike.action=off",
               "monitor.slowdown.action=off")  # fmt: skip


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """(1) the detectors in place in 2 and 1 ranks, (3, 4) the diagnostics and the norm in one,
    (2) the MLP end to end, monitor on and off."""
    blocks = 3 if args.smoke else 10 if args.quick else 30
    models = [] if args.smoke else ["mlp"] if args.quick else ["mlp", "resnet18"]
    world2 = spawn_world(2, _rank, (blocks, []), args.threads)
    say("  detectors in 2 ranks done")
    world1 = spawn_world(1, _rank, (blocks, models), args.threads)
    say("  detectors, diagnostics and norm in 1 rank done")
    return {"monitor": {
        "detectors": {1: world1["detectors"], 2: world2["detectors"]},
        "gather": world2["gather"],
        "step_costs": world1["step_costs"],
        "end_to_end": end_to_end(args, tmp, say),
        "quick": args.quick,
    }}  # fmt: skip


def _rank(env: DistEnv, tmp: Path, blocks: int, models: list[str]) -> dict[str, Any]:
    allocator.keep_freed_memory()  # the heap as in dpt's ranks: the clones and norms allocate
    report: dict[str, Any] = {"detectors": detector_costs(env, tmp, blocks)}
    if env.world_size > 1:
        report["gather"] = gather_costs(env, blocks)
    report["step_costs"] = [step_costs(name, blocks) for name in models]
    return report


def _us(seconds: list[float]) -> Stat:
    return Stat.of([t * 1e6 for t in seconds])


# --- (1) the detectors, in place ------------------------------------------------------------


class LossCurve:
    """A rank's training loss as the monitor sees it: decaying, with 5 % noise around its level
    (no spike: at threshold 10 an alarm needs ten times that)."""

    def __init__(self, seed: int) -> None:
        self.random, self.step = random.Random(seed), 0

    def take(self, steps: int) -> list[float]:
        values = []
        for _ in range(steps):
            self.step += 1
            level = 0.1 + 2.2 * math.exp(-self.step / 5000)
            values.append(level * (1 + 0.05 * self.random.gauss(0.0, 1.0)))
        return values


class MonitorCalls:
    """The agreements of a run at one cadence, on one rank: what the metrics send stands in as
    zeros of its size; the monitor's part is its own, with the settings' defaults (MonitorConfig;
    no YAML of dpt/conf overrides them) and no gradient clipping."""

    def __init__(self, env: DistEnv, run_dir: Path, log_every: int, windows: int) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.env, self.log_every, self.windows = env, log_every, windows
        self.monitor = Monitor(MonitorConfig(), run_dir, env.is_main, clipping=False,
                               sharded_norm=False)  # fmt: skip
        self.agreement = Agreement(env, 10**9, "error", log_every, spacing_s=0.0)
        self.curve, self.jitter = LossCurve(env.rank), random.Random(100 + env.rank)
        self.stop, self.step, self.events = StopRequest(), 0, 0
        self.metrics_floats = len(SINCE) + len(WINDOW) * windows  # `MetricsLogger.payload()`'s

    @property
    def steps(self) -> int:
        """Steps per agreement."""
        return self.log_every * self.windows

    def agreement_s(self) -> float:
        """One agreement; the seconds of the monitor's part of it."""
        losses, windows = self.curve.take(self.steps), self._windows()
        start = time.perf_counter()
        mine = Payload([0.0] * self.metrics_floats, self.monitor.payload(losses, []))
        paused = time.perf_counter()
        verdict = self.agreement.agree(self.stop, self.step + self.steps, losses, mine.row())
        resumed = time.perf_counter()
        self.step += self.steps
        world_batch = BATCH * self.env.world_size
        values = self.monitor.step_values(mine.split(verdict.rows).monitor, self.step, 0,
                                          self.step * world_batch, world_batch)  # fmt: skip
        judged = self.monitor.judge(values, None, [])
        slow = self.monitor.judge([], None, windows, 0)  # after_agreement's
        end = time.perf_counter()
        self.events += len(judged.events) + len(slow.events)
        return paused - start + end - resumed

    def block_us(self) -> float:
        """Microseconds of the monitor's work per step, over agreements of BLOCK_STEPS steps."""
        agreements = max(1, BLOCK_STEPS // self.steps)
        total = sum(self.agreement_s() for _ in range(agreements))
        return total / (agreements * self.steps) * 1e6

    def _windows(self) -> list[tuple[int, list[dict[str, float]]]]:
        """The logging windows an agreement hands the slowdown detector (`MetricsLogger.agreed`
        makes them from every rank's row): steps of about STEP_S, a little jitter per rank."""
        windows = []
        for i in range(1, self.windows + 1):
            world = []
            for _ in range(self.env.world_size):
                work_s = self.log_every * STEP_S * (0.9 + 0.1 * self.jitter.random())
                values = [1.0, 0.0, self.log_every, BATCH * self.log_every, work_s, 0.0, work_s]
                world.append(dict(zip(WINDOW, values, strict=True)))
            windows.append((self.step + i * self.log_every, world))
        return windows


def training_step(env: DistEnv, ddp: bool) -> Callable[[], float]:
    """The MLP's step (32 -> [256, 256] -> 10, batch 64 per rank, Adam): the model alone (the
    default job's step), or under dpt's DDP with its defaults. Returns a block's median seconds
    per step."""
    model, inputs, labels = _build(SyncModel("mlp", BATCH))
    if ddp:
        model = DDP(**dpt_ddp_options()).wrap(model, env, "32")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def block() -> float:
        _barrier()
        return Stat.of(time_calls(step, 100)).median

    return block


def _barrier() -> None:
    """Both ranks start a timed block together (nothing to wait for in one rank)."""
    if dist.is_initialized():
        dist.barrier()


def detector_costs(env: DistEnv, tmp: Path, blocks: int) -> dict[str, Any]:
    """Per cadence: the monitor's microseconds per step and their share of the MLP step (the
    model alone, the default job's: a 2-rank step, its all-reduce included, is longer), paired
    block by block; how many events were raised (0: the detectors' normal path). In 2 ranks the
    ddp step is timed too, for the text."""
    calls = {
        name: MonitorCalls(env, tmp / f"monitor-{name}-{env.rank}", *cadence)
        for name, cadence in CADENCES.items()
    }
    for c in calls.values():  # the levels warmed up (20 values), the first agreement planned
        c.block_us()
    steps = {"step": training_step(env, ddp=False)}
    if env.world_size > 1:
        steps["ddp_step"] = training_step(env, ddp=True)
    contenders = {**steps, **{n: c.block_us for n, c in calls.items()}}
    measured = alternate(contenders, blocks, warmup=1)
    step_s = measured["step"]
    return {
        **{f"{key}_ms": Stat.of([t * 1e3 for t in measured[key]]) for key in steps},
        "cadences": {
            name: {
                "log_every": c.log_every, "windows": c.windows, "us": Stat.of(measured[name]),
                "pct": paired_ratios([100 * us / 1e6 for us in measured[name]], step_s),
                "events": c.events,
            }
            for name, c in calls.items()
        },
    }  # fmt: skip


def gather_costs(env: DistEnv, blocks: int) -> dict[str, Any]:
    """The agreement's `all_gather` per cadence, without and with the monitor's floats (one loss
    per step); the difference per step, paired block by block."""
    sizes = {}
    for name, (log_every, windows) in CADENCES.items():
        base = HEADER + len(SINCE) + len(WINDOW) * windows
        sizes[name] = (base, base + log_every * windows)

    def gather(floats: int) -> float:
        _barrier()
        return Stat.of(time_calls(lambda: all_gather_floats([0.0] * floats, env), 20)).median

    contenders = {
        (name, with_monitor): functools.partial(gather, size[with_monitor])
        for name, size in sizes.items()
        for with_monitor in (0, 1)
    }
    measured = alternate(contenders, blocks, warmup=1)
    report = {}
    for name, (log_every, windows) in CADENCES.items():
        without, with_ = measured[(name, 0)], measured[(name, 1)]
        steps = log_every * windows
        report[name] = {
            "floats": sizes[name],
            "without_us": _us(without),
            "with_us": _us(with_),
            "extra_us_per_step": Stat.of(
                [(b - a) / steps * 1e6 for a, b in zip(without, with_, strict=True)]
            ),
        }
    return report


# --- (3, 4) the gradient diagnostics and the norm for grad_spike ------------------------------


@dataclass(frozen=True)
class StepModel:
    batch: int
    steps_per_block: int
    rounds: int  # for --quick and --smoke: at most the section's blocks


STEP_MODELS = {"mlp": StepModel(BATCH, 50, 30), "resnet18": StepModel(8, 3, 10)}


def step_costs(name: str, blocks: int) -> dict[str, Any]:
    """A training step, a step with the diagnostics around its update, and one with the norm
    computed (trainer.grad_clip_norm=null), alternated block by block; each block's median."""
    spec = STEP_MODELS[name]
    model, inputs, labels = _build(SyncModel(name, spec.batch, image_size=32))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    precision, diagnostics = Precision("32", torch.device("cpu")), GradDiagnostics(model, 1)

    def step(between: Callable[[], None], after: Callable[[], object]) -> tuple[float, float]:
        """Seconds of the whole step, and of `between` (before the update) and `after`."""
        start = time.perf_counter()
        F.cross_entropy(model(inputs), labels).backward()
        before = time.perf_counter()
        between()
        update = time.perf_counter()
        optimizer.step()
        stepped = time.perf_counter()
        after()
        end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        return end - start, update - before + end - stepped

    variants = {
        "step": functools.partial(step, lambda: None, lambda: None),
        "diagnostics": functools.partial(step, diagnostics.before_update, diagnostics.after_update),
        "norm": functools.partial(step, lambda: precision.norm(model, optimizer), lambda: None),
    }

    def block(variant: Callable[[], tuple[float, float]]) -> tuple[float, float]:
        times = [variant() for _ in range(spec.steps_per_block)]
        return Stat.of([t for t, _ in times]).median, Stat.of([c for _, c in times]).median

    contenders = {key: functools.partial(block, v) for key, v in variants.items()}
    measured = alternate(contenders, min(spec.rounds, blocks), warmup=1)
    step_s = [t for t, _ in measured["step"]]
    diagnosed = [c for _, c in measured["diagnostics"]]
    norm = [c for _, c in measured["norm"]]
    return {
        "model": name, "batch": spec.batch,
        "step_ms": Stat.of([t * 1e3 for t in step_s]),
        "diagnostics_us": _us(diagnosed),
        **{f"diagnostics_pct_every_{n}": _shares(diagnosed, step_s, n) for n in DIAGNOSED_EVERY},
        "norm_us": _us(norm), "norm_pct": _shares(norm, step_s, 1),
    }  # fmt: skip


def _shares(calls: list[float], steps: list[float], every: int) -> Stat:
    """Percent of a step for a call made every `every` steps, paired block by block."""
    return paired_ratios([100 * c for c in calls], [every * s for s in steps])


# --- (2) end to end ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MonitorJob(Job):
    """dpt's job with the monitor's detectors at their defaults, or off."""

    monitor: bool = True

    @property
    def label(self) -> str:
        return f"{super().label} monitor {'on' if self.monitor else 'off'}"

    def command(self, run_dir: Path) -> list[str]:
        return super().command(run_dir) + ([] if self.monitor else list(MONITOR_OFF))


def end_to_end(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """The MLP in one process (batch 64, log_every_n_steps=10; 200 batches an epoch, as section
    1), monitor on and off alternated: samples/s of `Trainer.fit` (metrics.json's
    `samples_per_s`) and over its logging windows after warmup, paired round by round."""
    warmup, steps = (10, 40) if args.smoke else (50, 600) if args.quick else (100, 3000)
    work = Workload("mlp", BATCH, warmup, steps, num_samples=BATCH * 200)
    on = MonitorJob("dpt", "single", 1, work)
    off = MonitorJob("dpt", "single", 1, work, monitor=False)
    env = child_env(args, "cpu")
    results = run_rounds([[on, off]], args.rounds, tmp / "monitor", env, say, args.retried)

    def fit_rates(job: MonitorJob) -> list[float]:
        return [_fit_samples_per_s(job, r) for r in results[job]]

    def window_rates(job: MonitorJob) -> list[float]:
        return [r.samples_per_s(job) for r in results[job]]

    return {
        "steps": steps, "warmup": warmup,
        "fit_on": Stat.of(fit_rates(on)), "fit_off": Stat.of(fit_rates(off)),
        "fit_ratio": paired_ratios(fit_rates(on), fit_rates(off)),
        "windows_on": Stat.of(window_rates(on)), "windows_off": Stat.of(window_rates(off)),
        "windows_ratio": paired_ratios(window_rates(on), window_rates(off)),
    }  # fmt: skip


def _fit_samples_per_s(job: Job, result: RunResult) -> float:
    """metrics.json's `samples_per_s`: the run's samples over `Trainer.fit`'s wall time."""
    assert result.fit_wall_s is not None, "a dpt run writes metrics.json"
    return job.samples_per_step * job.work.steps / result.fit_wall_s
