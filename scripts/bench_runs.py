"""dpt and the plain loop run as users run them (subprocesses), and what their timestamps say.

Both loops read the loss back every `log_every` steps and stamp the wall clock there: dpt in its
rank-0 TensorBoard events (`train/loss`), the plain loop in a JSON file. Throughput is taken over
the same logging windows of both, from step `warmup_steps` on: every window holds the same steps
and one read-back of each loop, and start-up and warmup are left out. A run's rate is the median
over its windows (robust to another process taking the core for a moment); the rate over all its
steps, epoch boundaries included, is kept too. Every run also records when its process started and
ended and when its first optimizer step returned (dpt through scripts/bench_train.py): start-up and
the whole-process cost per step come from those.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_common import FIRST_STEP_ENV, REPO, Stat, paired_ratios

from dpt.launch import allocator

LOG_RARELY = 10**6  # `trainer.log_every_n_steps` that never triggers inside a run
FIRST_STEP_FILE = "first_step.txt"  # where bench_train.py stamps dpt's first optimizer step


class BenchError(RuntimeError):
    """A benchmark run failed; the message holds the tail of its output."""


@dataclass(frozen=True)
class Workload:
    """A model on its data, with every knob the two loops share."""

    model: str  # mlp (synthetic vectors) | resnet18 (fake_images)
    batch_size: int  # per process
    warmup_steps: int  # the window starts after this step (a multiple of log_every)
    steps: int  # the run stops and the window ends here (a multiple of log_every)
    log_every: int = 10
    image_size: int = 32
    num_workers: int = 0
    device: str = "cpu"
    precision: str = "32"
    channels_last: bool = False
    num_samples: int | None = None  # None: the data set's default


@dataclass(frozen=True)
class Job:
    loop: str  # dpt | plain
    strategy: str  # single | dp | ddp
    world: int  # processes
    work: Workload
    # dpt only: True runs scripts/bench_train.py, which stamps the first optimizer step
    stamp_first_step: bool = False
    # False: both loops get dpt's heap settings through glibc's variables (dpt then leaves
    # glibc alone), so a ratio measures the loops. True: each loop as it runs out of the box,
    # the plain loop on glibc's defaults and dpt with the settings it makes itself.
    out_of_the_box: bool = False

    @property
    def label(self) -> str:
        suffix = f" x{self.world}" if self.strategy == "ddp" else ""
        as_is = " as-is" if self.out_of_the_box else ""
        return f"{self.loop} {self.strategy}{suffix}{as_is}"

    @property
    def samples_per_step(self) -> int:
        return self.work.batch_size * self.world

    def command(self, run_dir: Path) -> list[str]:
        return self._dpt(run_dir) if self.loop == "dpt" else self._plain(run_dir)

    def _dpt(self, run_dir: Path) -> list[str]:
        w = self.work
        entry = "scripts/bench_train.py" if self.stamp_first_step else "train.py"
        cmd = [
            sys.executable,
            str(REPO / entry),
            f"model={w.model}",
            f"strategy={self.strategy}",
            f"trainer.batch_size={w.batch_size}",
            f"trainer.max_steps={w.steps}",
            "trainer.epochs=100000",  # max_steps decides
            f"trainer.log_every_n_steps={w.log_every}",
            f"trainer.device={w.device}",
            f"trainer.precision={w.precision}",
            "checkpoint.enabled=false",
            f"dataset.num_workers={w.num_workers}",
            "dataset.num_val_samples=0",
            f"hydra.run.dir={run_dir}",
        ]
        if w.model != "mlp":
            cmd += [
                "dataset=fake_images",
                f"dataset.image_size={w.image_size}",
                f"model.channels_last={str(w.channels_last).lower()}",
            ]
        if w.num_samples:
            cmd.append(f"dataset.num_samples={w.num_samples}")
        if self.strategy == "ddp":
            cmd.append(f"launcher.nproc_per_node={self.world}")
        return cmd

    def _plain(self, run_dir: Path) -> list[str]:
        if self.strategy == "dp":
            raise ValueError("the plain loop has no DataParallel")
        w = self.work
        cmd = [
            sys.executable,
            str(REPO / "scripts" / "plain_loop.py"),
            f"--model={w.model}",
            f"--batch-size={w.batch_size}",
            f"--steps={w.steps}",
            f"--nproc={self.world}",
            f"--log-every={w.log_every}",
            f"--image-size={w.image_size}",
            f"--num-workers={w.num_workers}",
            f"--device={w.device}",
            f"--precision={w.precision}",
            f"--out={run_dir / 'plain.json'}",
        ]
        if w.channels_last:
            cmd.append("--channels-last")
        if w.num_samples:
            cmd.append(f"--num-samples={w.num_samples}")
        return cmd


@dataclass
class RunResult:
    launched: float  # time.time() just before the process started
    ended: float  # time.time() once it had exited
    stamps: dict[int, float]  # logging step -> wall-clock time, rank 0
    losses: dict[int, float]  # logging step -> rank 0's mean loss over the window
    first_step: float | None  # time.time() when rank 0's first optimizer step returned
    fit_wall_s: float | None = None  # dpt only: Trainer.fit's own wall time (metrics.json)

    def window_rates(self, job: Job) -> list[float]:
        """Samples/s of each logging window after warmup (dpt's extra stamps at epoch ends,
        which the plain loop does not make, are skipped: both get the same windows)."""
        w = job.work
        marks = range(w.warmup_steps, w.steps + 1, w.log_every)
        return [
            w.log_every * job.samples_per_step / (self.stamps[b] - self.stamps[a])
            for a, b in itertools.pairwise(marks)
        ]

    def samples_per_s(self, job: Job) -> float:
        return statistics.median(self.window_rates(job))

    def samples_per_s_all_steps(self, job: Job) -> float:
        w = job.work
        elapsed = self.stamps[w.steps] - self.stamps[w.warmup_steps]
        return (w.steps - w.warmup_steps) * job.samples_per_step / elapsed

    def first_step_s(self) -> float:
        """From `Popen` to the return of rank 0's first `optimizer.step()` (for dpt: only in
        runs with `stamp_first_step`)."""
        if self.first_step is None:
            raise BenchError("this run did not stamp its first optimizer step")
        return self.first_step - self.launched

    @property
    def wall_s(self) -> float:
        """The whole process, from `Popen` to its exit: what the user waits for."""
        return self.ended - self.launched


def run_job(job: Job, run_dir: Path, env: dict[str, str], timeout_s: float) -> RunResult:
    run_dir.mkdir(parents=True)
    console = run_dir / "console.txt"
    env = {k: v for k, v in env.items() if k not in allocator.ENV}
    if not job.out_of_the_box:
        env.update(allocator.ENV)
    env[FIRST_STEP_ENV] = str(run_dir / FIRST_STEP_FILE)  # read by bench_train.py only
    with console.open("w") as out:
        launched = time.time()
        proc = subprocess.Popen(
            job.command(run_dir),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills the workers too
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timeout after {timeout_s:.0f} s"
        ended = time.time()
    if code != 0:
        tail = "\n".join(console.read_text().splitlines()[-40:])
        raise BenchError(f"{job.label} ({job.work.model}) failed: exit {code}\n{tail}")
    read = _read_dpt if job.loop == "dpt" else _read_plain
    return read(run_dir, launched, ended)


def _read_dpt(run_dir: Path, launched: float, ended: float) -> RunResult:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb" / "rank0"), size_guidance={"scalars": 0})
    events.Reload()
    loss = events.Scalars("train/loss")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    first_step = run_dir / FIRST_STEP_FILE
    return RunResult(
        launched,
        ended,
        stamps={e.step: e.wall_time for e in loss},
        losses={e.step: e.value for e in loss},
        first_step=float(first_step.read_text()) if first_step.exists() else None,
        fit_wall_s=metrics["wall_time_s"],
    )


def _read_plain(run_dir: Path, launched: float, ended: float) -> RunResult:
    record = json.loads((run_dir / "plain.json").read_text())
    return RunResult(
        launched,
        ended,
        stamps={int(k): v for k, v in record["stamps"].items()},
        losses={int(k): v for k, v in record["losses"].items()},
        first_step=record["first_step"],
    )


Results = dict[Job, list[RunResult]]


def run_rounds(
    groups: Sequence[Sequence[Job]],
    rounds: int,
    tmp: Path,
    env: dict[str, str],
    say: Callable[[str], None],
    retried: list[str] | None = None,
    timeout_s: float = 600,
) -> Results:
    """Every job once per round, the jobs of a group back to back (A, B, A, B, ... over rounds),
    so each ratio compares neighbours in time. A run that fails is run once more (a shared
    machine); its label and last output line go to `retried`."""
    results: Results = {}
    for r in range(rounds):
        for g, group in enumerate(groups):
            for j, job in enumerate(group):
                start = time.perf_counter()
                run_dir = tmp / f"r{r}-g{g}-j{j}-{job.loop}-{job.strategy}"
                try:
                    result = run_job(job, run_dir, env, timeout_s)
                except BenchError as error:  # one more try, then give up
                    say(f"  {error}\n  ... once more")
                    last_line = str(error).strip().splitlines()[-1]
                    (retried if retried is not None else []).append(f"{job.label}: {last_line}")
                    result = run_job(
                        job, run_dir.with_name(f"{run_dir.name}-again"), env, timeout_s
                    )
                results.setdefault(job, []).append(result)
                say(
                    f"  round {r + 1}/{rounds}  {job.work.model:8s} {job.label:14s} "
                    f"({time.perf_counter() - start:4.1f} s)"
                )
    return results


# --- what the runs say --------------------------------------------------------------------------


def throughputs(results: Results, job: Job, all_steps: bool = False) -> list[float]:
    if all_steps:
        return [r.samples_per_s_all_steps(job) for r in results[job]]
    return [r.samples_per_s(job) for r in results[job]]


def loop_ratio_row(results: Results, plain: Job, dpt: Job) -> dict[str, object]:
    """dpt against the plain loop on one model, strategy and world size."""
    p, d = throughputs(results, plain), throughputs(results, dpt)
    n = dpt.work.steps
    loss_gap = max(
        abs(a.losses[n] - b.losses[n]) for a, b in zip(results[dpt], results[plain], strict=True)
    )
    return {
        "model": dpt.work.model,
        "strategy": dpt.loop.strategy,
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


def startup_row(results: Results, pairs: Sequence[tuple[Job, Job]]) -> dict[str, object]:
    """Time from launch to the return of the first optimizer step, over every (plain, dpt) pair
    of runs made side by side."""
    p = [r.first_step_s() for plain, _ in pairs for r in results[plain]]
    d = [r.first_step_s() for _, dpt in pairs for r in results[dpt]]
    dpt = pairs[0][1]
    return {
        "strategy": dpt.loop.strategy,
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
        "strategy": dpt.loop.strategy,
        "world": dpt.world,
        "steps": (short[0].work.steps, long[0].work.steps),
        "log_every": dpt.work.log_every,
        "plain_wall_s": [Stat.of([r.wall_s for r in results[job]]) for job in (short[0], long[0])],
        "dpt_wall_s": [Stat.of([r.wall_s for r in results[job]]) for job in (short[1], long[1])],
        "plain_ms": Stat.of(p),
        "dpt_ms": Stat.of(d),
        "ratio": paired_ratios(d, p),
    }
