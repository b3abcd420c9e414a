"""The monitor's parts in process: what it judges from the agreement's rows, the reactions it asks
for, its events and their log, the samples rollbacks skip, and the `monitor` config's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dpt.config.monitor import MonitorConfig
from dpt.data.loaders import order_of
from dpt.data.synthetic import SyntheticData
from dpt.errors import ConfigError
from dpt.launch.validate import validate
from dpt.monitor.events import Event, EventLog, read_events
from dpt.monitor.monitor import History, Monitor, StepValues
from tests.helpers import build_trainer, compose


def monitor(
    tmp_path: Path, clipping: bool = True, sharded: bool = False, **changes: object
) -> Monitor:
    """A monitor of rank 0 with these settings; non-finite losses are skipped."""
    # The worker resolves monitor.nonfinite.action's interpolation (trainer.on_nonfinite).
    changes = {"nonfinite": {"action": "skip"}, **changes}
    settings = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MonitorConfig), changes))
    return Monitor(settings, tmp_path, True, clipping=clipping, sharded_norm=sharded)


def steady(count: int, first: int = 1) -> list[StepValues]:
    """Losses that wobble by 1 % around 2.0, and gradient norms around 1.0."""
    return [StepValues(first + i, 2.0 + 0.02 * (i % 3 - 1), 1.0 + 0.01 * (i % 2), 0, 64 * i)
            for i in range(count)]  # fmt: skip


def spike(step: int, loss: float = 2.0, norm: float = 1.0) -> StepValues:
    return StepValues(step, loss, norm, 0, 64 * (step - 1))


# --- judging ------------------------------------------------------------------------------------


def test_step_values_are_the_world_mean_loss_and_the_global_norm(tmp_path: Path) -> None:
    replicated = monitor(tmp_path)  # ddp: every rank has the global norm
    rows = [[1.0, 3.0, 5.0, 5.0], [3.0, 5.0, 5.0, 5.0]]  # per rank: 2 losses, then 2 norms
    values = replicated.step_values(rows, last_step=8, epoch=1, next_sample=448, global_batch=64)
    assert [(v.step, v.loss, v.grad_norm, v.epoch, v.sample) for v in values] == [
        (7, 2.0, 5.0, 1, 384),
        (8, 4.0, 5.0, 1, 448),
    ]
    # No clipping: the norm is computed for grad_spike's rollback, from each rank's shards.
    sharded = monitor(tmp_path, clipping=False, sharded=True, grad_spike={"action": "rollback"})
    assert sharded.computes_norm and sharded.partial_norm
    [value] = sharded.step_values([[1.0, 3.0], [1.0, 4.0]], 5, 0, 256, 64)
    assert value.grad_norm == 5.0  # each rank's shards: sqrt(3^2 + 4^2)


def test_the_default_watches_no_norm_without_clipping(tmp_path: Path) -> None:
    quiet = monitor(tmp_path, clipping=False, nonfinite={"action": "error"})
    assert not quiet.computes_norm and not quiet.watches_norm
    assert quiet.payload([1.0, 2.0], [3.0, 4.0]) == [1.0, 2.0]  # losses only
    assert not quiet.every_step  # warn and error wait for no verdict


def test_a_spike_warns_and_the_run_goes_on(tmp_path: Path) -> None:
    watcher = monitor(tmp_path, loss_spike={"warmup": 5})
    assert watcher.judge(steady(10), None, []).events == []
    judgement = watcher.judge([spike(11, loss=20.0), spike(12)], None, [])
    [event] = judgement.events
    assert (event.step, event.detector, event.action, event.value) == (11, "loss_spike", "warn", 20)
    assert event.level == pytest.approx(2.0) and event.level < event.threshold < 20.0
    assert judgement.apply_update and judgement.decisive is None


def test_skip_withholds_the_update_and_agrees_every_step(tmp_path: Path) -> None:
    watcher = monitor(tmp_path, grad_spike={"action": "skip", "warmup": 5})
    assert watcher.every_step
    watcher.judge(steady(10), None, [])
    judgement = watcher.judge([spike(11, norm=50.0)], None, [])
    assert not judgement.apply_update and judgement.events[0].detector == "grad_spike"


def test_a_rollback_ends_the_judging_at_its_step(tmp_path: Path) -> None:
    watcher = monitor(tmp_path, loss_spike={"action": "rollback", "warmup": 5})
    watcher.judge(steady(10), None, [])
    level = json.dumps(watcher.levels.state_dict())
    judgement = watcher.judge([spike(11), spike(12, loss=30.0), spike(13, loss=40.0)], None, [])
    assert judgement.decisive is judgement.events[-1]
    assert [(e.step, e.action, e.sample) for e in judgement.events] == [(12, "rollback", 704)]
    # Step 11 was accepted into the level; 12 alarmed; 13 was not judged.
    assert json.loads(level)["loss_spike"]["added"] + 1 == watcher.levels.state_dict()[
        "loss_spike"]["added"]  # fmt: skip


def test_a_non_finite_loss_is_an_event_of_its_rank(tmp_path: Path) -> None:
    watcher = monitor(tmp_path)
    judgement = watcher.judge([spike(3, loss=math.nan)], (3, 1), [])
    [event] = judgement.events
    assert (event.detector, event.rank, event.action) == ("nonfinite", 1, "skip")
    assert not judgement.apply_update


def window(steps: int, data_s: float, work_s: list[float]) -> list[dict[str, float]]:
    return [{"steps": steps, "data_s": data_s * steps, "work_s": w * steps} for w in work_s]


def test_a_slowdown_is_judged_on_spans_and_said_after_its_patience(tmp_path: Path) -> None:
    watcher = monitor(tmp_path, slowdown={"span_s": 1.0, "warmup": 3, "patience": 2})
    usual = window(10, 0.01, [0.04, 0.05])  # 0.06 s a step for the slower rank: 0.6 s a window
    step = 0
    for _ in range(8):  # 4 spans of 2 windows each
        step += 10
        assert watcher.judge([], None, [(step, usual)], epoch=2).events == []
    slow = window(10, 0.01, [0.04, 0.5])  # rank 1 ten times slower: 5.1 s a window, one a span
    assert watcher.judge([], None, [(step + 10, slow)], epoch=2).events == []  # patience
    [event] = watcher.judge([], None, [(step + 20, slow)], epoch=2).events
    assert (event.detector, event.step, event.epoch, event.signal) == ("slowdown", 100, 2,
                                                                     "straggler_ratio")  # fmt: skip
    assert event.value == pytest.approx(12.5 / 1.25) and event.threshold == 3.0


# --- history, events and their log ------------------------------------------------------------


def test_skipped_samples_count_once_however_often_a_range_is_skipped() -> None:
    history = History(EventLog(Path("/nonexistent"), is_main=False))
    assert history.skip(0, 640, 704) == 64
    assert history.skip(0, 640, 768) == 64  # the second rollback to the same checkpoint
    assert history.skip(1, 640, 704) == 64  # another epoch
    assert history.skipped == [[0, 640, 704], [0, 640, 768], [1, 640, 704]]


def event(step: int, **fields: object) -> Event:
    values = {"epoch": 0, "detector": "loss_spike", "value": 9.0, "level": 2.0, "threshold": 3.0,
              "action": "warn", **fields}  # fmt: skip
    return Event(step=step, **values)  # type: ignore[arg-type]


def test_an_event_line_says_what_where_and_what_was_done() -> None:
    rolled = event(12, action="rollback", rollback_to=10, skipped_samples=128)
    assert rolled.line() == (
        "monitor: loss_spike at step 12: 9 > 3 (level 2); rolled back to step 10, 128 samples "
        "skipped"
    )
    nan = event(3, detector="nonfinite", value=math.nan, level=None, threshold=None,
                action="skip", rank=1, module="layer1.0.conv2", module_class="Conv2d",
                skipped_samples=64)  # fmt: skip
    assert nan.line() == (
        "monitor: nonfinite at step 3: nan on rank 1, first non-finite output: layer1.0.conv2 "
        "(Conv2d); update skipped, 64 samples skipped"
    )
    slow = event(40, detector="slowdown", value=4.5, level=0.12, signal="step_time")
    assert slow.line() == (
        "monitor: slowdown (step_time) at step 40: 4.5x the usual (0.12 s per step), over 3x; "
        "warned"
    )


def test_the_log_has_a_json_object_a_line_and_a_resume_moves_later_lines_aside(
    tmp_path: Path,
) -> None:
    log = EventLog(tmp_path, is_main=True)
    for step in (3, 7, 9):
        log.add(event(step))
    log.add(event(11, detector="nonfinite", value=math.inf, level=None, threshold=None))
    events = read_events(tmp_path)
    assert [e["step"] for e in events] == [3, 7, 9, 11]
    assert set(events[0]) >= {"step", "detector", "value", "level", "action", "skipped_samples"}
    assert "value" not in events[3] and events[3]["value_text"] == "inf"  # JSON has no inf
    resumed = EventLog(tmp_path, is_main=True)
    resumed.resume_at(2)  # the checkpoint knew of 2 events: 9 and 11 came after it
    assert [e["step"] for e in read_events(tmp_path)] == [3, 7] and resumed.written == 2
    [aside] = tmp_path.glob("events.abandoned-*.jsonl")
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [9, 11]


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("monitor.loss_spike.action=undo",
         "monitor.loss_spike.action=undo: must be one of warn, skip, rollback, stop, off"),
        ("monitor.slowdown.action=rollback",
         "monitor.slowdown.action=rollback: must be one of warn, stop, off"),
        ("trainer.on_nonfinite=warn",
         "trainer.on_nonfinite=warn: must be one of error, skip, rollback"),
        ("monitor.grad_spike.warmup=200",
         "monitor.grad_spike.warmup=200: must be <= monitor.grad_spike.window (100)"),
        ("monitor.loss_spike.threshold=-1", "monitor.loss_spike.threshold=-1.0: must be >= 0"),
        ("+monitor.loss_spike.treshold=3",
         "monitor.loss_spike.treshold: unknown key; allowed keys: action, threshold, window, "
         "warmup"),
    ],
)  # fmt: skip
def test_bad_monitor_settings_are_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(compose(override))
    assert str(caught.value) == message


def test_a_rollback_needs_checkpoints() -> None:
    with pytest.raises(ConfigError) as caught:
        validate(compose("monitor.loss_spike.action=rollback", "checkpoint.enabled=false"))
    assert str(caught.value) == (
        "monitor.loss_spike.action=rollback: needs checkpoints to return to "
        "(checkpoint.enabled=true)"
    )


def test_nonfinite_follows_trainer_on_nonfinite_unless_set() -> None:
    assert compose("trainer.on_nonfinite=skip").monitor.nonfinite.action == "skip"
    both = compose("trainer.on_nonfinite=skip", "monitor.nonfinite.action=rollback")
    assert both.monitor.nonfinite.action == "rollback"


# --- dataset.shuffle=false -------------------------------------------------------------------


def test_without_shuffling_every_epoch_is_in_index_order() -> None:
    data = SyntheticData(100, 0, 4, 3, 0, seed=0)
    assert list(order_of(data.train, shuffle=False)(7, 3)) == list(range(100))
    assert list(order_of(data.train)(7, 3)) != list(range(100))

    class OwnOrder:  # a data set with its own epoch order (shards) is read in index order too
        def __len__(self) -> int:
            return 5

        def epoch_order(self, seed: int, epoch: int) -> list[int]:
            return [4, 3, 2, 1, 0]

    assert list(order_of(OwnOrder(), shuffle=False)(0, 0)) == [0, 1, 2, 3, 4]
    assert list(order_of(OwnOrder())(0, 0)) == [4, 3, 2, 1, 0]


def test_a_steps_batch_is_fetched_again_as_the_loader_fetched_it(tmp_path: Path) -> None:
    env = _cpu1()
    trainer = build_trainer(tmp_path, env, "dataset.num_samples=256", "trainer.batch_size=16",
                            "trainer.grad_accum_steps=2")  # fmt: skip
    loaders = trainer.parts.loaders
    batches = [group for group, _ in loaders.epoch_batches(trainer.position, 2)]
    again = loaders.step_batches(0, 3 * 32, accum=2, rank=0)  # step 4: samples 96..127
    for (inputs, labels, _), (expected_inputs, expected_labels, _) in zip(
        again, batches[3], strict=True
    ):
        assert torch.equal(inputs, expected_inputs) and torch.equal(labels, expected_labels)


def _cpu1():
    from dpt.distributed import DistEnv

    return DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                   device=torch.device("cpu"))  # fmt: skip
