"""The monitor in real runs: spikes injected through a user's data set (tests/monitor_data, the
own-data contract) are warned of, skipped or rolled back past; clean runs raise no event; a
rollback survives a kill; a non-finite value is traced to its module; a slowdown is seen."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.distributed import env_from_environment
from dpt.monitor.events import read_events
from tests.helpers import (
    REPO,
    TRAIN,
    WorldRun,
    build_trainer,
    committed_checkpoints,
    job_tb,
    joined_world,
    load_weights,
    max_abs_diff,
    one_thread,
    run_cmd,
    run_here,
    run_until,
    shared_port,
    spawn,
    summary,
    tb_points,
    train,
    world_rank_runs,
    world_run,
)

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

# The 2-rank runs train in one spawned world (one start-up: `world` below), the one-process runs
# that only compare weights or read the console in this process (`run_here`: what `train.py
# strategy=single` runs). Processes are started where the test is about one: a SIGKILL, an exit
# status and the last line on stderr, a sweep.

CONF = ["--config-dir", str(REPO / "tests" / "monitor_data" / "conf")]
# 34 global batches of 64 an epoch, in index order; samples 1024..1151 (batches 17 and 18 of
# every epoch) are poisoned: their inputs x1000 make the loss ~100 times its level.
POISONED = [
    *CONF,
    "dataset=poisoned",
    "dataset.num_samples=2176",
    "dataset.poison_start=1024",
    "dataset.poison_end=1152",
    "trainer.epochs=2",
    "trainer.log_every_n_steps=4",
    "checkpoint.every_n_steps=16",  # a rolled-back epoch has 32 steps: one falls before its window
    "monitor.loss_spike.warmup=12",  # judged from step 13, before the first window
    "monitor.max_rollbacks=4",  # two a window, in each of 2 epochs
]
WINDOW = (1024, 1152)


def _events(run_dir: Path) -> list[tuple[Any, ...]]:
    return [(e["step"], e["epoch"], e["detector"], e["action"], e["skipped_samples"])
            for e in read_events(run_dir)]  # fmt: skip


def _metrics(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One sweep over the loss spike's reactions on the poisoned data (every job's events counted
    in its summary), and the run on the same data without the window ("dropped": the run that
    never saw it)."""
    root = tmp_path_factory.mktemp("poisoned")
    sweep = root / "sweep"
    # On one thread, as the run in this process: weights compared to the bit (or within 1e-6)
    # come from the same sums.
    run_cmd([sys.executable, str(TRAIN), "-m", *POISONED, "monitor.grad_diagnostics_every=8",
             "monitor.loss_spike.action=off,warn,skip,rollback", f"hydra.sweep.dir={sweep}"],
            timeout=240, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    run_here(root / "dropped", *POISONED, "dataset.poison=drop")
    runs = {row["overrides"].split("=")[-1]: sweep / row["job_dir"] for row in summary(sweep)}
    return {**runs, "sweep": sweep, "dropped": root / "dropped"}


def test_warn_says_where_and_changes_nothing(poisoned: dict[str, Path]) -> None:
    # Steps 17 and 18 of every epoch of 34 steps; the updates are applied as without a monitor.
    assert _events(poisoned["warn"]) == [
        (s, e, "loss_spike", "warn", 0) for e, s in ((0, 17), (0, 18), (1, 51), (1, 52))
    ]
    assert max_abs_diff(load_weights(poisoned["warn"]), load_weights(poisoned["off"])) == 0.0
    assert _events(poisoned["off"]) == []


def test_skip_withholds_exactly_the_window_updates(poisoned: dict[str, Path]) -> None:
    """The spiking steps count, but their updates are not applied: with a constant learning
    rate that is the run that never saw the window, to the bit."""
    events = _events(poisoned["skip"])
    assert [(s, a, n) for s, _, _, a, n in events] == [(s, "skip", 64) for s in (17, 18, 51, 52)]
    assert _metrics(poisoned["skip"])["steps"] == 2 * 34
    assert max_abs_diff(load_weights(poisoned["skip"]), load_weights(poisoned["dropped"])) < 1e-6


def test_rollback_returns_before_the_spike_and_skips_exactly_the_window(
    poisoned: dict[str, Path],
) -> None:
    run = poisoned["rollback"]
    events = read_events(run)
    # Each epoch: batch 17 spikes at its step 17, back to step 16; batch 18, tried on the
    # checkpoint's weights, would spike too: skipped with it. A rolled-back epoch has 32 steps.
    assert [(e["step"], e["rollback_to"], e["epoch"]) for e in events] == [
        (17, 16, 0), (49, 48, 1)
    ]  # fmt: skip
    for epoch in range(2):
        ranges = [e["skipped"] for e in events if e["epoch"] == epoch]
        skipped = set().union(*(range(a, b) for a, b in ranges))  # shuffle=false: indices
        assert skipped == set(range(*WINDOW)), epoch
        assert sum(e["skipped_samples"] for e in events if e["epoch"] == epoch) == 128
    assert all(e["value"] > 100 * e["level"] for e in events)
    assert _metrics(run)["steps"] == 2 * 32
    # It ends where the run that never saw the window ends: the same weights, the same loss.
    dropped = _metrics(poisoned["dropped"])["final_loss"]
    assert _metrics(run)["final_loss"] == pytest.approx(dropped, rel=0.01)
    assert max_abs_diff(load_weights(run), load_weights(poisoned["dropped"])) < 1e-6
    # TensorBoard: a point on the detector's curve at each event's step, the lines as text.
    world = job_tb(poisoned["sweep"], 3) / "world"
    assert [step for step, _ in tb_points(world, "monitor/loss_spike")] == [17, 49]
    acc = EventAccumulator(str(world), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("monitor/events")]
    assert len(texts) == 2 and "rolled back to step 16" in texts[0]


# Ten consecutive poisoned global batches (25 to 34 of 40: samples 1536 to 2175), the monitor at
# its defaults (judging from step 21) but for the reaction: one rollback to step 24 gets past the
# whole region.
REGION = [*CONF, "dataset=poisoned", "dataset.num_samples=2560", "dataset.poison_start=1536",
          "dataset.poison_end=2176", "trainer.epochs=1", "checkpoint.every_n_steps=8",
          "trainer.log_every_n_steps=5"]  # fmt: skip


def test_one_rollback_gets_past_a_region_of_ten_bad_batches(tmp_path: Path) -> None:
    """The spike's batch is skipped by the rollback; the nine after it, tried on the
    checkpoint's weights, would spike too and are skipped with it; the run then trains as the
    run that never saw the region."""
    run_here(tmp_path / "rollback", *REGION, "monitor.loss_spike.action=rollback")
    run_here(tmp_path / "dropped", *REGION, "dataset.poison=drop")
    events = read_events(tmp_path / "rollback")
    assert [(e["step"], e["action"], e["rollback_to"], e["skipped"], e["skipped_samples"])
            for e in events] == [(25, "rollback", 24, [1536, 2176], 640)]  # fmt: skip
    rolled, dropped = _metrics(tmp_path / "rollback"), _metrics(tmp_path / "dropped")
    assert rolled["steps"] == dropped["steps"] == 40 - 10
    assert rolled["final_loss"] == pytest.approx(dropped["final_loss"], rel=0.01)
    diff = max_abs_diff(load_weights(tmp_path / "rollback"), load_weights(tmp_path / "dropped"))
    assert diff < 1e-6


def test_the_sweep_counts_each_jobs_events_and_diagnostics_reach_tensorboard(
    poisoned: dict[str, Path],
) -> None:
    rows = {row["overrides"].split("=")[-1]: row for row in summary(poisoned["sweep"])}
    assert {name: int(row["events"]) for name, row in rows.items()} == {
        "off": 0, "warn": 4, "skip": 4, "rollback": 2
    }  # fmt: skip
    world = job_tb(poisoned["sweep"], 0) / "world"
    norms = tb_points(world, "grads/0/norm")
    assert [step for step, _ in norms] == list(range(8, 2 * 34 + 1, 8))
    assert all(value > 0 for _, value in tb_points(world, "grads/4/update_ratio"))


@pytest.mark.timeout(600)  # the first test of the world builds it
def test_a_rollback_killed_on_2_ranks_resumes_to_the_weights_of_the_run_not_killed(
    world: dict[str, Any],
) -> None:
    killed, full = world["rollback-killed"].run_dir, world["rollback-full"].run_dir
    assert world["events-at-kill"] == [17]  # written before the kill
    assert max_abs_diff(load_weights(killed), load_weights(full)) < 1e-6
    # The log follows the run's line: the replayed rollback is written once.
    assert _events(killed) == _events(full)
    assert len(read_events(full)) == 1
    [aside] = killed.glob("events.abandoned-*.jsonl")
    assert len(aside.read_text().splitlines()) == 1


@pytest.mark.timeout(600)  # the first test of the world builds it
def test_a_non_finite_value_is_traced_to_the_module_that_divides_by_zero(
    world: dict[str, Any],
) -> None:
    """The poisoned samples' first feature is 0; the model's `ratio` divides by it. Under fsdp:
    the ranks replay rank 0's batch together (every forward gathers the weights)."""
    events = read_events(world["nonfinite-fsdp"].run_dir)
    assert [(e["step"], e["module"], e["action"]) for e in events] == [
        (6, "ratio", "skip"), (7, "ratio", "skip")  # samples 320..447 of a global batch of 64
    ]  # fmt: skip


def test_an_error_on_a_non_finite_loss_names_the_module(tmp_path: Path) -> None:
    overrides = [*CONF, "dataset=poisoned", "model=dividing", "dataset.poison=zero",
                 "dataset.poison_start=0", "dataset.poison_end=64", "trainer.log_every_n_steps=1",
                 "trainer.max_steps=4"]  # fmt: skip
    result = train(tmp_path, *overrides, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: non-finite loss (nan) at step 1 on rank 0 (first non-finite output: ratio "
        "(Ratio)); "
        "set trainer.on_nonfinite=skip to skip such steps"
    )
    [event] = read_events(tmp_path)
    assert (event["detector"], event["action"], event["module"]) == ("nonfinite", "error", "ratio")


def test_a_loader_that_slows_down_is_a_slowdown_event(tmp_path: Path) -> None:
    # From step 9 on every sample takes 2 ms more to load: a step of 64, 128 ms more. Spans of
    # 2 ms: the warmup's 3 spans lie in steps 1-8 however fast a step is (at 10 ms, a fast
    # machine's eight steps of ~1.3 ms made one span, and the slow ones fell into the warmup).
    overrides = [*CONF, "dataset=slow", "trainer.epochs=1", "trainer.log_every_n_steps=1",
                 "monitor.slowdown.span_s=0.002", "monitor.slowdown.patience=2"]  # fmt: skip
    result = train(tmp_path, *overrides)  # a process of its own: step times as a user sees them
    [event] = read_events(tmp_path)
    assert (event["detector"], event["signal"], event["action"]) == ("slowdown", "step_time",
                                                                     "warn")  # fmt: skip
    # The second slow span meets the patience (step 10); a fast span the machine's other work
    # slowed just before step 9 can start the streak one span early (step 9), and a slow span
    # judged against a level the same work raised can end it late: up to two spans (step 12,
    # seen under the full suite on 2 cores). Earlier would be a false alarm, later a missed
    # slowdown.
    assert event["step"] in (9, 10, 11, 12) and event["value"] > 3
    assert f"monitor: slowdown (step_time) at step {event['step']}" in result.stdout


def test_stop_checkpoints_and_ends_with_exit_1(tmp_path: Path) -> None:
    result = train(tmp_path, *POISONED, "trainer.epochs=1", "monitor.loss_spike.action=stop",
                   check=False)  # fmt: skip
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    # At the agreement that saw the step: within 4 steps (the log steps), or 50 ms of steps.
    stopped = re.fullmatch(
        rf"Error: monitor: loss_spike at step 17: .*; stopped \(checkpoint written to "
        rf"{re.escape(str(tmp_path))}/checkpoints/step-000000(\d\d)\)",
        line,
    )
    assert stopped is not None, line
    assert [c.name for c in committed_checkpoints(tmp_path)][-1] == f"step-000000{stopped[1]}"
    _, resumed = run_here(tmp_path, *POISONED, "trainer.epochs=1", "monitor.loss_spike.action=off")
    assert f"at step {int(stopped[1])}" in resumed


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        # one rollback gets past the whole window (2 batches): none allowed at all
        (["monitor.max_rollbacks=0"], "monitor.max_rollbacks=0 reached"),
        (["checkpoint.every_n_steps=null"],
         "no checkpoint of this run before step 17 to return to (set checkpoint.every_n_steps)"),
    ],
    ids=["past max_rollbacks", "no checkpoint before"],
)  # fmt: skip
def test_a_rollback_that_cannot_be_taken_ends_the_run_in_one_line(
    tmp_path: Path, overrides: list[str], why: str
) -> None:
    result = train(tmp_path, *POISONED, "trainer.epochs=1", "monitor.loss_spike.action=rollback",
                   *overrides, check=False)  # fmt: skip
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"Error: monitor: loss_spike at step 17: .*; stopped \(asked for a "
                        rf"rollback: {re.escape(why)}\)", line), line  # fmt: skip
    assert read_events(tmp_path)[-1]["action"] == "error"


# Clean runs at the monitor's defaults, gradient norms computed (clipping far above them) so that
# grad_spike judges too: every step past the warm-up (20) is judged.
MLP_CLEAN = ["trainer.max_steps=100", "trainer.grad_clip_norm=1000", "trainer.batch_size=32",
             "dataset.num_val_samples=64", "checkpoint.enabled=false"]  # fmt: skip
RESNET_CLEAN = ["model=resnet18", "dataset=fake_images", "dataset.image_size=16",
                "dataset.num_samples=480", "dataset.num_val_samples=16", "trainer.batch_size=4",
                "trainer.max_steps=36", "trainer.grad_clip_norm=1000", "dataset.num_workers=0",
                "checkpoint.enabled=false"]  # fmt: skip
CLEAN_IN_WORLD = {
    "mlp-ddp-0": [*MLP_CLEAN, "strategy=ddp", "trainer.seed=0"],
    "mlp-fsdp-1": [*MLP_CLEAN, "strategy=fsdp", "trainer.seed=1"],
    "resnet-ddp-5": [*RESNET_CLEAN, "strategy=ddp", "trainer.seed=5"],
    "resnet-fsdp-6": [*RESNET_CLEAN, "strategy=fsdp", "trainer.seed=6"],
}
CLEAN_SINGLE = {
    "mlp-single-0": [*MLP_CLEAN, "trainer.seed=0", "trainer.batch_size=64"],
    "mlp-single-1": [*MLP_CLEAN, "trainer.seed=1", "trainer.batch_size=64"],
    "mlp-single-2": [*MLP_CLEAN, "trainer.seed=2", "trainer.batch_size=64"],
    "resnet-single-3": [*RESNET_CLEAN, "trainer.seed=3", "trainer.batch_size=8"],
    "resnet-single-4": [*RESNET_CLEAN, "trainer.seed=4", "trainer.batch_size=8"],
}


def _clean_run(run_dir: Path, env: Any, overrides: list[str]) -> dict[str, Any]:
    """A run trained in this process, as a rank trains it; what its monitor judged."""
    trainer = build_trainer(run_dir, env, *overrides)
    trainer.fit()
    trainer.metrics.close()
    return {name: detector.level.added for name, detector in trainer.monitor.spikes.items()}


# The rollback of a run killed on 2 ranks, resumed in the world, and the run not killed; fsdp
# replaying a non-finite step to find its module.
ROLLBACK_DDP = [*POISONED, "trainer.epochs=1", "monitor.loss_spike.action=rollback",
                "strategy=ddp", "launcher.nproc_per_node=2", "trainer.batch_size=32"]  # fmt: skip
DIVIDING_FSDP = [*CONF, "dataset=poisoned", "model=dividing", "dataset.poison=zero",
                 "dataset.num_samples=512", "dataset.poison_start=320", "dataset.poison_end=448",
                 "trainer.epochs=1", "trainer.on_nonfinite=skip", "strategy=fsdp",
                 "trainer.batch_size=32"]  # fmt: skip


def _world(rank: int, world: int, runs: list[WorldRun], out: Path) -> None:
    """One 2-rank world (one start-up) for every ddp and fsdp run: the runs as a rank runs them
    (`run_worker`), then the clean runs, trained as a rank trains them to read their monitor."""
    world_rank_runs(rank, world, runs)
    with joined_world(rank, world, shared_port(rank, out / "clean.port")) as env:
        judged = {name: _clean_run(out / name, env, overrides)
                  for name, overrides in CLEAN_IN_WORLD.items()}  # fmt: skip
        if env.is_main:
            (out / "judged.json").write_text(json.dumps(judged))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A rollback killed on 2 ranks (train.py, SIGKILL once the rollback is logged), then every
    2-rank run of this file in one world."""
    out = tmp_path_factory.mktemp("world")
    killed = out / "rollback-killed"
    run_until(killed, ROLLBACK_DDP, "rolled back to step 16",
              lambda proc, _: os.killpg(proc.pid, signal.SIGKILL))  # fmt: skip
    at_kill = [e["step"] for e in read_events(killed)]
    runs = [
        world_run("rollback-full", out / "rollback-full", *ROLLBACK_DDP),
        world_run("rollback-killed", killed, *ROLLBACK_DDP),
        world_run("nonfinite-fsdp", out / "nonfinite-fsdp", *DIVIDING_FSDP),
    ]
    spawn(_world, 2, runs, out, nprocs=2)
    judged = json.loads((out / "judged.json").read_text())
    return {"events-at-kill": at_kill, "judged": judged, "out": out} | {r.name: r for r in runs}


@pytest.mark.timeout(600)
def test_clean_runs_raise_no_event(world: dict[str, Any], tmp_path: Path) -> None:
    """The MLP on 3 seeds under single, and under ddp and fsdp; ResNet-18 on 2 seeds under single,
    and under ddp and fsdp: no event, while both spike detectors judged every step past their
    warm-up."""
    judged = dict(world["judged"])
    cpu = env_from_environment("cpu")
    with one_thread():
        judged |= {name: _clean_run(tmp_path / name, cpu, overrides)
                   for name, overrides in CLEAN_SINGLE.items()}  # fmt: skip
    for name, overrides in {**CLEAN_IN_WORLD, **CLEAN_SINGLE}.items():
        run = (world["out"] if name in CLEAN_IN_WORLD else tmp_path) / name
        assert not (run / "events.jsonl").exists(), name
        steps = int(next(o for o in overrides if "max_steps" in o).split("=")[1])
        # Every step's value was accepted into the level: none alarmed.
        assert judged[name] == {"loss_spike": steps, "grad_spike": steps}, name
