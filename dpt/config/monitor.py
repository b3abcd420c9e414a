"""`monitor`: training that watches itself (dpt/monitor), its detectors and what each may do."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpt.config.checks import at_least, one_of

# What each detector may do (dpt/monitor). A non-finite update cannot be applied and go on (warn),
# nor be checkpointed (stop); a slowdown is no reason to undo or skip updates.
SPIKE_ACTIONS = ("warn", "skip", "rollback", "stop", "off")
NONFINITE_ACTIONS = ("error", "skip", "rollback")
SLOWDOWN_ACTIONS = ("warn", "stop", "off")


@dataclass
class SpikeConfig:
    """A spike detector (dpt/monitor/detectors.py): a value more than `threshold` robust units
    above the median of the last `window` values it accepted."""

    # warn: one line and an event; skip: the step's update is not applied (ranks then agree every
    # step, as the update waits for the verdict); rollback: back to the newest checkpoint before
    # the step, past the data since it (at most monitor.max_rollbacks times); stop: checkpoint and
    # end with exit code 1; off: not watched.
    action: str = one_of(SPIKE_ACTIONS, "warn")
    # Robust units: 1.4826 x the median absolute deviation (a normal noise's standard deviation),
    # at least 1 % of the level. 10 passes no clean run of dpt's own tests and benchmarks.
    threshold: float = at_least(0, 10.0)
    window: int = at_least(1, 100)  # the values the running median and deviation are taken over
    warmup: int = at_least(1, 20)  # values accepted before the first judgement


@dataclass
class NonFiniteConfig:
    # error, skip or rollback (see trainer.on_nonfinite, its default).
    action: str = one_of(NONFINITE_ACTIONS, "${trainer.on_nonfinite}")


@dataclass
class SlowdownConfig:
    """The world's time per step (the slowest rank's data wait and compute, checkpoints and
    validation left out) and the straggler ratio (slowest rank's compute / the median rank's),
    each judged per logging window against its running median."""

    # warn, stop or off (a slow machine is not the data's fault: no rollback)
    action: str = one_of(SLOWDOWN_ACTIONS, "warn")
    threshold: float = at_least(0, 3.0)  # times the running median
    # Seconds of training one judged value spans (the logging windows in it together): a moment
    # of stall (another process, a collection) is not a slowdown.
    span_s: float = at_least(0, 10.0)
    window: int = at_least(1, 30)  # spans the running median is taken over
    warmup: int = at_least(1, 3)  # spans accepted before the first judgement
    patience: int = at_least(1, 3)  # spans in a row over the threshold before it is an event


@dataclass
class MonitorConfig:
    """Training that watches itself (dpt/monitor): detectors judged at the ranks' agreement (no
    collective of their own), reactions every rank takes at the same step, events in
    <run>/events.jsonl, on the console and in TensorBoard."""

    loss_spike: SpikeConfig = field(default_factory=SpikeConfig)  # the world-mean loss of a step
    # The global gradient norm before clipping: computed anyway under trainer.grad_clip_norm;
    # otherwise computed for this detector only when its action is skip, rollback or stop.
    grad_spike: SpikeConfig = field(default_factory=SpikeConfig)
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    slowdown: SlowdownConfig = field(default_factory=SlowdownConfig)
    # rollbacks in one run; one more event that asks for one stops it
    max_rollbacks: int = at_least(0, 3)
    # Every N steps: each module's gradient norm and update/weight ratio to TensorBoard
    # (grads/<module>/...); null: off.
    grad_diagnostics_every: int | None = at_least(1, None)
