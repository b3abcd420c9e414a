"""fsdp checkpoints: each rank writes its shards; another world size loads them resharded."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from dpt.distributed import env_from_environment
from dpt.models.mlp import MLP
from dpt.state import checkpoint
from dpt.state.stateful import ModelState, OptimizerState, full_state_dict
from tests.helpers import (
    FAST,
    WorldRun,
    build_trainer,
    committed_checkpoints,
    joined_world,
    load_weights,
    max_abs_diff,
    run_here,
    shared_port,
    spawn,
    world_rank_runs,
    world_run,
)

pytestmark = pytest.mark.slow  # every test here starts ranks

# Two spawned worlds, one start-up each (`worlds` below): 2 ranks train the uninterrupted run and
# its first 25 steps, resume those on 2 ranks and write the resharding test's checkpoint; 3 ranks
# resume them and load that checkpoint. The one-process resume and load run in this process.

# A global batch of 48 = 2 x 24 = 3 x 16 = 1 x 48; 2048 samples make 42 steps an epoch in each.
GLOBAL_BATCH = 48
COMMON = [*FAST, "dataset.num_val_samples=65", "optimizer=adam", "trainer.seed=4",
          "strategy=fsdp", "model.hidden_dims=[64,64]"]  # fmt: skip


def _world(ranks: int) -> list[str]:
    return [f"launcher.nproc_per_node={ranks}", f"trainer.batch_size={GLOBAL_BATCH // ranks}"]


def _resume_on(worlds: dict[str, Any], ranks: int) -> dict[str, torch.Tensor]:
    root = worlds["root"]
    if ranks == 1:  # one process: in this one, as `train.py strategy=fsdp` with one rank runs
        shutil.copytree(root / "first", root / "on1")
        _, stdout = run_here(root / "on1", *COMMON, *_world(1), "trainer.max_steps=40")
    else:
        stdout = worlds[f"on{ranks}"].stdout
    assert "resumed from" in stdout and "at step 25" in stdout
    return load_weights(root / f"on{ranks}")


@pytest.mark.timeout(600)
def test_fsdp_resumed_on_the_same_ranks_ends_where_the_uninterrupted_run_ends(
    worlds: dict[str, Any],
) -> None:
    whole = load_weights(worlds["root"] / "whole")
    MLP((32,), 10, [64, 64]).load_state_dict(whole)  # model.pt: gathered, for the bare model
    assert max_abs_diff(load_weights(worlds["root"] / "first"), whole) > 1e-3  # the last 15 count
    assert max_abs_diff(_resume_on(worlds, 2), whole) < 1e-5


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [1, 3])
def test_fsdp_resumed_on_another_world_size_ends_where_the_uninterrupted_run_ends(
    worlds: dict[str, Any], ranks: int
) -> None:
    whole = load_weights(worlds["root"] / "whole")
    assert max_abs_diff(_resume_on(worlds, ranks), whole) < 1e-5


# --- the resharding itself, without the data and RNG parts -------------------------------------

SMALL = [*COMMON, "checkpoint.enabled=true", "trainer.log_every_n_steps=100"]


def _gathered(trainer: Any) -> dict[str, Any]:
    """The whole model and optimizer state on rank 0 (every rank must call this)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = trainer.model
    return {
        "model": full_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, trainer.optimizer, options=options),
    }


def _write_shards(env: Any, out: Path) -> None:
    """Train 3 steps on the world's fsdp ranks; the last step's checkpoint is written by all."""
    trainer = build_trainer(out / "run", env, *SMALL, *_world(env.world_size)[1:],
                            "trainer.max_steps=3")  # fmt: skip
    trainer.fit()
    trainer.metrics.close()
    state = _gathered(trainer)
    if env.is_main:
        torch.save(state, out / "written.pt")


def _load_shards(env: Any, out: Path, name: str) -> None:
    trainer = build_trainer(out / name, env, *SMALL, *_world(env.world_size)[1:])
    parts = {
        "model": ModelState(trainer.model),
        "optimizer": OptimizerState(trainer.model, trainer.optimizer),
    }
    checkpoint.load(committed_checkpoints(out / "run")[-1], parts)
    state = _gathered(trainer)
    trainer.metrics.close()
    if env.is_main:
        torch.save(state, out / f"{name}.pt")


def _world_of(rank: int, world: int, runs: list[WorldRun], out: Path) -> None:
    """The runs as a rank runs them (`run_worker`), then the resharding: 2 ranks write the
    checkpoint, 3 load it."""
    world_rank_runs(rank, world, runs)
    with joined_world(rank, world, shared_port(rank, out / f"shards-{world}.port")) as env:
        if world == 2:
            _write_shards(env, out)
        else:
            _load_shards(env, out, f"loaded-on-{world}")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """40 steps on 2 fsdp ranks uninterrupted (`whole`) and the first 25 of them (`first`), those
    resumed on 2 and on 3 ranks (`on2`, `on3`); the resharding test's checkpoint of 2 ranks
    (`shards/run`), loaded on 3 (`shards/loaded-on-3.pt`)."""
    root = tmp_path_factory.mktemp("fsdp-resume")
    shards = root / "shards"
    shards.mkdir()
    runs = {
        2: [world_run("whole", root / "whole", *COMMON, *_world(2), "trainer.max_steps=40"),
            world_run("first", root / "first", *COMMON, *_world(2), "trainer.max_steps=25")],
        3: [],
    }  # fmt: skip
    for ranks in (2, 3):
        runs[ranks].append(world_run(f"on{ranks}", root / f"on{ranks}", *COMMON, *_world(ranks),
                                     "trainer.max_steps=40", copy_from=root / "first"))  # fmt: skip
        spawn(_world_of, ranks, runs[ranks], shards, nprocs=ranks)
    return {"root": root, "shards": shards} | {run.name: run for run in runs[2] + runs[3]}


def _assert_same(a: Any, b: Any) -> None:
    """The same nested state, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.timeout(600)
def test_a_checkpoint_of_two_fsdp_ranks_loads_on_one_and_three(worlds: dict[str, Any]) -> None:
    out = worlds["shards"]
    [written_at] = committed_checkpoints(out / "run")
    assert sorted(p.name for p in written_at.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    written = torch.load(out / "written.pt", weights_only=True)
    assert written["optimizer"]["state"]  # Adam's moments exist: there is state to reshard
    _load_shards(env_from_environment("cpu"), out, "loaded-on-1")
    for world in (1, 3):
        _assert_same(written, torch.load(out / f"loaded-on-{world}.pt", weights_only=True))
