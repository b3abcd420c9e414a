"""What earlier runs left in a run folder: its results, step folders and curves.

A folder with such history is never trained from step 0 without being asked to
(`checkpoint.resume=never`): a new start there would mix a second run into the first one's
curves and replace its results.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from dpt.observe.dashboard import TB_FOLDER
from dpt.observe.event_file import last_step


def earlier_work(run_dir: Path, step_folders: int) -> list[str]:
    """What an earlier run left in `run_dir`, in words (empty: nothing); `step_folders`: how
    many its checkpoints folder holds (dpt.state.checkpoint counts them)."""
    found = []
    if (run_dir / "metrics.json").exists():
        found.append("metrics.json")
    if step_folders:
        found.append(f"{step_folders} step folder(s) in checkpoints/")
    curves = max((_last_step(path) for path in (run_dir / TB_FOLDER).rglob("events.out.*")),
                 default=0)  # fmt: skip
    if curves:
        found.append(f"TensorBoard curves to step {curves}")
    return found


def _last_step(path: Path) -> int:
    with contextlib.suppress(OSError):
        return last_step(path)
    return 0
