"""The tiny GPT trained for real on the same global batch: fsdp (a unit per block) = ddp = one
process; activation checkpointing = none; a run stopped on 2 ranks and resumed on 1 = the
uninterrupted run, from the token file and from token shards served over HTTP on loopback.

The 2-rank runs share one spawned world (one start-up); the one-process runs run in this
process, through the rank's own entry point (`run_worker`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dpt.launch.launchers import resolved
from dpt.state.stateful import full_state_dict
from tests.helpers import (
    build_trainer,
    compose,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    run_config_here,
    spawn,
    write_shards,
)
from tests.http_server import serve

pytestmark = pytest.mark.slow

LINES = "".join(f"{a}+{b}={a + b}\n" for a in range(40) for b in range(40))
STEPS, FIRST = 10, 6
# A tiny GPT on byte tokens; SGD at a small rate (Adam would turn float-order noise in
# near-zero gradients into steps of its learning rate).
TINY = ["model=gpt", "task=language_model", "model.block_size=16", "model.n_layer=2",
        "model.n_head=2", "model.n_embd=32", "optimizer=sgd", "optimizer.lr=0.05",
        "optimizer.momentum=0", "trainer.log_every_n_steps=5",
        f"trainer.max_steps={STEPS}"]  # fmt: skip
GLOBAL_BATCH = 16


def _batch(ranks: int) -> list[str]:
    return [f"trainer.batch_size={GLOBAL_BATCH // ranks}"]


def _text(folder: Path) -> list[str]:
    return ["dataset=text", f"dataset.root={folder / 'text'}", f"dataset.cache_dir={folder / 'c'}"]


def _two_ranks(rank: int, world: int, port: int, out: Path, url: str) -> None:
    """Every 2-rank run in one world: ddp, fsdp, the text run stopped at FIRST and the shards
    run (over HTTP) stopped at FIRST."""
    runs = {
        "ddp": [*_text(out), "strategy=ddp", "checkpoint.enabled=false"],
        "fsdp": [*_text(out), "strategy=fsdp", "checkpoint.enabled=false"],
        "text-first": [*_text(out), "strategy=ddp", f"trainer.max_steps={FIRST}"],
        "shards-first": ["dataset=shards", f"dataset.root={url}", "dataset.num_workers=0",
                         f"dataset.cache_dir={out / 'shard-cache'}", "strategy=ddp",
                         f"trainer.max_steps={FIRST}"],
    }  # fmt: skip
    with joined_world(rank, world, port) as env:
        for name, overrides in runs.items():
            trainer = build_trainer(out / name, env, *TINY, *overrides, *_batch(2))
            trainer.fit()
            trainer.metrics.close()
            weights = full_state_dict(trainer.model)
            if env.is_main:
                torch.save(weights, out / f"{name}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The 2-rank runs; the shards stay served (a resume reads them at the same URL)."""
    out = tmp_path_factory.mktemp("gpt")
    (out / "text").mkdir()
    (out / "text" / "lines.txt").write_text(LINES)
    write_shards("--text", str(out / "text"), "--block-size", "16", "--out", str(out / "shards"),
                 "--shard-size-mb", "0.01")  # fmt: skip
    with serve(out / "shards") as server:
        (out / "url").write_text(server.url)
        spawn(_two_ranks, 2, free_port(), out, server.url, nprocs=2)
        yield out


def _single(run_dir: Path, *overrides: str) -> dict:
    return run_config_here(resolved(compose(*TINY, *_batch(1), *overrides)), run_dir)


def test_fsdp_per_block_equals_ddp_equals_one_process(runs: Path, tmp_path: Path) -> None:
    _single(tmp_path, *_text(runs), "checkpoint.enabled=false")
    single = load_weights(tmp_path)
    for strategy in ("ddp", "fsdp"):
        assert max_abs_diff(torch.load(runs / f"{strategy}.pt"), single) < 1e-5, strategy
    assert max_abs_diff(torch.load(runs / "text-first.pt"), single) > 1e-4  # 4 steps count


def test_activation_checkpointing_changes_no_weight(runs: Path, tmp_path: Path) -> None:
    common = [*_text(runs), "checkpoint.enabled=false"]
    _single(tmp_path / "plain", *common)
    _single(tmp_path / "recomputed", *common, "model.activation_checkpointing=true")
    diff = max_abs_diff(load_weights(tmp_path / "plain"), load_weights(tmp_path / "recomputed"))
    assert diff < 1e-6


@pytest.mark.parametrize("source", ["text", "shards"])
def test_stopped_on_two_ranks_resumed_on_one_ends_with_the_uninterrupted_weights(
    runs: Path, tmp_path: Path, source: str
) -> None:
    shards = ["dataset=shards", "dataset.num_workers=0", f"dataset.cache_dir={tmp_path / 'c'}"]
    url = (runs / "url").read_text()
    # The uninterrupted run reads the shards' folder; the resumed one, as its first part, HTTP.
    whole, rest = (_text(runs), _text(runs)) if source == "text" else (
        [*shards, f"dataset.root={runs / 'shards'}"], [*shards, f"dataset.root={url}"])  # fmt: skip
    _single(tmp_path / "whole", *whole)
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / f"{source}-first", resumed)
    result = _single(resumed, *rest, "checkpoint.strict=true")
    assert result["steps"] == STEPS
    assert max_abs_diff(load_weights(resumed), load_weights(tmp_path / "whole")) < 1e-6


def test_tokens_per_s_and_tflops_are_reported(runs: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = _single(tmp_path, *_text(runs), "checkpoint.enabled=false")
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["tokens_per_s"] == pytest.approx(metrics["samples_per_s"] * 16)
    assert metrics["tflops"] > 0 and "mfu" not in metrics  # a CPU: no peak to compare with
    assert result["tokens_per_s"] == metrics["tokens_per_s"]
    for folder in ("rank0", "world"):
        acc = EventAccumulator(str(tmp_path / "tb" / folder))
        acc.Reload()
        assert {"train/tokens_per_s", "perf/tflops"} <= set(acc.Tags()["scalars"]), folder
