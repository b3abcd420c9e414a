"""The sweep's summary: columns that mean something, each clock named for what it times."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dpt.launch.sweep import format_table, plot_label, report, rows, write_status
from tests.helpers import summary


def _job(number: int, loss: float, acc1: float) -> dict[str, object]:
    best = {"val/loss": loss, "val/acc1": acc1, "val/acc5": 0.9, "val/samples": 1024}
    result = {"final_loss": loss, "samples_per_s": 5000.0, "wall_time_s": 4.0,
              "best_per_metric": best, "world_size": 1, "steps": 20}  # fmt: skip
    return {"job": number, "overrides": [f"trainer.seed={number}"], "status": "COMPLETED",
            "error": None, "started_at": 100.0, "ended_at": 109.5, "result": result}  # fmt: skip


def test_summary_columns_name_their_clock_and_leave_out_the_sample_count(tmp_path: Path) -> None:
    for number in range(2):
        write_status(tmp_path / str(number), _job(number, 2.0 + number, 0.3))
    report(tmp_path, final=True)
    (first, _) = summary(tmp_path)
    assert list(first) == [
        "job", "status", "overrides", "objective", "best", "final_loss", "best_val/loss",
        "best_val/acc1",
        "best_val/acc5", "loop_samples_per_s", "loop_time_s", "job_wall_s", "world_size",
        "steps", "events", "error", "job_dir",
    ]  # fmt: skip
    assert float(first["loop_time_s"]) == 4.0 and float(first["job_wall_s"]) == 9.5
    assert (tmp_path / "summary.png").stat().st_size > 1000


def test_the_table_says_which_clock() -> None:
    table = rows([{**_job(0, 2.0, 0.3), "job_dir": "0"}])
    head = format_table(table).splitlines()[0]
    assert "loop samples/s" in head and "job wall s" in head and "best val/acc1" in head


def test_the_best_objective_is_marked_and_its_folder_linked(tmp_path: Path, capsys: Any) -> None:
    for number, acc1 in ((0, 0.3), (1, 0.7), (2, 0.5)):
        job = _job(number, 1.0, acc1)
        job["result"]["objective"] = {"name": "val/acc1", "direction": "maximize", "value": acc1}
        (tmp_path / str(number)).mkdir()
        write_status(tmp_path / str(number), job)
    failed = {**_job(3, 0.1, 0.99), "status": "FAILED", "result": None, "error": "boom"}
    write_status(tmp_path / "3", failed)
    report(tmp_path, final=True)
    assert [row["best"] for row in summary(tmp_path)] == ["False", "True", "False", "False"]
    assert os.readlink(tmp_path / "best") == "1" and (tmp_path / "best").is_dir()
    out = capsys.readouterr().out
    assert "\n1 *  " in out
    assert f"[sweep] best (*): job 1, val/acc1 0.7 (maximize): {tmp_path / 'best'}" in out


def test_the_plot_labels_every_swept_key_with_short_numbers() -> None:
    """A search's trial draws 16 digits: each key on its own line, 4 significant digits, none
    cut off (the label was cut at 50 characters, the second key lost)."""
    assert plot_label(0, "optimizer.lr=0.004430375245218269 trainer.batch_size=32") == (
        "#0\noptimizer.lr=0.00443\ntrainer.batch_size=32"
    )
    assert plot_label(3, "") == "#3"


def test_the_loop_column_is_the_steady_pace_where_the_run_had_one() -> None:
    steady = _job(0, 2.0, 0.3)
    steady["result"]["steady_samples_per_s"] = 9000.0  # after the first window
    one_window = _job(1, 2.0, 0.3)  # its whole run's 5000.0
    table = rows([{**steady, "job_dir": "0"}, {**one_window, "job_dir": "1"}])
    assert [row["loop_samples_per_s"] for row in table] == [9000.0, 5000.0]
