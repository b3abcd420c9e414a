"""Whether one batch of inputs can fit in this machine's memory at all, checked before a loader
worker or the model tries to allocate it: an image size whose batch needs terabytes is one line
naming the setting, not a failed allocation deep inside a loader worker."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dpt.errors import DptError

FLOAT32_BYTES = 4


def check_batch_fits(
    input_shape: Sequence[int], batch_size: int, dataset: Mapping[str, Any]
) -> None:
    """Refuse a batch of float32 inputs larger than the machine's memory, naming the data set's
    keys whose values make the input's shape (e.g. `dataset.image_size`)."""
    need = batch_size * math.prod(input_shape) * FLOAT32_BYTES
    have = memory_bytes()
    if have is None or need <= have:
        return
    sizes = {f"dataset.{key}": value for key, value in dataset.items()
             if type(value) is int and value > 1 and value in input_shape}  # fmt: skip
    shape = "x".join(str(size) for size in input_shape)
    caused = "".join(f", {key}={value}" for key, value in sizes.items())
    raise DptError(
        f"one batch (trainer.batch_size={batch_size} inputs of {shape}{caused}) needs "
        f"{_gib(need)} as float32, more than this machine's {_gib(have)} of memory; lower "
        f"{' or '.join([*sizes, 'trainer.batch_size'])}"
    )


def memory_bytes() -> int | None:
    """Physical memory, or the cgroup's limit where that is lower (a container, a SLURM job)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _gib(count: int) -> str:
    return f"{count / 2**30:,.1f} GiB"
