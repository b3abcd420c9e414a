"""The benchmark (benchmarks/): its shared runner, its report writer, and a `--smoke` run end to end
(the runner's subprocess A/B rounds, an in-process section, the report and its plots). No timing
is asserted: the numbers of a smoke run on a shared machine mean nothing."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

# benchmarks.bench and benchmarks.report are imported by the tests that use them: the ranks that
# test_spawn_world starts import this module, and those two import torchvision too.
from benchmarks import jobs
from benchmarks.runner import RunError, Stat, alternate, run_process, spawn_world
from tests.helpers import REPO, run_cmd

PNG = b"\x89PNG\r\n\x1a\n"


# --- the runner ---------------------------------------------------------------------------------


def test_alternate_runs_a_b_rounds_and_drops_the_warmup() -> None:
    calls: list[str] = []

    def contender(name: str) -> Any:
        return lambda: calls.append(name) or len(calls)

    done: list[tuple[str, int]] = []
    results = alternate(
        {"a": contender("a"), "b": contender("b")},
        rounds=2,
        warmup=1,
        done=lambda key, r, _: done.append((key, r)),
    )
    assert calls == ["a", "b"] * 3
    assert results == {"a": [3, 5], "b": [4, 6]}  # the first round is warmup
    assert done == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_run_process_reports_the_tail_and_kills_on_timeout(tmp_path: Path) -> None:
    launched, ended = run_process(["true"], tmp_path / "ok.txt", {}, 30, "ok")
    assert launched <= ended
    with pytest.raises(RunError, match=r"(?s)failed: exit 3\n.*last words"):
        cmd = ["sh", "-c", "echo last words; exit 3"]
        run_process(cmd, tmp_path / "fails.txt", {}, 30, "fails")
    with pytest.raises(RunError, match="timeout after 0 s"):
        run_process(["sleep", "30"], tmp_path / "sleeps.txt", {}, 0.2, "sleeps")


def test_run_rounds_alternates_jobs_and_retries_a_failure_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = jobs.Workload("mlp", 64, warmup_steps=10, steps=20)
    plain, dpt = jobs.Job("plain", "single", 1, work), jobs.Job("dpt", "single", 1, work)
    ran: list[str] = []

    def run_job(job: jobs.Job, run_dir: Path, env: dict, timeout_s: float) -> str:
        ran.append(run_dir.name)
        if len(ran) == 2:
            raise RunError("dpt single (mlp) failed: exit 1\nboom")
        return job.label

    monkeypatch.setattr(jobs, "run_job", run_job)
    retried: list[str] = []
    results = jobs.run_rounds([[plain, dpt]], 2, tmp_path, {}, lambda _: None, retried)
    assert results == {plain: ["plain single"] * 2, dpt: ["dpt single"] * 2}
    assert [name.split("-", 1)[1] for name in ran] == [
        "plain-single", "dpt-single", "dpt-single-again", "plain-single", "dpt-single",
    ]  # fmt: skip
    assert retried == ["dpt single: boom"]


def _world_sum(env: Any, tmp: Path, value: float) -> dict[str, Any]:
    total = torch.tensor([value * (env.rank + 1)])
    dist.all_reduce(total)
    return {"world": env.world_size, "sum": total.item(), "stat": Stat.of([1.0, 2.0, 4.0])}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_spawn_world_returns_rank_0s_result() -> None:
    result = spawn_world(2, _world_sum, (1.5,), threads=1)
    assert result == {"world": 2, "sum": 4.5, "stat": Stat(2.0, 1.0, 4.0, 3)}


# --- the report ---------------------------------------------------------------------------------


def _stat(x: float) -> Stat:
    return Stat(x, 0.9 * x, 1.1 * x, 3)


def _results() -> dict[str, Any]:
    """One of everything the report shows (numbers made up)."""
    loop = {"model": "mlp", "strategy": "single", "world": 1, "batch": 64, "log_every": 10,
            "plain": _stat(20000), "dpt": _stat(21000), "ratio": _stat(1.05),
            "ratio_all_steps": _stat(1.04), "loss_gap": 1e-7}  # fmt: skip
    ddp = {**loop, "strategy": "ddp", "world": 2, "ratio": _stat(0.97)}
    strategies = [
        {"model": m, "strategy": s, "world": w, "batch": b, "global_batch": b * w,
         "log_every": 10, "samples_s": _stat(30 if m == "resnet18" else 20000),
         "efficiency": _stat(0.9)}
        for m, b in (("mlp", 64), ("resnet18", 8)) for s, w in (("single", 1), ("ddp", 2))
    ]  # fmt: skip
    startup = {"strategy": "single", "world": 1, "plain": _stat(3.0), "dpt": _stat(3.3),
               "extra_s": _stat(0.3), "ratio": _stat(1.1)}  # fmt: skip
    marginal = {"strategy": "single", "world": 1, "steps": (100, 600), "log_every": 10,
                "plain_wall_s": [_stat(4.0), _stat(4.5)], "dpt_wall_s": [_stat(4.3), _stat(4.8)],
                "plain_ms": _stat(1.0), "dpt_ms": _stat(1.0), "ratio": _stat(1.0)}  # fmt: skip
    logging = {"strategy": "single", "world": 1, "step_ms": _stat(1.0), "cost_ms": _stat(0.04),
               "cost_pct": _stat(4.0), "ratio_at_1": _stat(1.0)}  # fmt: skip
    pipeline = [{"decoder": "decode_jpeg", "what": what, "images_s": _stat(100),
                 "vs_decode": _stat(0.8)}
                for what in ("decode only", "dpt train sample")]  # fmt: skip
    sync = {"model": "mlp", "mbytes": 0.3, **{k: _stat(1.0) for k in (
        "bare_ms", "bare_busbw", "hook_ms", "hook_busbw", "hook_vs_bare", "one_bucket_busbw",
        "one_bucket_vs_bare", "step_ms", "exposed_ms", "torch_default_speedup", "static_speedup",
        "bf16_speedup")}}  # fmt: skip
    calls = ["each_step_us", "agree_us", "agreed_us",
             *(f"per_step_us_every_{n}" for n in (1, 10, 50))]  # fmt: skip
    per_step = {1: {k: _stat(10) for k in [*calls, "fetch_dpt_us", "fetch_plain_us"]},
                2: {k: _stat(20) for k in calls}}  # fmt: skip
    rank = {"memory/params_mb": 400.0, "memory/grads_mb": 400.0, "memory/optimizer_mb": 800.0,
            "peak_rss_mb": 2500.0, "samples_per_s": 4.0}  # fmt: skip
    return {
        "loops": [loop, ddp], "strategies": strategies, "out_of_the_box": [],
        "workloads": [jobs.Workload("mlp", 64, 50, 550, num_samples=12800)],
        "startup": [startup], "marginal": [marginal], "logging": [logging],
        "pipeline": pipeline, "pipeline_files": 100, "sync": [sync], "per_step": per_step,
        "gpu": None,
        "memory": {"worlds": {2: {"ddp": [[rank, rank]], "fsdp": [[rank, rank]]}},
                   "parameters": 105_000_000, "steps": 3},
    }  # fmt: skip


META = {"cpu": "a CPU", "cores": 2, "memory_gb": 24.0, "gpu": "none", "python": "3.11",
        "torch": "2", "torchvision": "0", "date": "today", "load_before": (1.0, 1.0, 1.0),
        "load_after": (1.0, 1.0, 1.0), "command": "python -m benchmarks", "retried": [],
        "duration_s": 60.0, "quick": False, "rounds": 3, "threads": 1, "device": "cpu"}  # fmt: skip
CHAPTERS = (
    "## Targets",
    "## 1. dpt against a hand-written loop",
    "## 2. Strategies and scaling",
    "## 3. Input pipeline",
    "## 4. Gradient synchronisation",
    "## 5. Start-up",
    "## 6. Per-step overhead",
    "## 7. Where dpt's time still goes",
    "## Method and caveats",
    "<!-- bench_memory -->\n## 8. Sharded training",
    "<!-- bench_gpu -->\n## 11. The GPU path",
)


def test_report_has_every_section_in_order(tmp_path: Path) -> None:
    from benchmarks.report import document

    text = document.write(tmp_path, _results(), META).read_text()
    places = [text.index(heading) for heading in CHAPTERS]
    assert places == sorted(places)
    assert text.endswith("<!-- /bench_gpu -->\n")
    targets = re.findall(r"^\| (dpt/plain|whole-process|launch|logging|pipeline|gradient|ResNet)",
                         text, flags=re.MULTILINE)  # fmt: skip
    # The targets table, section by section.
    assert list(dict.fromkeys(targets)) == [
        "dpt/plain", "whole-process", "launch", "logging", "pipeline", "gradient",
    ]  # fmt: skip
    assert "Not measured yet: no CUDA device" in text
    for name in ("perf_throughput.png", "perf_pipeline.png", "perf_sync.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
        assert f"]({name})" in text


def test_memory_alone_replaces_only_its_part(tmp_path: Path) -> None:
    from benchmarks.report import document

    results = _results()
    memory = results.pop("memory")
    del results["gpu"]  # a marked part too, appended before memory's
    path = document.write(tmp_path, results, META)
    without = path.read_text()
    assert "bench_memory" not in without
    document.write_marked(tmp_path, {"memory": memory})
    appended = path.read_text()
    assert appended.startswith(without.rstrip("\n") + "\n\n<!-- bench_memory -->\n## 8.")
    memory["steps"] = 7
    document.write_marked(tmp_path, {"memory": memory})
    replaced = path.read_text()
    assert replaced.replace("7 timed steps", "3 timed steps") == appended
    # A whole report that did not measure memory keeps the part it found.
    assert document.write(tmp_path, results, META).read_text() == replaced


def _gpu() -> dict[str, Any]:
    """What `--sections gpu` measures on a GPU machine (numbers made up)."""
    return {"device": "NVIDIA H200", "software": "torch 2", "date": "today", "cores": 16,
            "workers": 8, "in_process": {"synthetic": _stat(13000), "jpeg_gpu_decode": _stat(2300),
                                         "jpeg_vs_synthetic": _stat(0.18)},
            "loop": {"plain": _stat(3100), "dpt": _stat(5400), "ratio": _stat(1.7)}}  # fmt: skip


def test_gpu_numbers_stay_when_a_later_report_has_no_gpu(tmp_path: Path) -> None:
    from benchmarks.report import document

    document.write_marked(tmp_path, {"gpu": _gpu()})
    measured = (tmp_path / "performance.md").read_text()
    assert "## 11. The GPU path: NVIDIA H200" in measured
    verdict = "- JPEG with GPU decoding >= 0.9 of synthetic: 0.180 (0.162-0.198), **not met**"
    assert verdict in measured
    # A whole report from a CPU machine (gpu: None) keeps the GPU numbers it found...
    text = document.write(tmp_path, _results(), META).read_text()
    assert "Not measured yet" not in text
    assert measured.split("<!-- bench_gpu -->")[1] == text.split("<!-- bench_gpu -->")[1]
    # ... and so does the section alone, run where there is no GPU.
    document.write_marked(tmp_path, {"gpu": None})
    assert (tmp_path / "performance.md").read_text() == text


def _baseline(ratios: tuple[Stat, ...]) -> dict[str, Any]:
    """What `--sections baseline` measures (numbers made up): one row per ratio."""
    row = {"model": "mlp", "strategy": "single", "world": 1, "batch": 64, "log_every": 10,
           "base": _stat(20000), "this": _stat(19800), "ratio_all_steps": _stat(0.99),
           "loss_gap": 0.0}  # fmt: skip
    return {"baseline": {
        "rows": [{**row, "ratio": ratio} for ratio in ratios],
        "workloads": [jobs.Workload("mlp", 64, 50, 550, num_samples=12800)],
        "imported": {"base": "/tmp/x/baseline/dpt/__init__.py", "this": "/repo/dpt/__init__.py"},
        "rev": "HEAD~1", "short": "265ee25", "hash": "265ee25" + "0" * 33, "subject": "before",
        "head": "ec17698" + "0" * 33, "head_subject": "after", "head_end": "ec17698" + "0" * 33,
        "uncommitted_code": ["dpt/loop/trainer.py"], "uncommitted_other": 3, "code_changed": False,
        "quick": False, "smoke": False, "rounds": 5, "models": "mlp,resnet18", "worlds": [2],
        "date": "today", "duration_s": 600.0, "load": ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)),
    }}  # fmt: skip


def test_the_baselines_loss_gap_says_whether_the_arithmetic_is_the_same(tmp_path: Path) -> None:
    """A gap of float-order noise is the check that both train the same; a larger one (a kernel
    changed between them, as Adam's fused kernel did) is said to check nothing."""
    from benchmarks.report import document

    ratios = (Stat(1.0, 0.98, 1.02, 3),)
    for gap, says in (
        (4e-9, "(at most 4.0e-09) is the sharper check: the two train the same numbers"),
        (0.26, "(up to 2.6e-01) says the two do not train the same numbers: a change"),
    ):
        measured = _baseline(ratios)
        measured["baseline"]["rows"][0]["loss_gap"] = gap
        text = document.write_marked(tmp_path, measured).read_text()
        assert f"The loss gap {says}" in text, text
        assert text.count("The loss gap") == 1


def test_baseline_alone_replaces_only_its_part(tmp_path: Path) -> None:
    from benchmarks.report import baseline, document

    path = document.write(tmp_path, _results(), META)
    whole = path.read_text()
    ratios = (Stat(0.95, 0.90, 1.02, 5), Stat(0.98, 0.96, 0.99, 5), Stat(0.95, 0.93, 0.96, 5))
    document.write_marked(tmp_path, _baseline(ratios))
    text = path.read_text()
    assert text.startswith(whole.rstrip("\n") + "\n\n<!-- bench_baseline -->\n## 10. This ")
    assert text.endswith("<!-- /bench_baseline -->\n")
    assert "| dpt@265ee25 samples/s | this checkout samples/s | this/265ee25 (paired) |" in text
    assert "| mlp | single | 1 | 64 | 10 | 20,000 (18,000-22,000) | 19,800" in text
    assert "--sections baseline --baseline HEAD~1 --rounds 5`" in text
    assert "with 1 uncommitted change(s), which these runs include (`dpt/loop/trainer.py`)" in text
    assert "3 other uncommitted file(s), none of them run by dpt." in text
    # Within noise: the range holds 1.0, or the median is at least 0.97.
    verdicts = [verdict for _, _, verdict in baseline.targets(_baseline(ratios))]
    assert [v.startswith("within noise") for v in verdicts] == [True, True, False]
    # Measured again: its part replaced, the rest as it was.
    document.write_marked(tmp_path, _baseline(ratios[:1]))
    again = path.read_text()
    assert again.startswith(whole.rstrip("\n")) and again.count("bench_baseline -->") == 2
    assert "0.980 (0.960-0.990)" not in again
    # Rendered from saved measurements: its part alone again.
    from benchmarks import bench

    (tmp_path / "saved.pkl").write_bytes(pickle.dumps((_baseline(ratios), META)))
    bench.main(["--render", str(tmp_path / "saved.pkl"), "--out", str(tmp_path)])
    assert path.read_text() == text


def test_baseline_section_needs_a_revision(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "baseline"])
    assert "--sections baseline needs --baseline REV" in capsys.readouterr().err
    assert "baseline" not in bench.DEFAULT_SECTIONS


def test_a_quick_run_writes_its_report_where_git_does_not_track_it() -> None:
    """`python -m benchmarks --quick`, as the docs print it, leaves the checkout unmodified:
    its report goes to an ignored folder; a measurement's (no --quick) to docs/, tracked."""
    from benchmarks import bench

    for flags in (["--quick"], ["--smoke"]):
        out = bench.parse_args(flags).out / "performance.md"
        ignored = run_cmd(["git", "check-ignore", "-q", str(out)], timeout=10, cwd=REPO,
                          check=False)  # fmt: skip
        assert ignored.returncode == 0, f"{flags}: {out} is not ignored by git"
    assert bench.parse_args([]).out == REPO / "docs"
    assert bench.parse_args(["--quick", "--out", "/tmp/perf"]).out == Path("/tmp/perf")


def test_a_job_of_another_checkout_runs_its_entry_there(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    work = jobs.Workload("mlp", 64, warmup_steps=10, steps=20)
    job = jobs.Job("dpt", "ddp", 2, work, checkout=tmp_path, rev="265ee25")
    assert job.label == "dpt@265ee25 ddp x2"
    assert job.command(tmp_path / "run")[1] == str(tmp_path / "train.py")
    assert jobs.checkout_env(tmp_path)["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    with pytest.raises(RunError, match="does not exist in that checkout"):
        dataclasses.replace(job, stamp_first_step=True).command(tmp_path / "run")


def test_render_reads_measurements_saved_before_the_move(tmp_path: Path) -> None:
    from benchmarks import bench

    results = {k: v for k, v in _results().items() if k in ("loops", "strategies", "workloads")}
    saved = pickle.dumps((results, META), protocol=0)  # names its classes' modules as text
    saved = saved.replace(b"benchmarks.runner\n", b"bench_common\n")
    saved = saved.replace(b"benchmarks.jobs\n", b"bench_runs\n")
    assert b"benchmarks." not in saved
    (tmp_path / "old.pkl").write_bytes(saved)
    bench.main(["--render", str(tmp_path / "old.pkl"), "--out", str(tmp_path)])
    report = (tmp_path / "performance.md").read_text()
    assert "| mlp | single | 1 | 64 | 10 | 20,000 (18,000-22,000) |" in report


def test_scripts_bench_is_the_package_entry() -> None:
    from benchmarks import bench

    shim = runpy.run_path(str(REPO / "scripts" / "bench.py"), run_name="not_main")
    assert shim["main"] is bench.main


# --- the gpt section ----------------------------------------------------------------------------


def _gpt(ratios: tuple[Stat, ...]) -> dict[str, Any]:
    """What `--sections gpt` measures (numbers made up): single, then ddp x2, one ratio each."""
    from benchmarks.gpt import MemoryRun

    work = jobs.Workload("gpt", 32, warmup_steps=50, steps=300, log_every=50)
    rows = [{"model": "gpt", "strategy": s, "world": w, "batch": 32, "log_every": 50,
             "plain": _stat(150.0 * w), "dpt": _stat(148.0 * w), "ratio": ratio,
             "ratio_all_steps": ratio, "loss_gap": 1e-7, "tokens_per_step": 1024 * w,
             "plain_tokens": _stat(4800.0 * w), "dpt_tokens": _stat(4736.0 * w)}
            for (s, w), ratio in zip((("single", 1), ("ddp", 2)), ratios,
                                     strict=False)]  # fmt: skip
    rank = {"memory/params_mb": 3.2, "memory/grads_mb": 3.2, "memory/optimizer_mb": 6.4,
            "peak_rss_mb": 600.0}  # fmt: skip
    result = jobs.RunResult(0.0, 1.0, {}, {}, None)
    memory = {2: {s: [MemoryRun(result, [rank, rank], 9000.0 - 3000 * (s == "fsdp"), 0.05)]
                  for s in ("ddp", "fsdp")}}  # fmt: skip
    model = {"experiment": "gpt_tiny", "text_bytes": 700_000, "tokens": 700_000,
             "windows": 21_874, "vocab_size": 256, "block_size": 32, "n_layer": 4, "n_head": 4,
             "n_embd": 128, "parameters": 830_000, "flops_per_token": 5.2e6,
             "flags": ("--lr=0.003",)}  # fmt: skip
    return {"gpt": {
        "rows": rows, "memory": memory, "model": model, "work": work,
        "memory_work": dataclasses.replace(work, steps=150), "quick": False, "smoke": False,
        "rounds": 5, "worlds": [2], "threads": 1, "date": "today", "duration_s": 600.0,
        "load": ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), "cores": 2,
    }}  # fmt: skip


def test_gpt_alone_replaces_only_its_part(tmp_path: Path) -> None:
    from benchmarks.report import document, gpt

    path = document.write(tmp_path, _results(), META)
    whole = path.read_text()
    results = _gpt((Stat(0.995, 0.97, 1.02, 5), Stat(0.98, 0.96, 0.985, 5)))
    document.write_marked(tmp_path, results)
    text = path.read_text()
    assert text.startswith(whole.rstrip("\n") + "\n\n<!-- bench_gpt -->\n## 12. A tiny GPT")
    assert text.endswith("<!-- /bench_gpt -->\n")
    assert "| single | 1 | 32 | 1,024 | 50 | 4,800 (4,320-5,280) | 4,736" in text
    assert "| ddp | 2 | 3.20 | 3.20 | 6.40 | 12.80 | 600 | 9,000 | 0.0500 |" in text
    assert "| 2 | 1.000 | 0.500 | 0.67 |" in text  # fsdp/ddp: state, 1/ranks, tokens/s
    assert "`python -m benchmarks --sections gpt --rounds 5`" in text
    verdicts = [verdict for _, _, verdict in gpt.targets(results)]
    assert verdicts == ["met (not in every round)", "**not met**"]
    # Measured again: its part replaced, the rest (and the other marked parts) as it was.
    document.write_marked(tmp_path, _gpt((Stat(1.01, 1.0, 1.02, 5),)))
    again = path.read_text()
    assert again.startswith(whole.rstrip("\n")) and again.count("bench_gpt -->") == 2
    assert "| ddp | 2 | 32 |" not in again
    # A whole report that measured it with the others has its rows in the targets table.
    both = document.write(tmp_path / "both", {**_results(), **results}, META).read_text()
    assert "| dpt/plain per-step throughput, tiny GPT: ddp x2, log_every_n_steps=50 |" in both


def test_plain_gpt_trains_on_dpts_batches_with_dpts_schedule(tmp_path: Path) -> None:
    """The plain loop's windows, their order over ranks, and its learning rate are dpt's."""
    import numpy as np

    from benchmarks import plain_gpt
    from dpt.data.loaders import epoch_order, rank_share
    from dpt.data.text import TokenWindows
    from dpt.loop.schedulers import WarmupCosine

    path, count, block, batch = tmp_path / "tokens.bin", 1000, 8, 4
    np.arange(count, dtype=np.uint16).tofile(path)
    theirs, mine = TokenWindows(path, count, "uint16", block), None
    for world in (1, 2):
        for rank in range(world):
            mine = plain_gpt.Windows(path, count, "uint16", block)
            sampler = torch.utils.data.DistributedSampler(
                range(len(mine)), num_replicas=world, rank=rank, shuffle=True, seed=3
            )
            sampler.set_epoch(1)
            batches = plain_gpt.epoch_batches(mine, sampler, batch)
            steps = len(theirs) // (batch * world)
            order = rank_share(epoch_order(len(theirs), 3, 1), 0, steps, batch * world, rank, world)
            assert batches[:steps] == [order[k : k + batch] for k in range(0, len(order), batch)]
            inputs, targets = mine.batch(batches[0])
            expected = theirs.__getitems__(batches[0])
            assert torch.equal(inputs, expected.inputs) and torch.equal(targets, expected.labels)
    dpts = WarmupCosine(50, 300, 0.1)
    assert [plain_gpt.lr_factor(s, 50, 300, 0.1) for s in range(310)] == [
        dpts(s) for s in range(310)
    ]


def test_gpt_jobs_run_the_experiment_and_its_plain_copy(tmp_path: Path) -> None:
    """The plain loop's flags come from experiment=gpt_tiny's resolved config; dpt's runs get the
    text, no validation, no checkpoints, and the token cache that already holds the tokens."""
    from benchmarks import gpt

    data, trainer, model = gpt.prepare(tmp_path, size=4000)
    assert data.tokens.is_file() and data.tokens.parent == data.cache == tmp_path / "tokens"
    assert data.count == len(data.text.read_bytes())  # byte tokens: one a byte
    assert (trainer["batch_size"], trainer["log_every_n_steps"]) == (8, 200)
    assert "--lr=0.003" in data.plain_flags and "--weight-decay=0.1" in data.plain_flags
    assert "--clip=1.0" in data.plain_flags and "--warmup-steps=50" in data.plain_flags
    assert model["parameters"] > 0 and model["n_layer"] == 3
    work = jobs.Workload("gpt", 32, warmup_steps=2, steps=6, log_every=2)
    dpt = gpt.GptJob("dpt", "ddp", 2, work, data=data).command(tmp_path / "run")
    assert dpt[1] == str(REPO / "train.py")
    for override in ("experiment=gpt_tiny", "dataset.val_fraction=0", "checkpoint.enabled=false",
                     f"dataset.cache_dir={data.cache}", "launcher.nproc_per_node=2",
                     "trainer.max_steps=6", "trainer.log_every_n_steps=2"):  # fmt: skip
        assert override in dpt
    rss = gpt.GptJob("dpt", "fsdp", 2, work, data=data, peak_rss=True)
    assert rss.command(tmp_path / "run")[1].endswith("benchmarks/stamped_train.py")
    assert rss.label == "dpt fsdp x2"
    plain = gpt.GptJob("plain", "ddp", 2, work, data=data).command(tmp_path / "run")
    assert plain[1].endswith("benchmarks/plain_gpt.py") and "--nproc=2" in plain
    assert f"--tokens={data.tokens}" in plain and "--steps=6" in plain


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_smoke_benchmark_writes_its_report(tmp_path: Path) -> None:
    """dpt and the plain loop as subprocesses (one A/B round), the pipeline in-process, and the
    report with its plots; a memory part already in the report is kept."""
    kept = "<!-- bench_memory -->\nmeasured before\n<!-- /bench_memory -->"
    (tmp_path / "performance.md").write_text(f"# Performance\n\n{kept}\n")
    cmd = [sys.executable, "-m", "benchmarks", "--smoke", "--sections", "loops,pipeline"]
    run_cmd([*cmd, "--out", str(tmp_path)], timeout=150)

    report = (tmp_path / "performance.md").read_text()
    for heading in CHAPTERS[:4]:
        assert heading in report
    assert "## 4." not in report  # not measured
    # The dpt/plain row of the MLP on one process, logging every 10 steps: two rates and their
    # ratio.
    row = r"\| mlp \| single \| 1 \| 64 \| 10 \| [\d,]+ \| [\d,]+ \| \d+\.\d{3} \|"
    assert re.search(row, report)
    assert "`python -m benchmarks --smoke --sections loops,pipeline --out" in report
    assert "This is a `--quick` smoke run" in report
    assert report.endswith(f"\n\n{kept}\n")
    for name in ("perf_throughput.png", "perf_pipeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
        assert f"]({name})" in report


# --- the pipeline_parallel section ---------------------------------------------------------------


def _pipeline_parallel() -> dict[str, Any]:
    """What `--sections pipeline_parallel` measures (numbers made up): 2 rounds each."""

    def run(step_s: float, bubbles: tuple[float, float]) -> dict[str, Any]:
        return {
            "step_s": step_s,
            "ranks": [{"pipeline/bubble": b, "state_mb": 28.0 - i} for i, b in enumerate(bubbles)],
        }

    runs = {
        "single": [{"step_s": 0.4, "ranks": [{"state_mb": 55.0}]}] * 2,
        "gpipe m=1": [run(0.40, (0.50, 0.25)), run(0.42, (0.52, 0.27))],
        "gpipe m=4": [run(0.28, (0.18, 0.12)), run(0.30, (0.19, 0.13))],
    }
    return {"pipeline_parallel": {
        "runs": runs, "steps": 8, "stages": 2, "batch": 16,
        "shape": {"n_layer": 6, "n_embd": 256, "n_head": 4, "block_size": 64},
        "quick": False, "smoke": False, "rounds": 2, "date": "today", "duration_s": 120.0,
        "load": ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), "cores": 2,
    }}  # fmt: skip


def test_pipeline_parallel_alone_replaces_only_its_part(tmp_path: Path) -> None:
    from benchmarks.report import document

    path = tmp_path / document.REPORT  # a report without its part (the whole one: above)
    path.write_text("# Performance\n\nthe rest, as it was\n")
    document.write_marked(tmp_path, _pipeline_parallel())
    text = path.read_text()
    assert text.startswith(
        "# Performance\n\nthe rest, as it was\n\n<!-- bench_pipeline_parallel -->\n## 13."
    )
    # ms per step, its paired ratio to one process, each stage's bubble, the formula's
    assert "| gpipe | 1 | 410.0 (400.0-420.0) | 1.02 (1.00-1.05) | 0.51 (0.50-0.52) |" in text
    assert "| gpipe | 4 | 290.0 (280.0-300.0) | 0.72 (0.70-0.75) | 0.18 (0.18-0.19) | " \
        "0.12 (0.12-0.13) | 0.20 |" in text  # fmt: skip
    assert "| stage 1 | 28.0 | 0.51 |" in text and "| one process | 55.0 | 1.00 |" in text
    assert "1.02 with m=1, 0.72 with m=4" in text
    # the first stage's bubble with one micro-batch (0.51) is above the formula's 0.50
    assert "exceeds the formula's for gpipe m=1:" in text


# --- the tensor_parallel section -----------------------------------------------------------------


def _tensor_parallel() -> dict[str, Any]:
    """What `--sections tensor_parallel` measures (numbers made up): 2 rounds each."""
    state = {"params_mb": 9.25, "grads_mb": 9.25, "optimizer_mb": 9.25, "state_mb": 27.75}
    calls = {f"_c10d_functional::{name}": n for name, n in (
        ("all_gather_into_tensor", 27.0), ("all_reduce", 27.0), ("reduce_scatter_tensor", 26.0),
        ("wait_tensor", 80.0))}  # fmt: skip

    def floors(scale: float) -> dict[str, Any]:
        return {
            "_c10d_functional::all_gather_into_tensor": {
                "calls": 26.0,
                "mb": 26.0,
                "alone_ms": 10.0 * scale,
                "floor_ms": 20.0,
            },
            "_c10d_functional::reduce_scatter_tensor": {
                "calls": 26.0,
                "mb": 26.0,
                "alone_ms": 30.0 * scale,
                "floor_ms": 20.0,
            },
        }

    def run(step_s: float, collectives_s: float, scale: float) -> dict[str, Any]:
        rank = {"step_s": step_s, **state, "profiled_step_s": step_s, "replicated_mb": 0.1,
                "collectives_s": collectives_s, "calls": calls, "logits_mb": 0.5,
                "floors": floors(scale)}  # fmt: skip
        return {"step_s": step_s, "ranks": [rank, {**rank, "collectives_s": collectives_s / 2}]}

    whole = {"params_mb": 18.4, "grads_mb": 18.4, "optimizer_mb": 18.4, "state_mb": 55.2}
    runs = {
        "single": [{"step_s": 0.4, "ranks": [whole]}, {"step_s": 0.5, "ranks": [whole]}],
        "tp=2": [run(0.8, 0.2, 1.0), run(1.2, 0.3, 2.0)],
        "ddp=2": [{"step_s": 0.2}, {"step_s": 0.3}],
    }
    return {"tensor_parallel": {
        "runs": runs, "steps": 8, "degree": 2, "batch": 16, "vocab": 256, "floor_repeats": 20,
        "shape": {"n_layer": 6, "n_embd": 256, "n_head": 4, "block_size": 64},
        "quick": False, "smoke": False, "rounds": 2, "date": "today", "duration_s": 120.0,
        "load": ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), "cores": 2,
    }}  # fmt: skip


def test_tensor_parallel_alone_replaces_only_its_part(tmp_path: Path) -> None:
    from benchmarks.report import document

    path = tmp_path / document.REPORT
    path.write_text("# Performance\n\nthe rest, as it was\n")
    document.write_marked(tmp_path, _pipeline_parallel())
    document.write_marked(tmp_path, _tensor_parallel())
    text = path.read_text()
    before, section = text.split("<!-- /bench_pipeline_parallel -->\n\n", 1)
    assert before.startswith("# Performance\n\nthe rest, as it was\n\n<!-- bench_pipeline_")
    assert section.startswith(
        "<!-- bench_tensor_parallel -->\n## 14. Tensor parallelism: memory per rank"
    )
    assert section.endswith("<!-- /bench_tensor_parallel -->\n")
    assert "`python -m benchmarks --sections tensor_parallel --rounds 2`" in section
    assert "load average (1, 5, 15 min) before 1.00, 1.00, 1.00, after 2.00" in section
    # one process: ms per step, its own ratio, tokens/s (16 x 64 a step), the state by kind, the
    # whole logits (16 x 64 x 256 floats); no collectives
    assert "| one process | 450.0 (400.0-500.0) | 1.00 | 2,304 (2,048-2,560) | 18.4 | 18.4 | " \
        "18.4 | 55.2 | 1.000 | 1.00 | - | - |" in section  # fmt: skip
    # each rank: ms, the paired ratio (0.8/0.4, 1.2/0.5), tokens/s, state, its ratio, logits,
    # collectives, share
    assert "| tp=2, rank 1 | 1,000.0 (800.0-1,200.0) | 2.20 (2.00-2.40) | 1,067 (853-1,280) | " \
        "9.2 | 9.2 | 9.2 | 27.8 | 0.503 | 0.50 | 250.0 (200.0-300.0) | 0.25 (0.25-0.25) |" \
        in section  # fmt: skip
    assert "| tp=2, rank 2 |" in section and "| 125.0 (100.0-150.0) | 0.12 (0.12-0.12) |" in section
    assert "| ddp=2 (each rank half the batch) | 250.0 (200.0-300.0) | 0.55 (0.50-0.60) | " \
        "4,267 (3,413-5,120) | - |" in section  # fmt: skip
    # each kind of collective: rank 1's calls, MB, alone and floor per round, and their ratio
    assert "| `all_gather_into_tensor` | 26 | 26.00 | 15.0 (10.0-20.0) | 20.0 (20.0-20.0) | " \
        "0.75 (0.50-1.00) |" in section  # fmt: skip
    assert "| `reduce_scatter_tensor` | 26 | 26.00 | 45.0 (30.0-60.0) | 20.0 (20.0-20.0) | " \
        "2.25 (1.50-3.00) |" in section  # fmt: skip
    # tp's tokens/s over ddp's, paired (0.2/0.8, 0.3/1.2); the logits; round 1's floors
    assert "tensor parallelism trains 0.25x its tokens/s; each rank's logits are 0.50 of" in section
    assert "Alone, a step's collectives took 1.50x what all-reduces" in section  # 1.0 and 2.0
    assert "Each rank holds 0.503 of one process's training state" in section
    assert "27 all-gathers, 26 reduce-scatters, 27 all-reduces and 80 waits" in section
    assert "2.20x one process's (slower than one process)" in section

    # Measured anew: its part replaced, the pipeline's and the rest as they were.
    again = _tensor_parallel()
    again["tensor_parallel"]["steps"] = 5
    document.write_marked(tmp_path, again)
    replaced = path.read_text()
    assert replaced.replace("5 timed steps", "8 timed steps").replace(
        "over 5 more steps", "over 8 more steps"
    ) == text  # fmt: skip


def test_tensor_parallel_is_a_section_of_its_own() -> None:
    from benchmarks import bench

    assert "tensor_parallel" in bench.SECTIONS and "tensor_parallel" in bench.RUNNERS
    assert "tensor_parallel" not in bench.DEFAULT_SECTIONS
    assert bench.parse_args(["--sections", "tensor_parallel"]).sections == ["tensor_parallel"]


def test_collective_time_counts_each_call_once_inside_the_steps() -> None:
    """The outermost collective inside a step, not the c10d op it calls, nor Gloo's thread's
    transfer, nor a barrier between steps."""
    from types import SimpleNamespace as Event

    from benchmarks.tensor_parallel import STEP_EVENT, collective_time

    step = Event(name=STEP_EVENT, cpu_parent=None, cpu_time_total=9e5)
    backward = Event(name="autograd::engine::evaluate_function", cpu_parent=step,
                     cpu_time_total=5e5)  # fmt: skip
    gather = Event(name="_c10d_functional::all_gather_into_tensor", cpu_parent=step,
                   cpu_time_total=1e5)  # fmt: skip
    events = [
        step, backward, gather,
        Event(name="c10d::allgather_into_tensor_coalesced_", cpu_parent=gather, cpu_time_total=9e4),
        Event(name="_c10d_functional::reduce_scatter_tensor", cpu_parent=backward,
              cpu_time_total=2e5),
        Event(name="_c10d_functional::wait_tensor", cpu_parent=step, cpu_time_total=5e4),
        Event(name="gloo:all_gather", cpu_parent=None, cpu_time_total=8e4),  # Gloo's thread
        Event(name="c10d::barrier", cpu_parent=None, cpu_time_total=3e5),  # between steps
    ]  # fmt: skip
    seconds, calls = collective_time(events)
    assert seconds == pytest.approx(0.35)
    assert calls == {"_c10d_functional::all_gather_into_tensor": 1,
                     "_c10d_functional::reduce_scatter_tensor": 1,
                     "_c10d_functional::wait_tensor": 1}  # fmt: skip


def test_collective_sizes_are_the_whole_tensors_each_call_moves() -> None:
    """An all-gather's whole is its output (its input times the world), a reduce-scatter's and
    an all-reduce's their input; waits and calls outside a step are left out."""
    from types import SimpleNamespace as Event

    from benchmarks.tensor_parallel import GATHER, REDUCE, SCATTER, STEP_EVENT, collective_sizes

    step = Event(name=STEP_EVENT, cpu_parent=None, input_shapes=[])
    events = [
        step,
        Event(name=GATHER, cpu_parent=step, input_shapes=[[4, 8, 16]]),
        Event(name=GATHER, cpu_parent=step, input_shapes=[[4, 8, 16]]),
        Event(name=SCATTER, cpu_parent=step, input_shapes=[[4, 16, 16]]),
        Event(name=REDUCE, cpu_parent=step, input_shapes=[[16]]),
        Event(name="_c10d_functional::wait_tensor", cpu_parent=step, input_shapes=[[4, 16, 16]]),
        Event(name=REDUCE, cpu_parent=None, input_shapes=[[99]]),  # outside the steps
    ]  # fmt: skip
    assert collective_sizes(events, world=2) == {GATHER: {1024: 2}, SCATTER: {1024: 1},
                                                 REDUCE: {16: 1}}  # fmt: skip


def test_tensor_parallel_one_process_reports_its_state_by_kind() -> None:
    from benchmarks.tensor_parallel import _single

    tiny = {"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 8}
    result = _single(0, 1, tiny)
    (state,) = result["ranks"]
    assert result["step_s"] > 0
    # SGD's momentum is one buffer per parameter: the three kinds are the same size
    assert state["params_mb"] == state["grads_mb"] == state["optimizer_mb"] > 0
    assert state["state_mb"] == pytest.approx(3 * state["params_mb"])


# --- the trackers section ------------------------------------------------------------------------


def test_trackers_report_pairs_each_rounds_paces_and_counts_what_mlflow_holds(
    tmp_path: Path,
) -> None:
    """What `--sections trackers` measures (numbers made up): 2 rounds each."""
    from benchmarks import bench
    from benchmarks.report import document

    assert "trackers" in bench.RUNNERS and "trackers" not in bench.DEFAULT_SECTIONS
    alone = [{"steady": 100_000.0, "logged": 400}, {"steady": 80_000.0, "logged": 400}]
    both = [{"steady": 99_000.0, "logged": 400, "held": 400},
            {"steady": 76_000.0, "logged": 400, "held": 399}]  # fmt: skip
    measured = {"trackers": {
        "runs": {"[tensorboard]": alone, "[tensorboard,mlflow,csv]": both}, "steps": 4000,
        "log_every": 10, "threads": 1, "quick": False, "smoke": False, "rounds": 2,
        "date": "today", "duration_s": 60.0, "load": ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)),
        "cores": 2,
    }}  # fmt: skip
    path = tmp_path / document.REPORT
    path.write_text("# Performance\n\nthe rest, as it was\n")
    document.write_marked(tmp_path, measured)
    section = path.read_text().split("the rest, as it was\n\n", 1)[1]
    assert section.startswith("<!-- bench_trackers -->\n## 15. Trackers off the step")
    assert "`python -m benchmarks --sections trackers --rounds 2`" in section
    # the paces' medians; the ratios paired round by round: 0.99 and 0.95
    assert "| `logger=[tensorboard]` | 90,000 (80,000-100,000) | 1.000 | - |" in section
    assert "| `logger=[tensorboard,mlflow,csv]` | 87,500 (76,000-99,000) | 0.970 (0.950-0.990) " \
        "| 799 of 800 |" in section  # fmt: skip
    assert "| 0.970 (0.950-0.990) | **not met** (met in some rounds) |" in section
