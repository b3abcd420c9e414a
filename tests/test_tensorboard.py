"""What a person sees in TensorBoard: a sweep (the session's, tests/session_runs.py: a ddp, an
fsdp, a pipeline and a single job), read through a real `tensorboard` server's API."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dpt.observe import dashboard
from tests.helpers import free_port, start
from tests.session_runs import LOG_EVERY, STEPS, STRATEGIES, Sweep

JOBS = [f"{job} strategy={strategy}" for job, strategy in enumerate(STRATEGIES)]
SWEEP_RUNS = {
    "tb",  # the sweep's one experiment
    *(f"tb/{job}/{rank}" for job in JOBS for rank in ("rank0", "world")),
    *(f"tb/{job}/rank1" for job in JOBS if not job.endswith("single")),  # 2 ranks
}
TENSORBOARD = Path(sys.executable).with_name("tensorboard")


class Server:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=30) as reply:
            return json.loads(reply.read())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())


@pytest.fixture(scope="module")
def sweep(session_sweep: Sweep) -> Path:
    return session_sweep.folder


@pytest.fixture(scope="module")
def server(sweep: Path) -> Iterator[Server]:
    """`tensorboard --logdir <sweep>` on a free local port, answering once it has read every run."""
    port = free_port()
    proc = start([str(TENSORBOARD), "--logdir", str(sweep), "--port", str(port),
                  "--host", "127.0.0.1", "--reload_interval", "1"])  # fmt: skip
    try:
        served = Server(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if set(served.get("/data/runs")) >= SWEEP_RUNS:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass  # not listening yet
            assert time.monotonic() < deadline, "tensorboard did not list the sweep's runs"
            time.sleep(0.5)
        yield served
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def metrics_json(sweep: Path, job: int) -> dict[str, Any]:
    return json.loads((sweep / str(job) / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_runs_are_named_by_job_swept_values_and_rank(server: Server) -> None:
    assert set(server.get("/data/runs")) == SWEEP_RUNS


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_hparams_shows_what_the_sweep_varied(server: Server) -> None:
    experiment = server.post("/data/plugin/hparams/experiment", {"experimentName": ""})
    infos = {info["name"]: info for info in experiment["hparamInfos"]}
    assert infos["strategy"]["domainDiscrete"] == sorted(STRATEGIES)
    assert infos["strategy"]["differs"] is True
    assert infos["world_size"]["domainDiscrete"] == [1, 2] and infos["world_size"]["differs"]
    # Keys every job shared are listed with their one value, and not as differing.
    assert infos["trainer.max_steps"] == {**infos["trainer.max_steps"], "differs": False,
                                          "domainDiscrete": [STEPS]}  # fmt: skip
    differing = [info["name"] for info in experiment["hparamInfos"] if info["differs"]]
    assert experiment["hparamInfos"][: len(differing)] == [infos[n] for n in differing]
    tags = [m["name"]["tag"] for m in experiment["metricInfos"]]
    assert tags == list(dashboard.SESSION_METRICS)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_each_job_is_a_session_with_its_final_metrics(server: Server, sweep: Path) -> None:
    reply = server.post(
        "/data/plugin/hparams/session_groups",
        {
            "experimentName": "",
            "allowedStatuses": [f"STATUS_{s}" for s in ("UNKNOWN", "SUCCESS", "FAILURE")],
            "colParams": [{"hparam": "strategy"}]
            + [{"metric": {"group": "", "tag": tag}} for tag in dashboard.SESSION_METRICS],
            "startIndex": 0,
            "sliceSize": 10,
        },
    )
    groups = {g["name"]: g for g in reply["sessionGroups"]}
    assert set(groups) == {f"tb/{job}/world" for job in JOBS}
    for job, strategy in enumerate(STRATEGIES):
        group = groups[f"tb/{JOBS[job]}/world"]
        assert group["hparams"]["strategy"] == strategy
        assert [s["status"] for s in group["sessions"]] == ["STATUS_SUCCESS"]
        values = {m["name"]["tag"]: m for m in group["metricValues"]}
        assert set(values) == set(dashboard.SESSION_METRICS)
        result = metrics_json(sweep, job)
        assert values["train/loss"]["trainingStep"] == STEPS  # the last point of the curve
        assert values["train/loss"]["value"] == pytest.approx(result["final_loss"], rel=1e-5)
        assert values["val/acc1"]["value"] == pytest.approx(result["val"]["val/acc1"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_scalars_are_training_curves_without_hparam_points(server: Server) -> None:
    tags = server.get("/data/plugin/scalars/tags")
    assert not [t for run in tags.values() for t in run if t.startswith("hparam/")]
    for rank in ("rank0", "rank1"):
        run = f"tb/0 strategy=ddp/{rank}"
        assert {"train/loss", "train/samples_per_s", "time/step_s"} <= set(tags[run])
        points = server.get("/data/plugin/scalars/scalars", run=run, tag="train/loss")
        assert [step for _, step, _ in points] == [LOG_EVERY, STEPS]  # a curve: each logged step


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_custom_scalars_overlay_every_rank_once(server: Server) -> None:
    layout = server.get("/data/plugin/custom_scalars/layout")
    [category] = layout["category"]  # every job wrote it; TensorBoard shows it once
    charts = {c["title"]: c["multiline"]["tag"] for c in category["chart"]}
    assert charts == {"loss": ["^train/loss$"], "samples/s": ["^train/samples_per_s$"],
                      "step time (s)": ["^time/step_s$"]}  # fmt: skip


def test_job_label_keeps_the_swept_values_and_no_slash() -> None:
    overrides = ["trainer.seed=2", "dataset.root=data/coco", "trainer.max_steps=4"]
    label = dashboard.job_label(3, overrides, {"trainer.seed", "dataset.root"})
    assert label == "3 trainer.seed=2,dataset.root=data_coco"
    assert dashboard.job_label(0, overrides, set()) == "0"
    trial = ["optimizer.lr=0.004430375245218269", "trainer.batch_size=32"]  # a search's
    swept = {"optimizer.lr", "trainer.batch_size"}
    assert dashboard.job_label(4, trial, swept) == "4 optimizer.lr=0.00443,trainer.batch_size=32"
