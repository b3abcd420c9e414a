"""Python's cyclic garbage collector around a rank's run.

Start-up (torch's import, the model, the optimizer) makes objects that live as long as the run.
The collector's full passes over them cost ~0.3 s before the first step, and during training
such a pass is a pause of ~0.1 s that each rank takes at a different step, so that the others
wait for it at the next all-reduce. So collection is off while a rank starts; before training,
what start-up made is frozen (left out of every later pass, the one at the interpreter's exit
too) and collection goes back on for the garbage the run itself makes.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_paused = False  # collection turned off by `off_during_startup`, to be turned on again


@contextlib.contextmanager
def off_during_startup() -> Iterator[None]:
    """No collection while a rank starts (`freeze_for_training` turns it back on)."""
    global _paused
    _paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _paused:
            gc.enable()
        _paused = False


def freeze_for_training() -> None:
    """Before training: what exists now is left out of every later collection (also the full
    one at the interpreter's exit), and collection is on again if start-up turned it off. A
    later job of the same process (a sweep's) first hands the earlier job's objects back to the
    collector, so that what that job left is freed."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    if _paused:
        gc.enable()
