"""Commit, rotation and rollback of checkpoints, in this process (no ranks started): fast."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.compat.proto.summary_pb2 import Summary

from dpt.distributed import DistEnv
from dpt.observe.event_file import EventFile, scalars_event, summary_event
from dpt.state.checkpoint import (
    MARKER,
    CheckpointError,
    Checkpoints,
    committed,
    step_folders,
    strays,
)
from dpt.state.stateful import PlainState, Progress
from tests.helpers import file_tree, junk_files

CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


class Weights:
    """A tensor part, like the model's."""

    def __init__(self) -> None:
        self.w = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w.copy_(state["w"])


def _parts(step: int = 0) -> dict[str, Any]:
    weights, progress = Weights(), Progress(step=step)
    weights.w.fill_(step)
    return {"weights": weights, "progress": PlainState(progress)}


def _checkpoints(run: Path, keep: int = 2) -> Checkpoints:
    return Checkpoints(run, CPU1, keep, config_yaml="a: 1\n")


def _save(ckpts: Checkpoints, *steps: int) -> None:
    for step in steps:
        ckpts.save(_parts(step), step)


def _names(run: Path) -> list[str]:
    return [c.path.name for c in committed(run / "checkpoints")]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_checkpoint_is_a_committed_folder_and_loads_back(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path)
    ckpts.resume("auto", _parts())  # nothing there yet: a fresh start
    _save(ckpts, 3)
    folder = tmp_path / "checkpoints" / "step-00000003"
    assert json.loads((folder / MARKER).read_text())["step"] == 3
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    parts = _parts()
    start = _checkpoints(tmp_path).resume("auto", parts)
    assert start is not None and (start.path, start.step) == (folder, 3)
    assert torch.equal(parts["weights"].w, torch.full((3,), 3.0))
    assert parts["progress"].part.step == 3


def test_rotation_keeps_the_newest_and_ignores_strays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "checkpoints"
    ckpts = _checkpoints(tmp_path, keep=1)
    ckpts.resume("auto", _parts())
    _save(ckpts, 1)
    (folder / "step-99999999.pt").write_bytes(b"\x00garbage")  # a high-numbered stray file
    (folder / "step-99999998").mkdir()  # a folder named like a checkpoint, never committed
    _save(ckpts, 2, 3)
    assert _names(tmp_path) == ["step-00000003"]  # the new save never deletes itself
    assert {p.name for p in strays(folder)} == {"step-99999999.pt", "step-99999998"}
    named = [w for w in _warnings(caplog) if "not a committed checkpoint" in w]
    assert len(named) == 2 and any("step-99999999.pt" in w for w in named)  # each once


def test_rotation_never_deletes_what_it_cannot_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = _checkpoints(tmp_path, keep=1)
    ckpts.resume("auto", _parts())
    _save(ckpts, 1)
    marker = tmp_path / "checkpoints" / "step-00000001" / MARKER
    marker.write_text("{not json")  # changed under the run: not provably this run's any more
    _save(ckpts, 2, 3)
    assert (tmp_path / "checkpoints" / "step-00000001").is_dir()
    assert _names(tmp_path) == ["step-00000003"]
    left = [w for w in _warnings(caplog) if "left " in w]
    assert len(left) == 1 and "step-00000001" in left[0]


def test_a_checkpoint_without_marker_is_ignored_and_temporaries_cleaned(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path, keep=3)
    ckpts.resume("auto", _parts())
    _save(ckpts, 1, 2)
    (tmp_path / "checkpoints" / "step-00000002" / MARKER).unlink()  # cut off before the marker
    stale = tmp_path / "checkpoints" / ".step-00000003.tmp-4242"  # a dead run's temporary
    stale.mkdir()
    parts = _parts()
    start = _checkpoints(tmp_path, keep=3).resume("auto", parts)
    assert start is not None and start.step == 1
    assert not stale.exists()


def test_the_same_step_saved_twice_replaces_the_first(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path)
    ckpts.resume(None, _parts())
    _save(ckpts, 1, 2)
    ckpts.save(_parts(7), 2)  # the run's last step is also a periodic one: saved again
    parts = _parts()
    _checkpoints(tmp_path).resume("auto", parts)
    assert _names(tmp_path) == ["step-00000001", "step-00000002"]
    assert torch.equal(parts["weights"].w, torch.full((3,), 7.0))


def test_rollback_moves_the_newer_branch_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dpt")
    ckpts = _checkpoints(tmp_path, keep=5)
    ckpts.resume(None, _parts())
    _save(ckpts, 1, 2, 3, 4)
    older = tmp_path / "checkpoints" / "step-00000002"
    rolled = _checkpoints(tmp_path, keep=5)
    assert rolled.resume(str(older), _parts()) is not None
    aside = list((tmp_path / "checkpoints").glob("abandoned-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == [
        "step-00000003",
        "step-00000004",
    ]
    moved = [r.getMessage() for r in caplog.records if "moved 2 newer" in r.getMessage()]
    assert len(moved) == 1 and str(aside[0]) in moved[0]
    _save(rolled, 3)  # the new branch: no clash with the old step 3
    start = _checkpoints(tmp_path).resume("auto", _parts())
    assert start is not None and start.step == 3
    assert _names(tmp_path) == ["step-00000001", "step-00000002", "step-00000003"]


WAYS_ON = (
    "set checkpoint.resume=never to start over in this run folder, or start a new one "
    "(hydra.run.dir=...)"
)


def test_auto_refuses_when_every_checkpoint_is_damaged_and_moves_nothing(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path, keep=3)
    ckpts.resume(None, _parts())
    _save(ckpts, 1, 2, 3)
    junk_files(tmp_path / "checkpoints")
    before = file_tree(tmp_path)
    with pytest.raises(CheckpointError) as refused:
        _checkpoints(tmp_path).resume("auto", _parts())
    assert str(refused.value) == (
        f"checkpoint.resume=auto: every checkpoint in {tmp_path / 'checkpoints'} is damaged "
        f"(3 found), nothing trained or moved; {WAYS_ON}"
    )
    assert file_tree(tmp_path) == before


@pytest.mark.parametrize("what", ["marker", "shards"])
def test_a_damaged_newest_checkpoint_is_skipped_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, what: str
) -> None:
    ckpts = _checkpoints(tmp_path, keep=3)
    ckpts.resume(None, _parts())
    _save(ckpts, 1, 2)
    newest = tmp_path / "checkpoints" / "step-00000002"
    junk_files(newest) if what == "marker" else _junk_shards(newest)
    parts = _parts()
    start = _checkpoints(tmp_path).resume("auto", parts)
    assert start is not None and start.step == 1
    assert torch.equal(parts["weights"].w, torch.full((3,), 1.0))
    skipped = [w for w in _warnings(caplog) if w.startswith("skipped: ")]
    reason = (
        f"is damaged: its {MARKER} marker cannot be read"
        if what == "marker"
        else "is unreadable (cut off or corrupt)"
    )
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped: checkpoint {newest} {reason}")
    assert not newest.exists()  # moved aside with the branch it ended: kept for a person


def _junk_shards(checkpoint: Path) -> None:
    for path in checkpoint.iterdir():
        if path.name != MARKER:
            path.write_bytes(b"\x00junk" * 8)


def test_a_checkpoint_asked_for_by_path_with_a_damaged_marker_is_named(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path)
    ckpts.resume(None, _parts())
    _save(ckpts, 1)
    path = tmp_path / "checkpoints" / "step-00000001"
    (path / MARKER).write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError) as refused:
        _checkpoints(tmp_path).resume(str(path), _parts())
    assert str(refused.value) == f"checkpoint {path} is damaged: its {MARKER} marker cannot be read"


@pytest.mark.parametrize("left", ["metrics.json", "step folder", "curves"])
def test_a_folder_with_an_earlier_runs_work_is_never_trained_from_step_0(
    tmp_path: Path, left: str
) -> None:
    if left == "metrics.json":
        (tmp_path / "metrics.json").write_text("{}")
        said = "metrics.json"
    elif left == "step folder":
        (tmp_path / "checkpoints" / "step-00000012").mkdir(parents=True)  # cut off uncommitted
        said = "1 step folder(s) in checkpoints/"
    else:
        events = EventFile(tmp_path / "tb" / "rank0")
        events.write([scalars_event({"train/loss": 1.0}, 36, 0.0)])
        events.close()
        said = "TensorBoard curves to step 36"
    with pytest.raises(CheckpointError) as refused:
        _checkpoints(tmp_path).resume("auto", _parts())
    assert str(refused.value) == (
        f"checkpoint.resume=auto: run folder {tmp_path} holds an earlier run's work ({said}) but "
        f"no checkpoint to continue from, nothing trained; {WAYS_ON}"
    )
    assert _checkpoints(tmp_path).resume("never", _parts()) is None  # asked for: starts over
    restarted = _checkpoints(tmp_path)  # a torchrun restart of the job that left that work
    restarted.restarted = True
    assert restarted.resume("auto", _parts()) is None  # starts over in its own folder


def test_curves_without_a_trained_step_are_no_history(tmp_path: Path) -> None:
    events = EventFile(tmp_path / "tb" / "rank0")  # what a run that failed at its start leaves
    events.write([summary_event(Summary())])
    events.close()
    assert _checkpoints(tmp_path).resume("auto", _parts()) is None


def test_never_starts_over_and_moves_every_step_folder_aside(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path, keep=3)
    ckpts.resume(None, _parts())
    _save(ckpts, 1, 2)
    junk_files(tmp_path / "checkpoints" / "step-00000002")
    assert _checkpoints(tmp_path).resume("never", _parts()) is None
    (aside,) = (tmp_path / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000001", "step-00000002"]
    assert step_folders(tmp_path / "checkpoints") == []


def test_a_checkpoint_missing_a_part_is_named(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path)
    ckpts.resume(None, _parts())
    _save(ckpts, 1)
    path = tmp_path / "checkpoints" / "step-00000001"
    parts = {**_parts(), "early_stopping": PlainState(Progress())}
    with pytest.raises(CheckpointError, match=r"lacks early_stopping: not written by this dpt"):
        _checkpoints(tmp_path).resume(str(path), parts)


def test_optimizer_state_written_before_it_was_flattened_still_loads(tmp_path: Path) -> None:
    """Checkpoints written before dpt stored the optimizer's settings per parameter (one
    `param_groups` list, DCP's default) load as they were written; saves are flattened."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from dpt.state.checkpoint import MARKER, load
    from dpt.state.stateful import OptimizerState

    def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = trained()
    old = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout before
    path = tmp_path / "step-00000001"
    dcp.save(old, checkpoint_id=path, no_dist=True)
    (path / MARKER).write_text(json.dumps({"step": 1}))
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fresh.load_state_dict(model.state_dict())
    loaded = torch.optim.Adam(fresh.parameters(), lr=0.5)
    part = OptimizerState(fresh, loaded)
    assert load(path, {"optimizer": part}) == 1
    for (_, a), (_, b) in zip(optimizer.state.items(), loaded.state.items(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["step"], b["step"])
    assert loaded.param_groups[0]["lr"] == 0.01
    assert part.flat and "param_groups.0.weight.lr" in part.state_dict()  # saved flattened
