"""MLflow, W&B and CSV beside TensorBoard (logger=[...]): what a user finds in each after a sweep,
a killed and resumed run, and a server that went away mid-run."""

from __future__ import annotations

import json
import math
import shlex
import signal
import sys
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import pytest
from omegaconf import OmegaConf

from tests.helpers import (
    BIN,
    FAST,
    REPO,
    TRAIN,
    Process,
    Result,
    cmd_until,
    run_cmd,
    run_docs_block,
    run_here,
    start,
)
from tests.session_runs import STRATEGIES, Sweep
from tests.trackers_read import (
    artifacts,
    by_key,
    csv_rows,
    history,
    metric_steps,
    relay,
    runs_of,
    stop,
    wait_up,
    wandb_records,
)

# Wide enough that a run is still training when it is killed.
LONG = [*FAST, "model.hidden_dims=[512,512]", "trainer.max_steps=200",
        "checkpoint.every_n_steps=20", "trainer.log_every_n_steps=5"]  # fmt: skip


def dpt(*args: str, cwd: Path, timeout: float = 240, check: bool = True) -> Result:
    return run_cmd([sys.executable, str(TRAIN), *args], timeout=timeout, cwd=cwd, check=check)


def _points_equal(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(
        sa == sb and (va == vb or (math.isnan(va) and math.isnan(vb)))
        for (sa, va), (sb, vb) in zip(a, b, strict=True)
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_sweep_is_one_mlflow_parent_run_with_a_child_run_per_job(session_sweep: Sweep) -> None:
    """The session's sweep (tests/session_runs.py): a ddp, an fsdp, a pipeline and a single
    job, each a child run of the sweep's run, holding its config, dpt's tags, the history
    metrics.json has and its files."""
    uri, folder = session_sweep.uri, session_sweep.folder
    runs = {
        run.info.run_name: run
        for run in runs_of(uri)
        if run.data.tags.get("sweep_dir") == str(folder)
        or (folder / "tb" / run.info.run_name).is_dir()
    }
    parent = next(r for r in runs.values() if "sweep_dir" in r.data.tags)
    children = [
        r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    ]
    assert sorted(r.info.run_name for r in children) == [
        f"{job} strategy={strategy}" for job, strategy in enumerate(STRATEGIES)
    ]
    assert sorted(artifacts(uri, parent.info.run_id)) == ["summary.csv", "summary.png"]
    for child in children:
        job = folder / child.info.run_name.split()[0]
        config = OmegaConf.load(job / ".hydra" / "config.yaml")
        strategy = STRATEGIES[int(job.name)]
        world_size = "1" if strategy == "single" else "2"
        params = child.data.params
        assert params["optimizer.lr"] == str(config.optimizer.lr)
        assert params["trainer.seed"] == str(config.trainer.seed)
        assert (params["strategy"], params["world_size"]) == (strategy, world_size)
        tags = child.data.tags
        assert (tags["strategy"], tags["world_size"], tags["task"]) == (
            strategy,
            world_size,
            "classification",
        )
        assert child.info.status == "FINISHED"
        expected = by_key(history(job))
        assert {"train/loss", "val/loss", "val/acc1", "objective"} <= set(expected)
        for key, points in expected.items():
            assert _points_equal(metric_steps(uri, child.info.run_id, key), points), key
        assert "model_best.pt" in artifacts(uri, child.info.run_id)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_csv_and_wandb_offline_hold_the_runs_history(session_sweep: Sweep) -> None:
    for job in (session_sweep.folder / str(n) for n in range(len(STRATEGIES))):
        rows = history(job)
        assert csv_rows(job) == rows  # every value as metrics.json has it
        config, logged = wandb_records(job)
        swept = OmegaConf.load(job / ".hydra/config.yaml")
        assert config["optimizer.lr"] == swept.optimizer.lr
        assert config["strategy"] == STRATEGIES[int(job.name)]
        wandb_points = by_key([{k: v for k, v in row.items() if not k.startswith("_")}
                               | {"step": row["_step"]} for row in logged])  # fmt: skip
        assert wandb_points["train/loss"] == by_key(rows)["train/loss"]
        assert wandb_points["val/acc1"] == by_key(rows)["val/acc1"]


@pytest.mark.slow
def test_an_optuna_search_is_a_parent_run_with_a_child_run_per_trial(
    mlflow_uri: str, tmp_path: Path
) -> None:
    uri = mlflow_uri
    dpt("-m", *FAST, "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "trainer.max_steps=5",
        "optimizer.lr=interval(0.001,0.01)", "logger=[mlflow]", f"logger.mlflow.tracking_uri={uri}",
        f"hydra.sweep.dir={tmp_path / 'search'}", cwd=tmp_path)  # fmt: skip
    runs = runs_of(uri)
    parent = next(r for r in runs if r.data.tags.get("sweep_dir") == str(tmp_path / "search"))
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    lrs = {json.loads((tmp_path / "search" / str(job) / "metrics.json").read_text())["hparams"]
           ["optimizer.lr"] for job in (0, 1)}  # fmt: skip
    assert {float(r.data.params["optimizer.lr"]) for r in trials} == lrs and len(lrs) == 2


def _kill(proc: Process, line: str) -> None:
    """SIGKILL the run and its trackers' process, right after a logging window: what was held
    for the trackers' next batch, and what they had not written yet, goes with them."""
    import os

    os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_run_killed_after_a_logging_window_resumes_with_every_step_in_mlflow_and_the_csv(
    mlflow_uri: str, tmp_path: Path
) -> None:
    """Nothing lost to batching, nothing twice: the resumed run sends its checkpoint's history
    that MLflow lacks, then the steps it trains again that MLflow does not hold."""
    uri, run_dir = mlflow_uri, tmp_path / "run"
    args = [*LONG, "logger=[tensorboard,mlflow,csv]", f"logger.mlflow.tracking_uri={uri}",
            f"hydra.run.dir={run_dir}"]  # fmt: skip
    killed = cmd_until([sys.executable, str(TRAIN), *args], "step 30/200", _kill, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL and not (run_dir / "metrics.json").exists()
    run_id = OmegaConf.load(run_dir / "trackers.json").mlflow.run_id
    dpt(*args, cwd=tmp_path)
    assert OmegaConf.load(run_dir / "trackers.json").mlflow.run_id == run_id
    named = [r for r in runs_of(uri) if r.info.run_name == f"{run_dir.parent.name}/run"]
    assert [r.info.run_id for r in named] == [run_id]
    assert named[0].info.status == "FINISHED"
    expected = by_key(history(run_dir))
    assert set(range(5, 201, 5)) <= {s for s, _ in expected["train/loss"]}  # every window
    for key in ("train/loss", "val/loss", "objective"):
        assert _points_equal(metric_steps(uri, run_id, key), expected[key]), key
    assert csv_rows(run_dir) == history(run_dir)


def test_a_continued_mlflow_run_gets_the_checkpoints_rows_it_lacks(tmp_path: Path) -> None:
    """Killed with rows held for a batch: the resumed run sends them from its checkpoint's
    history; the steps MLflow holds already are not sent twice."""
    from dpt.config.loggers import MlflowLoggerConfig
    from dpt.observe.trackers.mlflow_run import MlflowTracker
    from dpt.observe.trackers.tracker import RunInfo

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = OmegaConf.structured(MlflowLoggerConfig(tracking_uri=uri))
    rows = [{"step": step, "train/loss": 1.0 / step} for step in range(1, 9)]
    stopped = MlflowTracker(cfg)
    ids = stopped.start(RunInfo(tmp_path, "run", {}, {}, resumed=False), None)
    stopped.log_metrics([({"train/loss": 1.0 / s}, s, 0.0) for s in (1, 2, 3)])  # 4-6: held
    resumed = MlflowTracker(cfg)  # from the checkpoint of step 6
    info = RunInfo(tmp_path, "run", {}, {}, resumed=True, history=rows[:6])
    assert resumed.start(info, ids)["run_id"] == ids["run_id"]
    resumed.log_metrics([({"train/loss": 1.0 / s}, s, 0.0) for s in (7, 8)])
    resumed.finish("FINISHED")
    assert metric_steps(uri, ids["run_id"], "train/loss") == [(s, 1.0 / s) for s in range(1, 9)]


@pytest.mark.slow
def test_a_server_gone_mid_run_costs_one_warning_and_nothing_else(
    mlflow_uri: str, tmp_path: Path
) -> None:
    """The session's server reached through a relay, which goes away at step 20: for the run,
    its server gone (the port refuses, every connection cut)."""
    run_dir = tmp_path / "run"
    with relay(mlflow_uri) as (uri, gone):
        args = [*LONG, "logger=[tensorboard,mlflow,csv]", f"logger.mlflow.tracking_uri={uri}",
                f"hydra.run.dir={run_dir}"]  # fmt: skip
        done = cmd_until([sys.executable, str(TRAIN), *args], "step 20/200",
                         lambda *_: gone(), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.output[-3000:]
    warnings = [line for line in done.output.splitlines() if "logger mlflow:" in line]
    assert len(warnings) == 1, warnings
    assert "dropped after 3 tries" in warnings[0]
    rows = history(run_dir)
    assert rows[-1]["step"] == 200 and csv_rows(run_dir) == rows
    assert {"model.pt", "model_best.pt", "data.json"} <= {p.name for p in run_dir.iterdir()}


@pytest.mark.slow  # a process of its own trains
def test_a_run_with_tensorboard_alone_imports_no_tracker(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from dpt.launch.cli import main\n"
        f"sys.argv = ['dpt', 'trainer.max_steps=2', 'hydra.run.dir={tmp_path / 'run'}']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('imported:', sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'wandb'}))\n"
    )
    result = run_cmd([sys.executable, "-c", script], cwd=REPO, timeout=120)
    assert "imported: []" in result.stdout, result.output[-2000:]
    assert (tmp_path / "run" / "metrics.json").exists()


def test_csv_alone_equals_the_history_in_metrics_json(tmp_path: Path) -> None:
    summary, _ = run_here(tmp_path, *FAST, "trainer.max_steps=12", "logger=[csv]")
    assert summary["history"][-1]["step"] == 12
    assert csv_rows(tmp_path) == summary["history"]
    assert not (tmp_path / "tb").exists()  # tensorboard left out of the list: no event files


@pytest.mark.slow
def test_the_tracking_guides_commands_leave_what_it_says(tmp_path: Path) -> None:
    """docs/guides/tracking.md's ```bash tracking lines, word for word, from an empty folder:
    MLflow's default SQLite store in outputs/ (the run, then its evaluation), the CSV, and the
    guide's `mlflow ui` line serving them. (A sweep's parent and children, with W&B: the
    module's ddp sweep.)"""
    cwd, _ = run_docs_block("tracking", tmp_path)
    uri = f"sqlite:///{cwd / 'outputs' / 'mlflow.db'}"
    runs = {run.info.run_name: run for run in runs_of(uri)}
    run_dir = cwd / "outputs" / "tracked"
    tracked = runs["outputs/tracked"]
    for key, points in by_key(history(run_dir)).items():
        assert _points_equal(metric_steps(uri, tracked.info.run_id, key), points), key
    assert csv_rows(run_dir) == history(run_dir)
    evaluated = json.loads((run_dir / "eval-val.json").read_text())
    assert metric_steps(uri, tracked.info.run_id, "eval/val/loss") == [
        (20, pytest.approx(evaluated["metrics"]["val/loss"]))
    ]
    _serves_the_runs(cwd, "outputs/tracked")


def _serves_the_runs(folder: Path, name: str) -> None:
    """The guide's `mlflow ui` line, as printed, started in `folder`: it serves the store the
    runs wrote, `name` among them."""
    line = next(c for c in _page_commands() if c.startswith("mlflow ui"))
    args = shlex.split(line)
    proc = start([str(BIN / args[0]), *args[1:]], cwd=folder)
    try:
        wait_up("http://127.0.0.1:5000", proc)
        with urlopen("http://127.0.0.1:5000/", timeout=10) as page:
            assert page.status == 200
        assert name in {run.info.run_name for run in runs_of("http://127.0.0.1:5000")}
    finally:
        stop(proc)


def _page_commands() -> list[str]:
    text = (REPO / "docs" / "guides" / "tracking.md").read_text()
    blocks = text.split("```bash\n")[1:]
    return [line.split(" # ")[0].strip() for block in blocks
            for line in block.split("```")[0].splitlines() if line.strip()]  # fmt: skip


class _Recording:
    """A tracker that records its calls; `fails_from`: every call after that many fails."""

    def __init__(self, name: str, fails_from: int | None = None) -> None:
        self.name, self.fails_from, self.calls = name, fails_from, []

    def _call(self, what: Any) -> None:
        if self.fails_from is not None and len(self.calls) >= self.fails_from:
            raise ConnectionError("Connection refused")
        self.calls.append(what)

    def log_metrics(self, rows: list[Any]) -> None:
        for row in rows:
            self._call(row[:2])

    def log_files(self, paths: list[Path]) -> None:
        self._call(paths)

    def finish(self, status: str) -> None:
        self._call(status)


def test_a_tracker_that_fails_is_tried_again_then_dropped_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The trackers' process's calls (its warnings go to the rank's log)."""
    from dpt.observe.trackers import fanout

    monkeypatch.setattr(fanout, "RETRY_WAIT_S", 0.0)
    good, bad = _Recording("csv"), _Recording("mlflow", fails_from=2)
    trackers = fanout.Fanout([good, bad])  # type: ignore[list-item]
    with caplog.at_level("WARNING", logger="dpt"):
        for step in (1, 2, 3, 4):  # one batch a step: the 3rd is the first to fail
            trackers.log_metrics([({"train/loss": 1.0 / step}, step, 0.0)])
        trackers.finish("FINISHED")
    steps = [({"train/loss": 1.0 / step}, step) for step in (1, 2, 3, 4)]
    assert good.calls == [*steps, "FINISHED"]
    assert bad.calls == steps[:2]
    lines = [r.getMessage() for r in caplog.records if "logger mlflow" in r.getMessage()]
    assert lines == [
        "logger mlflow: Connection refused; dropped after 3 tries: the rest of this run is not "
        "in it (the run goes on; its own files, metrics.json and tb/, are complete)"
    ]


def test_the_trackers_process_appends_the_rows_it_is_sent_and_its_death_is_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0's hand-over: rows held, sent in a batch (a flush: before a checkpoint), the CSV
    file appended to (a validation joining its step's row: the file written anew); the process
    gone mid-run is one warning, and the run's later calls go nowhere."""
    from dpt.observe.trackers.opening import open_trackers
    from dpt.observe.trackers.tracker import RunInfo
    from tests.helpers import compose

    logger, info = compose("logger=[csv]").logger, RunInfo(tmp_path, "run", {}, {}, False)
    trackers = open_trackers(logger, info)
    for step in (1, 2):
        trackers.log_metrics({"train/loss": 1.0 / step}, step, 0.0)
    trackers.flush()
    trackers.log_metrics({"val/loss": 0.25}, 2, 0.0)  # joins step 2's row
    trackers.log_metrics({"train/loss": 1 / 3}, 3, 0.0)
    trackers.close("FINISHED")
    assert csv_rows(tmp_path) == [{"step": 1, "train/loss": 1.0},
                                  {"step": 2, "train/loss": 0.5, "val/loss": 0.25},
                                  {"step": 3, "train/loss": 1 / 3}]  # fmt: skip
    trackers = open_trackers(logger, info)
    assert trackers.proc is not None and trackers._reader is not None
    with caplog.at_level("WARNING", logger="dpt"):
        trackers.proc.kill()
        trackers._reader.join(10)
        trackers.log_metrics({"train/loss": 1.0}, 1, 0.0)
        trackers.close("FINISHED")
    assert [r.getMessage() for r in caplog.records if "logger csv" in r.getMessage()] == [
        "logger csv: the trackers' process ended mid-run; the rest of this run is not in them "
        "(the run goes on; its own files, metrics.json and tb/, are complete)"
    ]
