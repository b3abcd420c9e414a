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
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dpt.agreement import Agreement, NonFiniteLoss
from dpt.config import EarlyStoppingConfig, TrainerConfig
from dpt.distributed import DistEnv
from dpt.early_stopping import EarlyStopping
from dpt.interrupt import StopRequest
from dpt.metrics import FIELDS, MetricsLogger, StragglerWatch
from dpt.parts import RunConfig
from tests.helpers import FAST, build_trainer, compose, free_port, joined_world, train

CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


# --- agreement ------------------------------------------------------------------------------


def test_agreement_names_the_first_non_finite_step_and_raises() -> None:
    agreement = Agreement(CPU1, last_step=100, on_nonfinite="error")
    losses = [1.0, float("nan"), float("inf")]  # steps 1, 2, 3: not the first, 2 is named
    with pytest.raises(NonFiniteLoss, match=r"^non-finite loss \(nan\) at step 2 on rank 0; "):
        agreement.agree(StopRequest(), 3, losses, [])


def test_agreement_skips_the_update_and_starts_over(caplog: pytest.LogCaptureFixture) -> None:
    agreement = Agreement(CPU1, last_step=100, on_nonfinite="skip")
    assert agreement.every_step
    with caplog.at_level(logging.WARNING, logger="dpt"):
        verdict = agreement.agree(StopRequest(), 7, [float("nan")], [1.5, 2.0])
    assert not verdict.apply_update and not verdict.stop
    assert verdict.rows == [[1.5, 2.0]]  # every rank's payload comes back
    assert "skipping the update of step 7 on rank 0: non-finite loss" in caplog.text
    assert agreement.agree(StopRequest(), 8, [0.5], []).apply_update  # only step 8's loss counts


def test_agreement_stops_on_a_signal() -> None:
    stop = StopRequest()
    stop.signal_name = "SIGTERM"
    verdict = Agreement(CPU1, last_step=10, on_nonfinite="error").agree(stop, 5, [0.5], [])
    assert verdict.stop and verdict.apply_update


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


def test_metrics_read_back_once_and_write_once_per_window(tmp_path: Path) -> None:
    metrics = MetricsLogger(tmp_path, CPU1, log_every_n_steps=2, total_steps=4)
    for loss in (1.0, 3.0):
        metrics.record(torch.tensor(loss), samples=8, bad=1, data_s=0.1, work_s=0.2,
                       grad_norm=torch.tensor(2.0))  # fmt: skip
    assert metrics.read_back() == [1.0, 3.0]  # every step's loss, in order
    assert metrics.read_back() == []  # nothing new since
    payload = dict(zip(FIELDS, metrics.payload(), strict=True))
    assert payload["loss"] == 4.0 and payload["grad_norm"] == 4.0 and payload["steps"] == 2
    assert payload["samples_since"] == 16 and payload["bad_since"] == 2
    metrics.agreed([metrics.payload()], step=2, epoch=0, lr=0.1, log=True)
    assert metrics.last_world_loss == 2.0
    assert metrics.world_samples == 16 and metrics.take_bad() == 2 and metrics.take_bad() == 0
    assert metrics.payload()[FIELDS.index("steps")] == 0  # a new window
    metrics.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(2, 2.0)]
    assert [e.value for e in acc.Scalars("optim/grad_norm")] == [2.0]


def test_held_scalars_reach_tensorboard_on_flush_stamped_when_made(tmp_path: Path) -> None:
    """Scalars wait up to a second for TensorBoard's writer (and are handed over before every
    checkpoint): on disk they carry the time their window ended, not the hand-over's."""
    metrics = MetricsLogger(tmp_path, CPU1, log_every_n_steps=1, total_steps=4)
    stamps = []
    for step in (1, 2):
        metrics.record(torch.tensor(float(step)), 8, 0, 0.0, 0.0, None)
        metrics.read_back()
        before = time.time()
        metrics.agreed([metrics.payload()], step=step, epoch=0, lr=0.1, log=True)
        stamps.append((before, time.time()))
        time.sleep(0.2)
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
    metrics = MetricsLogger(tmp_path, CPU1, log_every_n_steps=10, total_steps=20)
    metrics.record(torch.tensor(1.0), 8, 0, 0.0, 0.0, None)
    assert metrics.read_back() == [1.0]
    metrics.agreed([metrics.payload()], step=1, epoch=0, lr=0.1, log=False)
    metrics.record(torch.tensor(3.0, dtype=torch.bfloat16), 8, 0, 0.0, 0.0, None)
    assert metrics.read_back() == [3.0]  # only the new step's; a bf16 loss too
    assert metrics.world_samples == 8
    window = dict(zip(FIELDS, metrics.payload(), strict=True))
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


def _count_collectives(rank: int, world: int, port: int, steps: int, out: Path) -> None:
    """Runs `steps` optimizer steps of a 2-rank ddp MLP; records, per step, the gradient
    all-reduces (a DDP comm hook) and every other collective (torch.distributed's functions)."""
    with joined_world(rank, world, port) as env:
        trainer = build_trainer(
            out, env, "strategy=ddp", "dataset.num_samples=2048", "dataset.num_val_samples=0",
            "trainer.batch_size=16", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=10",
            "checkpoint.enabled=false",
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
def test_one_gradient_all_reduce_per_step_and_one_collective_per_logging_window(
    tmp_path: Path,
) -> None:
    steps = 25  # windows end at steps 10, 20 and 25 (the run's last step)
    mp.spawn(_count_collectives, args=(2, free_port(), steps, tmp_path), nprocs=2, join=True)
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"counts-rank{rank}.json").read_text())
        assert counts["grads"][1:] == [1] * steps  # one bucket: one all-reduce per step
        expected = [1 if s in (10, 20, 25) else 0 for s in range(1, steps + 1)]
        assert counts["others"][1:] == expected, counts["others"]


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
    assert min(slowest) >= 0.03 > max(fastest)  # the slow rank sleeps 30 ms per step
