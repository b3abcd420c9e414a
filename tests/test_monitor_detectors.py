"""The instability detectors (dpt.monitor.detectors): spikes against a robust running level,
slowdowns against the usual step time and straggler ratio, and their state across a resume."""

from __future__ import annotations

import json
import random

import pytest

from dpt.monitor.detectors import Alarm, RobustLevel, SlowdownDetector, SpikeDetector


def noisy_loss(seed: int, n: int = 400, noise: float = 0.05) -> list[float]:
    """A loss decaying from ~5 towards 1, with relative normal noise of `noise`."""
    rng = random.Random(seed)
    return [(1 + 4 * 0.99**i) * (1 + rng.gauss(0, noise)) for i in range(n)]


def alarms(detector: SpikeDetector, values: list[float]) -> list[tuple[int, Alarm]]:
    return [(i, a) for i, v in enumerate(values) if (a := detector.check(v)) is not None]


def loss_detector() -> SpikeDetector:
    return SpikeDetector("loss_spike", threshold=6.0, window=50, warmup=20)


@pytest.mark.parametrize("seed", range(5))
def test_a_clean_noisy_loss_raises_no_alarm(seed: int) -> None:
    assert alarms(loss_detector(), noisy_loss(seed)) == []


@pytest.mark.parametrize("seed", range(3))
def test_a_10x_spike_raises_one_alarm_with_its_level(seed: int) -> None:
    values = noisy_loss(seed)
    values[200] *= 10
    detector = loss_detector()
    found = alarms(detector, values[:200])
    before = detector.level.median, detector.level.scale
    found += [(i + 200, a) for i, a in alarms(detector, values[200:])]
    [(index, alarm)] = found
    assert index == 200 and alarm.detector == "loss_spike" and alarm.value == values[200]
    assert alarm.level == before[0] and alarm.threshold_value == before[0] + 6.0 * before[1]
    assert alarm.level < alarm.threshold_value < alarm.value


def test_an_alarming_value_is_not_added_and_a_burst_keeps_alarming() -> None:
    detector = loss_detector()
    alarms(detector, noisy_loss(0, n=100))
    level = detector.level.state_dict()
    burst = alarms(detector, [50.0] * 5)
    assert [i for i, _ in burst] == [0, 1, 2, 3, 4] and detector.level.state_dict() == level


def test_warmup_suppresses_alarms() -> None:
    detector = SpikeDetector("grad_spike", threshold=6.0, window=50, warmup=20)
    values = [1.0] * 10 + [100.0] + [1.0] * 8  # 19 accepted values: not ready yet
    assert alarms(detector, values) == [] and not detector.level.ready
    detector.check(1.0)
    assert detector.level.ready and detector.check(100.0) is not None


def test_a_constant_series_tolerates_a_wobble_but_not_a_jump() -> None:
    detector = loss_detector()
    assert alarms(detector, [2.0] * 30) == []
    assert detector.level.scale == pytest.approx(0.02)  # the floor: 1 % of the level
    assert detector.check(2.05) is None  # +2.5 %: 2.5 robust units
    alarm = detector.check(3.0)
    assert alarm is not None and alarm.threshold_value == pytest.approx(2.12)


def test_non_finite_values_are_neither_judged_nor_kept() -> None:
    detector = loss_detector()
    alarms(detector, [1.0] * 30)
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert detector.check(bad) is None
    assert len(detector.level.values) == 30


def test_only_upward_deviations_alarm() -> None:
    level = RobustLevel(window=10, warmup=3)
    for value in (1.0, 2.0, 3.0):
        level.add(value)
    assert level.median == 2.0 and level.scale == pytest.approx(1.4826)
    assert level.score(0.0) < 0 < level.score(3.0)
    detector = loss_detector()
    alarms(detector, [1.0] * 30)
    assert detector.check(0.01) is None  # a sudden drop is not a spike


def test_warmup_beyond_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="warmup"):
        RobustLevel(window=10, warmup=11)


def test_a_spike_detector_resumes_with_the_same_decisions() -> None:
    values = noisy_loss(7)
    for i in (150, 151, 260):
        values[i] *= 4
    original = loss_detector()
    alarms(original, values[:120])
    resumed = loss_detector()
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))  # as the checkpoint
    after = values[120:]
    expected = alarms(original, after)
    assert [i + 120 for i, _ in expected] == [150, 151, 260]
    assert alarms(resumed, after) == expected


def test_a_shorter_window_keeps_the_newest_values() -> None:
    long = RobustLevel(window=10, warmup=1)
    for value in range(10):
        long.add(value)
    short = RobustLevel(window=4, warmup=1)
    short.load_state_dict(long.state_dict())
    assert list(short.values) == [6.0, 7.0, 8.0, 9.0]


# --- slowdown -------------------------------------------------------------------------------


def steady_steps(seed: int, n: int = 300, jitter: float = 0.2) -> list[tuple[float, float]]:
    """Step times of ~0.5 s and straggler ratios of ~1.1, each with uniform +-`jitter`."""
    rng = random.Random(seed)

    def jittered(base: float) -> float:
        return base * (1 + rng.uniform(-jitter, jitter))

    return [(jittered(0.5), max(1.0, jittered(1.1))) for _ in range(n)]


def slow_alarms(detector: SlowdownDetector, steps: list[tuple[float, float]]) -> list:
    return [(i, a) for i, step in enumerate(steps) if (a := detector.check(*step)) is not None]


def slowdown() -> SlowdownDetector:
    return SlowdownDetector(threshold=3.0, window=50, warmup=10)


@pytest.mark.parametrize("seed", range(3))
def test_steady_steps_with_jitter_raise_no_slowdown(seed: int) -> None:
    assert slow_alarms(slowdown(), steady_steps(seed)) == []


def test_a_5x_step_time_alarms() -> None:
    detector = slowdown()
    slow_alarms(detector, steady_steps(0, n=50))
    median = detector.levels["step_time"].median
    alarm = detector.check(5 * median, 1.1)
    assert alarm == Alarm("slowdown", pytest.approx(5.0), median, 3.0, "step_time")
    assert len(detector.levels["step_time"].values) == 50  # not kept: the window was full
    assert detector.levels["step_time"].median == median


def test_a_straggler_ratio_jump_alarms() -> None:
    detector = slowdown()
    slow_alarms(detector, steady_steps(1, n=30))
    median = detector.levels["straggler_ratio"].median
    alarm = detector.check(0.5, 4.0)  # the world's step time is usual; one rank is not
    assert alarm is not None and alarm.signal == "straggler_ratio"
    assert alarm.value == pytest.approx(4.0 / median) and alarm.level == median
    assert detector.levels["step_time"].values[-1] == 0.5  # the usual signal is still kept


def test_slowdown_warmup_and_resume() -> None:
    detector = slowdown()
    assert slow_alarms(detector, [(0.5, 1.0)] * 9 + [(10.0, 9.0)]) == []
    steps = steady_steps(2, n=100)
    steps[40], steps[70] = (4.0, 1.1), (0.5, 5.0)
    slow_alarms(detector, steps[:30])
    resumed = slowdown()
    resumed.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    expected = slow_alarms(detector, steps[30:])
    assert [i + 30 for i, _ in expected] == [40, 70]
    assert slow_alarms(resumed, steps[30:]) == expected
