"""Sections 1 and 2 of the report, from the `loops` section (benchmarks/loops.py): dpt against the
plain loop (with the out-of-the-box table), the strategies and their scaling, and the throughput
plot."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report.common import (
    THROUGHPUT_TARGET,
    Results,
    TargetRow,
    error_bars,
    fmt_ratio,
    md_table,
    target,
)
from benchmarks.runner import Stat
from dpt.launch import allocator

PLOT = "perf_throughput.png"


def targets(results: Results) -> list[TargetRow]:
    rows = []
    for r in results.get("loops", []):
        name = (f"dpt/plain throughput >= {THROUGHPUT_TARGET}: {r['model']} {r['strategy']} "
                f"x{r['world']}, log_every_n_steps={r['log_every']}")  # fmt: skip
        rows.append(target(name, r["ratio"], lambda v: v >= THROUGHPUT_TARGET))
    return rows


def chapters(results: Results) -> list[str]:
    return [_loops(results), _strategies(results)]


def plot(out: Path, results: Results) -> None:
    if "loops" in results:
        _plot_throughput(out / PLOT, results)


def _loops(results: Results) -> str:
    if "loops" not in results:
        return ""
    rows = [
        (r["model"], r["strategy"], r["world"], r["batch"], r["log_every"], r["plain"].fmt(),
         r["dpt"].fmt(), fmt_ratio(r["ratio"]), fmt_ratio(r["ratio_all_steps"]),
         f"{r['loss_gap']:.1e}")
        for r in results["loops"]
    ]  # fmt: skip
    heap = ", ".join(f"`{k}={v}`" for k, v in allocator.HEAP_ENV.items())
    describe = "; ".join(
        f"{w.model}: batch {w.batch_size} per process, windows of {w.log_every} steps from step "
        f"{w.warmup_steps} to {w.steps}"
        + (f", {w.image_size} px images" if w.model != "mlp" else "")
        for w in results["workloads"]
    )
    return (
        "## 1. dpt against a hand-written loop\n\n"
        "`python train.py ...` against `benchmarks/plain_loop.py` (DistributedSampler, DDP, Adam, "
        "cross-entropy; nothing from dpt), as subprocesses, same model, data, seed, batch and "
        "world size; ddp on CPU ranks over Gloo. Both loops read the loss back every "
        "`log_every` steps (dpt: `trainer.log_every_n_steps`; 10 and 50, each loop at the "
        "same cadence) and stamp the wall clock there "
        "(dpt: its rank-0 TensorBoard events; plain: a JSON file). A run's samples/s is the "
        "median over its logging windows after warmup: every window holds the same steps and "
        "one read-back of each loop (for dpt: TensorBoard writes, the world aggregation and a "
        "log line); start-up and warmup are left out. *all steps*: the ratio over the whole "
        "timed span instead, epoch boundaries included (more exposed to other processes' load). "
        "dpt runs with `checkpoint.enabled=false dataset.num_val_samples=0`. Both loops run "
        "with the heap settings dpt gives its ranks (`dpt/launch/allocator.py`), passed to both as "
        f"glibc's variables ({heap}), so that a ratio measures the loops, not where glibc's "
        "adaptive thresholds happened to settle in each process (the next table). "
        f"Workloads: {describe}. *loss gap*: the largest difference between the two loops of "
        "the last window's mean loss (the same arithmetic gives ~0).\n\n"
        + md_table(
            "model | strategy | world | batch/rank | log every | "
            "plain samples/s | dpt samples/s | dpt/plain | dpt/plain, all steps | loss gap",
            rows,
        )
        + f"\n\n![throughput]({PLOT})"
        + _out_of_the_box(results)
    )


def _out_of_the_box(results: Results) -> str:
    """Each loop as it runs with nothing set: the plain loop on glibc's defaults, dpt with the
    heap settings it makes itself."""
    if not results.get("out_of_the_box"):
        return ""
    rows = [
        (r["model"], r["strategy"], r["world"], r["log_every"], r["plain"].fmt(),
         r["dpt"].fmt(), fmt_ratio(r["ratio"]))
        for r in results["out_of_the_box"]
    ]  # fmt: skip
    return (
        "\n\n**Out of the box.** The same runs with no heap variable set: the plain loop on "
        "glibc's defaults, dpt with the thresholds it sets in every rank (`mallopt`; it leaves "
        "them to the user who sets glibc's variables or preloads another allocator). glibc "
        "raises its mmap threshold to each large block freed and gives the heap's top back "
        "above twice that, so a process settles faster or slower depending on the order of its "
        "first allocations; the spread of the plain loop's rates below is that.\n\n"
        + md_table(
            "model | strategy | world | log every | plain samples/s (glibc's defaults) | "
            "dpt samples/s (its own) | dpt/plain",
            rows,
        )
    )


def _strategies(results: Results) -> str:
    if "strategies" not in results:
        return ""
    rows = [
        (r["model"], r["strategy"], r["world"], r["batch"], r["global_batch"],
         r["samples_s"].fmt(), fmt_ratio(r["efficiency"]))
        for r in results["strategies"]
    ]  # fmt: skip
    return (
        "## 2. Strategies and scaling\n\n"
        "dpt's runs from section 1 at log_every_n_steps=10. Weak scaling: every process keeps "
        "its batch, so a world of n does n times the work per step; *scaling efficiency* = "
        "samples/s / (n x samples/s of `single`), paired round by round. On CPU each process "
        "runs one thread, so a 'device' is one core, and `dp` (DataParallel needs 2 GPUs) "
        "runs as `single`.\n\n"
        + md_table(
            "model | strategy | world | batch/rank | global batch | samples/s | scaling efficiency",
            rows,
        )
    )


def step_times_ms(results: Results) -> dict[str, dict[int, float]]:
    """model -> world -> ms per step of dpt's single/ddp runs (section 2)."""
    steps: dict[str, dict[int, float]] = {}
    for r in results.get("strategies", []):
        if r["strategy"] != "dp":
            steps.setdefault(r["model"], {})[r["world"]] = (
                1e3 * r["global_batch"] / r["samples_s"].median
            )
    return steps


def _throughput_bars(results: Results, model: str) -> list[tuple[str, Stat, str, str]]:
    """(label, samples/s, colour, note) for one model: plain and dpt at every cadence and world
    size (and dp, where it was run)."""
    bars = []
    for r in (r for r in results["loops"] if r["model"] == model):
        world = "single" if r["strategy"] == "single" else f"ddp x{r['world']}"
        tag = f"{world}\nlog {r['log_every']}"
        bars += [
            (f"plain\n{tag}", r["plain"], "#9a9a9a", ""),
            (f"dpt\n{tag}", r["dpt"], "#2f6db5", f"{r['ratio'].median:.3f}x"),
        ]
        dp = [
            s for s in results["strategies"]
            if (s["model"], s["strategy"], s["log_every"]) == (model, "dp", r["log_every"])
        ] if r["strategy"] == "single" else []  # fmt: skip
        bars += [(f"dpt\ndp\nlog {r['log_every']}", d["samples_s"], "#7fa7d8", "") for d in dp]
    return bars


def _plot_throughput(path: Path, results: Results) -> None:
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results["loops"]))
    widths = [len(_throughput_bars(results, m)) for m in models]
    fig, axes = plt.subplots(
        1, len(models), figsize=(0.8 * sum(widths) + 1, 4.4), squeeze=False,
        gridspec_kw={"width_ratios": widths},
    )  # fmt: skip
    for ax, model in zip(axes[0], models, strict=True):
        labels, stats, colors, notes = zip(*_throughput_bars(results, model), strict=True)
        x = range(len(labels))
        ax.bar(x, [s.median for s in stats], yerr=error_bars(list(stats)), color=colors, capsize=3)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_title(f"{model}: samples/s (median, min-max), dpt/plain above dpt")
        ax.set_ylabel("samples/s")
        for i, note in enumerate(notes):
            if note:
                ax.annotate(note, (i, stats[i].high), textcoords="offset points", xytext=(0, 4),
                            ha="center", fontsize=8)  # fmt: skip
        ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
