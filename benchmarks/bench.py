"""dpt's performance, measured side by side; writes docs/performance.md and its plots.

    python -m benchmarks                   # everything (about 20 minutes on 2 CPU cores)
    python -m benchmarks --quick           # a smoke run (1-2 minutes), into outputs/benchmarks
    python -m benchmarks --sections gpu    # only the GPU path (needs CUDA)
    python -m benchmarks --out /tmp/perf   # write the report elsewhere

(`python scripts/bench.py ...` is the same command.) Sections: `loops` (dpt against a
hand-written loop at log_every_n_steps 10 and 50; single vs dp vs ddp), `startup` (time to the
first optimizer step; whole-process cost per step; cost of logging every step), `pipeline` (JPEG
images/s per loader worker), `sync` (gradient all-reduce bus bandwidth; dpt's per-step and
per-window calls), `gpu` (ResNet-18 bf16 channels_last, synthetic and GPU-decoded JPEG; runs only
where CUDA is available), `memory` (not run by default: ddp against fsdp, memory per rank and
throughput for a 105 M-parameter MLP; about 2 GiB per ddp rank; writes only its own section of
the report), `monitor` (not run by default: the monitor's detectors timed in place per step, the
MLP end to end with the monitor on and off, gradient diagnostics and grad_spike's norm; writes
only its own section of the report), `baseline` (not run by default; needs --baseline REV: dpt
at another commit against this checkout on the loops workloads, alternated; writes only its own
section of the report), `gpt` (not run by default: dpt's experiment=gpt_tiny against a
hand-written loop of the same model and data, single and ddp, and dpt's tokens/s and memory per
rank under ddp and fsdp; writes only its own section of the report), `pipeline_parallel` (not
run by default: a GPT on 2 pipeline stages under gpipe and 1f1b with 1, 2, 4 micro-batches, per
step time, each stage's measured bubble against (p-1)/(m+p-1), the state per stage against one
process; writes only its own section), `tensor_parallel` (not run by default: the same GPT with
every layer split over 2 ranks by `strategy.tensor_parallel=2`, against one process: per step
time, each rank's state against one process's, the collectives' time per step from
torch.profiler; writes only its own section), `trackers` (not run by default: the default job
logging every 10 steps with MLflow and the CSV file beside TensorBoard, against TensorBoard
alone, and the steps the MLflow runs hold; writes only its own section), `hf` (not run by
default: a `model=hf` Llama folder, tiny and of 3 M parameters, full and LoRA, trained by dpt, a
hand-written loop and transformers' Trainer: samples/s and seconds to the first step; writes
only its own section). benchmarks/README.md says more.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import (
    baseline,
    gpt,
    gpu,
    hf_models,
    loops,
    memory,
    monitor,
    pipeline,
    pipeline_parallel,
    startup,
    sync,
    tensor_parallel,
    trackers,
)
from benchmarks.report import document
from benchmarks.runner import REPO, RunError, Say

SECTIONS = (
    "loops", "startup", "pipeline", "sync", "gpu", "memory", "monitor", "baseline", "gpt",
    "pipeline_parallel", "tensor_parallel", "trackers", "hf",
)  # fmt: skip
DEFAULT_SECTIONS = SECTIONS[:5]  # memory, monitor, baseline, gpt, the parallelisms: on their own
REPORT = REPO / "docs"  # where a measurement's report goes: docs/performance.md, tracked
SMOKE_REPORT = REPO / "outputs" / "benchmarks"  # a --quick or --smoke run's (git ignores outputs/)
# Each section: (its arguments, a temporary folder, a progress printer) -> its results, by key.
RUNNERS: dict[str, Callable[[argparse.Namespace, Path, Say], dict[str, Any]]] = {
    "loops": loops.run,
    "startup": startup.run,
    "pipeline": pipeline.run,
    "sync": sync.run,
    "gpu": gpu.run,
    "memory": memory.run,
    "monitor": monitor.run,
    "baseline": baseline.run,
    "gpt": gpt.run,
    "pipeline_parallel": pipeline_parallel.run,
    "tensor_parallel": tensor_parallel.run,
    "trackers": trackers.run,
    "hf": hf_models.run,
}
# Where the classes in results saved with --save before the benchmarks were a package now live.
_MOVED = {"bench_common": "benchmarks.runner", "bench_runs": "benchmarks.jobs"}


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 cadence")
    p.add_argument(
        "--smoke", action="store_true",
        help="the machinery only, in seconds (implies --quick; tests/test_bench.py): the\n"
        "smallest runs of each section, one process each where it can",
    )  # fmt: skip
    p.add_argument(
        "--out", type=Path, default=None,
        help=f"where the report goes (default {REPORT.relative_to(REPO)}; with --quick or\n"
        f"--smoke {SMOKE_REPORT.relative_to(REPO)}: a smoke run's numbers are no\n"
        "measurement, and never replace the tracked report)",
    )  # fmt: skip
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
    p.add_argument(
        "--baseline", metavar="REV", default=None,
        help="the baseline section's git revision: dpt there against this checkout",
    )  # fmt: skip
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
    if "baseline" in args.sections and not args.render:
        if not args.baseline:
            p.error("--sections baseline needs --baseline REV (a git revision, e.g. HEAD~1)")
        try:
            baseline.resolve(args.baseline)
        except RunError:
            p.error(f"--baseline {args.baseline}: no such commit in this repository")
    args.quick = args.quick or args.smoke
    if args.out is None:
        args.out = SMOKE_REPORT if args.quick else REPORT
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    args.worlds = [int(w) for w in args.world_sizes.split(",")] if args.world_sizes else [2]
    args.retried = []  # runs that failed once and were run again
    return args


def _save(path: Path, results: dict[str, Any], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps((results, meta)))


class _Unpickler(pickle.Unpickler):
    """Measurements saved by scripts/bench_*.py, before the move, load too."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(_MOVED.get(module, module), name)


def load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, meta) saved with --save."""
    with path.open("rb") as f:
        return _Unpickler(f).load()


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks") -> None:
    """`prog`: the command as the report quotes it (`python scripts/bench.py` from the shim)."""
    args = parse_args(argv, prog)
    if args.render:  # e.g. after editing the report's text: the same numbers, written anew
        results, meta = load(args.render)
        if results and all(name in document.MARKED for name in results):
            path = document.write_marked(args.out, results)  # only their parts, as measured
        else:
            path = document.write(args.out, results, meta)
        print(f"wrote {path}")
        return
    started = time.time()

    def say(message: str) -> None:
        print(f"[{time.time() - started:6.0f} s] {message}", flush=True)

    results: dict[str, Any] = {}
    meta = document.machine()
    with tempfile.TemporaryDirectory(prefix="dpt-bench-") as tmp:
        for name in args.sections:
            say(f"section {name}")
            results |= RUNNERS[name](args, Path(tmp), say)
            if args.save:  # what was measured survives a later section's failure
                _save(args.save, results, meta)
    meta |= {
        "command": " ".join([prog, *(sys.argv[1:] if argv is None else argv)]),
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
    if args.sections and all(name in document.MARKED for name in args.sections):
        path = document.write_marked(args.out, results)  # their parts; the rest stays as it is
    else:
        path = document.write(args.out, results, meta)
    say(f"wrote {path}")
