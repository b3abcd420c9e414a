"""Section `gpt` (not run by default): dpt's tiny GPT against a hand-written loop of the same model
and data, and dpt's tokens/s and memory per rank under ddp and fsdp.

(1) `python train.py experiment=gpt_tiny dataset.root=<text> ...` against
benchmarks/plain_gpt.py (the same model class, token file, windows, order, AdamW, warmup and
cosine, clipping), single and ddp at every `--world-sizes`, at the experiment's batch and logging
cadence; tokens/s over the same logging windows, dpt/plain paired round by round, as section
`loops` pairs them (`loop_ratio_row`). (2) dpt alone under ddp and fsdp on the same worlds, each
run through benchmarks/stamped_train.py, which stamps every rank's peak resident memory: tokens/s
(metrics.json's `tokens_per_s`), the training state per rank (each rank's TensorBoard
`memory/params_mb`, `memory/grads_mb`, `memory/optimizer_mb`) and the peak RSS per rank. All jobs
alternate run by run, round after round. The text is made here (seeded, about 700 kB of
made-up words: byte tokens, no epoch ends within a run) and tokenized once, before the rounds,
into the token cache that dpt's runs are given: neither loop tokenizes in its timed runs.
Its section of docs/performance.md sits between two markers (benchmarks/report/gpt.py).

    python -m benchmarks --sections gpt --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.jobs import Job, RunResult, Workload, child_env, run_job
from benchmarks.loops import loop_ratio_row
from benchmarks.runner import REPO, RunError, Say, Stat, alternate, paired_ratios
from benchmarks.stamped_train import PEAK_RSS_ENV, PEAK_RSS_FILE

EXPERIMENT = "gpt_tiny"
TEXT_BYTES = 700_000  # ~21,900 windows of 33 bytes: 680 steps of 32 in one process, 340 in two
MEMORY_STRATEGIES = ("ddp", "fsdp")
MEMORY_KEYS = ("memory/params_mb", "memory/grads_mb", "memory/optimizer_mb")
TIMEOUT_S = 900.0  # one run: a loaded machine stretches a run of a minute a lot


# --- the data and the experiment's settings -------------------------------------------------------


def write_text(path: Path, size: int = TEXT_BYTES, seed: int = 0) -> Path:
    """Sentences of made-up words, the same for the same seed: something a GPT learns."""
    draw = random.Random(seed)
    syllables = ["ka", "to", "ri", "men", "sa", "lo", "ve", "da", "nu", "pi", "ter", "gal", "bo",
                 "shi", "ru", "an", "el", "or"]  # fmt: skip
    words = ["".join(draw.choices(syllables, k=draw.randint(1, 3))) for _ in range(500)]
    parts, length = [], 0
    while length < size:
        sentence = " ".join(draw.choices(words, k=draw.randint(4, 14)))
        sentence = sentence[0].upper() + sentence[1:] + ". "
        parts.append(sentence)
        length += len(sentence)
    path.write_text("".join(parts))
    return path


@dataclass(frozen=True)
class GptData:
    """The text, dpt's token cache holding its token file, and what both loops train with."""

    text: Path
    cache: Path  # dataset.cache_dir of dpt's runs: its token file is there already
    tokens: Path
    count: int
    dtype: str
    vocab_size: int
    block_size: int
    plain_flags: tuple[str, ...]  # the experiment's model, optimizer and schedule, as flags
    dpt_overrides: tuple[str, ...]  # what selects the experiment and this text


def prepare(folder: Path, size: int = TEXT_BYTES) -> tuple[GptData, dict[str, Any], dict[str, Any]]:
    """The text, its token file (in the cache dpt's runs get) and the plain loop's flags from the
    experiment's resolved config; the experiment's trainer settings (batch, cadence); the
    model's shape and size, for the report."""
    from omegaconf import OmegaConf

    from dpt.data.text import cached_tokens
    from dpt.data.tokenizer import load_tokenizer
    from dpt.launch.cli import compose_from_argv

    folder.mkdir(parents=True, exist_ok=True)
    text, cache = write_text(folder / "text.txt", size), folder / "tokens"
    # val_fraction=0 with a single .txt file: no validation, every token trains.
    overrides = (f"experiment={EXPERIMENT}", f"dataset.root={text}", "dataset.val_fraction=0",
                 f"dataset.cache_dir={cache}")  # fmt: skip
    cfg = compose_from_argv(list(overrides))
    assert cfg is not None
    c = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(c, dict)
    model, optimizer, scheduler, trainer = (c[k] for k in ("model", "optimizer", "scheduler",
                                                           "trainer"))  # fmt: skip
    expected = {"model": (model, "dpt.models.gpt.GPT"),
                "optimizer": (optimizer, "dpt.loop.optimizers.adamw_gpt"),
                "scheduler": (scheduler, "dpt.loop.schedulers.warmup_cosine")}  # fmt: skip
    for group, (node, target) in expected.items():  # what the plain loop writes by hand
        if node["_target_"] != target:
            raise RunError(f"experiment={EXPERIMENT}: {group} is {node['_target_']}, and "
                           f"benchmarks/plain_gpt.py has only {target}")  # fmt: skip
    tokenizer = load_tokenizer(c["dataset"]["tokenizer"])
    found = cached_tokens([text], [], tokenizer, cache, 0.0)["train"]  # the key dpt's runs use
    vocab = model["vocab_size"] or tokenizer.vocab_size
    flags = [
        f"--vocab-size={vocab}", f"--block-size={model['block_size']}",
        f"--n-layer={model['n_layer']}", f"--n-head={model['n_head']}",
        f"--n-embd={model['n_embd']}", f"--dropout={model['dropout']}",
        f"--lr={optimizer['lr']}", f"--weight-decay={optimizer['weight_decay']}",
        f"--warmup-steps={scheduler['warmup_steps']}", f"--min-lr={scheduler['min_lr']}",
        f"--clip={trainer['grad_clip_norm']}", f"--seed={trainer['seed']}",
    ]  # fmt: skip
    if not model["bias"]:
        flags.append("--no-bias")
    betas = [str(b) for b in optimizer["betas"]]
    data = GptData(
        text=text, cache=cache, tokens=Path(found["path"]), count=int(found["count"]),
        dtype=found["dtype"], vocab_size=vocab, block_size=int(model["block_size"]),
        plain_flags=(*flags, "--betas", *betas), dpt_overrides=overrides,
    )  # fmt: skip
    return data, trainer, describe(data, model, text)


def describe(data: GptData, model: dict[str, Any], text: Path) -> dict[str, Any]:
    """The model's shape and size, and the data's, for the report."""
    from dpt.models.gpt import GPT

    gpt = GPT(data.vocab_size, data.block_size, model["n_layer"], model["n_head"],
              model["n_embd"], model["dropout"], model["bias"])  # fmt: skip
    return {
        "experiment": EXPERIMENT, "text_bytes": text.stat().st_size, "tokens": data.count,
        "windows": (data.count - 1) // data.block_size, "vocab_size": data.vocab_size,
        "block_size": data.block_size, "n_layer": gpt.n_layer, "n_head": gpt.n_head,
        "n_embd": gpt.n_embd, "parameters": sum(p.numel() for p in gpt.parameters()),
        "flops_per_token": gpt.flops_per_token(data.block_size), "flags": data.plain_flags,
    }  # fmt: skip


# --- the jobs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GptJob(Job):
    """A run of dpt's `experiment=gpt_tiny` or of benchmarks/plain_gpt.py on `data`."""

    data: GptData | None = None
    # dpt only: run through benchmarks/stamped_train.py, which stamps each rank's peak RSS
    peak_rss: bool = False

    @property
    def label(self) -> str:
        suffix = f" x{self.world}" if self.world > 1 else ""
        return f"{self.loop} {self.strategy}{suffix}"

    @property
    def tokens_per_step(self) -> int:
        assert self.data is not None
        return self.samples_per_step * self.data.block_size

    def _dpt(self, run_dir: Path) -> list[str]:
        assert self.data is not None
        w = self.work
        entry = "benchmarks/stamped_train.py" if self.peak_rss else "train.py"
        cmd = [
            sys.executable, str(self.root / entry), *self.data.dpt_overrides,
            f"strategy={self.strategy}", f"trainer.batch_size={w.batch_size}",
            f"trainer.max_steps={w.steps}", f"trainer.log_every_n_steps={w.log_every}",
            f"trainer.device={w.device}", "checkpoint.enabled=false", f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        if self.world > 1:
            cmd.append(f"launcher.nproc_per_node={self.world}")
        return cmd

    def _plain(self, run_dir: Path) -> list[str]:
        assert self.data is not None
        if self.strategy not in ("single", "ddp"):
            raise ValueError(f"the plain GPT loop has no {self.strategy}")
        w, d = self.work, self.data
        return [
            sys.executable, str(REPO / "benchmarks" / "plain_gpt.py"),
            f"--tokens={d.tokens}", f"--count={d.count}", f"--dtype={d.dtype}",
            f"--batch-size={w.batch_size}", f"--steps={w.steps}", f"--nproc={self.world}",
            f"--log-every={w.log_every}", f"--out={run_dir / 'plain.json'}", *d.plain_flags,
        ]  # fmt: skip


def workloads(trainer: dict[str, Any], quick: bool, smoke: bool) -> tuple[Workload, Workload]:
    """The throughput workload (the experiment's batch and logging cadence; windows after one
    of warmup) and the shorter one of the memory runs. On 2 loaded cores a step of the tiny
    GPT takes about 0.2 s: 300 steps are a minute."""
    batch, every = int(trainer["batch_size"]), int(trainer["log_every_n_steps"])
    if smoke:  # the machinery only: two windows of two steps
        work = Workload("gpt", batch, warmup_steps=2, steps=6, log_every=2)
        return work, replace(work, warmup_steps=2, steps=4)
    if quick:
        work = Workload("gpt", batch, warmup_steps=10, steps=40, log_every=10)
        return work, replace(work, steps=20)
    work = Workload("gpt", batch, warmup_steps=every, steps=6 * every, log_every=every)
    return work, replace(work, steps=3 * every)


# --- the runs -----------------------------------------------------------------------------------


@dataclass
class MemoryRun:
    """A dpt run under ddp or fsdp: its stamps, and what each rank held."""

    result: RunResult
    ranks: list[dict[str, float]]  # per rank: MEMORY_KEYS and peak_rss_mb
    tokens_per_s: float  # metrics.json: the world's, over the whole fit
    tflops: float | None


def _read_memory(job: GptJob, run_dir: Path, result: RunResult) -> MemoryRun:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ranks = []
    for rank in range(job.world):
        events = EventAccumulator(str(run_dir / "tb" / f"rank{rank}"), size_guidance={"scalars": 0})
        events.Reload()
        found = {key: events.Scalars(key)[-1].value for key in MEMORY_KEYS}
        rss = run_dir / "peak_rss" / PEAK_RSS_FILE.format(rank=rank)
        found["peak_rss_mb"] = float(rss.read_text()) if rss.exists() else float("nan")
        ranks.append(found)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return MemoryRun(result, ranks, metrics["tokens_per_s"], metrics.get("tflops"))


def _contender(
    job: GptJob, tmp: Path, env: dict[str, str], say: Say, retried: list[str], count: Any
) -> Callable[[], RunResult | MemoryRun]:
    def once(run_dir: Path) -> RunResult | MemoryRun:
        if not job.peak_rss:
            return run_job(job, run_dir, env, TIMEOUT_S)
        result = run_job(job, run_dir, env | {PEAK_RSS_ENV: str(run_dir / "peak_rss")}, TIMEOUT_S)
        return _read_memory(job, run_dir, result)

    def run() -> RunResult | MemoryRun:
        kind = "mem-" if job.peak_rss else ""
        run_dir = tmp / f"{next(count):03d}-{job.loop}-{kind}{job.strategy}"
        try:
            return once(run_dir)
        except RunError as error:  # a shared machine: one more try, then give up
            say(f"  {error}\n  ... once more")
            retried.append(f"{job.label}: {str(error).strip().splitlines()[-1]}")
            return once(run_dir.with_name(f"{run_dir.name}-again"))

    return run


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """dpt against the plain loop (single, ddp), and dpt's ddp against fsdp (memory, tokens/s)."""
    started, load_before = time.time(), os.getloadavg()
    data, trainer, model = prepare(tmp / "gpt-data")
    work, memory_work = workloads(trainer, args.quick, args.smoke)
    say(f"  {data.count:,} tokens in {data.tokens}; batch {work.batch_size} per process, "
        f"{work.steps} steps, logging every {work.log_every}")  # fmt: skip
    worlds = [] if args.smoke else args.worlds
    make = lambda loop, strategy, world, w=work, **kw: GptJob(  # noqa: E731
        loop, strategy, world, w, data=data, **kw
    )
    pairs = [(make("plain", "single", 1), make("dpt", "single", 1))]
    pairs += [(make("plain", "ddp", n), make("dpt", "ddp", n)) for n in worlds]
    memory = {n: {s: make("dpt", s, n, memory_work, peak_rss=True) for s in MEMORY_STRATEGIES}
              for n in worlds}  # fmt: skip
    jobs = [*(job for pair in pairs for job in pair),
            *(job for by in memory.values() for job in by.values())]  # fmt: skip
    for job in jobs:
        _check_epochs(job, data)
    env, count = child_env(args, "cpu"), itertools.count()
    contenders = {job: _contender(job, tmp / "gpt-runs", env, say, args.retried, count)
                  for job in jobs}  # fmt: skip

    def done(job: GptJob, r: int, seconds: float) -> None:
        what = " (memory)" if job.peak_rss else ""
        say(f"  round {r + 1}/{args.rounds}  {job.label + what:22s} ({seconds:5.1f} s)")

    measured = alternate(contenders, args.rounds, done=done)
    results = {job: measured[job] for pair in pairs for job in pair}
    rows = []
    for plain, dpt in pairs:
        row = loop_ratio_row(results, plain, dpt)  # type: ignore[arg-type]
        block = data.block_size
        rows.append({**row, "tokens_per_step": dpt.tokens_per_step,
                     "plain_tokens": _scaled(row["plain"], block),
                     "dpt_tokens": _scaled(row["dpt"], block)})  # fmt: skip
    memory_rows = {n: {s: measured[job] for s, job in by.items()} for n, by in memory.items()}
    return {"gpt": {
        "rows": rows,
        "memory": memory_rows,
        "model": model,
        "work": work,
        "memory_work": memory_work,
        "quick": args.quick,
        "smoke": args.smoke,
        "rounds": args.rounds,
        "worlds": worlds,
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "duration_s": time.time() - started,
        "load": (load_before, os.getloadavg()),
        "cores": os.cpu_count(),
    }}  # fmt: skip


def _scaled(stat: Stat, factor: float) -> Stat:
    return Stat(stat.median * factor, stat.low * factor, stat.high * factor, stat.n)


def _check_epochs(job: GptJob, data: GptData) -> None:
    """No epoch ends within a run: dpt logs at an epoch's end too (a window cut there would not
    be the plain loop's), and DistributedSampler pads an epoch where dpt drops its tail."""
    steps_per_epoch = ((data.count - 1) // data.block_size) // job.samples_per_step
    if job.work.steps > steps_per_epoch:
        raise RunError(f"{job.label}: {job.work.steps} steps cross an epoch of "
                       f"{steps_per_epoch}; make the text longer (TEXT_BYTES)")  # fmt: skip


def memory_ratios(runs: dict[str, list[MemoryRun]]) -> Stat:
    """fsdp/ddp tokens/s, paired round by round."""
    return paired_ratios([r.tokens_per_s for r in runs["fsdp"]],
                         [r.tokens_per_s for r in runs["ddp"]])  # fmt: skip
