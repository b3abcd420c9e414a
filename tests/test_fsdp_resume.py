"""fsdp checkpoints: each rank writes its shards; another world size loads them resharded."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from dpt.distributed import env_from_environment
from dpt.models.mlp import MLP
from dpt.state import checkpoint
from dpt.state.stateful import ModelState, OptimizerState, full_state_dict
from tests.helpers import (
    FAST,
    build_trainer,
    committed_checkpoints,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    train,
)

pytestmark = pytest.mark.slow  # every test here starts ranks

# A global batch of 48 = 2 x 24 = 3 x 16 = 1 x 48; 2048 samples make 42 steps an epoch in each.
GLOBAL_BATCH = 48
COMMON = [*FAST, "dataset.num_val_samples=65", "optimizer=adam", "trainer.seed=4",
          "strategy=fsdp", "model.hidden_dims=[64,64]"]  # fmt: skip


def _world(ranks: int) -> list[str]:
    return [f"launcher.nproc_per_node={ranks}", f"trainer.batch_size={GLOBAL_BATCH // ranks}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 steps on 2 fsdp ranks uninterrupted (`whole`), and the first 25 of them (`first`)."""
    root = tmp_path_factory.mktemp("fsdp-resume")
    train(root / "whole", *COMMON, *_world(2), "trainer.max_steps=40", timeout=300)
    train(root / "first", *COMMON, *_world(2), "trainer.max_steps=25", timeout=300)
    return root


def _resume_on(runs: Path, ranks: int) -> dict[str, torch.Tensor]:
    resumed = runs / f"on{ranks}"
    shutil.copytree(runs / "first", resumed)
    result = train(resumed, *COMMON, *_world(ranks), "trainer.max_steps=40", timeout=300)
    assert "resumed from" in result.stdout and "at step 25" in result.stdout
    return load_weights(resumed)


@pytest.mark.timeout(600)
def test_fsdp_resumed_on_the_same_ranks_ends_where_the_uninterrupted_run_ends(runs: Path) -> None:
    whole = load_weights(runs / "whole")
    MLP((32,), 10, [64, 64]).load_state_dict(whole)  # model.pt: gathered, for the bare model
    assert max_abs_diff(load_weights(runs / "first"), whole) > 1e-3  # the last 15 steps count
    assert max_abs_diff(_resume_on(runs, 2), whole) < 1e-5


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [1, 3])
def test_fsdp_resumed_on_another_world_size_ends_where_the_uninterrupted_run_ends(
    runs: Path, ranks: int
) -> None:
    assert max_abs_diff(_resume_on(runs, ranks), load_weights(runs / "whole")) < 1e-5


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


def _write_shards(rank: int, world: int, port: int, out: Path) -> None:
    """Train 3 steps on `world` fsdp ranks; the last step's checkpoint is written by all."""
    with joined_world(rank, world, port) as env:
        trainer = build_trainer(out / "run", env, *SMALL, *_world(world)[1:], "trainer.max_steps=3")
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


def _load_in_world(rank: int, world: int, port: int, out: Path) -> None:
    with joined_world(rank, world, port) as env:
        _load_shards(env, out, f"loaded-on-{world}")


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
def test_a_checkpoint_of_two_fsdp_ranks_loads_on_one_and_three(tmp_path: Path) -> None:
    mp.spawn(_write_shards, args=(2, free_port(), tmp_path), nprocs=2, join=True)
    [written_at] = committed_checkpoints(tmp_path / "run")
    assert sorted(p.name for p in written_at.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    written = torch.load(tmp_path / "written.pt", weights_only=True)
    assert written["optimizer"]["state"]  # Adam's moments exist: there is state to reshard
    mp.spawn(_load_in_world, args=(3, free_port(), tmp_path), nprocs=3, join=True)
    _load_shards(env_from_environment("cpu"), tmp_path, "loaded-on-1")
    for world in (1, 3):
        _assert_same(written, torch.load(tmp_path / f"loaded-on-{world}.pt", weights_only=True))
