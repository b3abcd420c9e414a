"""Section 4 of the report, from the `sync` section (benchmarks/sync.py): the gradient all-reduce
against a bare all-reduce, DDP's settings, and the bandwidth plot. (The same section's per-step
costs are in section 6: benchmarks/report/overhead.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import Results, TargetRow, error_bars, fmt_ratio, md_table, target

PLOT = "perf_sync.png"


def targets(results: Results) -> list[TargetRow]:
    rows = []
    for r in results.get("sync", []):
        name = f"gradient sync >= 0.9 of bare all-reduce busbw: {r['model']} (Gloo, 2 ranks)"
        rows.append(target(name, r["hook_vs_bare"], lambda v: v >= 0.9))
    return rows


def chapters(results: Results) -> list[str]:
    return [_sync(results)]


def plot(out: Path, results: Results) -> None:
    if "sync" in results:
        _plot_sync(out / PLOT, results["sync"])


def _sync(results: Results) -> str:
    if "sync" not in results:
        return ""
    bandwidth = [
        (r["model"], f"{r['mbytes']:.1f}", r["bare_ms"].fmt(".2f"), r["bare_busbw"].fmt(".2f"),
         r["hook_ms"].fmt(".2f"), r["hook_busbw"].fmt(".2f"), fmt_ratio(r["hook_vs_bare"]),
         r["one_bucket_busbw"].fmt(".2f"), fmt_ratio(r["one_bucket_vs_bare"]))
        for r in results["sync"]
    ]  # fmt: skip
    variants = [
        (r["model"], r["step_ms"].fmt(".1f"), r["exposed_ms"].fmt(".2f"),
         fmt_ratio(r["torch_default_speedup"]), fmt_ratio(r["static_speedup"]),
         fmt_ratio(r["bf16_speedup"]))
        for r in results["sync"]
    ]  # fmt: skip
    return (
        "## 4. Gradient synchronisation\n\n"
        "Two CPU ranks over Gloo (one thread each) in one world, every variant once per round, "
        "rounds alternating. Bus bandwidth = 2(n-1)/n x bytes / time (the nccl-tests "
        "convention). *bare*: `dist.all_reduce` of one flat fp32 tensor with as many bytes as the "
        "gradients. *ddp*: dpt's DDP wrapper (25 MB buckets, gradient_as_bucket_view) with a comm "
        "hook that does the default mean all-reduce and stamps each bucket from the moment the "
        "last rank launched it to its completion; the time is the union of those intervals. "
        "*one bucket*: the same with a single bucket, launched after backward, so the all-reduce "
        "does not share the core with backward.\n\n"
        + md_table(
            "model | MB | bare ms | bare GB/s | "
            "ddp ms | ddp GB/s | ddp/bare | one bucket GB/s | one bucket/bare",
            bandwidth,
        )
        + "\n\nThe ddp training step (forward, backward, all-reduce) with dpt's defaults, what "
        "the all-reduce adds to it (*exposed*: the step minus the same step under `no_sync()`), "
        "and the step-time ratio of other settings against dpt's defaults (> 1: that setting is "
        "faster). *PyTorch defaults* is `DistributedDataParallel(model)` as the plain loop builds "
        "it: a 1 MiB first bucket and gradients copied into the buckets.\n\n"
        + md_table(
            "model | step ms | exposed ms | PyTorch defaults | static_graph=true | comm_hook=bf16",
            variants,
        )
        + f"\n\n![sync]({PLOT})"
    )


def _plot_sync(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    series = (
        ("bare_busbw", None, "bare all_reduce", "#9a9a9a"),
        ("hook_busbw", "hook_vs_bare", "ddp gradients (25 MB buckets)", "#2f6db5"),
        ("one_bucket_busbw", "one_bucket_vs_bare", "ddp gradients, one bucket", "#7fa7d8"),
    )
    width = 0.8 / len(series)
    for k, (key, ratio, label, color) in enumerate(series):
        stats = [r[key] for r in rows]
        x = [i + (k - 1) * width for i in range(len(rows))]
        ax.bar(x, [s.median for s in stats], width, yerr=error_bars(stats), label=label,
               color=color, capsize=3)  # fmt: skip
        for i, r in enumerate(rows):
            if ratio:
                ax.annotate(f"{r[ratio].median:.2f}x", (x[i], stats[i].high),
                            textcoords="offset points", xytext=(0, 4), ha="center",
                            fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['mbytes']:.1f} MB" for r in rows])
    ax.set_ylabel("bus bandwidth, GB/s")
    ax.set_title("all-reduce bus bandwidth, 2 ranks, Gloo")
    ax.legend()
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
