"""docs/performance.md and its plots, from what the sections measured: the document's frame (the
machine and the command, the targets, the method) around each section's chapters, in order.

Each section's report is a module of this package with `chapters(results)` (Markdown, "" where the
section was not measured), and `targets(results)` (its rows of the targets table) and
`plot(out, results)` where it has them. Sections measured on their own (MARKED: `memory`,
`monitor`, `baseline`, `gpu` (which needs a machine with a GPU), `gpt`, `pipeline_parallel`,
`tensor_parallel`, `trackers`, `hf`) stand between two markers, `<!-- bench_NAME -->` and
`<!-- /bench_NAME -->`: `--sections memory` replaces that part of an existing report alone, and
a whole report keeps it unless it measured it anew (a `gpu` section that found no GPU keeps the
numbers an earlier report measured on one).
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torchvision

from benchmarks.report import (
    baseline,
    gpt,
    gpu,
    hf_models,
    loops,
    memory,
    monitor,
    overhead,
    pipeline,
    pipeline_parallel,
    startup,
    sync,
    tensor_parallel,
    trackers,
)
from benchmarks.report.common import Results, md_table

REPORT = "performance.md"
CHAPTERS: tuple[ModuleType, ...] = (loops, pipeline, sync, startup, overhead)  # in order
# The targets table's rows come in this order (each section's rows in its own order).
TARGETS: tuple[ModuleType, ...] = (
    loops, startup, overhead, pipeline, sync, monitor, baseline, gpt, trackers, hf_models
)  # fmt: skip
PLOTS: tuple[ModuleType, ...] = (loops, pipeline, sync)
# After the method, each between its markers, in this order.
MARKED: dict[str, ModuleType] = {
    "memory": memory, "monitor": monitor, "baseline": baseline, "gpu": gpu, "gpt": gpt,
    "pipeline_parallel": pipeline_parallel, "tensor_parallel": tensor_parallel,
    "trackers": trackers, "hf": hf_models,
}  # fmt: skip


def machine() -> dict[str, Any]:
    return {
        "cpu": _lscpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": os.getloadavg(),
    }


def _lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "unknown").strip()
    hypervisor = fields.get("Hypervisor vendor", "").strip()
    return f"{model} ({hypervisor} guest)" if hypervisor else model


def _memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


# --- the document -----------------------------------------------------------------------------


def write(out: Path, results: Results, meta: dict[str, Any]) -> Path:
    """The whole report and its plots, in `out`. A marked section that was not measured keeps
    what an earlier report in `out` had for it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT
    earlier = path.read_text() if path.exists() else ""
    _plots(out, results)
    parts = [
        _header(meta),
        _targets(results),
        *(chapter for section in CHAPTERS for chapter in section.chapters(results)),
        _method(meta),
    ]
    path.write_text(_with_marked("\n\n".join(p for p in parts if p) + "\n", results, earlier))
    return path


def write_marked(out: Path, results: Results) -> Path:
    """Only the marked sections in `results`, each in place of its part of the report in `out`
    (appended where it has none); the rest stays as it is."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT
    text = path.read_text() if path.exists() else "# Performance\n"
    path.write_text(_with_marked(text, results, earlier=text))
    return path


def _with_marked(text: str, results: Results, earlier: str = "") -> str:
    """`text` with each marked section of `results` between its markers, in place of what
    stood there or appended; one that `results` lacks, or measured as None (no GPU), keeps its
    part of `earlier`, if any."""
    for name, section in MARKED.items():
        kept = _read_marked(earlier, name)
        measured = results.get(name) is not None
        block = (_marked(name, section, results) if measured or kept is None else None) or kept
        if block is not None:
            text = _put_marked(text, name, block)
    return text


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench_{name} -->", f"<!-- /bench_{name} -->"


def _marked(name: str, section: ModuleType, results: Results) -> str | None:
    """The section's chapters between its markers; None if it was not measured."""
    if name not in results:
        return None
    start, end = _markers(name)
    return f"{start}\n" + "\n\n".join(section.chapters(results)) + f"\n{end}"


def _read_marked(text: str, name: str) -> str | None:
    """The part of `text` between `name`'s markers, markers included; None if it has none."""
    start, end = _markers(name)
    if start not in text or end not in text:
        return None
    return start + text.split(start, 1)[1].split(end, 1)[0] + end


def _put_marked(text: str, name: str, block: str) -> str:
    """`block` (markers included) in place of `name`'s part of `text`, or appended."""
    start, end = _markers(name)
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def _header(meta: dict[str, Any]) -> str:
    load = lambda key: ", ".join(f"{x:.2f}" for x in meta[key])  # noqa: E731
    rows = [
        ("machine", f"{meta['cpu']}, {meta['cores']} cores, {meta['memory_gb']:.0f} GiB"),
        ("GPU", meta["gpu"]),
        ("software", f"Python {meta['python']}, torch {meta['torch']}, "
                     f"torchvision {meta['torchvision']}"),
        ("load average (1, 5, 15 min)",
         f"before {load('load_before')}; after {load('load_after')}"),
        ("command", f"`{meta['command']}`"),
        ("run", f"{meta['date']}, {meta['duration_s'] / 60:.1f} min, {meta['rounds']} A/B "
                f"round(s), {meta['threads']} intra-op thread(s) per CPU process"),
    ]  # fmt: skip
    quick = (
        "\n\n**This is a `--quick` smoke run: one round, few steps. Its numbers are not a "
        "measurement.**"
        if meta["quick"]
        else ""
    )
    if meta["retried"]:
        rows.append(("runs that failed once and were run again", "; ".join(meta["retried"])))
    return (
        "# Performance\n\n"
        "Generated by `python -m benchmarks` (benchmarks/); edit the code there, not this file. "
        "Every number is the median over alternating runs (A, B, A, B, ...), with the range in "
        "parentheses, and every comparison is a ratio of runs taken side by side. On a machine "
        "shared with other work, compare ratios, not absolute rates, between reports."
        + quick
        + "\n\n"
        + md_table(("", ""), rows)
    )


def _targets(results: Results) -> str:
    rows = [row for section in TARGETS for row in section.targets(results)]
    return "## Targets\n\n" + md_table("target | measured | ", rows)


def _plots(out: Path, results: Results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    for section in PLOTS:
        section.plot(out, results)


def _method(meta: dict[str, Any]) -> str:
    return (
        "## Method and caveats\n\n"
        "- Runs alternate A, B, A, B, ...: each ratio is taken between neighbouring runs of the "
        "same round, then the median over rounds is shown; a range in parentheses is min-max.\n"
        f"- CPU processes run {meta['threads']} intra-op thread(s) (`OMP_NUM_THREADS`), for dpt "
        "and the plain loop alike. With more threads than free cores, a process stalls "
        "whenever one of its threads loses its core, which on a shared machine buries every "
        "difference in noise (a 2-thread MLP run measured 20-60x slower under load).\n"
        "- On 2 CPU cores ResNet-18 runs on 32 px images, batch 8, for a few steps: the numbers "
        "say how much dpt adds per step to a compute-heavy step, not what ResNet-18 trains at.\n"
        "- The plain loop uses DDP's defaults (`gradient_as_bucket_view=False`); dpt's default is "
        "True. It fetches a batch as most hand-written loops do, through `DataLoader` over a "
        "`TensorDataset`; dpt's in-memory data sets fetch a batch in one indexing op (section 6 "
        "times both, section 7 says what that is worth).\n"
        "- The MLP's step is about a millisecond, so every fixed per-step cost of a trainer shows "
        "in its ratios; ResNet-18's step is about a hundred times longer. Section 6's per-call "
        "costs are timed in place, many times, and are the precise numbers; the end-to-end "
        "ratios carry the machine's noise (see the ranges).\n"
        "- Nothing here is a test: `tests/test_bench.py` only checks that a `--smoke` run writes "
        "this report."
    )
