"""Checkpoints and exact resume: a stopped, resumed run ends with the uninterrupted weights."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.loop.schedulers import WarmupCosine
from tests.helpers import (
    FAST,
    Result,
    WorldRun,
    committed_checkpoints,
    load_weights,
    max_abs_diff,
    read_checkpoint,
    refused_in_process,
    run_here,
    run_until,
    run_world,
    train,
    world_run,
)

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

# The 2-rank runs train in one spawned world (one start-up: `runs` below); the one-process runs
# in this process (`run_here`: what `train.py strategy=single` runs). Processes are started
# where the test is about one: a SIGKILL, a SIGTERM, the launcher's exit and its last line.

DDP = ["strategy=ddp", "launcher.nproc_per_node=2", "trainer.batch_size=32"]
# 2048 samples / (2 ranks x 32) = 32 steps per epoch: 40 steps cross an epoch boundary.
CKPT = ["checkpoint.every_n_steps=5", "trainer.log_every_n_steps=5"]
# A wider net makes each step take long enough to kill the run mid-training.
WIDE = ["model.hidden_dims=[512,512]"]


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def _tb_steps(folder: Path, tag: str = "train/loss") -> list[int]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


# The uninterrupted ddp run and one stopped by max_steps at 25 (no loader workers), shared by
# the tests that resume a copy of the stopped one or compare with the uninterrupted one.
REFERENCE = [*FAST, *DDP, *CKPT]
# Killed with SIGKILL mid-training (2 loader workers a rank), and stopped by a SIGTERM to the
# launcher: real processes, resumed in the world.
KILLED = [*FAST, *DDP, *CKPT, *WIDE, "dataset.num_workers=2", "trainer.max_steps=40"]
SIGTERMED = [*FAST, *DDP, *WIDE, "trainer.log_every_n_steps=5", "trainer.max_steps=60"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The runs killed or stopped by a signal (train.py), then every 2-rank run of this file in
    one world: the reference runs, the resumes of the stopped and killed ones, the rollback."""
    root = tmp_path_factory.mktemp("ddp_runs")
    killed = _run_until(root / "killed", KILLED, "[rank 0] epoch 1 | step 10/40", signal.SIGKILL)
    out: dict[str, Any] = {
        "killed": killed,
        "killed-left": [p.name for p in committed_checkpoints(root / "killed")],
        "killed-finished": (root / "killed" / "model.pt").exists(),
        "sigtermed": run_until(root / "sigtermed", SIGTERMED, "[rank 0] epoch 1 | step 10/",
                               lambda proc, _: os.kill(proc.pid, signal.SIGTERM)),  # the launcher
        "sigtermed-saved": committed_checkpoints(root / "sigtermed"),
    }  # fmt: skip
    rollback = root / "rollback"
    world = [
        world_run("full", root / "full", *REFERENCE, "trainer.max_steps=40"),
        world_run("stopped", root / "stopped", *REFERENCE, "trainer.max_steps=25"),
        *(world_run(f"cut-{workers}", root / f"cut-{workers}", *REFERENCE,
                    f"dataset.num_workers={workers}", "trainer.max_steps=40",
                    copy_from=root / "stopped") for workers in (0, 2)),
        world_run("rollback-15", rollback, *REFERENCE, "trainer.max_steps=15"),
        world_run("rollback-to-5", rollback, *REFERENCE,
                  f"checkpoint.resume={rollback / 'checkpoints' / 'step-00000005'}",
                  "trainer.max_steps=10"),
        world_run("rollback-auto", rollback, *REFERENCE, "trainer.max_steps=12"),
        world_run("killed-full", root / "killed-full", *KILLED),
        world_run("killed-resumed", root / "killed", *KILLED),
        world_run("sigtermed-resumed", root / "sigtermed", *SIGTERMED),
    ]  # fmt: skip
    run_world(2, world)
    return out | {run.name: run for run in world}


@pytest.mark.timeout(600)  # the first test of the world builds it
@pytest.mark.parametrize("workers", [0, 2])
def test_ddp_stopped_by_max_steps_resumes_to_the_same_weights(
    runs: dict[str, Any], workers: int
) -> None:
    """Stopped without loader workers, resumed without or with 2 per rank: the same samples."""
    resumed, full = runs[f"cut-{workers}"], runs["full"].run_dir
    assert (runs["stopped"].run_dir / "checkpoints" / "step-00000025" / "COMMITTED").exists()
    assert "resumed from" in resumed.stdout and "at step 25" in resumed.stdout
    _assert_same_weights(full, resumed.run_dir)
    # The curves continue at the right step, without duplicates.
    for folder in ("rank0", "rank1", "world"):
        assert _tb_steps(resumed.run_dir / "tb" / folder) == _tb_steps(full / "tb" / folder)


def _run_until(run_dir: Path, overrides: list[str], marker: str, sig: int) -> Result:
    """Start a run, wait for `marker` on stdout, then send `sig` to its whole process group."""
    return run_until(run_dir, overrides, marker, lambda proc, _: os.killpg(proc.pid, sig))


@pytest.mark.timeout(400)
def test_ddp_killed_mid_training_resumes_to_the_same_weights(runs: dict[str, Any]) -> None:
    killed: Result = runs["killed"]
    assert killed.returncode == -signal.SIGKILL
    assert not runs["killed-finished"]  # it really died before the end
    left = runs["killed-left"]
    assert left and left[-1] < "step-00000040"
    resumed, full = runs["killed-resumed"], runs["killed-full"].run_dir
    assert "resumed from" in resumed.stdout
    _assert_same_weights(full, resumed.run_dir)
    steps = _tb_steps(resumed.run_dir / "tb" / "rank0")
    assert steps == sorted(set(steps)) == _tb_steps(full / "tb" / "rank0")


@pytest.mark.timeout(300)
def test_sigterm_finishes_the_step_writes_a_checkpoint_and_resumes(tmp_path: Path) -> None:
    common = [*FAST, *WIDE, "trainer.log_every_n_steps=5", "trainer.max_steps=60"]
    run_here(tmp_path / "full", *common)
    # The stopped process on one thread, as the runs in this process: the same sums, to the bit.
    stopped = run_until(tmp_path / "cut", common, "step 10/60",
                        lambda proc, _: os.killpg(proc.pid, signal.SIGTERM),
                        env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert stopped.returncode == 1
    message = stopped.stderr.strip().splitlines()[-1]
    assert message.startswith("Error: stopped by SIGTERM after step ")
    assert f"Resume: the same command with hydra.run.dir={tmp_path / 'cut'}" in message
    step = int(message.split("after step ")[1].split(";")[0])
    assert 10 <= step < 60
    assert step % 5 == 0 or step == 32  # ranks agree at log steps and at the epoch's last step
    assert (tmp_path / "cut" / "checkpoints" / f"step-{step:08d}" / "COMMITTED").exists()
    run_here(tmp_path / "cut", *common)
    _assert_same_weights(tmp_path / "full", tmp_path / "cut")


@pytest.mark.timeout(120)
def test_a_sigterm_under_a_deadline_ends_in_a_checkpoint_within_it(tmp_path: Path) -> None:
    """trainer.stop_within=2 (a preemption's grace): steps of 0.2 s logged every 50 (10 s a
    window, which a stop would otherwise wait for): the ranks agree between log steps, and the
    SIGTERM ends in a committed checkpoint within the 2 s, said in the stop's line."""
    overrides = [*FAST, "model._target_=tests.faults.SlowMLP", "trainer.log_every_n_steps=50",
                 "trainer.max_steps=200", "trainer.stop_within=2"]  # fmt: skip
    env = {"DPT_TEST_SLOW_RANK": "0", "DPT_TEST_SLOW_S": "0.2", "OMP_NUM_THREADS": "1"}

    def preempt(proc: Any, line: str) -> None:
        time.sleep(1.0)  # a few steps in
        os.killpg(proc.pid, signal.SIGTERM)

    stopped = run_until(tmp_path / "run", overrides, "[rank 0] pid", preempt, env=env)
    message = stopped.stderr.strip().splitlines()[-1]
    found = re.search(r"after step (\d+); checkpoint written to \S+ (\d+\.\d) s after the "
                      r"signal \(trainer\.stop_within=2\)\. Resume", message)  # fmt: skip
    assert found, message
    step, took = int(found[1]), float(found[2])
    assert took <= 2.0 and 1 <= step < 50, message  # before the first log step
    assert (tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "COMMITTED").exists()


@pytest.mark.timeout(300)
def test_truncated_or_corrupt_checkpoint_is_refused_and_auto_falls_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    common = [*FAST, "trainer.log_every_n_steps=5", "checkpoint.every_n_steps=5"]
    run_here(run, *common, "trainer.max_steps=15")
    ckpts = run / "checkpoints"
    newest = ckpts / "step-00000015"
    data = (newest / "__0_0.distcp").read_bytes()
    (newest / "__0_0.distcp").write_bytes(data[: len(data) // 2])  # its data cut off
    (ckpts / "step-00000010" / ".metadata").write_bytes(os.urandom(4096))  # corrupt

    explicit = refused_in_process(
        tmp_path / "other", *common, f"checkpoint.resume={newest}", "trainer.max_steps=20"
    )  # its exit status and last line, as its process ends
    assert explicit.returncode == 1
    assert explicit.stderr.strip().startswith(
        f"Error: checkpoint {newest} is unreadable (cut off or corrupt):"
    )

    _, auto = run_here(run, *common, "trainer.max_steps=20")
    assert f"checkpoint {newest} is unreadable (cut off or corrupt)" in auto
    assert f"resumed from {ckpts / 'step-00000005'} at step 5" in auto


@pytest.mark.timeout(120)
def test_resume_path_that_does_not_exist(tmp_path: Path) -> None:
    result = refused_in_process(tmp_path / "run", *FAST, "checkpoint.resume=/nonexistent/step-1")
    assert result.returncode == 1
    assert result.stderr.strip() == "Error: checkpoint.resume=/nonexistent/step-1: folder not found"


@pytest.mark.timeout(120)
def test_checkpoints_keep_only_the_newest(tmp_path: Path) -> None:
    run_here(tmp_path, *FAST, "checkpoint.every_n_steps=2", "checkpoint.keep=2",
             "trainer.max_steps=9")  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000008", "step-00000009"]  # 9: the end of a cut-short epoch
    state = read_checkpoint(tmp_path / "checkpoints" / names[-1])
    assert {
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "progress",
        "data_position",
        "validation",
        "early_stopping",
        "rng",
        "config",
    } <= state.keys()
    assert state["progress"]["step"] == 9
    # Samples of the epoch's global order, not per-rank steps: 9 steps of the default batch 64.
    assert state["data_position"] == {"epoch": 0, "sample": 9 * 64, "global_batch": 64}
    assert "strategy:" in state["config"]["yaml"]
    assert state["rng"].keys() == {"rank0"}  # each rank its own generators


@pytest.mark.timeout(300)
def test_sigterm_to_a_ddp_launcher_checkpoints_and_says_how_to_resume(
    runs: dict[str, Any],
) -> None:
    stopped: Result = runs["sigtermed"]
    run = runs["sigtermed-resumed"].run_dir
    assert stopped.returncode == 1
    saved = runs["sigtermed-saved"]
    assert saved, stopped.output
    newest = saved[-1]
    assert stopped.stderr.strip() == (
        f"Error: stopped by SIGTERM; newest checkpoint {newest}. Resume: the same command with "
        f"hydra.run.dir={run} (checkpoint.resume=auto picks the newest checkpoint)"
    )
    assert "failed" not in stopped.stdout
    assert f"resumed from {newest}" in runs["sigtermed-resumed"].stdout  # the same command


@pytest.mark.timeout(300)
def test_a_checkpoint_cut_off_before_its_commit_is_ignored(tmp_path: Path) -> None:
    common = [*FAST, "checkpoint.every_n_steps=5"]
    run_here(tmp_path, *common, "trainer.max_steps=15")
    cut = tmp_path / "checkpoints" / "step-00000015"
    (cut / "COMMITTED").unlink()  # killed between the rename and the marker
    _, resumed = run_here(tmp_path, *common, "trainer.max_steps=20")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000010'} at step 10" in resumed
    # Newer than the start: moved aside with its branch, kept, not deleted; step 15 is written
    # again on this run's line.
    assert "moved 1 newer checkpoint(s) (step-00000015) aside to" in resumed
    assert (cut / "COMMITTED").exists()
    assert len(list((tmp_path / "checkpoints").glob("abandoned-*/step-00000015"))) == 1


@pytest.mark.timeout(300)
def test_a_stray_high_numbered_file_does_not_make_saves_delete_themselves(tmp_path: Path) -> None:
    stray = tmp_path / "checkpoints" / "step-99999999.pt"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(os.urandom(512))  # unreadable, and "newer" than anything by its name
    _, result = run_here(tmp_path, *FAST, "checkpoint.every_n_steps=2", "checkpoint.keep=2",
                         "trainer.max_steps=9")  # fmt: skip
    assert [p.name for p in committed_checkpoints(tmp_path)] == ["step-00000008", "step-00000009"]
    assert stray.exists()
    assert result.count(f"{stray}: not a committed checkpoint; ignored, never deleted") == 1


@pytest.mark.timeout(400)
def test_ddp_rollback_to_an_older_checkpoint_then_auto_continues_the_new_branch(
    runs: dict[str, Any],
) -> None:
    rolled: WorldRun = runs["rollback-to-5"]
    ckpts = rolled.run_dir / "checkpoints"
    aside = list(ckpts.glob("abandoned-*"))
    assert len(aside) == 1
    assert sorted(p.name for p in aside[0].iterdir()) == ["step-00000010", "step-00000015"]
    # Every rank wrote its own part; each rank's generators under its own key (step 15 of the
    # first run, moved aside as it was).
    assert len(list((aside[0] / "step-00000015").glob("*.distcp"))) == 2
    assert read_checkpoint(aside[0] / "step-00000015")["rng"].keys() == {"rank0", "rank1"}
    assert (
        f"moved 2 newer checkpoint(s) (step-00000010, step-00000015) aside to {aside[0]}: this "
        "run continues from step 5, and checkpoint.resume=auto follows it"
    ) in rolled.stdout
    auto = runs["rollback-auto"].stdout
    assert f"resumed from {ckpts / 'step-00000010'} at step 10" in auto
    assert [p.name for p in committed_checkpoints(rolled.run_dir)] == [
        "step-00000005",
        "step-00000010",
        "step-00000012",
    ]


@pytest.mark.timeout(600)
def test_ddp_2x32_resumed_on_4x16_or_1x64_ends_with_the_uninterrupted_weights(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    # 2048 samples / global batch 64 = 32 steps per epoch: 25 is mid-epoch, 40 in the next one.
    # 4 ranks through the launcher (train.py), one process in this one.
    world_4 = ["strategy=ddp", "launcher.nproc_per_node=4", "trainer.batch_size=16"]
    world_1 = ["strategy=single", "trainer.batch_size=64"]
    for name, other in (("four", world_4), ("one", world_1)):
        run = tmp_path / name
        shutil.copytree(runs["stopped"].run_dir, run)  # one stopped run, resumed twice
        overrides = [*FAST, *CKPT, *other, "trainer.max_steps=40"]
        if name == "four":
            resumed = train(run, *overrides, timeout=240).stdout
        else:
            resumed = run_here(run, *overrides)[1]
        assert "at step 25" in resumed and "resuming at sample" not in resumed
        world = 4 if name == "four" else 1
        assert (
            f"the checkpoint holds random generators for 2 rank(s), this run has {world}: every "
            "rank's are re-derived from (trainer.seed, rank, step 25)"
        ) in resumed
        # The same global batch: the same samples at every step; only the sums' order differs.
        weights = load_weights(run)
        assert max_abs_diff(load_weights(runs["full"].run_dir), weights) < 1e-5


@pytest.mark.timeout(300)
def test_another_global_batch_continues_from_the_same_sample_and_says_so(tmp_path: Path) -> None:
    common = [*FAST, "checkpoint.every_n_steps=5", "trainer.epochs=2", "scheduler=warmup_cosine",
              "scheduler.warmup_steps=5", "scheduler.min_lr=1e-5"]  # fmt: skip
    run_here(tmp_path, *common, "trainer.max_steps=25")  # global batch 64: 32 steps per epoch
    _, resumed = run_here(tmp_path, *common, "trainer.batch_size=96")  # to the end of epoch 2
    left = (2048 - 25 * 64) // 96
    assert (
        f"resuming at sample {25 * 64} of epoch 1 with global batch 96 (was 64): the epoch "
        f"continues from the same sample, {left} full step(s) left in it"
    ) in resumed
    assert f"epoch 1 done | step {25 + left} |" in resumed
    # The second epoch in whole steps of 96; the run's total counts them, not steps of 64.
    last = 25 + left + 2048 // 96
    assert f"epoch 2 | step {last}/{last} |" in resumed
    # The cosine ends at the new last step: the learning rate logged after every step since the
    # resume is the schedule's for a run of `last` steps (lr 1e-3, min_lr 1e-5), not of the
    # 42 steps a fresh run at batch 96 would have.
    steps = range(30, last + 1, 5)
    floor = 1e-5 / 1e-3
    expected = [1e-3 * WarmupCosine(5, last, floor)(step) for step in steps]
    acc = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    acc.Reload()
    logged = {e.step: e.value for e in acc.Scalars("optim/lr")}
    assert [logged[step] for step in steps] == pytest.approx(expected, rel=1e-5)
    state = read_checkpoint(committed_checkpoints(tmp_path)[-1])
    assert state["progress"]["step"] == last
    assert state["data_position"] == {"epoch": 2, "sample": 0, "global_batch": 96}
