"""The one runner every section shares: medians with their spread, paired ratios, contenders
alternated round by round, processes run with a timeout, and worlds of ranks started in-process.

- `Stat`, `paired_ratios`: a median with its range, never a single time; ratios of measurements
  taken side by side (round i with round i).
- `time_calls`: seconds per call.
- `alternate`: every contender once per round, in order (A, B, A, B, ...), warmup rounds dropped.
- `run_process`: a command in its own process group, output to a file, killed whole on timeout;
  a failure raises `RunError` with the tail of the output.
- `spawn_world`: a function on N CPU ranks over Gloo (this process serves the rendezvous store);
  what rank 0's function returned comes back as JSON (`Stat`s included).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
Say = Callable[[str], None]  # a progress line for the console


@dataclass(frozen=True)
class Stat:
    """The median of repeated measurements, with their range: a single time is never reported."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("no measurements")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, spec: str = ",.0f", spread: bool = True) -> str:
        text = format(self.median, spec)
        if spread and self.n > 1:
            text += f" ({format(self.low, spec)}-{format(self.high, spec)})"
        return text


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Stat:
    """Ratios of measurements taken side by side (round i with round i): the load on a shared
    machine drifts between rounds, much less between two neighbouring runs."""
    return Stat.of([a / b for a, b in zip(numerators, denominators, strict=True)])


def time_calls(func: Callable[[], object], repeat: int) -> list[float]:
    """Seconds per call, `repeat` calls, each timed on its own."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        times.append(time.perf_counter() - start)
    return times


def step_seconds(
    step: Callable[[], object],
    warmup: int,
    steps: int,
    after_warmup: Callable[[], object] | None = None,
) -> float:
    """Seconds per step of `steps` steps after `warmup` untimed ones (then `after_warmup`, e.g.
    a reset of what the warm-up counted); in a process group, every rank starts and ends the
    timed steps together (a barrier each side: the slowest rank's time is the world's)."""
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    if after_warmup is not None:
        after_warmup()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if dist.is_initialized():
        dist.barrier()
    return (time.perf_counter() - start) / steps


def alternate(
    contenders: Mapping[K, Callable[[], T]],
    rounds: int,
    warmup: int = 0,
    done: Callable[[K, int, float], None] | None = None,
) -> dict[K, list[T]]:
    """Every contender called once per round, in order, round after round (A, B, A, B, ...), so
    that each comparison is between neighbours in time; what the calls return, per contender.
    The first `warmup` rounds run too and are dropped (caches, allocators, DDP's buckets).
    `done(key, round, seconds)` follows every call (`round` counts from 0, warmup included)."""
    results: dict[K, list[T]] = {key: [] for key in contenders}
    for r in range(warmup + rounds):
        for key, contender in contenders.items():
            start = time.perf_counter()
            value = contender()
            if r >= warmup:
                results[key].append(value)
            if done is not None:
                done(key, r, time.perf_counter() - start)
    return results


class RunError(RuntimeError):
    """A benchmark run failed; the message holds the tail of its output."""


def run_process(
    cmd: Sequence[str],
    console: Path,
    env: Mapping[str, str],
    timeout_s: float,
    what: str,
    cwd: Path = REPO,
) -> tuple[float, float]:
    """`cmd` from the repo root (or `cwd`), its output to `console`, in a process group of its
    own: a timeout kills its workers too. Returns `time.time()` just before it started and once
    it had exited; a failure raises `RunError` naming `what`, with the output's last 40 lines."""
    args, environ = list(cmd), dict(env)
    with console.open("w") as out:
        launched = time.time()
        proc = subprocess.Popen(
            args,
            cwd=cwd,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a timeout kills the workers too
        )
        try:
            code: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timeout after {timeout_s:.0f} s"
        ended = time.time()
    if code != 0:
        tail = "\n".join(console.read_text().splitlines()[-40:])
        raise RunError(f"{what} failed: exit {code}\n{tail}")
    return launched, ended


# --- a world of ranks in this process's children ------------------------------------------------


def spawn_world(world: int, fn: Callable[..., Any], args: tuple[Any, ...], threads: int) -> Any:
    """`fn(env, tmp, *args)` on `world` CPU ranks over Gloo, each with `threads` intra-op
    threads; `env` is the rank's `dpt.distributed.DistEnv`, `tmp` a folder they share. `fn`
    must be a module-level function (it is pickled). Returns what rank 0's `fn` returned, through
    JSON (`Stat`s come back as `Stat`s)."""
    import torch.multiprocessing as mp

    from dpt.launch.launchers import restored_environ
    from dpt.rendezvous import loopback_store

    with tempfile.TemporaryDirectory(prefix="dpt-bench-world-") as tmp:
        out = Path(tmp) / "rank0.json"
        # This process serves the rendezvous store, as torchrun's agent does, on 127.0.0.1 at a
        # port the OS picks and keeps (a port found free and then released could be taken).
        store = loopback_store(0, True, timedelta(seconds=600))
        with restored_environ():
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
            os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the ranks are its clients
            mp.spawn(_world_rank, args=(fn, args, threads, Path(tmp)), nprocs=world)
        return json.loads(out.read_text(), object_hook=_stat_from_json)


def _world_rank(
    rank: int, fn: Callable[..., Any], args: tuple[Any, ...], threads: int, tmp: Path
) -> None:
    import torch

    from dpt.distributed import destroy_process_group, env_from_environment, init_process_group

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    env = env_from_environment("cpu")
    init_process_group(env, timeout_s=600)
    try:
        result = fn(env, tmp, *args)
        if rank == 0:
            (tmp / "rank0.json").write_text(json.dumps(result, default=_stat_to_json))
    finally:
        destroy_process_group()
    # Its work done, the rank leaves without the interpreter's finalization, as dpt's own
    # local ranks do: under torch 2.14 a spawned Gloo rank can abort there (SIGABRT, with
    # "terminate called without an active exception"), which would fail the measurement.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stat_to_json(value: object) -> object:
    if isinstance(value, Stat):
        return asdict(value)
    raise TypeError(type(value))


def _stat_from_json(obj: dict[str, Any]) -> object:
    return Stat(**obj) if obj.keys() == {"median", "low", "high", "n"} else obj
