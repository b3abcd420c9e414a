"""The splits a data set may have, named once: `train` (what training reads), `val` (what
validation reads each epoch) and `test` (what only `dpt-evaluate` reads: training never builds
it). A data set's `test` is an attribute like `val` (None or absent: none); dpt's own data sets
build it on first use (a `cached_property`), so that a run pays nothing for it.

torch-free: `dpt-evaluate --help` and its argument checks import it before torch loads.
"""

from __future__ import annotations

from typing import Any

SPLITS = ("train", "val", "test")
TRAIN, VAL, TEST = SPLITS
# What dpt-evaluate reads, its default first (training's own split is not a measure of a model).
EVALUATED = (TEST, VAL)


def split_of(data: Any, split: str) -> Any:
    """The data set's `split` (a map-style Dataset), or None where it has none."""
    return getattr(data, split, None)


def has_split(data: Any, split: str) -> bool:
    return split_of(data, split) is not None


def missing_split(data: Any, split: str) -> str:
    """Why the data set has no `split`, in its own words: its `missing_split(split)` where it
    says (an image folder names its folders), else what a data set of yours has."""
    own = getattr(data, "missing_split", None)
    if callable(own):
        return str(own(split))
    kind = type(data)
    has = ", ".join(name for name in SPLITS if name != split and has_split(data, name))
    return (f"the data set {kind.__module__}.{kind.__qualname__} has no {split} split (no "
            f"`{split}` attribute; it has {has or 'none'})")  # fmt: skip
