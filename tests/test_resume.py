"""Checkpoints and exact resume: a stopped, resumed run ends with the uninterrupted weights."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.loop.schedulers import WarmupCosine
from tests.helpers import (
    FAST,
    Result,
    committed_checkpoints,
    load_weights,
    max_abs_diff,
    read_checkpoint,
    run_until,
    train,
)

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

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


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ddp_runs")
    train(root / "full", *REFERENCE, "trainer.max_steps=40")
    train(root / "stopped", *REFERENCE, "trainer.max_steps=25")
    assert (root / "stopped" / "checkpoints" / "step-00000025" / "COMMITTED").exists()
    return {"full": root / "full", "stopped": root / "stopped"}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("workers", [0, 2])
def test_ddp_stopped_by_max_steps_resumes_to_the_same_weights(
    ddp_runs: dict[str, Path], tmp_path: Path, workers: int
) -> None:
    """Stopped without loader workers, resumed without or with 2 per rank: the same samples."""
    cut = tmp_path / "cut"
    shutil.copytree(ddp_runs["stopped"], cut)
    resumed = train(cut, *REFERENCE, f"dataset.num_workers={workers}", "trainer.max_steps=40")
    assert "resumed from" in resumed.stdout and "at step 25" in resumed.stdout
    _assert_same_weights(ddp_runs["full"], cut)
    # The curves continue at the right step, without duplicates.
    for folder in ("rank0", "rank1", "world"):
        assert _tb_steps(cut / "tb" / folder) == _tb_steps(ddp_runs["full"] / "tb" / folder)


def _run_until(run_dir: Path, overrides: list[str], marker: str, sig: int) -> Result:
    """Start a run, wait for `marker` on stdout, then send `sig` to its whole process group."""
    return run_until(run_dir, overrides, marker, lambda proc, _: os.killpg(proc.pid, sig))


@pytest.mark.timeout(400)
def test_ddp_killed_mid_training_resumes_to_the_same_weights(tmp_path: Path) -> None:
    common = [*FAST, *DDP, *CKPT, *WIDE, "dataset.num_workers=2", "trainer.max_steps=40"]
    train(tmp_path / "full", *common)
    killed = _run_until(tmp_path / "cut", common, "[rank 0] epoch 1 | step 10/40", signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "cut" / "model.pt").exists()  # it really died before the end
    left = [p.name for p in committed_checkpoints(tmp_path / "cut")]
    assert left and left[-1] < "step-00000040"
    resumed = train(tmp_path / "cut", *common)
    assert "resumed from" in resumed.stdout
    _assert_same_weights(tmp_path / "full", tmp_path / "cut")
    steps = _tb_steps(tmp_path / "cut" / "tb" / "rank0")
    assert steps == sorted(set(steps)) == _tb_steps(tmp_path / "full" / "tb" / "rank0")


@pytest.mark.timeout(300)
def test_sigterm_finishes_the_step_writes_a_checkpoint_and_resumes(tmp_path: Path) -> None:
    common = [*FAST, *WIDE, "trainer.log_every_n_steps=5", "trainer.max_steps=60"]
    train(tmp_path / "full", *common)
    stopped = _run_until(tmp_path / "cut", common, "step 10/60", signal.SIGTERM)
    assert stopped.returncode == 1
    message = stopped.stderr.strip().splitlines()[-1]
    assert message.startswith("Error: stopped by SIGTERM after step ")
    assert f"Resume: the same command with hydra.run.dir={tmp_path / 'cut'}" in message
    step = int(message.split("after step ")[1].split(";")[0])
    assert 10 <= step < 60
    assert step % 5 == 0 or step == 32  # ranks agree at log steps and at the epoch's last step
    assert (tmp_path / "cut" / "checkpoints" / f"step-{step:08d}" / "COMMITTED").exists()
    train(tmp_path / "cut", *common)
    _assert_same_weights(tmp_path / "full", tmp_path / "cut")


@pytest.mark.timeout(300)
def test_truncated_or_corrupt_checkpoint_is_refused_and_auto_falls_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    common = [*FAST, "trainer.log_every_n_steps=5", "checkpoint.every_n_steps=5"]
    train(run, *common, "trainer.max_steps=15")
    ckpts = run / "checkpoints"
    newest = ckpts / "step-00000015"
    data = (newest / "__0_0.distcp").read_bytes()
    (newest / "__0_0.distcp").write_bytes(data[: len(data) // 2])  # its data cut off
    (ckpts / "step-00000010" / ".metadata").write_bytes(os.urandom(4096))  # corrupt

    explicit = train(
        tmp_path / "other",
        *common,
        f"checkpoint.resume={newest}",
        "trainer.max_steps=20",
        check=False,
    )
    assert explicit.returncode == 1
    assert explicit.stderr.strip().startswith(
        f"Error: checkpoint {newest} is unreadable (cut off or corrupt):"
    )

    auto = train(run, *common, "trainer.max_steps=20")
    assert f"checkpoint {newest} is unreadable (cut off or corrupt)" in auto.stdout
    assert f"resumed from {ckpts / 'step-00000005'} at step 5" in auto.stdout


@pytest.mark.timeout(120)
def test_resume_path_that_does_not_exist(tmp_path: Path) -> None:
    result = train(tmp_path / "run", *FAST, "checkpoint.resume=/nonexistent/step-1", check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == "Error: checkpoint.resume=/nonexistent/step-1: folder not found"


@pytest.mark.timeout(120)
def test_checkpoints_keep_only_the_newest(tmp_path: Path) -> None:
    train(tmp_path, *FAST, "checkpoint.every_n_steps=2", "checkpoint.keep=2", "trainer.max_steps=9")
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
def test_sigterm_to_a_ddp_launcher_checkpoints_and_says_how_to_resume(tmp_path: Path) -> None:
    common = [*FAST, *DDP, *WIDE, "trainer.log_every_n_steps=5", "trainer.max_steps=60"]
    run = tmp_path / "run"
    stopped = run_until(
        run,
        common,
        "[rank 0] epoch 1 | step 10/",
        lambda proc, _: os.kill(proc.pid, signal.SIGTERM),
    )  # the launcher only
    assert stopped.returncode == 1
    saved = committed_checkpoints(run)
    assert saved, stopped.output
    newest = saved[-1]
    assert stopped.stderr.strip() == (
        f"Error: stopped by SIGTERM; newest checkpoint {newest}. Resume: the same command with "
        f"hydra.run.dir={run} (checkpoint.resume=auto picks the newest checkpoint)"
    )
    assert "failed" not in stopped.stdout
    resumed = train(run, *common)
    assert f"resumed from {newest}" in resumed.stdout


@pytest.mark.timeout(300)
def test_a_checkpoint_cut_off_before_its_commit_is_ignored(tmp_path: Path) -> None:
    common = [*FAST, "checkpoint.every_n_steps=5"]
    train(tmp_path, *common, "trainer.max_steps=15")
    cut = tmp_path / "checkpoints" / "step-00000015"
    (cut / "COMMITTED").unlink()  # killed between the rename and the marker
    resumed = train(tmp_path, *common, "trainer.max_steps=20")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000010'} at step 10" in resumed.stdout
    # Newer than the start: moved aside with its branch, kept, not deleted; step 15 is written
    # again on this run's line.
    assert "moved 1 newer checkpoint(s) (step-00000015) aside to" in resumed.stdout
    assert (cut / "COMMITTED").exists()
    assert len(list((tmp_path / "checkpoints").glob("abandoned-*/step-00000015"))) == 1


@pytest.mark.timeout(300)
def test_a_stray_high_numbered_file_does_not_make_saves_delete_themselves(tmp_path: Path) -> None:
    stray = tmp_path / "checkpoints" / "step-99999999.pt"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(os.urandom(512))  # unreadable, and "newer" than anything by its name
    result = train(tmp_path, *FAST, "checkpoint.every_n_steps=2", "checkpoint.keep=2",
                   "trainer.max_steps=9")  # fmt: skip
    assert [p.name for p in committed_checkpoints(tmp_path)] == ["step-00000008", "step-00000009"]
    assert stray.exists()
    assert result.stdout.count(f"{stray}: not a committed checkpoint; ignored, never deleted") == 1


@pytest.mark.timeout(400)
def test_ddp_rollback_to_an_older_checkpoint_then_auto_continues_the_new_branch(
    tmp_path: Path,
) -> None:
    common = [*FAST, *DDP, *CKPT]
    ckpts = tmp_path / "checkpoints"
    train(tmp_path, *common, "trainer.max_steps=15")
    # Every rank wrote its own part; each rank's generators under its own key.
    assert len(list((ckpts / "step-00000015").glob("*.distcp"))) == 2
    assert read_checkpoint(ckpts / "step-00000015")["rng"].keys() == {"rank0", "rank1"}
    rolled = train(tmp_path, *common, f"checkpoint.resume={ckpts / 'step-00000005'}",
                   "trainer.max_steps=10")  # fmt: skip
    aside = list(ckpts.glob("abandoned-*"))
    assert len(aside) == 1
    assert sorted(p.name for p in aside[0].iterdir()) == ["step-00000010", "step-00000015"]
    assert (
        f"moved 2 newer checkpoint(s) (step-00000010, step-00000015) aside to {aside[0]}: this "
        "run continues from step 5, and checkpoint.resume=auto follows it"
    ) in rolled.stdout
    auto = train(tmp_path, *common, "trainer.max_steps=12")
    assert f"resumed from {ckpts / 'step-00000010'} at step 10" in auto.stdout
    assert [p.name for p in committed_checkpoints(tmp_path)] == [
        "step-00000005",
        "step-00000010",
        "step-00000012",
    ]


@pytest.mark.timeout(600)
def test_ddp_2x32_resumed_on_4x16_or_1x64_ends_with_the_uninterrupted_weights(
    ddp_runs: dict[str, Path], tmp_path: Path
) -> None:
    # 2048 samples / global batch 64 = 32 steps per epoch: 25 is mid-epoch, 40 in the next one.
    world_4 = ["strategy=ddp", "launcher.nproc_per_node=4", "trainer.batch_size=16"]
    world_1 = ["strategy=single", "trainer.batch_size=64"]
    for name, other in (("four", world_4), ("one", world_1)):
        shutil.copytree(ddp_runs["stopped"], tmp_path / name)  # one stopped run, resumed twice
        resumed = train(tmp_path / name, *FAST, *CKPT, *other, "trainer.max_steps=40",
                        timeout=240)  # fmt: skip
        assert "at step 25" in resumed.stdout and "resuming at sample" not in resumed.stdout
        world = 4 if name == "four" else 1
        assert (
            f"the checkpoint holds random generators for 2 rank(s), this run has {world}: every "
            "rank's are re-derived from (trainer.seed, rank, step 25)"
        ) in resumed.stdout
        # The same global batch: the same samples at every step; only the sums' order differs.
        weights = load_weights(tmp_path / name)
        assert max_abs_diff(load_weights(ddp_runs["full"]), weights) < 1e-5


@pytest.mark.timeout(300)
def test_another_global_batch_continues_from_the_same_sample_and_says_so(tmp_path: Path) -> None:
    common = [*FAST, "checkpoint.every_n_steps=5", "trainer.epochs=2", "scheduler=warmup_cosine",
              "scheduler.warmup_steps=5", "scheduler.min_lr=1e-5"]  # fmt: skip
    train(tmp_path, *common, "trainer.max_steps=25")  # global batch 64: 32 steps per epoch
    resumed = train(tmp_path, *common, "trainer.batch_size=96")  # to the end of epoch 2
    left = (2048 - 25 * 64) // 96
    assert (
        f"resuming at sample {25 * 64} of epoch 1 with global batch 96 (was 64): the epoch "
        f"continues from the same sample, {left} full step(s) left in it"
    ) in resumed.stdout
    assert f"epoch 1 done | step {25 + left} |" in resumed.stdout
    # The second epoch in whole steps of 96; the run's total counts them, not steps of 64.
    last = 25 + left + 2048 // 96
    assert f"epoch 2 | step {last}/{last} |" in resumed.stdout
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
