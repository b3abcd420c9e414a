"""The loop's parts, in process (agreement, early stopping, metrics window, straggler watch,
config conversion), and, across real ranks, how often the loop talks to the other ranks."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dpt.config.trainer import EarlyStoppingConfig, TrainerConfig
from dpt.distributed import DistEnv
from dpt.loop import agreement
from dpt.loop.agreement import MAX_WINDOWS, SPACING_S, Agreement, NonFiniteLoss
from dpt.loop.early_stopping import EarlyStopping
from dpt.loop.interrupt import StopRequest
from dpt.loop.parts import RunConfig, check_log_interval
from dpt.observe.dashboard import one_run
from dpt.observe.logs import HeldLines, setup_logging
from dpt.observe.metrics import SINCE, WINDOW, MetricsLogger, StragglerWatch
from tests.helpers import FAST, build_trainer, compose, free_port, joined_world, spawn, train

CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


# --- agreement ------------------------------------------------------------------------------


def test_agreement_names_the_first_non_finite_step_and_raises() -> None:
    agreement = Agreement(CPU1, last_step=100, on_nonfinite="error")
    losses = [1.0, float("nan"), float("inf")]  # steps 1, 2, 3: not the first, 2 is named
    with pytest.raises(
        NonFiniteLoss, match=r"^non-finite loss \(nan\) at step 2 on rank 0; "
    ) as raised:
        agreement.agree(StopRequest(), 3, losses, [4.0, 5.0])
    assert raised.value.rows == [[4.0, 5.0]]  # the windows it carried can still be written


def test_agreement_skips_the_update_and_starts_over() -> None:
    agreement = Agreement(CPU1, last_step=100, on_nonfinite="skip")
    assert agreement.every_step
    verdict = agreement.agree(StopRequest(), 7, [float("nan")], [1.5, 2.0])
    assert not verdict.apply_update and not verdict.stop
    assert verdict.nonfinite == (7, 0)  # the step and the rank, for the monitor's event
    assert verdict.rows == [[1.5, 2.0]]  # every rank's payload comes back
    verdict = agreement.agree(StopRequest(), 8, [0.5], [])  # only step 8's loss counts
    assert verdict.apply_update and verdict.nonfinite is None


def test_agreement_stops_on_a_signal() -> None:
    stop = StopRequest()
    stop.signal_name = "SIGTERM"
    verdict = Agreement(CPU1, last_step=10, on_nonfinite="error").agree(stop, 5, [0.5], [])
    assert verdict.stop and verdict.apply_update


def test_agreements_are_spaced_by_the_slowest_ranks_time() -> None:
    """Log steps are due at least SPACING_S of training apart, planned from the seconds per
    step every rank sees in the collective (here 1 ms per step: 50 windows of 1 step)."""
    agreement = Agreement(CPU1, last_step=10**6, on_nonfinite="error", log_every=1)
    assert agreement.spacing_s == SPACING_S == 0.05
    assert agreement.due(1)  # the first log step
    agreement._plan(10, slowest_s=0.010)
    assert agreement.next_step == 60 and not agreement.due(59) and agreement.due(60)
    slow = Agreement(CPU1, last_step=10**6, on_nonfinite="error", log_every=10)
    slow._plan(10, slowest_s=1.0)  # windows of 1 s: every log step
    assert slow.next_step == 20 and not slow.due(15) and slow.due(20)
    slow._plan(23, slowest_s=0.0)  # a checkpoint step; instant steps: the most windows
    assert slow.next_step == 20 + MAX_WINDOWS * 10
    assert Agreement(CPU1, 10, "skip", log_every=10).due(3)  # skip: every step
    resumed = Agreement(CPU1, 10**6, "error", log_every=5)
    resumed.start_at(42)
    assert not resumed.due(44) and resumed.due(45)


def test_a_stop_deadline_brings_the_next_agreement_within_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """trainer.stop_within: a stop signalled just after an agreement waits for the steps to the
    next and a checkpoint; those fit in the deadline (a fifth to spare), between log steps
    where they must."""
    agreement = Agreement(CPU1, 10**6, "error", log_every=10, stop_within=5.0)
    assert agreement.due(1)  # the first step: its time plans the next
    agreement.checkpoint_s = 1.0
    agreement._plan(10, slowest_s=10.0)  # 1 s a step: 3 and a checkpoint fit in 4 s of 5
    assert agreement.next_step == 13 and not agreement.due(12) and agreement.due(13)
    agreement._plan(13, slowest_s=0.003)  # 1 ms steps: the log steps' own spacing decides
    assert agreement.next_step == 60
    with caplog.at_level(logging.WARNING, logger="dpt"):
        agreement._plan(60, slowest_s=282.0)  # 6 s a step: no step fits; every step, said once
        agreement._plan(61, slowest_s=6.0)
    assert agreement.next_step == 62
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.stop_within=5: a step takes 6.0 s and a checkpoint 1.0 s, longer than that: a "
        "SIGTERM mid-step ends before its checkpoint (the run resumes from the newest one); "
        "checkpoint more often (checkpoint.every_n_steps) or give the engine a longer grace"
    ]


def test_every_rank_plans_a_deadline_with_the_worlds_slowest_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next agreement is a collective: each rank plans it from the world's numbers, the
    slowest checkpoint among them (here another rank's 3 s against this one's 1 s)."""
    mine = Agreement(CPU1, 10**6, "error", log_every=10, stop_within=5.0)
    mine.checkpoint_s = 1.0

    def world(row: list[float], env: object) -> list[list[float]]:
        other = list(row)
        other[3] = 3.0  # the other rank's checkpoint_s
        return [row, other]

    monkeypatch.setattr(agreement, "all_gather_floats", world)
    mine.agree(StopRequest(), 1, [0.5], [])
    assert mine.checkpoint_s == 3.0


def test_a_real_agreement_plans_the_next_from_its_own_collective() -> None:
    agreement = Agreement(CPU1, last_step=10**6, on_nonfinite="error", log_every=1)
    time.sleep(0.001)
    agreement.agree(StopRequest(), 1, [0.5], [])  # 1 step in >= 1 ms: at most 50 windows
    assert 2 <= agreement.next_step <= 51


# --- early stopping -------------------------------------------------------------------------


def test_early_stopping_counts_stale_epochs_and_resumes_its_state() -> None:
    es = EarlyStopping(
        EarlyStoppingConfig(metric="val/acc1", mode="max", patience=2, min_delta=0.01)
    )
    assert not es.should_stop({"val/acc1": 0.50})
    assert not es.should_stop({"val/acc1": 0.505})  # within min_delta: stale 1
    resumed = EarlyStopping(es.settings)
    resumed.load_state_dict(es.state_dict())
    assert resumed.state_dict() == {"best": 0.50, "stale_epochs": 1}
    assert resumed.should_stop({"val/acc1": 0.49})  # stale 2 = patience


def test_early_stopping_off_and_unknown_metric() -> None:
    assert not EarlyStopping(EarlyStoppingConfig()).should_stop({})
    es = EarlyStopping(EarlyStoppingConfig(metric="val/acc5", patience=1))
    with pytest.raises(Exception, match=r"trainer.early_stopping.metric=val/acc5: not among"):
        es.should_stop({"val/loss": 1.0})


# --- metrics window -------------------------------------------------------------------------


def _window(payload: list[float], index: int = 0) -> dict[str, float]:
    """The `index`-th ended window of a payload, by name."""
    at = len(SINCE) + index * len(WINDOW)
    return dict(zip(WINDOW, payload[at : at + len(WINDOW)], strict=True))


def _tb(folder: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_metrics_read_back_once_and_write_once_per_window(tmp_path: Path) -> None:
    metrics = MetricsLogger(one_run(tmp_path), CPU1, total_steps=4)
    for loss in (1.0, 3.0):
        metrics.record(torch.tensor(loss), samples=8, bad=1, data_s=0.1, work_s=0.2,
                       grad_norm=torch.tensor(2.0))  # fmt: skip
    metrics.end_window(step=2, epoch=0)
    metrics.set_lr({"default": 0.1})
    assert metrics.read_back() == ([1.0, 3.0], [2.0, 2.0])  # every step's loss, in order
    assert metrics.read_back() == ([], [])  # nothing new since
    payload = metrics.payload()
    assert dict(zip(SINCE, payload, strict=False)) == {"samples_since": 16, "bad_since": 2}
    window = _window(payload)
    assert window["loss"] == 4.0 and window["grad_norm"] == 4.0 and window["steps"] == 2
    assert len(payload) == len(SINCE) + len(WINDOW)  # one window ended
    metrics.agreed([payload])
    assert metrics.last_world_loss == 2.0
    assert metrics.world_samples == 16 and metrics.take_bad() == 2 and metrics.take_bad() == 0
    assert metrics.payload() == [0, 0]  # written: no window left to send
    metrics.close()
    assert _tb(tmp_path / "tb" / "rank0", "train/loss") == [(2, 2.0)]
    assert _tb(tmp_path / "tb" / "rank0", "optim/grad_norm") == [(2, 2.0)]
    assert _tb(tmp_path / "tb" / "rank0", "optim/lr") == [(2, pytest.approx(0.1))]


def test_one_agreement_writes_every_window_it_carries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Short windows ride on one agreement: each is still written with its own step, loss and
    line, the lines in order and in one record (one write per handler)."""
    metrics = MetricsLogger(one_run(tmp_path), CPU1, total_steps=4)
    for step, losses in ((1, [1.0]), (3, [3.0, 5.0])):  # windows of 1 and 2 steps
        for loss in losses:
            metrics.record(torch.tensor(loss), 8, 0, 0.0, 0.0, None)
        metrics.end_window(step, epoch=0)
        metrics.set_lr({"default": 0.1 * step})
    assert metrics.read_back() == ([1.0, 3.0, 5.0], [])  # one read-back for both windows
    payload = metrics.payload()
    assert [_window(payload, i)["loss"] for i in (0, 1)] == [1.0, 8.0]
    with caplog.at_level(logging.INFO, logger="dpt"):
        metrics.agreed([payload])
    metrics.close()
    assert _tb(tmp_path / "tb" / "rank0", "train/loss") == [(1, 1.0), (3, 4.0)]
    assert _tb(tmp_path / "tb" / "rank0", "optim/lr") == [
        (1, pytest.approx(0.1)),
        (3, pytest.approx(0.3)),
    ]
    assert metrics.last_world_loss == 4.0  # the last window's
    [record] = [r for r in caplog.records if "| step " in r.getMessage()]
    lines = record.getMessage().splitlines()
    assert [line.split(" | ")[1] for line in lines] == ["step 1/4", "step 3/4"]


def test_the_steady_pace_leaves_out_the_first_window_and_what_is_not_training(
    tmp_path: Path,
) -> None:
    """The done line's loop pace: the world's samples over the windows after the first (which
    holds start-up), validation and checkpoints not counted in any window."""
    metrics = MetricsLogger(one_run(tmp_path), CPU1, total_steps=3)
    pause_s = 0.1
    for step in (1, 2, 3):
        metrics.record(torch.tensor(1.0), 8, 0, 0.0, 0.0, None)
        # Validation with a checkpoint inside it: out of the window's time, and once only.
        with metrics.outside_windows(), metrics.outside_windows():
            time.sleep(pause_s)
        metrics.end_window(step, epoch=0)
        metrics.set_lr({"default": 0.1})
    metrics.read_back()
    payload = metrics.payload()
    # Counted, the pause would make a window at least pause_s; taken out twice, negative.
    assert all(0 <= _window(payload, i)["elapsed"] < pause_s for i in range(3))
    # The world's rows as the agreement carries them: 10 s of start-up, then 2 s a window.
    rows = [[*payload[: len(SINCE)], *(v for i, s in enumerate((10.0, 2.0, 2.0))
             for v in {**_window(payload, i), "elapsed": s}.values())]]  # fmt: skip
    metrics.agreed(rows)
    steady, whole = metrics.speeds(whole_samples_per_s=1.5)
    metrics.close()
    assert steady is not None and steady.samples_per_s == 4.0  # 16 samples in 4 s
    assert whole.samples_per_s == 1.5 and whole.record() == {"samples_per_s": 1.5}
    assert steady.record("steady_") == {"steady_samples_per_s": 4.0}


def test_held_lines_keep_their_order_and_every_line_its_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = setup_logging("rank 3", tmp_path / "rank3.log")
    try:
        lines = HeldLines(logger)
        lines.add("step 1")
        lines.add("step 2")
        logger.warning("a warning made after them")  # releases them first
        lines.add("step 3")
        lines.close()
    finally:
        setup_logging("rank 0")  # the file handler closed
    expected = ["step 1", "step 2", "a warning made after them", "step 3"]
    assert capsys.readouterr().out.splitlines() == [f"[rank 3] {line}" for line in expected]
    in_file = (tmp_path / "rank3.log").read_text().splitlines()
    assert [line.split(" [rank 3] ")[1] for line in in_file] == expected
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[rank 3\] ", x) for x in in_file)


def test_what_every_rank_says_alike_rank_0_says_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dpt.once` lines (what the data set holds, ...): on the console from rank 0 alone, in
    every rank's log file."""
    once = logging.getLogger("dpt.once")
    try:
        for rank in (0, 1):
            setup_logging(f"rank {rank}", tmp_path / f"rank{rank}.log", speaks_once=rank == 0)
            once.info("text: 98,000 training tokens")
            logging.getLogger("dpt").info("pid 12")
    finally:
        setup_logging("rank 0")  # the file handlers closed
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] text: 98,000 training tokens", "[rank 0] pid 12", "[rank 1] pid 12",
    ]  # fmt: skip
    for rank in (0, 1):
        assert "text: 98,000 training tokens" in (tmp_path / f"rank{rank}.log").read_text()


def test_held_scalars_reach_tensorboard_on_flush_stamped_when_made(tmp_path: Path) -> None:
    """Scalars wait up to a second for TensorBoard's writer (and are handed over before every
    checkpoint): on disk they carry the time their window ended, not the hand-over's."""
    metrics = MetricsLogger(one_run(tmp_path), CPU1, total_steps=4)
    stamps = []
    for step in (1, 2):
        metrics.record(torch.tensor(float(step)), 8, 0, 0.0, 0.0, None)
        before = time.time()
        metrics.end_window(step, epoch=0)
        stamps.append((before, time.time()))
        metrics.set_lr({"default": 0.1})
        time.sleep(0.2)
    metrics.read_back()
    metrics.agreed([metrics.payload()])  # both windows, after both ended
    handed_over = time.time()
    metrics.flush()
    metrics.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0)]
    for event, (before, after) in zip(events, stamps, strict=True):
        assert before <= event.wall_time <= after < handed_over


def test_a_window_not_logged_keeps_accumulating(tmp_path: Path) -> None:
    """A checkpoint-only agreement counts samples but leaves the logging window open."""
    metrics = MetricsLogger(one_run(tmp_path), CPU1, total_steps=20)
    metrics.record(torch.tensor(1.0), 8, 0, 0.0, 0.0, None)
    assert metrics.read_back() == ([1.0], [])
    metrics.agreed([metrics.payload()])
    metrics.record(torch.tensor(3.0, dtype=torch.bfloat16), 8, 0, 0.0, 0.0, None)
    assert metrics.read_back() == ([3.0], [])  # only the new step's; a bf16 loss too
    assert metrics.world_samples == 8
    metrics.end_window(step=2, epoch=0)
    window = _window(metrics.payload())
    assert window["steps"] == 2 and window["loss"] == 4.0
    metrics.close()


def test_straggler_watch_warns_once_after_three_windows(caplog: pytest.LogCaptureFixture) -> None:
    watch = StragglerWatch(ratio=1.25, windows=3)
    with caplog.at_level(logging.WARNING, logger="dpt"):
        first = watch.update([0.010, 0.030])
        for _ in range(4):
            watch.update([0.010, 0.030])
    assert first == {
        "world/work_s_max": 0.030,
        "world/work_s_min": 0.010,
        "world/straggler_ratio": pytest.approx(3.0),
    }
    assert caplog.text.count("rank 1 is a straggler") == 1
    assert "took 3.00x the median rank's for 3 logging windows" in caplog.text


def test_straggler_watch_restarts_when_the_slow_rank_changes_or_recovers() -> None:
    watch = StragglerWatch(ratio=1.25, windows=3)
    for times in ([1, 2, 1], [1, 2, 1], [2, 1, 1], [2, 1, 1], [1, 1, 1], [2, 1, 1]):
        watch.update([float(t) for t in times])
    assert watch.streak == 1 and watch.rank == 0


# --- config conversion ----------------------------------------------------------------------


def test_the_config_becomes_typed_settings_once() -> None:
    cfg = RunConfig.of(compose("trainer.max_steps=7", "trainer.early_stopping.patience=2"))
    assert isinstance(cfg.trainer, TrainerConfig)
    assert cfg.trainer.max_steps == 7 and cfg.trainer.early_stopping.patience == 2
    assert isinstance(cfg.trainer.early_stopping, EarlyStoppingConfig)
    assert cfg.checkpoint.keep == 3  # the schema's default: one place for defaults
    assert "max_steps: 7" in cfg.yaml


# --- collectives, counted across real ranks ------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_object",
               "broadcast_object_list", "reduce", "gather", "scatter", "all_to_all",
               "all_gather_into_tensor", "reduce_scatter_tensor")  # fmt: skip


def _count_collectives(
    rank: int, world: int, port: int, steps: int, log_every: int, spacing_s: float, out: Path
) -> None:
    """Runs `steps` optimizer steps of a 2-rank ddp MLP; records, per step, the gradient
    all-reduces (a DDP comm hook) and every other collective (torch.distributed's functions).
    `spacing_s`: the agreements' least spacing (dpt.loop.agreement.SPACING_S) in this rank."""
    patched = {name: getattr(dist, name) for name in COLLECTIVES}, agreement.SPACING_S
    agreement.SPACING_S = spacing_s
    try:
        _count_in_world(rank, world, port, steps, log_every, out)
    finally:  # a resident rank (tests/worlds.py) runs the next test with torch's own functions
        for name, original in patched[0].items():
            setattr(dist, name, original)
        agreement.SPACING_S = patched[1]


def _count_in_world(
    rank: int, world: int, port: int, steps: int, log_every: int, out: Path
) -> None:
    with joined_world(rank, world, port) as env:
        trainer = build_trainer(
            out, env, "strategy=ddp", "dataset.num_samples=2048", "dataset.num_val_samples=0",
            "trainer.batch_size=16", f"trainer.max_steps={steps}",
            f"trainer.log_every_n_steps={log_every}", "checkpoint.enabled=false",
        )  # fmt: skip
        step, grads, others = [0], [0] * (steps + 1), [0] * (steps + 1)
        in_hook = [False]  # the hook's all-reduce is a gradient one, not an "other"

        def hook(state, bucket):  # type: ignore[no-untyped-def]
            grads[step[0]] += 1
            in_hook[0] = True
            try:
                return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
            finally:
                in_hook[0] = False

        def counted(name: str):  # type: ignore[no-untyped-def]
            original = getattr(dist, name)

            def call(*args, **kwargs):  # type: ignore[no-untyped-def]
                others[step[0]] += not in_hook[0]
                return original(*args, **kwargs)

            return call

        for name in COLLECTIVES:
            setattr(dist, name, counted(name))
        trainer.model.register_comm_hook(None, hook)
        train_step = trainer.train_step

        def numbered_step(*args):  # type: ignore[no-untyped-def]
            step[0] += 1
            return train_step(*args)

        trainer.train_step = numbered_step
        trainer.fit()
        trainer.metrics.close()
        (out / f"counts-rank{rank}.json").write_text(json.dumps({"grads": grads, "others": others}))


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("log_every", "spacing_s", "agreed_at"),
    [
        # Windows of 10 steps, agreements not spaced: one per window, ending at 10, 20 and 25
        # (the run's last step).
        (10, 0.0, (10, 20, 25)),
        # Windows of 1 step far shorter than the spacing: the first log step, then the most
        # windows one agreement carries (MAX_WINDOWS), cut short by the run's last step. The
        # plan divides the spacing by the first step's time: 10 s planned an agreement at step
        # 13 once, after a first step of ~0.85 s on a loaded machine.
        (1, 1000.0, (1, 25)),
    ],
)
def test_one_gradient_all_reduce_per_step_and_one_collective_per_logging_window(
    tmp_path: Path, log_every: int, spacing_s: float, agreed_at: tuple[int, ...]
) -> None:
    steps = 25
    args = (2, free_port(), steps, log_every, spacing_s, tmp_path)
    spawn(_count_collectives, *args, nprocs=2)
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts-rank{rank}.json").read_text())
        assert counts["grads"][1:] == [1] * steps  # one bucket: one all-reduce per step
        expected = [1 if s in agreed_at else 0 for s in range(1, steps + 1)]
        assert counts["others"][1:] == expected, counts["others"]
    # Every window was written, each at its own step, from the agreements' rows.
    logged = [step for step, _ in _tb(tmp_path / "tb" / "world", "train/loss")]
    assert logged == [*range(log_every, steps, log_every), steps]


# --- stragglers, across real ranks ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_slow_rank_shows_in_the_world_metrics_and_a_warning(tmp_path: Path) -> None:
    result = train(
        tmp_path, *FAST, "strategy=ddp", "trainer.batch_size=32", "trainer.max_steps=30",
        "model._target_=tests.faults.SlowMLP",
        env={"DPT_TEST_SLOW_RANK": "1", "DPT_TEST_SLOW_S": "0.03"},
    )  # fmt: skip
    warnings = re.findall(r"\[rank 0\] rank 1 is a straggler: .* took ([\d.]+)x", result.stdout)
    assert len(warnings) == 1 and float(warnings[0]) > 1.25, result.stdout
    acc = EventAccumulator(str(tmp_path / "tb" / "world"))
    acc.Reload()
    ratios = [e.value for e in acc.Scalars("world/straggler_ratio")]
    slowest = [e.value for e in acc.Scalars("world/work_s_max")]
    fastest = [e.value for e in acc.Scalars("world/work_s_min")]
    assert len(ratios) == 6 and min(ratios) > 1.25  # every window of 5 steps
    # The slow rank sleeps 30 ms per step: every window's slowest work holds it, above the
    # fast rank's (whose own work a loaded machine stretches: 51 ms once, in CI)
    assert min(slowest) >= 0.03
    assert all(slow > fast for slow, fast in zip(slowest, fastest, strict=True))


def test_a_logging_interval_as_long_as_the_run_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """experiment=gpt_tiny (log every 200) shortened to 40 steps would show one line at the end:
    rank 0 says so, with an interval that shows the run as it goes."""
    with caplog.at_level(logging.WARNING, logger="dpt.once"):
        check_log_interval(200, 40)
        check_log_interval(10, 40)  # shorter than the run: nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.log_every_n_steps=200 is not shorter than the run (40 steps): its progress "
        "shows only at the end; trainer.log_every_n_steps=4 shows it as it goes"
    ]
    assert caplog.records[0].name == "dpt.once"  # rank 0 alone says it on the console
