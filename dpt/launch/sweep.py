"""Multirun bookkeeping: every job records how it ended; the sweep ends with one summary.

Hydra runs a job's callbacks where the job runs: in this process (basic launcher), in a joblib
worker, or in SLURM task 0. So each job writes `<job>/job_status.json` itself, and
`on_multirun_end`, back in the process that started the sweep, reads them all. That works the
same for every launcher, and a job killed before it could report still shows up (as CRASHED).
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dpt.errors import Abort, DptError, one_line
from dpt.launch.sweep_trackers import close_sweep, open_sweep
from dpt.monitor.events import read_events
from dpt.observe import dashboard
from dpt.observe.dashboard import write_sweep_experiment
from dpt.state.results import METRICS_FILE
from dpt.state.sweep_folder import BEST_LINK, STATUS_FILE, SUMMARY_CSV, SUMMARY_PNG

FAILED_STATES = ("FAILED", "CRASHED")
# What a run's metrics.json reports where it names no validation metrics (before tasks).
DEFAULT_VAL_METRICS = dashboard.SESSION_METRICS[2:-1]


class SweepSummary(Callback):
    """`hydra.callbacks.summary`: job statuses, then `<sweep>/summary.csv`, a table and a plot.

    A failed job does not stop the others; the sweep exits with status 1 once all have run.
    With `stop_on_failure=true` the first failure ends the sweep at once (jobs running beside it
    under joblib or SLURM are stopped too).
    """

    def __init__(self, stop_on_failure: bool = False) -> None:
        self.stop_on_failure = stop_on_failure

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        open_sweep(config, Path(config.hydra.sweep.dir).absolute())

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if _is_multirun(config):
            record = {**_job_info(config), "status": "RUNNING", "started_at": time.time()}
            write_status(_job_dir(config), record)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        record = finished_record(_job_dir(config), _job_info(config), job_return)
        write_status(_job_dir(config), record)
        if job_return.status != JobStatus.FAILED:
            return
        print(f"[sweep] job {record['job']} failed: {record['error']}", file=sys.stderr)
        if "traceback" in record:  # a bug rather than bad input: show where
            print(record["traceback"], file=sys.stderr, end="")
        if self.stop_on_failure:
            report(Path(config.hydra.sweep.dir), final=False)
            if "SUBMITIT_EXECUTOR" in os.environ:
                return  # in a SLURM job: the launcher sees the failure and cancels the others
            raise Abort(
                DptError(
                    f"job {record['job']} failed ({record['error']}); sweep stopped "
                    "(hydra.callbacks.summary.stop_on_failure=true)"
                )
            )
        # Hydra's sweeper re-raises a failed job once its batch is done, which ends the sweep
        # before `on_multirun_end` (no summary) and skips later batches. The failure is kept in
        # job_status.json and reported, with a non-zero exit, by `on_multirun_end` instead.
        job_return.status = JobStatus.COMPLETED

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        records = report(sweep_dir, final=True)
        # The one HPARAMS experiment: every key and the values the jobs gave it.
        runs = [(r.get("result") or {}).get("hparams") for r in records]
        metrics = dashboard.session_metrics(val_metrics_of(records))
        write_sweep_experiment(sweep_dir, [hparams for hparams in runs if hparams], metrics)
        failed = [r for r in records if r["status"] in FAILED_STATES]
        close_sweep(sweep_dir.absolute(), bool(failed))
        if failed and _is_search(config) and len(failed) < len(records):
            print(f"[sweep] {len(failed)} of {len(records)} trials failed; a search goes on past "
                  "them (hydra.sweeper.max_failure_rate)", file=sys.stderr)  # fmt: skip
            return
        if failed:
            first = failed[0]
            raise Abort(
                DptError(
                    f"{len(failed)} of {len(records)} jobs failed (first: job {first['job']}: "
                    f"{first['error']}); summary: {sweep_dir / SUMMARY_CSV}"
                )
            )


def _is_search(config: DictConfig) -> bool:
    """Run by dpt's Optuna sweeper (`hydra/sweeper=optuna`): failed trials are a search's
    ordinary results."""
    target = OmegaConf.select(config, "hydra.sweeper._target_", default="")
    return str(target).startswith("hydra_plugins.dpt_optuna_sweeper.")


def _is_multirun(config: DictConfig) -> bool:
    return OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN


def _job_dir(config: DictConfig) -> Path:
    return Path(config.hydra.runtime.output_dir)


def _job_info(config: DictConfig) -> dict[str, Any]:
    return {"job": int(config.hydra.job.num), "overrides": list(config.hydra.overrides.task)}


# --- one job's status -----------------------------------------------------------------------------


def write_status(job_dir: Path, record: dict[str, Any]) -> None:
    """Atomically: the summary never reads half a file, even while jobs still run beside it."""
    job_dir.mkdir(parents=True, exist_ok=True)
    tmp = job_dir / f".{STATUS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, job_dir / STATUS_FILE)


def read_status(job_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((job_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def finished_record(job_dir: Path, info: dict[str, Any], job_return: JobReturn) -> dict[str, Any]:
    started = (read_status(job_dir) or {}).get("started_at")
    record: dict[str, Any] = {**info, "started_at": started, "ended_at": time.time()}
    value = job_return._return_value  # `return_value` would re-raise a failure
    if job_return.status == JobStatus.FAILED:
        record.update(status="FAILED", error=describe_error(value), result=None)
        if not isinstance(value, DptError) and isinstance(value, BaseException):
            record["traceback"] = "".join(traceback.format_exception(value))
    else:  # the task returns the objective; the run's results are its metrics.json
        record.update(status="COMPLETED", error=None, result=_results(job_dir))
    return record


def describe_error(error: Any, limit: int = 300) -> str:
    """One line, short enough for a table cell; the full traceback stays in job_status.json."""
    if isinstance(error, DptError):
        text = one_line(error)
    elif isinstance(error, BaseException):
        first = (str(error).strip().splitlines() or [""])[0]
        text = f"{type(error).__name__}: {first}" if first else type(error).__name__
    else:
        text = str(error)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _results(job_dir: Path) -> dict[str, Any]:
    try:
        found = json.loads((job_dir / METRICS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


# --- the sweep's summary --------------------------------------------------------------------------


def collect(sweep_dir: Path, final: bool) -> list[dict[str, Any]]:
    """Every job's record, by job number. After the sweep, RUNNING means its process died."""
    records = []
    for path in sweep_dir.rglob(STATUS_FILE):
        record = read_status(path.parent)
        if record is None:
            continue
        record["job_dir"] = str(path.parent.relative_to(sweep_dir))
        record["events"] = len(read_events(path.parent))  # the monitor's, failed jobs' too
        if final and record["status"] == "RUNNING":
            record.update(status="CRASHED", error="ended without a status (process killed?)")
        records.append(record)
    return sorted(records, key=lambda r: r["job"])


def val_metrics_of(records: list[dict[str, Any]]) -> list[str]:
    """The validation metrics the sweep's runs report, in the order they name them (a sweep over
    tasks has each task's); classification's for runs that name none (written before tasks)."""
    found: dict[str, None] = {}
    for record in records:
        result = record.get("result") or {}
        names = result.get("val_metrics", DEFAULT_VAL_METRICS if result else [])
        found.update(dict.fromkeys(names))
    return list(found)


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows for the CSV: one column per best validation metric seen in the sweep.

    Clocks named apart: `loop_samples_per_s` is the training loop's pace after its first
    logging window (metrics.json's `steady_samples_per_s`; its `samples_per_s` where the run had
    one window), `loop_time_s` the loop's whole time (`wall_time_s`), `job_wall_s` the whole
    job, start to end (start-up, data loading, validation and checkpoints included).
    """
    bests = [(r.get("result") or {}).get("best_per_metric") or {} for r in records]
    best_keys = [k for k in val_metrics_of(records) if any(k in best for best in bests)]
    out = []
    for r in records:
        result = r.get("result") or {}
        row: dict[str, Any] = {
            "job": r["job"],
            "status": r["status"],
            "overrides": " ".join(r["overrides"]),
            "objective": (result.get("objective") or {}).get("value"),
            "best": False,  # set by `mark_best`
            "final_loss": result.get("final_loss"),
        }
        row.update({f"best_{k}": (result.get("best_per_metric") or {}).get(k) for k in best_keys})
        row.update(
            loop_samples_per_s=result.get("steady_samples_per_s", result.get("samples_per_s")),
            loop_time_s=result.get("wall_time_s"),
            job_wall_s=_wall_time(r),
            world_size=result.get("world_size"),
            steps=result.get("steps"),
            events=r.get("events", 0),
            error=r.get("error"),
            job_dir=r["job_dir"],
        )
        out.append(row)
    return out


def _wall_time(record: dict[str, Any]) -> float | None:
    start, end = record.get("started_at"), record.get("ended_at")
    return end - start if start is not None and end is not None else None


def mark_best(
    records: list[dict[str, Any]], table: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The completed job with the best objective (its direction, as every job reports it),
    marked in the table, with its objective (name, direction, value); None where no job has
    one."""
    scored = [(row, (record.get("result") or {}).get("objective") or {})
              for record, row in zip(records, table, strict=True)]  # fmt: skip
    scored = [(row, found) for row, found in scored
              if row["status"] == "COMPLETED" and found.get("value") is not None]  # fmt: skip
    if not scored:
        return None
    sign = -1.0 if scored[0][1].get("direction") == "maximize" else 1.0
    best = min(scored, key=lambda pair: sign * pair[1]["value"])
    best[0]["best"] = True
    return best


def link_best(sweep_dir: Path, job_dir: str) -> Path:
    """`<sweep>/best`: the best job's run folder (model_best.pt, metrics.json, ...), a relative
    link replaced at once (a new one under a temporary name, renamed over the old)."""
    tmp = sweep_dir / f".{BEST_LINK}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(job_dir, target_is_directory=True)
    os.replace(tmp, sweep_dir / BEST_LINK)
    return sweep_dir / BEST_LINK


def report(sweep_dir: Path, final: bool) -> list[dict[str, Any]]:
    """Write summary.csv and summary.png into the sweep folder, link the best job's folder and
    print the table."""
    records = collect(sweep_dir, final)
    table = rows(records)
    best = mark_best(records, table)
    write_csv(sweep_dir / SUMMARY_CSV, table)
    plotted = plot(sweep_dir / SUMMARY_PNG, table, best[1] if best else None)
    print(format_table(table))
    print(f"[sweep] summary: {sweep_dir / SUMMARY_CSV}" + (f", {plotted}" if plotted else ""))
    if best is not None:
        row, found = best
        link = link_best(sweep_dir, row["job_dir"])
        print(f"[sweep] best (*): job {row['job']}, {found['name']} {found['value']:.6g} "
              f"({found['direction']}): {link}")  # fmt: skip
    return records


def write_csv(path: Path, table: list[dict[str, Any]]) -> None:
    fields = list(table[0]) if table else ["job", "status", "overrides", "error"]
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(table)
    os.replace(tmp, path)


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def swept(table: list[dict[str, Any]]) -> list[str]:
    """Each job's overrides without those every job shares: what tells the jobs apart."""
    split = [row["overrides"].split() for row in table]
    shared = set.intersection(*map(set, split)) if len(split) > 1 else set()
    return [" ".join(o for o in overrides if o not in shared) for overrides in split]


def _best_column(table: list[dict[str, Any]]) -> str | None:
    """The validation column the table and the plot show: accuracy if there is one, else loss."""
    columns = [k for k in (table[0] if table else {}) if k.startswith("best_")]
    return next((k for k in columns if k != "best_val/loss"), columns[0] if columns else None)


def format_table(table: list[dict[str, Any]]) -> str:
    """A plain-text table: one line per job, and its error on the next line if it failed."""
    best = _best_column(table)
    head = ["job", "status", "objective", "final loss", f"best {best[5:]}" if best else "best val"]
    head += ["loop samples/s", "job wall s", "events", "overrides"]
    lines = []
    for row, overrides in zip(table, swept(table), strict=True):
        cells = [
            str(row["job"]) + (" *" if row["best"] else ""),  # the best objective
            row["status"],
            _fmt(row["objective"], ".4f"),
            _fmt(row["final_loss"], ".4f"),
            _fmt(row.get(best) if best else None, ".4f"),
            _fmt(row["loop_samples_per_s"], ",.0f"),
            _fmt(row["job_wall_s"], ".1f"),
            str(row["events"]),
            overrides,
        ]
        lines.append((cells, row["error"]))
    widths = [max(len(c) for c in col) for col in zip(head, *(c for c, _ in lines), strict=False)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    for cells, error in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        if error:
            out.append(f"{'':{widths[0]}}  error: {error}")
    return "\n".join(out)


def plot(
    path: Path, table: list[dict[str, Any]], objective: dict[str, Any] | None = None
) -> Path | None:
    """One panel per measure, one bar per job, its value written on it; a job without a value
    gets its status in red instead. Loss and accuracy axes span the values, not 0..max: the
    differences between jobs are what a sweep is read for."""
    if not table:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display needed: a cluster node or CI writes the file
    import matplotlib.pyplot as plt

    panels = [("loop_samples_per_s", "loop samples/s (higher is better)", ",.0f", True)]
    if objective is not None:  # the best job's bar in its own colour
        better = "higher" if objective["direction"] == "maximize" else "lower"
        panels.append(("objective", f"objective: {objective['name']} ({better} is better)",
                       ".4f", False))  # fmt: skip
    panels.append(("final_loss", "final train loss (lower is better)", ".4f", False))
    best = _best_column(table)
    if best:
        better = "lower" if best.endswith("loss") else "higher"
        panels.append((best, f"best {best[5:]} ({better} is better)", ".4f", False))
    labels = [plot_label(r["job"], o) for r, o in zip(table, swept(table), strict=True)]
    row_height = 0.25 * max(2, *(label.count("\n") + 1 for label in labels))
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(4.5 * len(panels) + 2.5, 1.2 + row_height * len(table)),
        sharey=True,
    )
    for ax, (key, title, spec, from_zero) in zip(axes, panels, strict=True):
        marked = [bool(r["best"]) and key == "objective" for r in table]
        _bar_panel(ax, [r.get(key) for r in table], [r["status"] for r in table], spec, from_zero,
                   marked)  # fmt: skip
        ax.set_title(title, fontsize=10)
    axes[0].set_yticks(range(len(table)), labels)
    axes[0].set_ylim(len(table) - 0.5, -0.5)  # job 0 on top, half a row of room at each end
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_label(job: int, overrides: str) -> str:
    """`#3` and each of the job's swept `key=value` on a line of its own (none cut off), a
    number in 4 significant digits."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides.split())
    return "\n".join([f"#{job}", *(dashboard.short_override(o) for o in parsed)])


def _bar_panel(
    ax: Any,
    values: list[float | None],
    statuses: list[str],
    spec: str,
    from_zero: bool,
    marked: list[bool],
) -> None:
    known = [v for v in values if v is not None and math.isfinite(v)]
    low, high = _axis_range(known, from_zero)
    for i, (value, status) in enumerate(zip(values, statuses, strict=True)):
        if value is None or not math.isfinite(value):
            ax.text(low, i, f" {status}", va="center", color="tab:red")
            continue
        colour = "tab:green" if marked[i] else "tab:blue"  # the best job's objective
        ax.barh(i, value - low, left=low, color=colour, height=0.6)
        ax.text(value, i, f" {format(value, spec)}", va="center", fontsize=9)
    ax.set_xlim(low, high + (high - low) * 0.3)  # room for the value written after each bar
    ax.grid(axis="x", alpha=0.3)


def _axis_range(values: list[float], from_zero: bool) -> tuple[float, float]:
    """0..max for throughput; around the values otherwise (a bar still shows for the lowest)."""
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    if from_zero:
        return 0.0, high or 1.0
    pad = (high - low) * 0.5 or abs(high) * 0.05 or 1.0
    return low - pad, high
