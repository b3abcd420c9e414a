"""The run folder: one run at a time, a full disk anywhere said in one line, a finished run run
again overwrites nothing. Real starts of train.py (slow) and in-process writes (fast)."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dpt.errors import DptError
from dpt.launch import run_lock
from dpt.launch.worker import run_worker
from dpt.loop.train import write_outputs
from dpt.observe.logs import setup_logging
from dpt.state.checkpoint import CheckpointError
from tests.helpers import (
    FAST,
    REPO,
    Process,
    Result,
    committed_checkpoints,
    compose,
    read_checkpoint,
    run_here,
    run_until,
    run_world,
    small_tmpfs,
    train,
    train_in_process,
    world_run,
)

WIDE = ["model.hidden_dims=[512,512]"]  # steps slow enough to act while the run trains


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run's results and curves, by path."""
    files = [run / "metrics.json", run / "model.pt", *sorted((run / "tb").rglob("*"))]
    return {str(p.relative_to(run)): p.read_bytes() for p in files if p.is_file()}


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real file system with no room left (a one-page tmpfs, that page filled)."""
    with small_tmpfs(tmp_path / "disk", "4k") as disk:
        yield disk


def _fill(disk: Path) -> None:
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


# --- one run per folder ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "strategy",
    [[], ["strategy=ddp", "launcher.nproc_per_node=2", "trainer.batch_size=32"]],
    ids=["single", "ddp"],
)
def test_a_second_start_in_a_live_run_folder_stops_at_once(
    tmp_path: Path, strategy: list[str]
) -> None:
    run = tmp_path / "run"
    common = [*FAST, *WIDE, *strategy, "trainer.max_steps=40", "checkpoint.every_n_steps=5"]
    second: list[Result] = []
    launcher: list[int] = []

    def start_another(proc: Process, _: str) -> None:
        # refused before any run: in this process (another process holds the folder)
        second.append(train_in_process(*FAST, "trainer.seed=7", f"hydra.run.dir={run}"))
        launcher.append(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)  # the holder dies: its lock goes with it

    first = run_until(run, common, "step 10/40", start_another)
    assert first.returncode == -signal.SIGKILL
    assert second[0].returncode == 1
    holder = run_lock.read_holders((run / ".lock").read_text())[0]
    assert holder["pid"] == launcher[0]  # the process the user started, not a worker
    assert second[0].stderr.strip() == (
        f"Error: run folder {run} is in use by another run (pid {holder['pid']} on "
        f"{holder['host']} since {holder['since']}); wait for it to end, or start this one in "
        "another folder (hydra.run.dir=...)"
    )
    assert "trainer.seed=7" not in (run / ".hydra" / "overrides.yaml").read_text()  # untouched
    # The holder is dead: the folder is free again (one process: resumed in this one).
    if strategy:  # 2 ranks: the resident world's
        again = world_run("resumed", run, *common)
        run_world(2, [again])
        resumed = again.stdout
    else:
        resumed = run_here(run, *common)[1]
    assert "resumed from" in resumed


@pytest.mark.parametrize(
    ("environ", "holds"),
    [({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False), ({"SLURM_PROCID": "3"}, False)],
)
def test_only_rank_0_of_a_world_holds_the_folder(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], holds: bool
) -> None:
    for var in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    assert run_lock.holds_lock_here() is holds


def test_the_lock_is_held_once_per_process_and_released(tmp_path: Path) -> None:
    with run_lock.holding(tmp_path):
        with run_lock.holding(tmp_path):  # the same process again: no deadlock on itself
            assert run_lock.held() == [tmp_path.resolve()]
        assert run_lock.held() == [tmp_path.resolve()]
    assert run_lock.held() == []


def _holder(folder: Path, how: str) -> Process:
    """A process that takes (`acquire(folder)`) or joins (`join(folder, 1)`) the folder's lock
    and keeps it until killed."""
    code = ("import sys; from pathlib import Path; from dpt.launch import run_lock; "
            f"run_lock.{how.format(folder=repr(str(folder)))}; print('held', flush=True); "
            "sys.stdin.read()")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _end(*procs: Process) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def test_another_process_holding_the_folder_is_named(tmp_path: Path) -> None:
    holder = _holder(tmp_path, "acquire(Path({folder}))")
    try:
        with pytest.raises(run_lock.FolderInUse, match=rf"\(pid {holder.pid} on "):
            run_lock.acquire(tmp_path)
    finally:
        _end(holder)
    with run_lock.holding(tmp_path):  # released by the kernel when its holder died
        pass


def test_a_rank_that_outlived_its_launcher_keeps_the_folder_and_is_named(tmp_path: Path) -> None:
    launcher = _holder(tmp_path, "acquire(Path({folder}))")
    rank = _holder(tmp_path, "join(Path({folder}), 1)")  # shares the lock with its launcher
    try:
        _end(launcher)
        with pytest.raises(run_lock.FolderInUse) as refused:
            run_lock.acquire(tmp_path)
        named = (f"(its ranks, pids {rank.pid} on {socket.gethostname()}, outlived its launcher, "
                 f"pid {launcher.pid})")  # fmt: skip
        assert named in str(refused.value)
    finally:
        _end(launcher, rank)
    with run_lock.holding(tmp_path):  # free once the last of the run's processes ended
        assert [h["pid"] for h in run_lock.read_holders((tmp_path / ".lock").read_text())] == [
            os.getpid()]  # fmt: skip


def test_a_rank_cannot_join_a_folder_another_start_holds_alone(tmp_path: Path) -> None:
    """A start holds the lock exclusively only while it writes its record: a rank of another
    run that tries to join in that instant is refused, never let in beside it."""
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a start holds for that instant
        joiner = subprocess.run(
            [sys.executable, "-c", "from pathlib import Path; from dpt.launch import run_lock; "
             f"run_lock.join(Path({str(tmp_path)!r}), 1)"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert joiner.returncode == 1 and "FolderInUse: run folder" in joiner.stderr
    finally:
        os.close(fd)


# --- a full disk -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_full_disk_at_start_is_one_line(full_disk: Path) -> None:
    _fill(full_disk)
    run = full_disk / "run"
    result = train(run, *FAST, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == (f"Error: could not write {run}/.lock: no space left on device")


def test_a_full_disk_while_hydra_writes_its_config_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hydra.core.utils
    from hydra.core.global_hydra import GlobalHydra

    from dpt.launch import cli

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a failed close: no file

    monkeypatch.setattr(hydra.core.utils, "_save_config", full)
    GlobalHydra.instance().clear()  # left set up by an earlier in-process compose
    monkeypatch.setattr(sys, "argv", ["dpt", *FAST, f"hydra.run.dir={tmp_path / 'run'}"])
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main()
    finally:
        run_lock.release(tmp_path / "run")
        GlobalHydra.instance().clear()
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        f"Error: could not write {tmp_path / 'run'}: no space left on device\n"
    )


def test_a_full_disk_under_the_log_file_is_said_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log_file = tmp_path / "rank0.log"
    logger = setup_logging("rank 0", log_file)
    handler = next(h for h in logger.handlers if isinstance(h, logging.FileHandler))

    class FullStream:
        def write(self, text: str) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self) -> None: ...
        def close(self) -> None: ...

    handler.stream = FullStream()  # type: ignore[assignment]
    for step in (1, 2, 3):
        logger.info(f"step {step}")
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "[rank 0] step 1",
        f"[rank 0] could not write {log_file}: no space left on device; this rank's lines now "
        "go to the console only",
        "[rank 0] step 2",
        "[rank 0] step 3",
    ]
    assert err == ""  # no "--- Logging error ---" with a traceback per line


def test_a_full_disk_under_tensorboard_ends_in_one_line_and_keeps_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dpt.observe.event_file import EventFile

    written = EventFile.write

    def fills_up(self: Any, events: Any) -> None:
        events = list(events)
        if any(event.step > 6 for event in events):  # TensorBoard's disk fills up after step 6
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written(self, events)

    monkeypatch.setattr(EventFile, "write", fills_up)
    run = tmp_path / "run"
    cfg = compose(*FAST, "trainer.max_steps=20", "checkpoint.every_n_steps=3",
                  "trainer.log_every_n_steps=1", "dataset.num_val_samples=0")  # fmt: skip
    from dpt.launch.launchers import resolved

    with pytest.raises(DptError) as failed:
        run_worker(resolved(cfg), str(run))
    assert str(failed.value) == f"could not write {run}: no space left on device"
    newest = committed_checkpoints(run)[-1]
    assert newest.name == "step-00000006"
    assert read_checkpoint(newest)["progress"]["step"] == 6


def test_a_full_disk_at_the_end_leaves_no_half_written_results(full_disk: Path) -> None:
    run = full_disk / "run"
    run.mkdir()
    _fill(full_disk)
    summary = {"final_loss": 1.0}
    with pytest.raises(CheckpointError) as failed:
        write_outputs(run, torch.nn.Linear(64, 64), summary)
    assert str(failed.value) == f"could not write model {run}/model.pt: no space left on device"
    assert list(run.iterdir()) == []  # no half-written file, no temporary left


# --- a finished run run again ------------------------------------------------------------------


def _results(run: Path, steps: int, stopped_early: bool) -> dict[str, Any]:
    summary = {"steps": steps, "stopped_early": stopped_early, "final_loss": 0.5}
    run.mkdir(exist_ok=True)
    (run / "metrics.json").write_text(json.dumps(summary))
    return summary


@pytest.mark.parametrize(
    ("written", "step", "total", "finished"),
    [
        (None, 40, 40, False),  # cut off after its last checkpoint: the results are still due
        ((40, False), 40, 40, True),
        ((40, False), 40, 60, False),  # more steps asked for: training goes on
        ((12, True), 12, 40, True),  # early stopping ended it there
        ((12, True), 8, 40, False),  # rolled back before the early stop
    ],
)
def test_a_run_is_finished_when_its_results_are_written_and_nothing_is_left(
    tmp_path: Path, written: tuple[int, bool] | None, step: int, total: int, finished: bool
) -> None:
    from dpt.loop import train
    from dpt.state.checkpoint import Committed
    from tests.test_checkpoint import CPU1

    summary = _results(tmp_path, *written) if written else None
    resumed = Committed(tmp_path / "checkpoints" / f"step-{step:08d}", step)
    assert train.finished(tmp_path, resumed, total, CPU1) == (summary if finished else None)


def test_an_early_stopped_run_says_how_to_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dpt.loop.train import finished
    from dpt.state.checkpoint import Committed
    from tests.test_checkpoint import CPU1

    caplog.set_level(logging.INFO, "dpt")
    _results(tmp_path, 12, True)
    finished(tmp_path, Committed(tmp_path / "checkpoints" / "step-00000012", 12), 40, CPU1)
    assert [r.getMessage() for r in caplog.records] == [
        f"run folder {tmp_path} is complete (stopped early at step 12 of 40); nothing "
        "overwritten. To train further, raise trainer.early_stopping.patience "
        "(checkpoint.resume=auto continues from step 12), or start a new run folder "
        "(hydra.run.dir=...)"
    ]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_finished_run_folder_run_again_overwrites_nothing(tmp_path: Path) -> None:
    common = [*FAST, "trainer.max_steps=6"]  # one process: in this one (`run_here`)
    run_here(tmp_path, *common)
    before = _snapshot(tmp_path)
    _, again = run_here(tmp_path, *common)
    assert (
        f"[rank 0] run folder {tmp_path} is complete (trained to step 6 of 6); nothing "
        "overwritten. To train further, raise trainer.max_steps "
        "(checkpoint.resume=auto continues from step 6), or start a new run folder "
        "(hydra.run.dir=...)"
    ) in again.splitlines()
    assert _snapshot(tmp_path) == before
    _, further = run_here(tmp_path, *FAST, "trainer.max_steps=8")
    assert "resuming with changed settings: trainer.max_steps 6 -> 8" in further
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 8


# --- a plain start's run folder: named by the clock, laid out as the docs say ----------------

RUN_FOLDER_TABLE = REPO / "docs" / "getting-started.md"
# Rows of the table that not every run writes, and when they are written.
SOMETIMES = {"tokenizer.json": "a language model's", "events.jsonl": "once the monitor reports",
             "metrics.csv": "logger csv", "trackers.json": "a logger besides tensorboard",
             "wandb": "logger wandb", "eval-<split>.json": "dpt-evaluate",
             "confusion-<split>.png": "dpt-evaluate"}  # fmt: skip


def _table_entries() -> set[str]:
    """The run folder's top-level entries as the getting-started page's table lists them."""
    table = RUN_FOLDER_TABLE.read_text().split("| path | written by | what |", 1)[1]
    rows = table.strip().split("\n\n", 1)[0].splitlines()[1:]  # after the | --- | line
    return {row.split("|")[1].strip().strip("`").split("/")[0] for row in rows}


@pytest.mark.timeout(60)
def test_a_run_started_in_the_same_second_as_another_gets_a_folder_of_its_own(
    tmp_path: Path,
) -> None:
    """`outputs/<date>/<time>` there already (a run that began in the same second): the new run
    takes `<time>-1`, laid out as the run-folder table says, and the other is left as it was."""
    import datetime

    now = datetime.datetime.now()
    taken = [now + datetime.timedelta(seconds=s) for s in range(20)]  # the run starts in these
    for moment in taken:
        (tmp_path / "outputs" / f"{moment:%Y-%m-%d}" / f"{moment:%H-%M-%S}").mkdir(parents=True)
    result = train_in_process(*FAST, "trainer.max_steps=4", cwd=tmp_path)
    assert result.returncode == 0, result.output
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if any(p.iterdir())]
    assert len(runs) == 1 and runs[0].name.endswith("-1"), runs
    left = {p.name for p in runs[0].iterdir()}
    table = _table_entries()
    assert left <= table, f"not in the run-folder table: {left - table}"
    assert table - set(SOMETIMES) <= left, f"in the table, not left: {table - left}"
