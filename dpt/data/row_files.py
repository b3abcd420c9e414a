"""Rows of a table file (JSON lines, JSON, Parquet, CSV), read with the `datasets` library from
local files only: `dataset.root` a file (its last `dataset.val_fraction` of rows validate) or a
folder of `train.<ext>` and `val.<ext>` (and `test.<ext>`, dpt-evaluate's alone). dataset=chat
and dataset=records read their rows so."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from dpt.data.splits import SPLITS, TEST, TRAIN, VAL
from dpt.errors import DptError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
Rows = list[tuple[str, dict[str, Any]]]  # each row with where it is, for errors


def read_rows(root: Path, val_fraction: float) -> tuple[Rows, Rows]:
    """(where, row) of the training rows and of the validation rows."""
    if root.is_dir():
        train, val = split_file(root, TRAIN), split_file(root, VAL, required=False)
        return rows_of(train), rows_of(val) if val else []
    rows = rows_of(root)
    keep = len(rows) - int(len(rows) * val_fraction)
    return rows[:keep], rows[keep:]


def split_file(root: Path, split: str, required: bool = True) -> Path | None:
    """The folder's one `split.<ext>` file (None where it has none and none is required)."""
    found = sorted(p for p in root.iterdir() if p.stem == split and p.suffix in BUILDERS)
    if len(found) > 1 or (required and not found):
        kinds = ", ".join(f"{split}{ext}" for ext in BUILDERS)
        raise DptError(f"dataset.root={root}: needs one {split} file ({kinds}), found "
                       f"{len(found)}")  # fmt: skip
    return found[0] if found else None


def rows_of(path: Path, named: str | None = None) -> Rows:
    """The file's rows, read by `datasets` (in memory, its cache in a folder of this process's
    own: ranks reading at once share nothing), each with where it is for errors (`named`: how
    they name the file; `dataset.root=PATH` by default)."""
    named = named or f"dataset.root={path}"
    builder = BUILDERS.get(path.suffix)
    if builder is None or not path.is_file():
        raise DptError(f"{named}: not a file of {', '.join(BUILDERS)}")
    import datasets
    from tqdm import std

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    # Its bars are off, but the first of them would start tqdm's monitor thread all the same.
    interval, std.tqdm.monitor_interval = std.tqdm.monitor_interval, 0
    with tempfile.TemporaryDirectory(prefix="dpt-rows-") as cache:
        try:
            table = datasets.load_dataset(builder, data_files=str(path), split="train",
                                          cache_dir=cache, keep_in_memory=True)  # fmt: skip
        except Exception as error:  # the library's own: a bad line, a column of mixed types
            raise DptError(f"{named}: cannot read it ({str(error).strip()})") from error
        finally:
            std.tqdm.monitor_interval = interval
        rows = table.to_list()
    return [(f"{named}: row {i}", row) for i, row in enumerate(rows, start=1)]


def test_rows(root: Path) -> Rows | None:
    """A folder's `test.<ext>` rows; None where it has none (or root is a file)."""
    found = split_file(root, TEST, required=False) if root.is_dir() else None
    return None if found is None else rows_of(found)


def missing_split_file(root: Path, split: str, kind: str) -> str:
    """Why `root` has no `split` file, naming the split files there are."""
    kinds = ", ".join(f"{split}{ext}" for ext in BUILDERS)
    if not root.is_dir():
        return f"the {kind} file {root} is one file: no {split} file ({kinds}) beside it"
    has = ", ".join(p.name for p in sorted(root.iterdir())
                    if p.stem in SPLITS and p.suffix in BUILDERS)  # fmt: skip
    return f"the {kind} folder {root} has no {split} file ({kinds}; it has {has})"
