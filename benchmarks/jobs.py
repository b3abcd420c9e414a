"""dpt and the plain loop run as users run them (subprocesses), and what their timestamps say.

Both loops read the loss back every `log_every` steps and stamp the wall clock there: dpt in its
rank-0 TensorBoard events (`train/loss`), the plain loop in a JSON file. Throughput is taken over
the same logging windows of both, from step `warmup_steps` on: every window holds the same steps
and one read-back of each loop, and start-up and warmup are left out. A run's rate is the median
over its windows (robust to another process taking the core for a moment); the rate over all its
steps, epoch boundaries included, is kept too. Every run also records when its process started and
ended and when its first optimizer step returned (dpt through benchmarks/stamped_train.py):
start-up and the whole-process cost per step come from those. The sections `loops`, `startup`
and `gpu` run these jobs, alternated round by round (`run_rounds`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.runner import REPO, RunError, Say, alternate, run_process
from benchmarks.stamped_train import FIRST_STEP_ENV
from dpt.launch import allocator

LOG_RARELY = 10**6  # `trainer.log_every_n_steps` that never triggers inside a run
FIRST_STEP_FILE = "first_step.txt"  # where stamped_train.py stamps dpt's first optimizer step


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
    # dpt only: True runs benchmarks/stamped_train.py, which stamps the first optimizer step
    stamp_first_step: bool = False
    # False: both loops get dpt's heap settings through glibc's variables (dpt then leaves
    # glibc alone), so a ratio measures the loops. True: each loop as it runs out of the box,
    # the plain loop on glibc's defaults and dpt with the settings it makes itself.
    out_of_the_box: bool = False
    # dpt only: another checkout of the repo (a `git worktree` of another commit; section
    # `baseline`) whose entry script and package run instead of this checkout's; `rev` names it
    # in the label (`dpt@265ee25 single`). See `run_job` for how its own dpt gets imported.
    checkout: Path | None = None
    rev: str = ""

    @property
    def label(self) -> str:
        suffix = f" x{self.world}" if self.strategy == "ddp" else ""
        as_is = " as-is" if self.out_of_the_box else ""
        at = f"@{self.rev}" if self.checkout is not None else ""
        return f"{self.loop}{at} {self.strategy}{suffix}{as_is}"

    @property
    def root(self) -> Path:
        """The checkout the job runs from: this one, or `checkout`."""
        return self.checkout if self.checkout is not None else REPO

    @property
    def samples_per_step(self) -> int:
        return self.work.batch_size * self.world

    def command(self, run_dir: Path) -> list[str]:
        return self._dpt(run_dir) if self.loop == "dpt" else self._plain(run_dir)

    def _dpt(self, run_dir: Path) -> list[str]:
        w = self.work
        entry = self.root / ("benchmarks/stamped_train.py" if self.stamp_first_step else "train.py")
        if not entry.is_file():  # e.g. a baseline commit older than the stamped entry
            raise RunError(f"{self.label}: {entry} does not exist in that checkout")
        cmd = [
            sys.executable,
            str(entry),
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
            str(REPO / "benchmarks" / "plain_loop.py"),
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
            raise RunError("this run did not stamp its first optimizer step")
        return self.first_step - self.launched

    @property
    def wall_s(self) -> float:
        """The whole process, from `Popen` to its exit: what the user waits for."""
        return self.ended - self.launched


def child_env(args: argparse.Namespace, device: str) -> dict[str, str]:
    """The environment of the jobs: this one, unbuffered, with `--threads` intra-op threads."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        # One thread per process for both loops: on a shared box, a multi-threaded process
        # stalls whenever one of its threads loses its core (OpenMP barriers), which buries
        # every difference in noise. It is also what torchrun sets for multi-process jobs.
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def checkout_env(checkout: Path) -> dict[str, str]:
    """What a process needs to import `checkout`'s dpt rather than this one's. Started as a file,
    the checkout's entry puts its own folder first on sys.path, ahead of this checkout's editable
    install (a finder appended to sys.meta_path). But a local world's ranks fork from a server
    that multiprocessing starts as `python -c ...` in the launcher's working directory, and
    Python 3.11's forkserver ignores the launcher's sys.path: from this checkout's folder, or
    from anywhere else through the editable install, the ranks would import this checkout's dpt.
    So the job runs in `checkout` (`run_job` passes it as the working directory) with the
    checkout first on PYTHONPATH."""
    paths = [str(checkout), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(paths)}


def run_job(job: Job, run_dir: Path, env: dict[str, str], timeout_s: float) -> RunResult:
    run_dir.mkdir(parents=True)
    env = {k: v for k, v in env.items() if k not in allocator.HEAP_ENV}
    if not job.out_of_the_box:
        env.update(allocator.HEAP_ENV)
    env[FIRST_STEP_ENV] = str(run_dir / FIRST_STEP_FILE)  # read by stamped_train.py only
    if job.checkout is not None:
        env |= checkout_env(job.checkout)
    what = f"{job.label} ({job.work.model})"
    launched, ended = run_process(
        job.command(run_dir), run_dir / "console.txt", env, timeout_s, what, cwd=job.root
    )
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
    say: Say,
    retried: list[str] | None = None,
    timeout_s: float = 600,
) -> Results:
    """Every job once per round, the jobs of a group back to back (A, B, A, B, ... over rounds),
    so each ratio compares neighbours in time. A run that fails is run once more (a shared
    machine); its label and last output line go to `retried`."""
    runs = itertools.count()

    def contender(job: Job) -> Callable[[], RunResult]:
        def run() -> RunResult:
            run_dir = tmp / f"{next(runs):03d}-{job.loop}-{job.strategy}"
            try:
                return run_job(job, run_dir, env, timeout_s)
            except RunError as error:  # one more try, then give up
                say(f"  {error}\n  ... once more")
                last_line = str(error).strip().splitlines()[-1]
                (retried if retried is not None else []).append(f"{job.label}: {last_line}")
                return run_job(job, run_dir.with_name(f"{run_dir.name}-again"), env, timeout_s)

        return run

    def done(job: Job, r: int, seconds: float) -> None:
        say(f"  round {r + 1}/{rounds}  {job.work.model:8s} {job.label:14s} ({seconds:4.1f} s)")

    jobs = dict.fromkeys(job for group in groups for job in group)  # in order, each once
    return alternate({job: contender(job) for job in jobs}, rounds, done=done)


def throughputs(results: Results, job: Job, all_steps: bool = False) -> list[float]:
    """Samples/s of each of `job`'s runs: over its logging windows, or over all its steps."""
    if all_steps:
        return [r.samples_per_s_all_steps(job) for r in results[job]]
    return [r.samples_per_s(job) for r in results[job]]
