"""Faults injected for real: a rank that raises, a killed worker, a lost node, a full disk."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import (
    BIN,
    FAST,
    REPO,
    TORCHRUN,
    TRAIN,
    Process,
    Result,
    cmd_until,
    committed_checkpoints,
    file_tree,
    is_running,
    junk_files,
    load_weights,
    rank_pid,
    read_checkpoint,
    run_until,
    run_world,
    session_members,
    train,
    world_run,
)

pytestmark = pytest.mark.slow  # every test here starts train.py or ranks

# The faults are injected into real processes (train.py, torchrun). The 2-rank runs that are only
# compared with them or resumed after them, with nothing to say about processes, train in one
# spawned world (one start-up: `world` below).

DDP = [
    "strategy=ddp",
    "launcher.nproc_per_node=2",
    "trainer.batch_size=32",
    "trainer.timeout_s=20",
    "trainer.log_every_n_steps=5",
]
RAISING = ["model._target_=tests.faults.RaisingMLP"]


@pytest.mark.timeout(120)
def test_a_rank_that_raises_stops_the_world_with_one_line(tmp_path: Path) -> None:
    start = time.monotonic()
    result = train(
        tmp_path,
        *FAST,
        *DDP,
        *RAISING,
        check=False,
        env={"DPT_TEST_FAIL_RANK": "1", "DPT_TEST_FAIL_CALL": "3"},
    )
    assert time.monotonic() - start < 60  # far below any default timeout
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: rank 1 failed: the model's forward (RaisingMLP) raised ValueError: injected "
        f"failure on rank 1 at call 3 (log: {tmp_path}/logs/rank1.log)"
    )
    assert "Traceback" not in result.output  # no wall of tracebacks on the console...
    assert "[rank 0] stopped: another rank failed or stopped answering" in result.stdout
    assert "failed:" not in result.stdout  # the failure once, in the launcher's line
    rank1_log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "Traceback" in rank1_log and "injected failure" in rank1_log  # ...it is in the log
    assert "[rank 1] failed: the model's forward (RaisingMLP) raised" in rank1_log


@pytest.mark.timeout(120)
def test_a_rank_that_raises_in_a_single_process_run(tmp_path: Path) -> None:
    result = train(
        tmp_path,
        *FAST,
        *RAISING,
        check=False,
        env={"DPT_TEST_FAIL_RANK": "0", "DPT_TEST_FAIL_CALL": "2"},
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: rank 0 failed: the model's forward (RaisingMLP) raised ValueError: injected "
        f"failure on rank 0 at call 2 (log: {tmp_path}/logs/rank0.log)"
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", [[], DDP], ids=["single", "ddp"])
def test_a_model_that_does_not_fit_the_data_is_one_line_and_the_ranks_log(
    tmp_path: Path, strategy: list[str]
) -> None:
    """The same line under every strategy: which rank, what failed (the model's forward, named
    by its class), the error, and the log that holds the traceback."""
    result = train(tmp_path, *FAST, *strategy, "model._target_=tests.faults.MismatchedMLP",
                   check=False)  # fmt: skip
    assert result.returncode == 1
    line = result.stderr.strip()
    found = re.fullmatch(
        r"Error: rank (\d) failed: the model's forward \(MismatchedMLP\) raised RuntimeError: "
        rf"mat1 and mat2 shapes cannot be multiplied \((32|64)x32 and 7x256\) "
        rf"\(log: {re.escape(str(tmp_path))}/logs/rank(\d)\.log\)",
        line,
    )
    assert found and found.group(1) == found.group(3), line
    assert "Traceback" not in result.output and "Error executing job" not in result.output
    log = (tmp_path / "logs" / f"rank{found.group(1)}.log").read_text()
    assert "Traceback" in log and "in forward" in log and "mat1 and mat2" in log


@pytest.mark.timeout(180)
def test_a_worker_killed_with_sigkill_stops_the_world(tmp_path: Path) -> None:
    result = _sigkill_rank_1_at_step_10(
        tmp_path, [*FAST, *DDP, "trainer.max_steps=200", "model.hidden_dims=[512,512]"]
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"Error: rank 1 failed: killed by SIGKILL (log: {tmp_path}/logs/rank1.log)"
    )
    assert "[rank 0] stopped: another rank failed or stopped answering" in result.stdout


def _sigkill_rank_1_at_step_10(run_dir: Path, overrides: list[str]) -> Result:
    """Run until rank 0 logs step 10, then SIGKILL rank 1 (its pid from its start line)."""

    def kill_rank_1(proc: Process, line: str) -> None:
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)

    return run_until(run_dir, overrides, "[rank 0] epoch 1 | step 10/", kill_rank_1)


RESTARTED = [*FAST, *DDP, "trainer.max_steps=40", "checkpoint.every_n_steps=5",
             "model.hidden_dims=[512,512]"]  # fmt: skip
# The launcher killed mid-run, the folder then resumed by the same command (to step 30).
LAUNCHER_KILLED = [*FAST, *DDP, "trainer.max_steps=400", "checkpoint.every_n_steps=5",
                   "model.hidden_dims=[512,512]"]  # fmt: skip


@pytest.mark.timeout(600)  # the first test of the world builds it
def test_max_restarts_restarts_the_world_and_continues_from_the_checkpoint(
    tmp_path: Path, world: dict[str, Any]
) -> None:
    result = _sigkill_rank_1_at_step_10(tmp_path / "cut", [*RESTARTED, "launcher.max_restarts=1"])
    assert result.returncode == 0, result.output
    assert "resumed from" in result.stdout
    full, cut = load_weights(world["restarts-full"].run_dir), load_weights(tmp_path / "cut")
    assert all(torch.equal(full[k], cut[k]) for k in full)


@pytest.mark.timeout(300)
def test_torchrun_restarts_continue_one_run_folder_from_its_checkpoint(
    tmp_path: Path, world: dict[str, Any]
) -> None:
    """torchrun's own restarts (`--max-restarts`): rank 1 killed after a checkpoint, the restart
    runs in the same (default, dated) run folder, resumes, and ends as the uninterrupted run."""
    overrides = [o for o in RESTARTED if not o.startswith("launcher.")]
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=2", str(TRAIN),
           "launcher=torchrun", *overrides]  # fmt: skip

    def kill_rank_1(proc: Process, line: str) -> None:
        (run_dir,) = (tmp_path / "outputs").glob("*/*")
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)

    result = cmd_until(cmd, "[rank 0] epoch 1 | step 10/", kill_rank_1, cwd=tmp_path)
    assert result.returncode == 0, result.output
    (run_dir,) = (tmp_path / "outputs").glob("*/*")  # one run folder, every attempt's
    assert re.search(
        rf"\[rank 0\] torchrun restart 1 of 2: resumed from {re.escape(str(run_dir))}"
        r"/checkpoints/step-0*(\d+) at step \1\n",  # 10, or a later one the kill came after
        result.stdout,
    ), result.stdout
    full, cut = load_weights(world["restarts-full"].run_dir), load_weights(run_dir)
    assert all(torch.equal(full[k], cut[k]) for k in full)


@pytest.mark.timeout(180)
def test_dpt_torchrun_ends_a_job_whose_restarts_are_used_up_in_one_line(tmp_path: Path) -> None:
    """`dpt-torchrun` (torchrun's engine, torchrun's arguments): no restart left, rank 1 killed;
    the line dpt's own launcher prints, not torchrun's report."""
    overrides = [o for o in RESTARTED if not o.startswith("launcher.")]
    cmd = [str(BIN / "dpt-torchrun"), "--standalone", "--nproc_per_node=2", "--max-restarts=0",
           str(TRAIN), "launcher=torchrun", *overrides, f"hydra.run.dir={tmp_path}"]  # fmt: skip

    def kill_rank_1(proc: Process, line: str) -> None:
        os.kill(rank_pid(tmp_path, 1), signal.SIGKILL)

    result = cmd_until(cmd, "[rank 0] epoch 1 | step 10/", kill_rank_1)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"Error: rank 1 failed: killed by SIGKILL (log: {tmp_path}/logs/rank1.log)"
    ), result.output
    assert "[rank 0] stopped: another rank failed or stopped answering" in result.stdout


def _kill_the_launcher(run: Path) -> dict[str, Any]:
    """SIGKILL of the `dpt` process at step 10: its result, and how long its ranks outlived it."""
    gone_after: list[float] = []

    def kill_the_launcher(proc: Process, line: str) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()

        def watch() -> None:  # while run_until drains the pipes the ranks still write to
            while session_members(proc.pid) and time.monotonic() - killed_at < 30:
                time.sleep(0.1)
            gone_after.append(time.monotonic() - killed_at)

        threading.Thread(target=watch, daemon=True).start()

    killed = run_until(run, LAUNCHER_KILLED, "[rank 0] epoch 1 | step 10/", kill_the_launcher)
    deadline = time.monotonic() + 35
    while not gone_after and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"result": killed, "gone_after": gone_after, "newest": committed_checkpoints(run)[-1]}


@pytest.mark.timeout(600)
def test_a_killed_launcher_takes_its_ranks_with_it_and_the_folder_resumes(
    world: dict[str, Any],
) -> None:
    """SIGKILL of the `dpt` process (the OOM killer, a scheduler's hard kill): its fork server
    and ranks end within seconds (parent-death signals), and the run folder is free for the
    same command, which resumes from the newest checkpoint the ranks committed."""
    killed = world["launcher-killed"]
    assert killed["result"].returncode == -signal.SIGKILL
    gone_after = killed["gone_after"]
    assert gone_after and gone_after[0] < 10, gone_after
    resumed = world["launcher-killed-resumed"]
    assert f"resumed from {killed['newest']} at step" in resumed.stdout


@pytest.mark.timeout(180)
def test_a_killed_torchrun_agent_takes_its_ranks_with_it(tmp_path: Path) -> None:
    """torchrun starts its ranks in sessions of their own: only their parent-death signal (set
    by dpt in each rank) ends them when the agent is killed."""
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node=2", str(TRAIN),
           "launcher=torchrun", *FAST, *DDP[:1], *DDP[2:], "trainer.max_steps=400",
           "model.hidden_dims=[512,512]", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    ranks: list[int] = []
    lines: list[str] = []
    try:
        assert agent.stdout is not None
        for line in agent.stdout:
            lines.append(line)
            if "[rank 0] epoch 1 | step 10/" in line:
                ranks += [rank_pid(tmp_path, rank) for rank in (0, 1)]
                os.kill(agent.pid, signal.SIGKILL)
                break
        killed_at = time.monotonic()
        while any(is_running(pid) for pid in ranks) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        assert len(ranks) == 2, "".join(lines)
        assert time.monotonic() - killed_at < 10
        assert not any(is_running(pid) for pid in ranks)
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.communicate()


@pytest.mark.timeout(120)
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs (root needed): {mounted.stderr.strip()}")
    try:
        run = disk / "run"
        result = train(
            run,
            *FAST,
            "checkpoint.every_n_steps=5",
            "trainer.max_steps=30",
            "dataset.num_val_samples=0",
            check=False,
        )
        assert result.returncode == 1
        assert result.stderr.strip() == (
            f"Error: could not write checkpoint {run}/checkpoints/step-00000010: "
            "no space left on device"
        )
        kept = list((run / "checkpoints").iterdir())
        assert [p.name for p in kept] == ["step-00000005"]  # no temporary folder left either
        assert read_checkpoint(kept[0])["progress"]["step"] == 5
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_output_folder_that_cannot_be_written(tmp_path: Path, where: str) -> None:
    (tmp_path / "afile").write_text("")
    folder = tmp_path / "afile" / "run" if where == "file" else Path("/proc/dpt-run")
    reason = "Not a directory" if where == "file" else "No such file or directory"
    result = train(folder, *FAST, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"Error: hydra.run.dir={folder}: the output folder cannot be written ({reason})"
    )


@pytest.mark.timeout(180)
def test_a_stopped_rank_is_named_and_the_run_ends_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 is stopped (SIGSTOP), not dead: rank 0 waits trainer.timeout_s, calls the roll,
    and the final line names rank 1, not rank 0, the rank that waited."""
    timeout_s = 5  # long enough for a step on a busy machine, short enough to wait out
    stopped: dict[str, float] = {}

    def stop_rank_1(proc: Process, line: str) -> None:
        stopped["pid"] = rank_pid(tmp_path, 1)
        os.kill(int(stopped["pid"]), signal.SIGSTOP)
        stopped["at"] = time.monotonic()

    overrides = [*FAST, *DDP, f"trainer.timeout_s={timeout_s}", "trainer.max_steps=5000",
                 "dataset.num_samples=65536"]  # fmt: skip
    result = run_until(tmp_path, overrides, "step 10/", stop_rank_1, timeout=150)
    took = time.monotonic() - stopped["at"]
    assert result.returncode == 1, result.output
    assert timeout_s <= took < timeout_s + 15, took
    assert re.fullmatch(
        rf"Error: rank 1 stopped answering: no reply within trainer\.timeout_s={timeout_s}; "
        rf"pid {stopped['pid']} on \S+ "
        rf"\(noticed by rank 0; log: {re.escape(str(tmp_path))}/logs/rank1\.log\)",
        result.stderr.strip(),
    ), result.stderr
    assert "[rank 0] stopped: another rank failed or stopped answering" in result.stdout


# --- damaged checkpoints --------------------------------------------------------------------


def _cut_off(run: Path) -> None:
    """The run as if killed after its last checkpoint: no results yet."""
    for result in ("metrics.json", "model.pt", "model_best.pt"):
        (run / result).unlink(missing_ok=True)


def _cut_off_copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    _cut_off(copy)
    return copy


def _newest_damaged(run: Path) -> None:
    """Cut off after its last checkpoint, and that checkpoint junk."""
    _cut_off(run)
    junk_files(run / "checkpoints" / "step-00000024")


DAMAGE_RUN = [*FAST, *DDP, "trainer.max_steps=24", "checkpoint.every_n_steps=8"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The launcher killed (train.py, SIGKILL), then in one 2-rank world: its folder resumed by
    the same command; the run the restarted world must end as; 24 steps with checkpoints at
    steps 8, 16 and 24 (`damage`), then a copy of them cut off, its newest checkpoint damaged,
    resumed."""
    root = tmp_path_factory.mktemp("world")
    killed = _kill_the_launcher(root / "launcher-killed")
    runs = [
        world_run("launcher-killed-resumed", root / "launcher-killed", *LAUNCHER_KILLED,
                  "trainer.max_steps=30"),
        world_run("restarts-full", root / "restarts-full", *RESTARTED),
        world_run("damage", root / "damage", *DAMAGE_RUN),
        world_run("newest-damaged", root / "newest-damaged", *DAMAGE_RUN,
                  copy_from=root / "damage", prepare=_newest_damaged),
    ]  # fmt: skip
    run_world(2, runs)
    return {"launcher-killed": killed} | {run.name: run for run in runs}


@pytest.fixture(scope="module")
def finished_ddp_run(world: dict[str, Any]) -> Path:
    """24 steps of 2 ddp ranks, checkpoints at steps 8, 16 and 24."""
    run = world["damage"].run_dir
    assert [p.name for p in committed_checkpoints(run)] == [
        "step-00000008", "step-00000016", "step-00000024"]  # fmt: skip
    return run


@pytest.mark.timeout(600)
def test_every_checkpoint_damaged_is_refused_with_nothing_trained_or_moved(
    tmp_path: Path, finished_ddp_run: Path
) -> None:
    run = _cut_off_copy(finished_ddp_run, tmp_path)
    junk_files(run / "checkpoints")
    kept = {name: file_tree(run / name) for name in ("checkpoints", "tb")}
    result = train(run, *DAMAGE_RUN, "trainer.max_steps=32", check=False)
    assert result.returncode == 1
    assert re.fullmatch(
        rf"Error: rank \d failed: checkpoint\.resume=auto: every checkpoint in "
        rf"{re.escape(str(run))}/checkpoints is damaged \(3 found\), nothing trained or moved; "
        r"set checkpoint\.resume=never to start over in this run folder, or start a new one "
        r"\(hydra\.run\.dir=\.\.\.\) \(log: \S+\)",
        result.stderr.strip(),
    ), result.stderr
    assert "| step " not in result.stdout
    assert {name: file_tree(run / name) for name in kept} == kept


@pytest.mark.timeout(600)
def test_a_damaged_newest_checkpoint_is_skipped_said_and_the_run_ends_as_before(
    world: dict[str, Any], finished_ddp_run: Path
) -> None:
    resumed = world["newest-damaged"]
    run, newest = resumed.run_dir, resumed.run_dir / "checkpoints" / "step-00000024"
    skipped = [line for line in resumed.stdout.splitlines() if "skipped" in line]
    assert skipped == [
        f"[rank 0] skipped: checkpoint {newest} is damaged: its COMMITTED marker cannot be read"
    ]
    assert f"resumed from {run}/checkpoints/step-00000016 at step 16" in resumed.stdout
    before, after = load_weights(finished_ddp_run), load_weights(run)
    assert all(torch.equal(before[k], after[k]) for k in before)  # steps 17-24 again, the same
