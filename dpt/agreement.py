"""The one place where ranks agree, in one small collective per logging window.

Every rank must take the same decisions at the same step: apply this update or skip it (a
non-finite loss somewhere), stop now or go on (a signal on some rank). Between agreements nothing
waits for the device or the network: a non-finite loss is noted on the device, a signal sets a
flag. At an agreement, one `all_gather` carries those flags and the metrics window (see
`dpt.metrics`), so logging costs no second collective. Under `trainer.on_nonfinite=skip` ranks
agree every step, since the update itself waits for the verdict: the documented exception.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dpt.distributed import DistEnv, all_gather_floats
from dpt.errors import DptError
from dpt.interrupt import StopRequest

log = logging.getLogger("dpt")


class NonFiniteLoss(DptError):
    """The loss became NaN or infinite (trainer.on_nonfinite=error)."""


class FirstNonFinite:
    """The first non-finite loss since the last `take`, kept on the device: noting a step costs
    no host-device sync; `take`, once per agreement, costs one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.loss = torch.zeros((), device=self.device)

    def note(self, loss: torch.Tensor, step: int) -> None:
        first = ~torch.isfinite(loss) & (self.step == 0)
        self.step = torch.where(first, step, self.step)
        self.loss = torch.where(first, loss.detach().float(), self.loss)

    def take(self) -> tuple[int, float]:
        """(step, loss) of the first non-finite loss, or (0, 0.0); starts over."""
        step = int(self.step.item())  # waits for the device: once per agreement
        loss = float(self.loss.item()) if step else 0.0
        self._reset()
        return step, loss


@dataclass
class Verdict:
    """What every rank decided together at one step, and every rank's payload row."""

    apply_update: bool
    stop: bool
    rows: list[list[float]]  # rows[rank] = that rank's payload, as it sent it


class Agreement:
    def __init__(self, env: DistEnv, last_step: int, on_nonfinite: str) -> None:
        self.env, self.last_step, self.on_nonfinite = env, last_step, on_nonfinite
        self.nonfinite = FirstNonFinite(env.device)

    @property
    def every_step(self) -> bool:
        return self.on_nonfinite == "skip"

    def note(self, loss: torch.Tensor, step: int) -> None:
        self.nonfinite.note(loss, step)

    def agree(self, stop: StopRequest, payload: list[float]) -> Verdict:
        """One collective: ranks agree on the earliest non-finite loss and on stopping, and see
        each other's payload. Raises NonFiniteLoss under on_nonfinite=error."""
        first_step, first_loss = self.nonfinite.take()
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
