"""`trackers.json`: which tracker run a run folder (or a sweep folder, its parent run) is, so that
a resumed run, `dpt-evaluate` and a sweep's jobs find it again."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TRACKERS_FILE = "trackers.json"


def read_ids(folder: Path) -> dict[str, Any]:
    try:
        found = json.loads((folder / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def write_ids(folder: Path, ids: dict[str, Any]) -> None:
    """Atomically (a run killed while writing it keeps the earlier file)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{TRACKERS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(ids, indent=2) + "\n")
    os.replace(tmp, folder / TRACKERS_FILE)
