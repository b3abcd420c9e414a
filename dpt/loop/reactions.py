"""What the trainer does about the monitor's events (dpt.monitor): record them, withhold an update,
go back to a checkpoint past the data that caused a spike, stop; and name the module where a
non-finite value first appeared.

Every rank runs the same code on the same judgement, so the ranks load, skip and stop together.
A rollback is a resume from an earlier checkpoint of this run, with the data position moved past
the event's batch: the global batches between the checkpoint and the event are not trained on
again, and the run goes on from there (the monitor's history, not rolled back, records them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpt.distributed import all_gather_floats
from dpt.errors import DptError
from dpt.loop import resume_apply
from dpt.loop.agreement import NonFiniteLoss
from dpt.models import unwrap
from dpt.monitor.events import Event
from dpt.monitor.monitor import Judgement
from dpt.monitor.nonfinite_origin import first_nonfinite_module, has_nonfinite

if TYPE_CHECKING:
    from dpt.loop.loop_state import LoopState

log = logging.getLogger("dpt")


class RolledBack(Exception):  # a signal to the loop, not an error
    """The run went back to a checkpoint: the epoch's batches start again from its new place."""


class MonitorStop(DptError):
    """A detector's `stop` (after a checkpoint), or a rollback that could not be taken."""


def react(trainer: LoopState, judgement: Judgement) -> None:
    """Record the judgement's events with their reactions; a rollback or a stop ends here."""
    decisive = judgement.decisive
    for event in judgement.events:
        if event.action == "skip":
            event.skipped_samples = trainer.global_batch
    if decisive is not None and decisive.action == "rollback":
        roll_back(trainer, judgement.events, decisive)
    if decisive is not None and decisive.action == "stop":
        path = trainer.save_checkpoint()
        decisive.note = f"checkpoint written to {path}" if path else "no checkpoint (disabled)"
        _record(trainer, judgement.events)
        raise MonitorStop(decisive.line())
    _record(trainer, judgement.events)


def _record(trainer: LoopState, events: list[Event]) -> None:
    for event in events:
        trainer.monitor.record(event)
        value = event.value if event.value is not None else float("nan")
        trainer.metrics.event(f"monitor/{event.detector}", value, event.line(), event.step)


# --- rollback ---------------------------------------------------------------------------------


def roll_back(trainer: LoopState, events: list[Event], event: Event) -> None:
    """Back to the newest checkpoint before the event's step, past the event's batch; raises
    RolledBack for the loop, or MonitorStop where no rollback can be taken."""
    history = trainer.monitor.history
    limit = trainer.monitor.settings.max_rollbacks
    target = trainer.parts.checkpoints.newest_before(event.step)
    why = None
    if history.rollbacks >= limit:
        why = f"monitor.max_rollbacks={limit} reached"
    elif target is None:
        why = (f"no checkpoint of this run before step {event.step} to return to (set "
               "checkpoint.every_n_steps)")  # fmt: skip
    if why is not None:
        event.action, event.note = "error", f"asked for a rollback: {why}"
        _record(trainer, events)
        raise MonitorStop(event.line())
    assert target is not None and event.sample is not None
    # The event's batch ends here: the data position the run goes on from.
    epoch, end = event.epoch, event.sample + trainer.global_batch
    changes = trainer.parts.checkpoints.load_to_roll_back(target, _rolled_back_parts(trainer))
    resume_apply.after_load(trainer, changes)
    start = trainer.position.sample if trainer.position.epoch == epoch else 0
    trainer.position.epoch, trainer.position.sample = epoch, end
    if event.detector == "loss_spike":  # a bad region: the batches after the spike's too
        skip_bad_region(trainer)
        end = trainer.position.sample
    history.rollbacks += 1
    event.rollback_to, event.skipped = target.step, [start, end]
    event.skipped_samples = history.skip(epoch, start, end)
    trainer.metrics.rolled_back(target.step)
    trainer.agreement.start_at(target.step)
    resume_apply.replan(trainer)  # an epoch now has fewer steps left
    if event.detector == "nonfinite":  # on the checkpoint's weights, the event's batch
        name_nonfinite(trainer, event)
    _record(trainer, events)
    raise RolledBack


def skip_bad_region(trainer: LoopState) -> None:
    """Move the data position past every batch that would spike again: each next global batch
    is tried on the checkpoint's weights (a forward, no update) and skipped while the loss
    detector fires on the world's loss of it, so a region of bad batches longer than one costs
    one rollback. The first batch it does not fire on is trained, as it would have been."""
    detector = trainer.monitor.spikes["loss_spike"]
    model = unwrap(trainer.parts.strategy.whole_model(trainer.model))
    with _kept_state(model), torch.no_grad():
        while trainer.steps_left() > 0:
            loss = _world_loss(trainer, model)
            if not detector.fires(loss):
                return
            trainer.position.sample += trainer.global_batch


def _world_loss(trainer: LoopState, model: nn.Module) -> float:
    """The world's mean loss of the global batch at the data position (all ranks together)."""
    position = trainer.position
    total, count = 0.0, 0
    for inputs, targets, _ in _step_batches(
        trainer, position.epoch, position.sample, trainer.parts.env.rank
    ):
        inputs, targets = trainer.parts.to_device(inputs), trainer.parts.to_device(targets)
        with trainer.precision.autocast():  # every rank's forwards, also of an empty batch (fsdp)
            outputs = model(inputs)
            if len(targets):
                loss = float(trainer.parts.task.loss(outputs, targets))  # waits: a rare probe
                total, count = total + loss * len(targets), count + len(targets)
    rows = all_gather_floats([total, float(count)], trainer.parts.env)
    samples = sum(row[1] for row in rows)
    return sum(row[0] for row in rows) / samples if samples else 0.0


def _step_batches(trainer: LoopState, epoch: int, sample: int, rank: int) -> list[Any]:
    """Rank `rank`'s share of the step at (epoch, sample), fetched again; a pipeline's ranks
    read their replica's (rank % replicas, as its `data_env` places them)."""
    loaders = trainer.parts.loaders
    accum = trainer.settings.grad_accum_steps
    return loaders.step_batches(epoch, sample, accum, rank % loaders.world_size)


def _rolled_back_parts(trainer: LoopState) -> dict[str, object]:
    """Everything a checkpoint holds but the monitor's history, which stays as it is."""
    parts = trainer.state_parts()
    del parts["monitor"]
    return parts


# --- non-finite values: where they came from ---------------------------------------------------


def nonfinite_error(trainer: LoopState, error: NonFiniteLoss, rows: list[list[float]]) -> DptError:
    """trainer.on_nonfinite=error: the error line names the module too (and the event says it)."""
    steps = trainer.monitor.step_values(rows, trainer.progress.step + 1, trainer.position.epoch,
                                        trainer.position.sample, trainer.global_batch)  # fmt: skip
    values = next(v for v in steps if v.step == error.step)
    event = Event(step=error.step, epoch=values.epoch, detector="nonfinite", value=values.loss,
                  level=None, threshold=None, action="error", rank=error.rank,
                  sample=values.sample)  # fmt: skip
    name_nonfinite(trainer, event)
    trainer.monitor.record(event)
    where = event.note
    if event.module is not None:
        kind = f" ({event.module_class})" if event.module_class else ""
        where = f"first non-finite output: {event.module}{kind}"
    message = str(error).replace("; set", f" ({where}); set", 1)
    failure = NonFiniteLoss(message)
    failure.rows, failure.step, failure.rank = error.rows, error.step, error.rank
    return failure


def name_skipped_nonfinite(trainer: LoopState, judgement: Judgement) -> None:
    """A non-finite step whose update is skipped: named now, on the weights its forward used."""
    for event in judgement.events:
        if event.detector == "nonfinite" and event.action == "skip":
            name_nonfinite(trainer, event)


def name_nonfinite(trainer: LoopState, event: Event) -> None:
    """Replay the forward of the event's step on its batch (rank `event.rank`'s share, fetched
    again) with a hook on every module; sets `event.module` to the first whose output is not
    finite, or says in `event.note` why none is named. Every rank replays together (fsdp's
    forwards gather weights, SyncBatchNorm's gather statistics), on the weights it has now: the
    step's own where the agreement came at that step (trainer.on_nonfinite=skip: always), the
    checkpoint's after a rollback."""
    model = unwrap(trainer.parts.strategy.whole_model(trainer.model))  # a pipeline's stages too
    weights = [name for name, p in model.named_parameters() if has_nonfinite(p.detach())]
    # Under fsdp each rank sees its shards only: the ranks decide together whether to replay.
    if any(row[0] for row in all_gather_floats([float(bool(weights))], trainer.parts.env)):
        first = weights[0] if weights else "another rank's shard"
        event.note = (f"the weights are not finite already ({first}): no module can be named; "
                      "trainer.on_nonfinite=skip names it at the step itself")  # fmt: skip
        return
    assert event.sample is not None
    batches = _step_batches(trainer, event.epoch, event.sample, event.rank or 0)
    with _kept_state(model):
        for inputs, targets, _ in batches:
            inputs, targets = trainer.parts.to_device(inputs), trainer.parts.to_device(targets)
            outputs: list[torch.Tensor] = []
            with trainer.precision.autocast():
                name = first_nonfinite_module(
                    model, lambda x=inputs, kept=outputs: kept.append(model(x))
                )
            if name is not None:
                event.module = name
                found = dict(model.named_modules()).get(name)  # none: the input, the root
                event.module_class = type(found).__name__ if found is not None else None
                return
            blame = _nonfinite_loss(trainer, outputs[0], targets)
            if blame is not None:
                event.note = blame
                return
    event.note = "its forward and loss are finite when replayed: the backward made it"


def _nonfinite_loss(trainer: LoopState, outputs: torch.Tensor, targets: torch.Tensor) -> str | None:
    """Where a finite forward's step went non-finite: the targets, or the task's loss of them."""
    if not len(targets):
        return None
    if has_nonfinite(targets):
        return "its targets are not finite: the data set gave them"
    with torch.no_grad(), trainer.precision.autocast():
        loss = trainer.parts.task.loss(outputs, targets)
    if has_nonfinite(loss):
        return f"its forward is finite, the loss of task={trainer.parts.task.kind} is not"
    return None


@contextlib.contextmanager
def _kept_state(model: nn.Module) -> Iterator[None]:
    """A replay changes nothing the run goes on with: buffers (BatchNorm's running statistics)
    and the random generators are put back after it."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
