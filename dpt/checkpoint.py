"""Checkpoints: written atomically by rank 0, read with `weights_only=True`, newest good one wins.

A file in `<run>/checkpoints/` is either complete or absent: it is written to a temporary name,
flushed and fsynced, then renamed over (`os.replace` is atomic on POSIX). Everything stored is a
tensor, a number, a string or a container of those, so loading never unpickles code.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from dpt.errors import DptError

log = logging.getLogger("dpt")

PATTERN = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(DptError):
    """A checkpoint that cannot be used: missing, cut off, corrupt, or for another model."""


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save(state: dict[str, Any], folder: Path, step: int, keep: int) -> Path:
    """Write `step-<step>.pt` atomically, then delete all but the newest `keep` checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    write_atomically(path, lambda f: torch.save(state, f), what="checkpoint")
    for old in list_checkpoints(folder)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def write_atomically(path: Path, write: Callable[[BinaryIO], None], what: str) -> None:
    """Temporary file, flush, fsync, rename: `path` is the old file or the complete new one,
    never a half-written one (a full disk or a kill mid-write leaves the previous file intact)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as error:
        reason = _write_failure(error, path.parent)
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write {what} {path}: {reason}") from error


def _write_failure(error: BaseException, folder: Path) -> str:
    # torch.save reports a full disk as "enforce fail at inline_container.cc ... unexpected pos":
    # name the real cause when the file system is (nearly) out of space.
    if not isinstance(error, OSError):
        stat = os.statvfs(folder)
        if stat.f_bavail * stat.f_frsize < 64 * 1024:
            return "no space left on device"
    return _first_line(error)


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first (by step)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)))  # type: ignore[union-attr]


def load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint.resume={path}: file not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, bad magic, disallowed global: all unusable
        raise CheckpointError(
            f"checkpoint {path} is unreadable (cut off or corrupt): {_first_line(error)}"
        ) from error
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"checkpoint {path} is not a dpt checkpoint (no model/step)")
    return state


def resolve_resume(resume: str | None, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """`null` -> None; a path -> that checkpoint (must load); `auto` -> the newest checkpoint of
    this run that loads, skipping (with a warning) any that are cut off or corrupt."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        return path, load(path)
    for path in reversed(list_checkpoints(checkpoint_dir(run_dir))):
        try:
            return path, load(path)
        except CheckpointError as error:
            log.warning(f"{error}; trying an older one")
    return None


def rng_state() -> dict[str, Any]:
    """RNG states as tensors and numbers (no numpy objects: weights_only loading)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _plain(random.getstate()),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["gauss"],
        )
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, tuple | list) else value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
