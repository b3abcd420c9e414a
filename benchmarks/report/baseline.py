"""Section 10 of the report, from the `baseline` section (benchmarks/baseline.py): this checkout's
dpt against another commit's (`--baseline REV`), side by side, on section 1's workloads. It stands
between two markers (`<!-- bench_baseline -->`), so that `--sections baseline` replaces it alone
(benchmarks/report/document.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.report.common import (
    Results,
    TargetRow,
    fmt_ratio,
    md_table,
    measured_alone,
    quick_banner,
)
from benchmarks.runner import Stat
from dpt.launch import allocator

# "Within noise": the paired ratio's range (min-max over the rounds) holds 1.0, or its median is
# at least this (a slowdown under 3 % is below what runs of seconds on a shared machine show).
WITHIN_MEDIAN = 0.97
# A loss gap at most this: the two train the same numbers, to float order. Above it a change
# between them moved the arithmetic (a kernel, an order of summation), and Adam, this section's
# optimizer, grew it over the steps (0.26 after 100 steps of ResNet-18 under ddp: Adam's fused
# kernel against its per-tensor loop; 7.5e-09 for the same change on the MLP under ddp).
SAME_ARITHMETIC = 1e-6


def within_noise(ratio: Stat) -> bool:
    return ratio.low <= 1.0 <= ratio.high or ratio.median >= WITHIN_MEDIAN


def _verdict(ratio: Stat) -> str:
    if ratio.low <= 1.0 <= ratio.high:
        return "within noise (the range holds 1.0)"
    if ratio.median >= WITHIN_MEDIAN:
        faster = "; faster in every round" if ratio.low > 1.0 else ""
        return f"within noise (median >= {WITHIN_MEDIAN}{faster})"
    return "**not within noise** (slower in every round)"


def targets(results: Results) -> list[TargetRow]:
    if "baseline" not in results:
        return []
    b = results["baseline"]
    return [
        (f"per-step throughput of this checkout / {b['short']} within noise: {r['model']} "
         f"{r['strategy']} x{r['world']}, log_every_n_steps={r['log_every']}",
         fmt_ratio(r["ratio"]), _verdict(r["ratio"]))
        for r in b["rows"]
    ]  # fmt: skip


def chapters(results: Results) -> list[str]:
    return [markdown(results)] if "baseline" in results else []


def command(b: dict[str, Any]) -> str:
    """The command that measures this section again."""
    parts = ["python -m benchmarks --sections baseline", f"--baseline {b['rev']}"]
    parts.append(f"--rounds {b['rounds']}")
    if b["models"] != "mlp,resnet18":
        parts.append(f"--models {b['models']}")
    if b["worlds"] and b["worlds"] != [2]:
        parts.append(f"--world-sizes {','.join(map(str, b['worlds']))}")
    if b.get("smoke") or b["quick"]:
        parts.append("--smoke" if b.get("smoke") else "--quick")
    return " ".join(parts)


def markdown(results: Results) -> str:
    b = results["baseline"]
    quick = quick_banner(b)
    measured = measured_alone(b, command(b), "`--sections baseline` writes only this part of "
                              "the report; its rows of the targets table are below.")  # fmt: skip
    commits = (
        f'**The two.** REV (`--baseline {b["rev"]}`): `{b["hash"]}` "{b["subject"]}". '
        f'This checkout: HEAD `{b["head"]}` "{b["head_subject"]}", {_tree(b)}.'
    )
    verdicts = "\n".join(f"- {name}: {ratio}, {verdict}" for name, ratio, verdict in
                         targets(results))  # fmt: skip
    return "\n\n".join([
        "## 10. This change against its base" + quick,
        measured,
        commits,
        _method(b),
        _table(b),
        f"**Against the target** (within noise: the paired ratio's range holds 1.0, or its "
        f"median is at least {WITHIN_MEDIAN}):\n\n" + verdicts + _spread(b),
    ])  # fmt: skip


def _tree(b: dict[str, Any]) -> str:
    """What this checkout's runs ran: HEAD's dpt, or its working tree's."""
    code = b["uncommitted_code"]
    if code:
        shown = ", ".join(f"`{path}`" for path in code[:6]) + (", ..." if len(code) > 6 else "")
        text = (f"dpt's code (dpt/, hydra_plugins/, train.py) with {len(code)} uncommitted "
                f"change(s), which these runs include ({shown})")  # fmt: skip
    else:
        text = "dpt's code (dpt/, hydra_plugins/, train.py) as committed"
    if b["uncommitted_other"]:
        text += f"; {b['uncommitted_other']} other uncommitted file(s), none of them run by dpt"
    if b["head_end"] != b["head"]:
        text += f"; HEAD moved to `{b['head_end']}` while the section ran"
    if b["code_changed"]:
        text += (
            "; **dpt's code in this checkout was edited while the section ran**: its runs "
            "measured what stood there at each run"
        )
    return text


def _method(b: dict[str, Any]) -> str:
    describe = "; ".join(
        f"{w.model}: batch {w.batch_size} per process, windows of {w.log_every} steps from step "
        f"{w.warmup_steps} to {w.steps}"
        + (f", {w.image_size} px images" if w.model != "mlp" else "")
        for w in b["workloads"]
    )
    heap = ", ".join(f"`{k}={v}`" for k, v in allocator.HEAP_ENV.items())
    imported = b.get("imported", {})
    where = f" (this run: `{imported['base']}` and `{imported['this']}`)" if imported else ""
    return (
        "**How.** Section 1's dpt runs (`python train.py ...`, the same workloads, overrides, "
        "seed and measure: the median samples/s over the logging windows after warmup; *all "
        "steps*: over the whole timed span, epoch ends included), for dpt only: for each "
        "workload, single and ddp at each world size, a pair (dpt at REV, dpt of this checkout), "
        "alternated run by run and round by round, each ratio taken within a round. REV is "
        "checked out with `git worktree add --detach` in the run's temporary folder (removed "
        "afterwards); its runs start the worktree's `train.py` in the worktree with the "
        "worktree first on `PYTHONPATH`: ddp's ranks fork from a server that multiprocessing "
        "starts as `python -c ...` in the working directory (Python 3.11's forkserver does not "
        "take the launcher's `sys.path`), and from this checkout's folder, or through its "
        "editable install, they would import this checkout's dpt. Before the rounds a probe "
        "started the same way checks that `import dpt` finds each run's own package"
        f"{where}. dpt's compiled helpers (`dpt/data/_jpeg_box*.so`, `_normalize*.so`, built by "
        "setup.py, ignored by git) exist only in this checkout: the MLP (synthetic vectors) and "
        "ResNet-18 on `fake_images` (synthetic tensors) decode no JPEG and load neither, so "
        "both sides run the same code paths. Both get the heap settings of section 1 through "
        f"glibc's variables ({heap}; this checkout's values). Workloads: {describe}. *loss "
        "gap*: the largest difference, over the rounds, between the two runs of a pair of the "
        "last window's mean loss (rank 0's `train/loss`): ~0 where the training arithmetic is "
        "unchanged."
    )


def _spread(b: dict[str, Any]) -> str:
    """What the rule can see at the noise these runs had."""
    ratios = [r["ratio"] for r in b["rows"]]
    if not ratios or all(r.n < 2 for r in ratios):
        return ""
    widest = max(r.high - r.low for r in ratios)
    gap = max(r["loss_gap"] for r in b["rows"])
    return (
        f"\n\nThe paired ratios ran from {min(r.low for r in ratios):.3f} to "
        f"{max(r.high for r in ratios):.3f} (the widest row {widest:.3f} wide): a per-step change "
        "smaller than a row's spread cannot be told from the machine's noise here, and *within "
        "noise* says that no change was large and steady enough to show, not that there is "
        f"none. {_gap_says(gap)}"
    )


def _gap_says(gap: float) -> str:
    """What the largest loss gap tells: the same numbers, or not (then the rates compare each
    revision's own defaults, and the gap checks nothing)."""
    if gap <= SAME_ARITHMETIC:
        return (
            f"The loss gap (at most {gap:.1e}) is the sharper check: the two train the same "
            "numbers, to float order."
        )
    return (
        f"The loss gap (up to {gap:.1e}) says the two do not train the same numbers: a change "
        "between them moved the arithmetic (a kernel, an order of summation), which Adam grows "
        "over the steps; each rate is its revision's training as it runs by default, and the "
        "gap checks no sameness."
    )


def _table(b: dict[str, Any]) -> str:
    rows = [
        (r["model"], r["strategy"], r["world"], r["batch"], r["log_every"], r["base"].fmt(),
         r["this"].fmt(), fmt_ratio(r["ratio"]), fmt_ratio(r["ratio_all_steps"]),
         f"{r['loss_gap']:.1e}")
        for r in b["rows"]
    ]  # fmt: skip
    return md_table(
        f"model | strategy | world | batch/rank | log every | dpt@{b['short']} samples/s | "
        f"this checkout samples/s | this/{b['short']} (paired) | this/{b['short']}, all steps | "
        "loss gap",
        rows,
    )
