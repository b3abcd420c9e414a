"""Section `sync`: gradient synchronisation and the loop's per-step costs, inside a real world of
processes (2 CPU ranks over Gloo; the per-step costs also in 1). Report: benchmarks/report/sync.py
(4) and benchmarks/report/overhead.py (6).

Bus bandwidth (the nccl-tests convention): busbw = 2 (n - 1) / n x bytes / time, for an
all-reduce over n ranks. Three ways to time the gradients' all-reduce, alternated round by round:

- bare: `dist.all_reduce` of one flat fp32 tensor as large as all the gradients;
- ddp, comm hook: dpt's DDP wrapper with a hook that stamps each bucket's all-reduce from launch
  to completion; the union of those intervals is the time the step spent communicating;
- ddp, exposed: a forward+backward step minus the same step under `no_sync()`: what the
  all-reduce adds to the step after overlapping with backward.

Also timed, as step-time ratios against dpt's default DDP: one bucket (no overlap with backward),
`static_graph=True`, `comm_hook=bf16`, and DDP with PyTorch's own defaults (the plain loop's).

The per-step costs are dpt's own calls around the training, timed in place as the loop makes them:
every step `MetricsLogger.record` (no device op, no wait); for one agreement per logging window
`Agreement.agree` with `MetricsLogger.payload()` (one read-back from the device and the one
`all_gather`) and `MetricsLogger.agreed` (TensorBoard scalars, a log line); and whole windows of
1, 10 and 50 steps, per step, at the loop's own cadence (agreements spaced by
`dpt.loop.agreement.SPACING_S`: with these instant steps, one per `MAX_WINDOWS` windows), timed over
blocks of `MAX_WINDOWS` windows, so that each block holds one agreement and all its writing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmarks.runner import Say, Stat, alternate, paired_ratios, spawn_world, time_calls
from dpt.data.loaders import build_loaders
from dpt.data.synthetic import SyntheticData
from dpt.distributed import DistEnv
from dpt.launch.cli import compose_from_argv
from dpt.loop.agreement import MAX_WINDOWS, Agreement
from dpt.loop.interrupt import StopRequest
from dpt.loop.strategy import DDP
from dpt.models.mlp import MLP
from dpt.models.resnet import resnet
from dpt.observe.dashboard import one_run
from dpt.observe.logs import setup_logging
from dpt.observe.metrics import MetricsLogger


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """(4) gradient all-reduce against a bare all-reduce, on a 2-rank Gloo world; and the
    per-step costs of dpt's loop at world sizes 1 and 2."""
    models = [SyncModel("mlp", 64, rounds=3 if args.smoke else 10 if args.quick else 30)]
    if not args.quick:
        models.append(SyncModel("resnet18", 32, image_size=32, rounds=7))
    calls = 10 if args.smoke else 50 if args.quick else 300
    world2 = measure(2, models, args.threads, calls)
    say("  2-rank world done")
    world1 = measure(1, [], args.threads, calls)
    return {"sync": world2["models"], "per_step": {1: world1["per_step"], 2: world2["per_step"]}}


@dataclass(frozen=True)
class SyncModel:
    name: str  # mlp | resnet18
    batch_size: int  # per rank
    image_size: int = 32
    rounds: int = 7


def measure(world: int, models: list[SyncModel], threads: int, per_step_calls: int) -> dict:
    """Start `world` CPU ranks over Gloo; rank 0's measurements come back as a dict."""
    return spawn_world(world, _rank, ([asdict(m) for m in models], per_step_calls), threads)


def _rank(env: DistEnv, tmp: Path, models: list[dict], calls: int) -> dict[str, Any]:
    report: dict[str, Any] = {"per_step": per_step_costs(env, tmp, calls)}
    if env.world_size == 1:
        report["per_step"] |= fetch_costs(calls)
    if env.world_size > 1:
        report["models"] = [sync_of(SyncModel(**m), env) for m in models]
    return report


# --- gradient all-reduce --------------------------------------------------------------------


class BucketTimer:
    """A DDP comm hook that does what the default does (mean all-reduce) and stamps each
    bucket from launch to completion."""

    def __init__(self) -> None:
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}

    # No annotations on `bucket` and the result: DDP checks them against the real classes, and
    # `from __future__ import annotations` turns them into strings that fail that check.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        index = bucket.index()
        self.starts[index] = time.perf_counter()
        future = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        def done(f: torch.futures.Future) -> torch.Tensor:
            self.ends[index] = time.perf_counter()
            return f.value()

        return future.then(done)

    def busy_s(self) -> float:
        """Seconds with a bucket in flight, each bucket counted from the moment the last rank
        launched it: a rank that reaches a bucket late (its backward ran slower) is not billed
        as communication. perf_counter is one clock for all processes of a machine."""
        order = sorted(self.starts)
        starts = torch.tensor([self.starts[i] for i in order], dtype=torch.float64)
        dist.all_reduce(starts, op=dist.ReduceOp.MAX)
        spans = sorted(zip(starts.tolist(), (self.ends[i] for i in order), strict=True))
        self.starts.clear()
        self.ends.clear()
        total, end = 0.0, float("-inf")
        for a, b in spans:  # the union of the intervals: buckets queue behind each other
            if b > end:
                total += b - max(a, end)
                end = b
        return total


def _build(spec: SyncModel) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if spec.name == "mlp":
        model: nn.Module = MLP((32,), 10, [256, 256])
        inputs = torch.randn(spec.batch_size, 32)
    else:
        size = (3, spec.image_size, spec.image_size)
        model = resnet(size, 10, arch=spec.name, weights=None, channels_last=False)
        inputs = torch.randn(spec.batch_size, 3, spec.image_size, spec.image_size)
    return model, inputs, torch.randint(0, 10, (spec.batch_size,))


@functools.cache  # composed once per process: Hydra's global state allows one app
def dpt_ddp_options() -> dict[str, Any]:
    """`strategy=ddp` as dpt composes it (dpt/conf/strategy/ddp.yaml): the variants change one
    option each."""
    node = compose_from_argv(["strategy=ddp"]).strategy
    return {k: v for k, v in node.items() if not str(k).startswith("_")}


def sync_of(spec: SyncModel, env: DistEnv) -> dict[str, Any]:
    model, inputs, labels = _build(spec)
    numel = sum(p.numel() for p in model.parameters())
    flat = torch.zeros(numel)

    defaults = dpt_ddp_options()

    def wrap(**options: Any) -> nn.Module:
        return DDP(**{**defaults, **options}).wrap(copy.deepcopy(model), env, "32")

    def timed(**options: Any) -> tuple[nn.Module, BucketTimer]:
        ddp, timer = wrap(**options), BucketTimer()
        ddp.register_comm_hook(None, timer.hook)  # type: ignore[operator]
        return ddp, timer

    ddp = wrap()  # dpt's defaults: 25 MB buckets, gradients as bucket views
    models = {
        "static": wrap(static_graph=True),
        "bf16": wrap(comm_hook="bf16"),
        # What the plain loop gets: DDP's own defaults (a 1 MiB first bucket, gradient copies).
        "torch_default": DistributedDataParallel(copy.deepcopy(model)),
    }
    hooked, timer = timed()
    # One bucket, launched when backward is over: the all-reduce has the core to itself.
    one_bucket, one_timer = timed(bucket_cap_mb=1e6)

    def step(m: nn.Module, sync: bool = True) -> None:
        with contextlib.nullcontext() if sync else m.no_sync():  # type: ignore[operator]
            F.cross_entropy(m(inputs), labels).backward()
        m.zero_grad(set_to_none=True)

    variants: dict[str, Callable[[], object]] = {
        "bare": lambda: dist.all_reduce(flat),
        "sync": lambda: step(ddp),
        "no_sync": lambda: step(ddp, sync=False),
        "hooked": lambda: step(hooked),
        "one_bucket": lambda: step(one_bucket),
        **{name: functools.partial(step, m) for name, m in models.items()},
    }
    timers = {"hooked": timer, "one_bucket": one_timer}

    def timed_step(name: str, fn: Callable[[], object]) -> tuple[float, float | None]:
        """Seconds of one call, and, for the hooked models, of its buckets in flight."""
        dist.barrier()  # both ranks start together: rank 0's clock times the collective
        (elapsed,) = time_calls(fn, 1)
        return elapsed, timers[name].busy_s() if name in timers else None

    # Two warmup rounds: DDP rebuilds its buckets at first.
    contenders = {name: functools.partial(timed_step, name, fn) for name, fn in variants.items()}
    measured = alternate(contenders, spec.rounds, warmup=2)
    times = {name: [t for t, _ in values] for name, values in measured.items()}
    busy = {name: [b for _, b in measured[name] if b is not None] for name in timers}
    gb = 2 * (env.world_size - 1) / env.world_size * 4 * numel / 1e9  # bus GB per all-reduce
    exposed = [a - b for a, b in zip(times["sync"], times["no_sync"], strict=True)]
    return {
        "model": spec.name,
        "mbytes": 4 * numel / 1e6,
        "bare_ms": _ms(times["bare"]),
        "bare_busbw": Stat.of([gb / t for t in times["bare"]]),
        "hook_ms": _ms(busy["hooked"]),
        "hook_busbw": Stat.of([gb / t for t in busy["hooked"]]),
        "hook_vs_bare": paired_ratios(times["bare"], busy["hooked"]),
        "one_bucket_busbw": Stat.of([gb / t for t in busy["one_bucket"]]),
        "one_bucket_vs_bare": paired_ratios(times["bare"], busy["one_bucket"]),
        "step_ms": _ms(times["sync"]),
        "exposed_ms": _ms(exposed),
        # Step-time ratios, default / variant: > 1 means the variant's step is faster.
        **{f"{name}_speedup": paired_ratios(times["sync"], times[name]) for name in models},
    }


def _ms(seconds: list[float]) -> Stat:
    return Stat.of([t * 1e3 for t in seconds])


# --- per-step costs of dpt's loop -----------------------------------------------------------

WINDOWS = (1, 10, 50)  # log_every_n_steps of the whole-window timings
PIECE_WINDOW = 10  # steps per window where the per-window calls are timed one by one


class LoopCalls:
    """The calls `Trainer.train_step` makes besides the training, on one rank's agreement and
    metrics, with the arguments the loop passes (a loss left as the device made it, no gradient
    norm: trainer.grad_clip_norm=null). `spacing_s`: the agreements' least spacing (None: the
    loop's, `dpt.loop.agreement.SPACING_S`; 0: one agreement per window)."""

    def __init__(self, env: DistEnv, run_dir: Path, every: int, spacing_s: float | None) -> None:
        self.every = every
        self.metrics = MetricsLogger(one_run(run_dir), env, total_steps=10**9)
        self.agreement = Agreement(env, 10**9, "error", log_every=every, spacing_s=spacing_s)
        self.stop, self.loss, self.step = StopRequest(), torch.tensor(0.5), 0

    def each_step(self) -> None:
        self.step += 1
        self.metrics.record(self.loss, 64, 0, 1e-4, 1e-3, None)

    def end_window(self) -> None:
        self.metrics.end_window(self.step, 0)
        self.metrics.set_lr({"default": 1e-3})

    def agree(self) -> list[list[float]]:
        losses, _ = self.metrics.read_back()
        return self.agreement.agree(self.stop, self.step, losses, self.metrics.payload()).rows

    def agreed(self, rows: list[list[float]]) -> None:
        self.metrics.agreed(rows)

    def window(self, steps: int) -> None:
        for _ in range(steps):
            self.each_step()
        self.end_window()
        if self.agreement.due(self.step):
            self.agreed(self.agree())

    def windows(self, steps: int, count: int) -> None:
        for _ in range(count):
            self.window(steps)


def per_step_costs(env: DistEnv, tmp: Path, calls: int) -> dict[str, Any]:
    """Microseconds of dpt's own calls around the training, console lines going to a rank log
    file (and stdout, here swallowed). Both ranks run the same calls, so a collective waits
    only for what the other rank's identical work takes."""
    setup_logging(f"rank {env.rank}", tmp / "logs" / f"rank{env.rank}.log")
    us = lambda seconds: Stat.of([t * 1e6 for t in seconds])  # noqa: E731
    costs: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):  # before the loggers: no progress bar
        loop = LoopCalls(env, tmp / "pieces", PIECE_WINDOW, spacing_s=0.0)
        agree, agreed = [], []
        try:
            loop.window(PIECE_WINDOW)  # the first window makes the TensorBoard writers
            costs["each_step_us"] = us(time_calls(loop.each_step, calls))
            loop.end_window()
            loop.agreed(loop.agree())
            for _ in range(max(5, calls // PIECE_WINDOW)):
                for _ in range(PIECE_WINDOW):
                    loop.each_step()
                loop.end_window()
                start = time.perf_counter()
                rows = loop.agree()
                middle = time.perf_counter()
                loop.agreed(rows)
                agree.append(middle - start)
                agreed.append(time.perf_counter() - middle)
        finally:
            loop.metrics.close()
        costs["agree_us"], costs["agreed_us"] = us(agree), us(agreed)
        for every in WINDOWS:
            loop = LoopCalls(env, tmp / f"every{every}", every, spacing_s=None)
            try:
                loop.window(every)  # the first agreement; then one per block of windows
                block = functools.partial(loop.windows, every, MAX_WINDOWS)
                blocks = time_calls(block, max(5, calls // (every * MAX_WINDOWS)))
            finally:
                loop.metrics.close()
            costs[f"per_step_us_every_{every}"] = us([t / every / MAX_WINDOWS for t in blocks])
    return costs


def fetch_costs(calls: int) -> dict[str, Stat]:
    """Microseconds to fetch one MLP batch of 64, alternating block by block: dpt's train
    loader (`InMemoryDataset`: one indexing op per batch) against the plain loop's
    `DataLoader(TensorDataset)` (a `__getitem__` per sample, then `default_collate`)."""
    data = SyntheticData(num_samples=8192, num_val_samples=0, input_dim=32, num_classes=10,
                         num_workers=0, seed=0)  # fmt: skip
    one = DistEnv(0, 0, 1, 1, torch.device("cpu"))
    plain = TensorDataset(*data.train.tensors)
    sampler = DistributedSampler(plain, num_replicas=1, rank=0, shuffle=True, seed=0)
    loaders = {
        "fetch_dpt_us": build_loaders(data, one, 64, seed=0).train,
        "fetch_plain_us": DataLoader(plain, batch_size=64, sampler=sampler, drop_last=True),
    }
    blocks = {
        name: functools.partial(time_calls, functools.partial(next, _forever(loader)), 32)
        for name, loader in loaders.items()
    }  # 32 fetches a block, timed one by one
    times = alternate(blocks, max(5, calls // 32))
    return {
        name: Stat.of([t * 1e6 for block in values for t in block])
        for name, values in times.items()
    }


def _forever(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader
