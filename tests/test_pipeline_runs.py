"""strategy=pipeline trained for real on the same global batch as one process: 2 stages under
gpipe and 1f1b, 2 stages x 2 ddp replicas (4 ranks: every schedule at 2 and 4 micro-batches),
on the MLP and the tiny GPT (whose head shares its embedding's matrix across the stages); a run
stopped on 2 stages and resumed on 1 process, and one stopped on 1 process and resumed on 2
stages, end with the uninterrupted weights; validation, model_best.pt and dpt-predict see the
whole model; each stage logs its compute time, idle time and bubble.

The pipeline runs share two spawned worlds (2 and 4 ranks: one start-up each) and run through
the rank's own run function (`dpt.loop.train.train`: model.pt, data.json, metrics.json as a
real run writes them); the one-process runs run in this process (`run_worker`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    Process,
    committed_checkpoints,
    dpt_logger_kept,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    rank_pid,
    run_here,
    run_until,
    spawn,
    train_rank,
)

pytestmark = pytest.mark.slow

STEPS, FIRST, GLOBAL_BATCH = 10, 6, 16
# SGD at a small rate: Adam would turn float-order noise in near-zero gradients into steps.
SGD = ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0",
       "trainer.log_every_n_steps=5"]  # fmt: skip
# The MLP on 160 samples: one epoch of 10 steps, then validation and model_best.pt.
MLP = ["dataset.num_samples=160", "dataset.num_val_samples=48", "trainer.epochs=1"]
LINES = "".join(f"{a}+{b}={a + b}\n" for a in range(40) for b in range(40))
OFF = ["checkpoint.enabled=false"]
# Clipping by the norm over all stages; 2 accumulated micro-batches of 8 per step.
CLIP_ACCUM = ["trainer.grad_clip_norm=0.3", "trainer.grad_accum_steps=2", "trainer.batch_size=8"]


def gpt(folder: Path) -> list[str]:
    """The tiny GPT of the language-model tests: 4 units (embedding, 2 blocks, head)."""
    return ["model=gpt", "task=language_model", "model.block_size=16", "model.n_layer=2",
            "model.n_head=2", "model.n_embd=32", "dataset=text",
            f"dataset.root={folder / 'text'}", f"dataset.cache_dir={folder / 'cache'}",
            f"trainer.max_steps={STEPS}"]  # fmt: skip


def pipeline(ranks: int, schedule: str = "1f1b", microbatches: int = 4) -> list[str]:
    return ["strategy=pipeline", f"strategy.schedule={schedule}",
            f"strategy.microbatches={microbatches}",
            f"trainer.batch_size={GLOBAL_BATCH * 2 // ranks}"]  # fmt: skip


# The MLP on 2 stages x 2 ddp replicas: every schedule (interleaved: 2 stages a rank) at 2 and 4
# micro-batches (gpipe, and 1f1b at 2, run several forwards before a backward: DDP could not).
DDP_SCHEDULES = [(s, m) for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (2, 4)]


def ddp_run(schedule: str, microbatches: int) -> str:
    """The run's folder; `mlp-2x2` (1f1b x 4, the defaults) is also validation's 4-rank run."""
    if (schedule, microbatches) == ("1f1b", 4):
        return "mlp-2x2"
    return f"mlp-2x2-{schedule}-{microbatches}"


def _ddp_mlp(schedule: str, microbatches: int) -> list[str]:
    virtual = ["strategy.stages_per_rank=2"] if schedule == "interleaved_1f1b" else []
    return [*MLP, *OFF, *pipeline(4, schedule, microbatches), "strategy.data_parallel=ddp",
            *virtual]  # fmt: skip


def _world_runs(out: Path, world: int) -> dict[str, list[str]]:
    if world == 4:  # 2 stages x 2 replicas
        fsdp = [*gpt(out), *pipeline(4), "strategy.data_parallel=fsdp"]
        return {
            **{ddp_run(s, m): _ddp_mlp(s, m) for s, m in DDP_SCHEDULES},
            "gpt-2x2": [*gpt(out), *OFF, *pipeline(4)],
            # per replica 4 x 2 accumulated: the global batch of 16
            "gpt-2x2-fsdp": [*fsdp, *OFF, *CLIP_ACCUM, "trainer.batch_size=4"],
        }
    return {
        "mlp-gpipe": [*MLP, *OFF, *pipeline(2, "gpipe")],
        "mlp-1f1b": [*MLP, *OFF, *pipeline(2)],
        "gpt-gpipe": [*gpt(out), *OFF, *pipeline(2, "gpipe")],
        "gpt-1f1b": [*gpt(out), *OFF, *pipeline(2)],
        "gpt-clip-accum": [*gpt(out), *OFF, *pipeline(2), *CLIP_ACCUM],
        # 4 stages on 2 ranks: each rank holds 2 (embed and h.1, h.0 and head)
        "gpt-interleaved": [
            *gpt(out),
            *OFF,
            *pipeline(2, "interleaved_1f1b"),
            "strategy.stages_per_rank=2",
        ],
        "gpt-bf16": [*gpt(out), *OFF, *pipeline(2), "trainer.precision=bf16-mixed"],
        "gpt-first": [*gpt(out), *pipeline(2), f"trainer.max_steps={FIRST}"],
        "gpt-resumed-on-2": [*gpt(out), *pipeline(2)],  # the one-process run's checkpoint
    }


def _ranks(rank: int, world: int, port: int, out: Path) -> None:
    with joined_world(rank, world, port) as env:
        if world == 2:  # the benchmark's measurement, on this world (its own is the same code)
            from benchmarks.pipeline_parallel import _rank

            row = _rank(env, out, "1f1b", 2, 1, 1, TINY_BENCH)
            if env.is_main:
                (out / "bench.json").write_text(json.dumps(row))
        for name, overrides in _world_runs(out, world).items():
            train_rank(env, out / name, *SGD, *overrides)


def _single(run_dir: Path, *overrides: str) -> dict:
    return run_here(run_dir, *SGD, *overrides)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    (out / "text").mkdir()
    (out / "text" / "lines.txt").write_text(LINES)
    _single(out / "gpt-resumed-on-2", *gpt(out), f"trainer.batch_size={GLOBAL_BATCH}",
            f"trainer.max_steps={FIRST}")  # fmt: skip
    for world in (2, 4):
        spawn(_ranks, world, free_port(), out, nprocs=world)
    return out


@pytest.fixture(scope="module")
def single(runs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted one-process runs on the same global batch."""
    out = tmp_path_factory.mktemp("single")
    batch = f"trainer.batch_size={GLOBAL_BATCH}"
    _single(out / "mlp", *MLP, *OFF, batch)
    _single(out / "gpt", *gpt(runs), *OFF, batch)
    _single(out / "gpt-clip-accum", *gpt(runs), *OFF, *CLIP_ACCUM)
    _single(out / "gpt-bf16", *gpt(runs), *OFF, batch, "trainer.precision=bf16-mixed")
    return {path.name: path for path in out.iterdir()}


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("run", ["gpipe", "1f1b", "2x2"])
def test_two_stages_equal_one_process(
    runs: Path, single: dict[str, Path], model: str, run: str
) -> None:
    diff = max_abs_diff(load_weights(runs / f"{model}-{run}"), load_weights(single[model]))
    assert diff < 1e-5
    summary = json.loads((runs / f"{model}-{run}" / "metrics.json").read_text())
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * GLOBAL_BATCH


@pytest.mark.parametrize(("schedule", "microbatches"), DDP_SCHEDULES)
def test_ddp_replicas_of_every_schedule_equal_one_process(
    runs: Path, single: dict[str, Path], schedule: str, microbatches: int
) -> None:
    run = runs / ddp_run(schedule, microbatches)
    assert max_abs_diff(load_weights(run), load_weights(single["mlp"])) < 1e-5
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * GLOBAL_BATCH


def test_interleaved_stages_equal_one_process(runs: Path, single: dict[str, Path]) -> None:
    assert max_abs_diff(load_weights(runs / "gpt-interleaved"), load_weights(single["gpt"])) < 1e-5
    log = (runs / "gpt-interleaved" / "logs" / "rank0.log").read_text()
    assert "stage 1 of 4 (embed), 3 of 4 (h.1)" in log


@pytest.mark.parametrize("run", ["gpt-clip-accum", "gpt-2x2-fsdp"])
def test_clipping_and_accumulation_equal_one_process(
    runs: Path, single: dict[str, Path], run: str
) -> None:
    pipelined, one = load_weights(runs / run), load_weights(single["gpt-clip-accum"])
    assert max_abs_diff(pipelined, one) < 1e-5
    unclipped = load_weights(single["gpt"])  # the same batches: clipping changed the weights
    assert max_abs_diff(one, unclipped) > 1e-4


def test_bf16_autocast_trains_the_stages_as_one_process(
    runs: Path, single: dict[str, Path]
) -> None:
    pipelined = load_weights(runs / "gpt-bf16")
    # bf16 rounds products of other shapes (micro-batches) otherwise: close, not equal
    assert max_abs_diff(pipelined, load_weights(single["gpt-bf16"])) < 1e-3
    assert max_abs_diff(pipelined, load_weights(single["gpt"])) > 1e-5  # bf16 did compute


def test_validation_and_best_model_see_the_whole_model(runs: Path, single: dict[str, Path]) -> None:
    for run in ("mlp-1f1b", "mlp-2x2"):
        val = json.loads((runs / run / "metrics.json").read_text())["val"]
        expected = json.loads((single["mlp"] / "metrics.json").read_text())["val"]
        assert val["val/loss"] == pytest.approx(expected["val/loss"], abs=1e-5), run
        best = torch.load(runs / run / "model_best.pt", weights_only=True)
        assert max_abs_diff(best, load_weights(runs / run)) == 0, run  # one epoch: the last


def test_dpt_predict_runs_the_whole_model(runs: Path, tmp_path: Path) -> None:
    from dpt.commands.predict import main
    from dpt.models.mlp import MLP

    inputs = torch.randn(5, 32)
    torch.save(inputs, tmp_path / "x.pt")
    with dpt_logger_kept():
        main([str(runs / "mlp-1f1b"), str(tmp_path / "x.pt"), "--csv", str(tmp_path / "p.csv")])
    model = MLP((32,), 10, [256, 256])
    model.load_state_dict(torch.load(runs / "mlp-1f1b" / "model_best.pt", weights_only=True))
    with torch.no_grad():
        expected = torch.softmax(model(inputs), dim=1).max(dim=1).values.tolist()
    rows = (tmp_path / "p.csv").read_text().splitlines()[1:]
    assert [float(row.split(",")[2]) for row in rows] == pytest.approx(expected, abs=1e-6)


def test_stopped_on_two_stages_resumed_on_one_process(
    runs: Path, single: dict[str, Path], tmp_path: Path
) -> None:
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "gpt-first", resumed)
    result = _single(resumed, *gpt(runs), f"trainer.batch_size={GLOBAL_BATCH}",
                     "checkpoint.strict=true")  # fmt: skip
    assert result["steps"] == STEPS
    assert max_abs_diff(load_weights(resumed), load_weights(single["gpt"])) < 1e-6


def test_stopped_on_one_process_resumed_on_two_stages(runs: Path, single: dict[str, Path]) -> None:
    diff = max_abs_diff(load_weights(runs / "gpt-resumed-on-2"), load_weights(single["gpt"]))
    assert diff < 1e-6


def test_each_stage_logs_its_compute_idle_time_and_bubble(runs: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses, params = [], []
    for rank in (0, 1):
        acc = EventAccumulator(str(runs / "gpt-1f1b" / "tb" / f"rank{rank}"))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {"pipeline/compute_s", "pipeline/idle_s", "pipeline/bubble"} <= tags, rank
        bubble = [e.value for e in acc.Scalars("pipeline/bubble")]
        assert all(0 < b < 1 for b in bubble), (rank, bubble)
        losses.append([e.value for e in acc.Scalars("train/loss")])
        params.append(acc.Scalars("memory/params_mb")[-1].value)
    assert losses[0] == losses[1]  # the last stage's loss, on the first stage too
    whole = sum(t.numel() * 4 for t in load_weights(runs / "gpt-1f1b").values()) / 2**20
    assert all(p < whole for p in params)  # each stage holds part of the model


@pytest.mark.timeout(600)
def test_the_readme_pipeline_lines_train_and_sample(tmp_path: Path) -> None:
    from tests.helpers import run_docs_block

    folder, results = run_docs_block("pipeline", tmp_path)
    run = folder / "outputs" / "gpt_pp"
    metrics = json.loads((run / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["steps"]) == (2, 20)
    log = (run / "logs" / "rank1.log").read_text()
    assert "strategy=pipeline | stage 2 of 2 (h.1-head)" in log
    generated = next(r for c, r in results.items() if c.startswith("dpt-generate")).stdout
    assert generated.startswith("12+34=") and len(generated.strip()) > len("12+34=")


TINY_BENCH = {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 8}


def test_the_benchmark_measures_each_stages_bubble_and_state(runs: Path) -> None:
    """`python -m benchmarks --sections pipeline_parallel`'s rank, on a tiny GPT."""
    from benchmarks.pipeline_parallel import _single

    row = json.loads((runs / "bench.json").read_text())
    assert row["step_s"] > 0
    stages = row["ranks"]
    assert all(0 < stage["pipeline/bubble"] < 1 for stage in stages), stages
    whole = _single(0, 1, TINY_BENCH)["ranks"][0]["state_mb"]
    # the stages hold the model between them (the shared embedding once more, on the last)
    assert max(s["state_mb"] for s in stages) < whole < sum(s["state_mb"] for s in stages)


KILLED = [*SGD, "dataset.num_samples=8192", "trainer.max_steps=400", "checkpoint.every_n_steps=5",
          "trainer.batch_size=64"]  # fmt: skip


@pytest.mark.timeout(300)
def test_a_pipeline_killed_by_sigkill_resumes_on_one_process(tmp_path: Path) -> None:
    """`dpt strategy=pipeline` on 2 ranks, rank 1 killed (SIGKILL) after step 10: the world
    stops; the folder then resumes in one process, from the newest checkpoint the stages
    committed, and ends with the weights of one process run without a stop."""
    run = tmp_path / "killed"

    def kill_rank_1(proc: Process, line: str) -> None:
        os.kill(rank_pid(run, 1), signal.SIGKILL)

    killed = run_until(run, [*KILLED, "strategy=pipeline"], "[rank 0] epoch 1 | step 10/",
                       kill_rank_1)  # fmt: skip
    assert killed.returncode == 1, killed.output
    newest = committed_checkpoints(run)[-1]
    end = int(newest.name.removeprefix("step-")) + 5
    assert end < 400, killed.output  # stopped mid-run
    resumed = _single(run, *KILLED, f"trainer.max_steps={end}", "checkpoint.strict=true")
    assert resumed["steps"] == end
    _single(tmp_path / "whole", *KILLED, f"trainer.max_steps={end}", "checkpoint.enabled=false")
    assert max_abs_diff(load_weights(run), load_weights(tmp_path / "whole")) < 1e-6
