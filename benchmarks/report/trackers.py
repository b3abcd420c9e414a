"""Section 15 of the report, from the `trackers` section (benchmarks/trackers.py): the loop's
pace with MLflow and the CSV file beside TensorBoard, against TensorBoard alone. It stands
between two markers (`<!-- bench_trackers -->`), so that `--sections trackers` replaces it alone
(benchmarks/report/document.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.report.common import (
    Results,
    TargetRow,
    md_table,
    measured_alone,
    quick_banner,
    target,
)
from benchmarks.runner import Stat, paired_ratios

TITLE = "## 15. Trackers off the step: MLflow and the CSV file beside TensorBoard"
PACE_TARGET = 0.98  # of the pace with TensorBoard alone
ALONE, ALL = "[tensorboard]", "[tensorboard,mlflow,csv]"


def chapters(results: Results) -> list[str]:
    return [markdown(results["trackers"])] if "trackers" in results else []


def targets(results: Results) -> list[TargetRow]:
    return [_target(_ratio(results["trackers"]))] if "trackers" in results else []


def _ratio(r: dict[str, Any]) -> Stat:
    """Each round's pace with MLflow and the CSV file over the same round's with TensorBoard."""
    runs = r["runs"]
    return paired_ratios([run["steady"] for run in runs[ALL]],
                         [run["steady"] for run in runs[ALONE]])  # fmt: skip


def _target(ratio: Stat) -> TargetRow:
    return target(f"the loop's pace with MLflow and the CSV file >= {PACE_TARGET} of "
                  "TensorBoard alone's", ratio, lambda v: v >= PACE_TARGET)  # fmt: skip


def command(r: dict[str, Any]) -> str:
    quick = " --smoke" if r["smoke"] else " --quick" if r["quick"] else ""
    return f"python -m benchmarks --sections trackers --rounds {r['rounds']}{quick}"


def markdown(r: dict[str, Any]) -> str:
    runs, ratio = r["runs"], _ratio(r)
    held = sum(run["held"] for run in runs[ALL])
    logged = sum(run["logged"] for run in runs[ALL])
    rows = [
        [f"`logger={logger}`", Stat.of([run["steady"] for run in runs[logger]]).fmt(),
         "1.000" if logger == ALONE else ratio.fmt(".3f"),
         "-" if logger == ALONE else f"{held:,} of {logged:,}"]
        for logger in (ALONE, ALL)
    ]  # fmt: skip
    note = "`--sections trackers` writes only this part of the report."
    return f"""{TITLE}{quick_banner(r)}

{measured_alone(r, command(r), note, cores=True)}

The default job (dpt's MLP on synthetic vectors, one process, {r["threads"]} intra-op
thread(s)) for {r["steps"]:,} steps logging every {r["log_every"]}, checkpoints off, with
TensorBoard alone and with MLflow (its SQLite store) and the CSV file beside it, alternated
round by round. The pace is the done line's loop samples/s (the windows after the first); the
ratio pairs each round's two runs. The trackers run in a process of their own
(dpt/observe/trackers/process.py): the loop appends each logged row to a list, and every 2 s,
before a checkpoint and at the end rank 0 sends what it holds in one batch; the CSV file is
appended to. The last column is what the MLflow runs hold, read back with MLflow's client,
against the steps the runs logged.

{md_table("logger | samples/s | / TensorBoard alone | steps MLflow holds", rows)}

{md_table("target | measured | verdict", [_target(ratio)])}"""
