"""The one place where ranks agree, in one small collective per logging window.

Every rank must take the same decisions at the same step: apply this update or skip it (a
non-finite loss somewhere), stop now or go on (a signal on some rank). Between agreements nothing
waits for the device or the network: each step's loss stays on the device (`dpt.metrics` keeps
it) and a signal sets a flag. At the agreement the losses since the last one come back in one
device round trip (`MetricsLogger.read_back`) and are checked here on the host; one `all_gather`
then carries the flags and the metrics window, so logging costs no second collective. Under
`trainer.on_nonfinite=skip` ranks agree every step, since the update itself waits for the
verdict: the documented exception.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from dpt.distributed import DistEnv, all_gather_floats
from dpt.errors import DptError
from dpt.interrupt import StopRequest

log = logging.getLogger("dpt")


class NonFiniteLoss(DptError):
    """The loss became NaN or infinite (trainer.on_nonfinite=error)."""


@dataclass
class Verdict:
    """What every rank decided together at one step, and every rank's payload row."""

    apply_update: bool
    stop: bool
    rows: list[list[float]]  # rows[rank] = that rank's payload, as it sent it


class Agreement:
    def __init__(self, env: DistEnv, last_step: int, on_nonfinite: str) -> None:
        self.env, self.last_step, self.on_nonfinite = env, last_step, on_nonfinite

    @property
    def every_step(self) -> bool:
        return self.on_nonfinite == "skip"

    def agree(
        self, stop: StopRequest, step: int, losses: list[float], payload: list[float]
    ) -> Verdict:
        """One collective at `step`: ranks agree on the earliest non-finite loss and on
        stopping, and see each other's payload. `losses`: this rank's losses of the steps since
        the last agreement, the last one `step`'s. Raises NonFiniteLoss under
        on_nonfinite=error."""
        first_step, first_loss = _first_nonfinite(losses, step - len(losses) + 1)
        rows = all_gather_floats([float(self._code(first_step)), float(bool(stop)), *payload],
                                 self.env)  # fmt: skip
        stop_now = any(row[1] for row in rows)
        if stop_now and not stop:
            stop.signal_name = "a signal on another rank"
        verdict = Verdict(True, stop_now, [row[2:] for row in rows])
        bad_code = max(row[0] for row in rows)
        if bad_code:
            verdict.apply_update = self._bad_step(int(bad_code), first_loss)
        return verdict

    def _code(self, first_step: int) -> int:
        """The max over ranks picks the earliest bad step, then the lowest rank with it."""
        if not first_step:
            return 0
        world = self.env.world_size
        return (self.last_step + 1 - first_step) * world + world - 1 - self.env.rank

    def _bad_step(self, code: int, my_loss: float) -> bool:
        world = self.env.world_size
        step, rank = self.last_step + 1 - code // world, world - 1 - code % world
        where = f"step {step} on rank {rank}"
        if self.on_nonfinite == "error":
            raise NonFiniteLoss(
                f"non-finite loss ({my_loss if rank == self.env.rank else 'nan/inf'}) at "
                f"{where}; set trainer.on_nonfinite=skip to skip such steps"
            )
        log.warning(f"skipping the update of {where}: non-finite loss")
        return False


def _first_nonfinite(losses: list[float], first_step: int) -> tuple[int, float]:
    """(step, loss) of the first non-finite loss, or (0, 0.0); losses[0] is `first_step`'s."""
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return first_step + i, loss
    return 0, 0.0
