#!/usr/bin/env python
"""dpt's performance, measured side by side; writes docs/performance.md and its plots.

    python scripts/bench.py                 # everything (about 10 minutes on 2 CPU cores)
    python scripts/bench.py --quick         # a smoke run (1-2 minutes): fewer rounds and steps
    python scripts/bench.py --sections gpu  # only the GPU path (needs CUDA)
    python scripts/bench.py --out /tmp/perf # write the report elsewhere

Sections: `loops` (dpt against a hand-written loop at log_every_n_steps 10 and 50; single vs dp
vs ddp), `startup` (time to the first optimizer step; whole-process cost per step; cost of
logging every step), `pipeline` (JPEG images/s per loader worker), `sync` (gradient all-reduce bus
bandwidth; dpt's per-step and per-window calls), `gpu` (ResNet-18 bf16 channels_last, synthetic
and GPU-decoded JPEG; runs only where CUDA is available), `memory` (not run by default: ddp
against fsdp, memory per rank and throughput for a 105 M-parameter MLP; about 2 GiB per ddp rank;
writes only its own section of the report).

Every comparison alternates its contenders run by run (A, B, A, B, ...) and reports medians and
paired ratios: on a shared machine single absolute times say little. Runs go to a temporary
folder; only the report and its PNGs are written, to --out.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import bench_memory
import bench_pipeline
import bench_report
import bench_runs as runs
import bench_sync
import torch
from bench_common import REPO
from bench_runs import Job, Workload

SECTIONS = ("loops", "startup", "pipeline", "sync", "gpu", "memory")
DEFAULT_SECTIONS = SECTIONS[:-1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 cadence")
    p.add_argument("--out", type=Path, default=REPO / "docs", help="where the report goes")
    p.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated: {', '.join(SECTIONS)}",
    )
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 3, quick 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="for loops/startup")
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads per CPU process (default 1)"
    )
    p.add_argument("--world-sizes", default=None, help="ddp worlds, e.g. 2,4 (default: 2)")
    p.add_argument(
        "--models", default="mlp,resnet18", help="the loops section's models (default: both)"
    )
    p.add_argument("--save", type=Path, default=None, help="also pickle the measurements here")
    p.add_argument(
        "--render", type=Path, default=None,
        help="measure nothing: write the report from measurements saved with --save",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections: {', '.join(sorted(unknown))}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    args.worlds = [int(w) for w in args.world_sizes.split(",")] if args.world_sizes else [2]
    args.retried = []  # runs that failed once and were run again
    return args


LOG_EVERY = (10, 50)  # the logging cadences of the throughput targets, both loops alike


def workloads(quick: bool, device: str) -> list[Workload]:
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


def child_env(args: argparse.Namespace, device: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        # One thread per process for both loops: on a shared box, a multi-threaded process
        # stalls whenever one of its threads loses its core (OpenMP barriers), which buries
        # every difference in noise. It is also what torchrun sets for multi-process jobs.
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def loops_section(args: argparse.Namespace, tmp: Path, say: Any) -> dict[str, Any]:
    """(1) dpt / plain throughput at every cadence; (2) single vs dp vs ddp, scaling
    efficiency (at the first cadence)."""
    loops, strategies, groups = [], [], []
    plans = []
    models = args.models.split(",")
    works = [w for w in workloads(args.quick, args.device) if w.model in models]
    for work in works:
        pairs = [(Job("plain", "single", 1, work), Job("dpt", "single", 1, work))]
        pairs += [(Job("plain", "ddp", n, work), Job("dpt", "ddp", n, work)) for n in args.worlds]
        dp = Job("dpt", "dp", 1, work) if work.log_every == LOG_EVERY[0] else None
        groups += [[*pairs[0], *([dp] if dp else [])], *(list(pair) for pair in pairs[1:])]
        plans.append((pairs, dp))
    # Each loop as it runs out of the box (the heap): ResNet-18, whose steps free large blocks.
    as_is = [
        tuple(replace(job, out_of_the_box=True) for job in pair)
        for pairs, _ in plans
        for pair in pairs
        if pair[0].work.model != "mlp" and pair[0].work.log_every == LOG_EVERY[0]
    ]
    groups += [list(pair) for pair in as_is]
    env = child_env(args, args.device)
    results = runs.run_rounds(groups, args.rounds, tmp / "loops", env, say, args.retried)
    for pairs, dp in plans:
        loops += [runs.loop_ratio_row(results, *pair) for pair in pairs]
        if dp:
            others = [dp, *(dpt for _, dpt in pairs[1:])]
            strategies += runs.strategy_rows(results, pairs[0][1], others)
    out_of_the_box = [runs.loop_ratio_row(results, *pair) for pair in as_is]
    return {
        "loops": loops,
        "strategies": strategies,
        "workloads": works,
        "out_of_the_box": out_of_the_box,
    }


def startup_section(args: argparse.Namespace, tmp: Path, say: Any) -> dict[str, Any]:
    """(5) time to the first optimizer step, and the whole process's cost per step, from runs
    of N1 and N2 steps (MLP, both loops at the default log_every_n_steps=10); (6) the cost of
    logging every step, in one process (MLP: its steps are the shortest, so any fixed per-step
    cost shows most; section 6's in-place timings cover two ranks)."""
    n1, n2 = (50, 250) if args.quick else (100, 600)
    short = Workload("mlp", 64, warmup_steps=0, steps=n1, device=args.device)
    long = replace(short, steps=n2)
    steps = 120 if args.quick else 200
    every = Workload("mlp", 64, warmup_steps=20, steps=steps, log_every=1, device=args.device)
    rarely = replace(every, log_every=runs.LOG_RARELY)
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
    results = runs.run_rounds(groups, args.rounds, tmp / "startup", env, say, args.retried)
    return {
        "startup": [runs.startup_row(results, world) for world in pairs.values()],
        "marginal": [runs.marginal_row(results, *world) for world in pairs.values()],
        "logging": [runs.logging_row(results, g[1], g[2], g[0]) for g in logging],
    }


def pipeline_section(args: argparse.Namespace, tmp: Path, say: Any) -> dict[str, Any]:
    """(3) images/s per loader worker: training transform against decode-only."""
    count, rounds = (12, 2) if args.quick else (100, 5)
    root = bench_pipeline.make_jpegs(tmp / "coco", count)
    say(f"  {count} JPEGs of 640x480 written; timing one worker")
    rows = bench_pipeline.measure_cpu(root, image_size=224, rounds=rounds)
    if torch.cuda.is_available():
        rows += bench_pipeline.measure_gpu_decode(
            root, 224, batch=128, rounds=rounds, device=torch.device("cuda")
        )
    return {"pipeline": rows, "pipeline_files": count}


def sync_section(args: argparse.Namespace, tmp: Path, say: Any) -> dict[str, Any]:
    """(4) gradient all-reduce against a bare all-reduce, on a 2-rank Gloo world; and the
    per-step costs of dpt's loop at world sizes 1 and 2."""
    models = [bench_sync.SyncModel("mlp", 64, rounds=10 if args.quick else 30)]
    if not args.quick:
        models.append(bench_sync.SyncModel("resnet18", 32, image_size=32, rounds=7))
    calls = 50 if args.quick else 300
    world2 = bench_sync.measure(2, models, args.threads, calls)
    say("  2-rank world done")
    world1 = bench_sync.measure(1, [], args.threads, calls)
    return {"sync": world2["models"], "per_step": {1: world1["per_step"], 2: world2["per_step"]}}


def gpu_section(args: argparse.Namespace, tmp: Path, say: Any) -> dict[str, Any]:
    """ResNet-18, bf16, channels_last, 224 px on one GPU: dpt against the plain loop on
    synthetic images; the model's ceiling against JPEGs decoded on the GPU."""
    import bench_gpu

    if not torch.cuda.is_available():
        say("  no CUDA device: GPU section skipped")
        return {"gpu": None}
    root = bench_pipeline.make_jpegs(tmp / "gpu-coco", 200)
    workers = max(1, min(8, (os.cpu_count() or 2) - 2))
    in_process = bench_gpu.measure(root, torch.device("cuda"), workers=workers)
    say("  in-process GPU measurements done")
    work = Workload(
        "resnet18", batch_size=256, warmup_steps=10, steps=40, image_size=224, device="cuda",
        precision="bf16-mixed", channels_last=True, num_workers=workers, num_samples=16384,
    )  # fmt: skip
    pair = (Job("plain", "single", 1, work), Job("dpt", "single", 1, work))
    env = child_env(args, "cuda")
    results = runs.run_rounds([pair], max(3, args.rounds), tmp / "gpu", env, say, args.retried)
    return {
        "gpu": {
            "device": torch.cuda.get_device_name(),
            "workers": workers,
            "in_process": in_process,
            "loop": runs.loop_ratio_row(results, *pair),
        }
    }


def memory_section(args: argparse.Namespace, tmp: Path, say: Any) -> dict[str, Any]:
    """(8) ddp against fsdp: the training state per rank, and samples/s."""
    worlds = args.worlds if args.world_sizes else [2, 4]
    return {"memory": bench_memory.run(worlds, args.rounds, args.quick, args.threads, say)}


RUNNERS = {
    "loops": loops_section,
    "startup": startup_section,
    "pipeline": pipeline_section,
    "sync": sync_section,
    "gpu": gpu_section,
    "memory": memory_section,
}


def _save(path: Path, results: dict[str, Any], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps((results, meta)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:  # e.g. after editing the report's text: the same numbers, written anew
        results, meta = pickle.loads(args.render.read_bytes())
        print(f"wrote {_write_report(args.out, results, meta)}")
        return
    started = time.time()

    def say(message: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

    results: dict[str, Any] = {}
    meta = bench_report.machine()
    with tempfile.TemporaryDirectory(prefix="dpt-bench-") as tmp:
        for name in args.sections:
            say(f"section {name}")
            results |= RUNNERS[name](args, Path(tmp), say)
            if args.save:  # what was measured survives a later section's failure
                _save(args.save, results, meta)
    meta |= {
        "command": " ".join(["python scripts/bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "retried": args.retried,
        "duration_s": time.time() - started,
        "load_after": os.getloadavg(),
        "quick": args.quick,
        "rounds": args.rounds,
        "threads": args.threads,
        "device": args.device,
    }
    if args.save:
        _save(args.save, results, meta)
    if args.sections == ["memory"]:  # its own section of the report; the rest stays as it is
        path = bench_memory.write_section(args.out / "performance.md", results["memory"])
    else:
        path = _write_report(args.out, results, meta)
    say(f"wrote {path}")


def _write_report(out: Path, results: dict[str, Any], meta: dict[str, Any]) -> Path:
    """The report; the memory section, measured on its own, is kept unless measured anew."""
    kept = bench_memory.read_section(out / "performance.md")
    path = bench_report.write(out, results, meta)
    if "memory" in results:
        bench_memory.write_section(path, results["memory"])
    elif kept is not None:
        bench_memory.put_section(path, kept)
    return path


if __name__ == "__main__":
    main()
