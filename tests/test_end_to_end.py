"""single, dp and ddp end to end: what their runs write, and `python train.py` as a user runs
it."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.models.mlp import MLP
from tests.helpers import (
    FAST,
    REPO,
    TRAIN,
    committed_checkpoints,
    load_weights,
    max_abs_diff,
    run_cmd,
    run_here,
    run_world,
    train,
    world_run,
)

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

# The shared runs, compared with each other and read for their results, train as the ranks of
# a spawned world (one start-up for both) and in this process (`run_here`: what `train.py
# strategy=single` runs), as do the one-process runs that only compare weights and curves. What
# a user sees of the processes themselves (console lines, progress bar, torchrun, the default
# folder) starts train.py.

STEPS = 20
RANK_TAGS = {"train/loss", "train/samples_per_s", "time/step_s", "time/data_s", "optim/lr"}
WORLD_TAGS = {"train/loss", "train/samples_per_s"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ddp on 2 ranks with batch 32 and single with batch 64, 20 steps each, SGD and Adam."""
    root = tmp_path_factory.mktemp("e2e")
    common = {opt: [*FAST, f"optimizer={opt}", f"trainer.max_steps={STEPS}", "trainer.seed=3"]
              for opt in ("sgd", "adam")}  # fmt: skip
    ddp = ["strategy=ddp", "trainer.batch_size=32"]
    run_world(2, [world_run(f"ddp-{opt}", root / f"ddp-{opt}", *overrides, *ddp)
                  for opt, overrides in common.items()])  # fmt: skip
    for opt, overrides in common.items():
        run_here(root / f"single-{opt}", *overrides, "trainer.batch_size=64")
    return {f"{kind}-{opt}": root / f"{kind}-{opt}" for kind in ("single", "ddp") for opt in common}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_ddp_two_ranks_equals_single_with_the_global_batch(runs: dict[str, Path], opt: str) -> None:
    single, ddp = load_weights(runs[f"single-{opt}"]), load_weights(runs[f"ddp-{opt}"])
    assert max_abs_diff(single, ddp) < 1e-5
    # ... and training moved the weights: the comparison is not between two initialisations.
    torch.manual_seed(3)
    init = MLP((32,), 10, [256, 256]).state_dict()
    assert max_abs_diff(init, ddp) > 1e-3
    assert json.loads((runs[f"ddp-{opt}"] / "metrics.json").read_text())["steps"] == STEPS


@pytest.mark.timeout(300)
def test_metrics_json_and_model_written_by_rank_0(runs: dict[str, Path]) -> None:
    metrics = json.loads((runs["ddp-adam"] / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["global_batch_size"] == 64
    assert metrics["steps"] == STEPS
    assert metrics["samples"] == STEPS * 64
    assert metrics["samples_per_s"] > 0 and metrics["wall_time_s"] > 0
    assert math.isfinite(metrics["final_loss"])
    assert set(metrics["val"]) == {"val/loss", "val/acc1", "val/acc5", "val/samples"}
    assert metrics["val"]["val/samples"] == 256  # every validation sample, exactly once
    state = torch.load(runs["ddp-adam"] / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state)  # the unwrapped model


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.timeout(300)
def test_tensorboard_has_every_rank_and_the_world(runs: dict[str, Path]) -> None:
    tb = runs["ddp-adam"] / "tb"
    assert sorted(p.name for p in tb.iterdir()) == ["rank0", "rank1", "world"]
    expected_steps = list(range(5, STEPS + 1, 5))  # log_every_n_steps=5
    for rank in ("rank0", "rank1"):
        scalars = _scalars(tb / rank)
        assert scalars.keys() >= RANK_TAGS
        for tag in RANK_TAGS:
            assert [step for step, _ in scalars[tag]] == expected_steps, (rank, tag)
    world = _scalars(tb / "world")
    assert world.keys() >= WORLD_TAGS
    for tag in WORLD_TAGS:
        assert [step for step, _ in world[tag]] == expected_steps
    # The world loss is the mean of the two ranks' losses at each point.
    r0, r1 = _scalars(tb / "rank0")["train/loss"], _scalars(tb / "rank1")["train/loss"]
    for (_, w), (_, a), (_, b) in zip(world["train/loss"], r0, r1, strict=True):
        assert w == pytest.approx((a + b) / 2, rel=1e-5)
    assert {"val/loss", "val/acc1"} <= world.keys()


@pytest.mark.timeout(300)
def test_hparams_written_for_the_run(runs: dict[str, Path]) -> None:
    acc = EventAccumulator(str(runs["ddp-adam"] / "tb" / "world"))
    acc.Reload()
    plugins = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in plugins
    # One run is its own experiment; its metrics are the world's own curves, not hparam/* points.
    assert {"_hparams_/experiment", "_hparams_/session_end_info"} <= plugins.keys()
    assert not any(tag.startswith("hparam/") for tag in acc.Tags()["scalars"])


@pytest.mark.timeout(300)
def test_loss_falls_on_the_synthetic_task(tmp_path: Path) -> None:
    run_here(tmp_path, *FAST, "trainer.epochs=3")
    losses = [v for _, v in _scalars(tmp_path / "tb" / "world")["train/loss"]]
    assert len(losses) == 3 * 2048 // 64 // 5 + 3  # every 5 steps, plus each epoch's last step
    assert losses[-1] < 0.5 * losses[0]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["val"]["val/acc1"] > 0.7  # 10 classes: chance is 0.1


@pytest.mark.timeout(300)
def test_console_lines_are_rank_prefixed(tmp_path: Path) -> None:
    result = train(
        tmp_path / "run", *FAST, "trainer.max_steps=10", "strategy=ddp", "trainer.batch_size=32"
    )
    assert re.search(
        r"^\[rank 0\] epoch 1 \| step 10/10 \| loss \d+\.\d{4} \| [\d,]+ samples/s$",
        result.stdout,
        re.M,
    )
    assert re.search(r"^\[rank 1\] epoch 1 \| step 5/10 \|", result.stdout, re.M)
    assert "global batch 64" in result.stdout
    assert re.search(  # the loop's pace after its first window, then the whole run's
        r"^\[rank 0\] done: 10 steps in [\d.]+ s \| loop [\d,]+ samples/s \(world, after the "
        r"first logging window\) \| whole run [\d,]+ samples/s \(world, ",
        result.stdout,
        re.M,
    )
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["rank0.log", "rank1.log"]
    assert "[rank 1]" in (tmp_path / "run" / "logs" / "rank1.log").read_text()


# The shared single run's arguments (`runs["single-sgd"]`): sgd is the default optimizer.
SINGLE_SGD = [*FAST, "optimizer=sgd", f"trainer.max_steps={STEPS}", "trainer.batch_size=64"]


@pytest.mark.timeout(300)
def test_same_seed_same_weights_different_seed_different(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    for name, seed in (("again", 3), ("other", 4)):  # the shared run's seed is 3
        run_here(tmp_path / name, *SINGLE_SGD, f"trainer.seed={seed}")
    first, again, other = (load_weights(p) for p in (runs["single-sgd"], tmp_path / "again",
                                                     tmp_path / "other"))  # fmt: skip
    assert max_abs_diff(first, again) == 0.0
    assert max_abs_diff(first, other) > 1e-3


@pytest.mark.timeout(300)
def test_dp_without_two_gpus_runs_as_single_and_says_so(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2+ GPUs: dp really splits the batch here")
    _, dp = run_here(tmp_path / "dp", *SINGLE_SGD, "trainer.seed=3", "strategy=dp")
    warnings = [ln for ln in dp.splitlines() if "DataParallel needs 2 or more" in ln]
    assert len(warnings) == 1
    assert max_abs_diff(load_weights(tmp_path / "dp"), load_weights(runs["single-sgd"])) == 0.0


@pytest.mark.timeout(300)
def test_torchrun_makes_exactly_one_run_folder(tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"
    torchrun = Path(sys.executable).with_name("torchrun")
    run_cmd(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node=2",
            str(TRAIN),
            "strategy=fsdp",  # ddp under torchrun: tests/test_packaging.py, test_multinode.py
            "launcher=torchrun",
            *FAST,
            "trainer.max_steps=10",
            f"hydra.run.dir={outputs}/${{now:%H-%M-%S-%f}}",
        ],
        timeout=180,
    )
    folders = list(outputs.iterdir())
    assert len(folders) == 1, folders
    run = folders[0]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert sorted(p.name for p in (run / "tb").iterdir()) == ["rank0", "rank1", "world"]
    assert json.loads((run / "metrics.json").read_text())["world_size"] == 2
    assert (run / ".hydra" / "config.yaml").exists()
    assert "strategy=fsdp" in (run / ".hydra" / "overrides.yaml").read_text()
    # Each rank wrote its own shard of the model into the checkpoint.
    last = committed_checkpoints(run)[-1]
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.timeout(120)
def test_default_run_folder_under_outputs(tmp_path: Path) -> None:
    """No override of hydra.run.dir: the folder lands in ./outputs/<date>/<time> of the cwd."""
    shutil.copy(TRAIN, tmp_path / "train.py")
    run_cmd(
        [sys.executable, str(tmp_path / "train.py"), *FAST, "trainer.max_steps=5"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO)},
    )
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1 and (runs[0] / "model.pt").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(300)
def test_ddp_on_two_gpus_uses_nccl(tmp_path: Path) -> None:
    result = train(tmp_path / "run", *FAST, "trainer.max_steps=10", "strategy=ddp")
    assert "backend nccl" in result.stdout


@pytest.mark.timeout(120)
def test_progress_bar_on_a_terminal_plain_lines_otherwise(tmp_path: Path) -> None:
    """A bar redraws with carriage returns; in a log file that would be a flood of them."""
    import fcntl
    import pty
    import struct
    import subprocess
    import termios

    leader, follower = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, and tqdm fits its bar into that: give it 100.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    cmd = [
        sys.executable,
        str(TRAIN),
        *FAST,
        "trainer.max_steps=20",
        f"hydra.run.dir={tmp_path}/tty",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    screen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the run ended
            break
        if not chunk:
            break
        screen += chunk
    assert proc.wait(timeout=100) == 0
    os.close(leader)
    text = screen.decode(errors="replace")
    assert "20/20 [" in text and "step/s" in text  # tqdm's bar on rank 0...
    # ...and none where stdout is no terminal (a pipe, a file: here a buffer of this process).
    _, piped = run_here(tmp_path / "pipe", *FAST, "trainer.max_steps=20")
    assert "step/s" not in piped and "\r" not in piped
    assert "[rank 0] epoch 1 | step 20/20 |" in piped
