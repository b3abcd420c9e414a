"""A batch that cannot fit in memory is refused before anything allocates it."""

from __future__ import annotations

import pytest

from dpt.data import batch_memory
from dpt.data.batch_memory import check_batch_fits
from dpt.errors import DptError


def test_a_batch_larger_than_memory_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_memory, "memory_bytes", lambda: 8 * 2**30)
    dataset = {"image_size": 4096, "num_classes": 10, "num_workers": 2, "root": "x"}
    with pytest.raises(DptError) as refused:
        check_batch_fits((3, 4096, 4096), 64, dataset)
    assert str(refused.value) == (
        "one batch (trainer.batch_size=64 inputs of 3x4096x4096, dataset.image_size=4096) needs "
        "12.0 GiB as float32, more than this machine's 8.0 GiB of memory; lower "
        "dataset.image_size or trainer.batch_size"
    )


def test_a_batch_that_fits_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_memory, "memory_bytes", lambda: 8 * 2**30)
    check_batch_fits((3, 224, 224), 256, {"image_size": 224})  # 147 MiB


def test_this_machines_memory_is_read() -> None:
    found = batch_memory.memory_bytes()
    assert found is not None and found > 2**28
