"""Checkpoints: one folder per checkpoint, written by every rank through DCP, committed by rank 0.

`<run>/checkpoints/step-<8 digits>/` holds DCP's files (each rank writes its own part; replicated
model and optimizer state once) and, written last, `COMMITTED` (the step and a digest of the
config). A checkpoint exists only once committed: it is written under a temporary name
(`.step-<n>.tmp-<pid of rank 0>`), synced, renamed, and only then marked. Anything else in the
folder is ignored: never counted, never deleted (named once in a warning).

Rotation goes by this run's history, the committed checkpoints in the order they were written,
never by file names; resuming from an older step moves the newer ones aside, into
`abandoned-<UTC time>/`, so the history stays one line and `checkpoint.resume=auto` follows it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO

import torch
import torch.distributed as dist

from dpt.distributed import DistEnv, broadcast_object
from dpt.errors import DptError, first_line
from dpt.state import resume_config
from dpt.state.history import earlier_work
from dpt.state.resume_config import Change

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException

log = logging.getLogger("dpt")

MARKER = "COMMITTED"
NAME = re.compile(r"^step-(\d{8})$")
TEMPORARY = re.compile(r"^\.step-\d{8}\.tmp-")
ABANDONED = "abandoned-"


class CheckpointError(DptError):
    """A checkpoint that cannot be used: missing, cut off, corrupt, or for another model."""


class ConfigMismatch(DptError):
    """The checkpoint was written under a config this run must not continue (seed, data, model,
    optimizer kind); not a CheckpointError: `auto` must not fall back to an older checkpoint."""


@dataclass(frozen=True)
class Committed:
    path: Path
    step: int
    changes: tuple[Change, ...] = ()  # the config's keys that differ from the checkpoint's


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def config_digest(config_yaml: str) -> str:
    return hashlib.sha256(config_yaml.encode()).hexdigest()[:16]


# --- what is in the folder ---------------------------------------------------------------------


def read_marker(path: Path) -> int | None:
    """The step a checkpoint folder was committed at; None if it was not (or cannot be read)."""
    try:
        step = json.loads((path / MARKER).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    name = NAME.match(path.name)
    return step if isinstance(step, int) and name and int(name.group(1)) == step else None


def has_damaged_marker(path: Path) -> bool:
    """A marker is there but does not read back: the checkpoint was committed, and has been
    damaged since (a marker is written whole, atomically, or not at all)."""
    return (path / MARKER).exists() and read_marker(path) is None


def step_folders(folder: Path) -> list[Path]:
    """Every `step-<8 digits>` entry, committed or not, oldest step first."""
    return [path for path in _entries(folder) if NAME.match(path.name)]


def _step_of(path: Path) -> int:
    match = NAME.match(path.name)
    assert match is not None
    return int(match.group(1))


def committed(folder: Path) -> list[Committed]:
    """This run's committed checkpoints, oldest first. Only dpt writes markers, and resuming moves
    any newer branch aside, so within the folder the step order is the order of writing."""
    found = []
    for path in step_folders(folder):
        step = read_marker(path)
        if step is not None:
            found.append(Committed(path, step))
    return found


def strays(folder: Path) -> list[Path]:
    """Entries that are neither a committed checkpoint, a temporary, nor an abandoned branch."""
    known = {c.path for c in committed(folder)}
    return [
        p
        for p in _entries(folder)
        if p not in known and not TEMPORARY.match(p.name) and not p.name.startswith(ABANDONED)
    ]


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:  # no folder yet (or unreadable: then nothing in it counts)
        return []


# --- writing -----------------------------------------------------------------------------------


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
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return "no space left on device"
    if not isinstance(error, OSError):
        stat = os.statvfs(folder)
        if stat.f_bavail * stat.f_frsize < 64 * 1024:
            return "no space left on device"
    return first_line(error)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    """Every file and then the folder itself on disk: a rename must not outrun its contents."""
    for path in folder.iterdir():
        _fsync(path)
    _fsync(folder)


def _remove(path: Path) -> None:
    """Rename to a temporary name first: a removal cut short leaves nothing that looks committed
    (the next start cleans temporaries up)."""
    doomed = path.with_name(f".{path.name}.tmp-removed-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_temporaries(folder: Path) -> None:
    """Left by a run that died while writing or removing a checkpoint: never committed."""
    for path in _entries(folder):
        if TEMPORARY.match(path.name):
            shutil.rmtree(path, ignore_errors=True)


def move_aside(folder: Path, paths: Iterable[Path]) -> Path:
    """Into `abandoned-<UTC time>/`: kept for a person to look at, out of this run's history."""
    aside = folder / f"{ABANDONED}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    aside.mkdir(exist_ok=True)
    for path in paths:
        os.rename(path, aside / path.name)
    _fsync(folder)
    return aside


# --- loading -----------------------------------------------------------------------------------


def _dcp() -> ModuleType:
    """torch.distributed.checkpoint, imported at the first save or load: with DTensor, which it
    imports, it costs start-up time that a run with no checkpoint to read does not spend before
    its first step."""
    import torch.distributed.checkpoint as dcp

    return dcp


@functools.cache
def _plain_load_planner() -> type:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class PlainLoadPlanner(DefaultLoadPlanner):
        """DCP unpickles non-tensor values with `weights_only=False`; dpt stores only strings,
        numbers and containers of them, so load them as data, never as code."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            torch.load(value, weights_only=True)  # refuses anything but data (values are small)
            value.seek(0)
            super().load_bytes(read_item, value)

    return PlainLoadPlanner


def _dcp_load(state: dict[str, Any], path: Path, no_dist: bool) -> None:
    """DCP's load into `state`, its failure as one CheckpointError naming what went wrong."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _one_process_is_fine():
            _dcp().load(state, checkpoint_id=path, planner=_plain_load_planner()(), no_dist=no_dist)
    except CheckpointException as failed:
        raise _load_failure(path, failed) from failed


def stored_keys(path: Path) -> set[str]:
    """The flattened keys a checkpoint holds (`model.net.0.weight`, `rng.rank1.torch`, ...)."""
    try:
        return set(_dcp().FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as error:  # missing or cut-off `.metadata`, bad pickle: unusable alike
        raise CheckpointError(
            f"checkpoint {path} is unreadable (cut off or corrupt): {first_line(error)}"
        ) from error


def read_config(path: Path) -> str | None:
    """The resolved config YAML a checkpoint was written with; None if it holds none."""
    if "config.yaml" not in stored_keys(path):
        return None
    state = {"config": {"yaml": ""}}
    _dcp_load(state, path, no_dist=True)
    return state["config"]["yaml"]


def check(path: Path, parts: dict[str, Any]) -> int:
    """The step of a committed checkpoint that holds every part; nothing is loaded yet."""
    step = read_marker(path)
    if step is None and has_damaged_marker(path):
        raise CheckpointError(f"checkpoint {path} is damaged: its {MARKER} marker cannot be read")
    if step is None:
        raise CheckpointError(
            f"checkpoint {path} was never committed (no {MARKER} marker): cut off while written"
        )
    present = _part_names(stored_keys(path))
    missing = [name for name in parts if name not in present]
    missing = [name for name in missing if not getattr(parts[name], "optional", False)]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing)}: not written by this dpt version"
        )
    return step


def _part_names(keys: set[str]) -> set[str]:
    return {key.split(".", 1)[0] for key in keys}


def load(path: Path, parts: dict[str, Any]) -> int:
    """Load every part (all ranks together); returns the step. The parts' own `load_state_dict`
    runs here rather than inside DCP, so an error names the part."""
    step = check(path, parts)
    keys = stored_keys(path)
    present = _part_names(keys)
    parts = {name: part for name, part in parts.items() if name in present}  # optional: fresh
    for name, part in parts.items():  # a part that adapts to what is stored (RNGState)
        if hasattr(part, "expect"):
            part.expect({k.split(".", 1)[1] for k in keys if k.startswith(f"{name}.")})
    states = {name: part.state_dict() for name, part in parts.items()}
    _dcp_load(states, path, no_dist=_no_dist())
    for name, part in parts.items():
        try:
            part.load_state_dict(states[name])
        except (RuntimeError, ValueError, KeyError) as error:  # e.g. another optimizer
            raise CheckpointError(
                f"checkpoint {path} does not fit this {name}: {first_line(error)[:300]}"
            ) from error
    return step


_PART_IN_MESSAGE = re.compile(r"(?:for|state_dict:) (\w+)\.")


def _load_failure(path: Path, failed: CheckpointException) -> CheckpointError:
    error = _cause(failed)
    part = _PART_IN_MESSAGE.search(str(error))  # a key missing, a tensor of another shape
    if isinstance(error, ValueError | RuntimeError) and part and "Size mismatch" in str(error):
        return CheckpointError(
            f"checkpoint {path} does not fit this {part.group(1)}: {first_line(error)[:300]}"
        )
    if part and "Missing key" in str(error):
        return CheckpointError(f"checkpoint {path} lacks {part.group(1)}: {first_line(error)}")
    first = first_line(error).split(". ")[0]  # DCP's reader errors run on for lines
    return CheckpointError(f"checkpoint {path} is unreadable (cut off or corrupt): {first[:300]}")


def _cause(failed: CheckpointException) -> BaseException:
    """DCP gathers every rank's exception; the first rank's tells what happened."""
    return next(iter(sorted(failed.failures.items())))[1][0]


@contextlib.contextmanager
def _one_process_is_fine() -> Iterator[None]:
    """DCP warns on every save and load without a process group, even when told no_dist."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _barrier() -> None:
    if not _no_dist():
        dist.barrier()


# --- this run's checkpoints --------------------------------------------------------------------


class Checkpoints:
    """Write, commit, rotate and resume this run's checkpoints. Every rank calls `save` and
    `resume`; the folder's bookkeeping (commit, rotation, moving aside) is rank 0's."""

    def __init__(self, run_dir: Path, env: DistEnv, keep: int, config_yaml: str) -> None:
        self.folder, self.env, self.keep = checkpoint_dir(run_dir), env, keep
        self.config_yaml, self.digest = config_yaml, config_digest(config_yaml)
        self.config = resume_config.flat(config_yaml)
        self.strict = bool(self.config.get("checkpoint.strict", True))
        if env.is_main:
            clean_temporaries(self.folder)
        # One temporary name for all ranks' parts of a checkpoint: rank 0's pid.
        self.token = broadcast_object(os.getpid(), env)
        self.history: list[Committed] = []  # rank 0: committed on this run's line, in order
        self.named: set[Path] = set()  # strays already named in a warning
        # A restart of the job that wrote this folder's earlier work (torchrun's): where it
        # left no checkpoint, the run starts over here rather than refusing that work. Rank 0's
        # counts (agents of one world may have restarted a different number of times).
        self.restarted = False

    # --- saving ---

    def save(self, parts: dict[str, Any], step: int) -> Path:
        """Every rank writes its part under a temporary name; once all have, rank 0 commits."""
        final = self.folder / f"step-{step:08d}"
        tmp = self.folder / f".{final.name}.tmp-{self.token}"
        state = {**parts, "config": {"yaml": self.config_yaml}}
        dcp = _dcp()
        try:
            with _one_process_is_fine():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=_no_dist())
        except dcp.api.CheckpointException as failed:
            reason = _write_failure(_cause(failed), self.folder)  # while the disk is still full
            if self.env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {reason}") from failed
        _barrier()  # every rank's files are written and synced (DCP fsyncs them) before commit
        if self.env.is_main:
            self.commit(tmp, final, step)
            self.rotate()
        _barrier()  # no rank races ahead of a checkpoint that is not yet committed
        return final

    def commit(self, tmp: Path, final: Path, step: int) -> None:
        """Sync, rename, mark. A second save at one step (the run's last step is also a periodic
        one; validation ran in between) replaces this run's own checkpoint of that step."""
        replaces = bool(self.history) and self.history[-1].path == final
        try:
            _sync_tree(tmp)
            self._clear(final, replaces)
            os.rename(tmp, final)
            _fsync(self.folder)
            marker = json.dumps({"step": step, "config_digest": self.digest}).encode()
            write_atomically(final / MARKER, lambda f: f.write(marker), "checkpoint marker")
            _fsync(final)
        except (OSError, CheckpointError) as error:
            cause = error.__cause__ if isinstance(error, CheckpointError) else error
            reason = _write_failure(cause or error, self.folder)  # while the disk is still full
            for path in (tmp, final):  # never committed: nothing to keep
                shutil.rmtree(path, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {reason}") from error
        if replaces:
            self.history.pop()
        self.history.append(Committed(final, step))

    def _clear(self, final: Path, replaces: bool) -> None:
        if not final.exists():
            return
        if replaces:
            _remove(final)  # until the new one is marked, the previous checkpoint is the newest
            return
        aside = move_aside(self.folder, [final])  # a commit cut short by a kill, or a stray
        log.warning(f"{final} was not a committed checkpoint of this run: moved aside to {aside}")

    def rotate(self) -> None:
        """Keep the newest `keep` of this run's history; the newest is never removed (keep >= 1).
        A checkpoint whose marker no longer reads back is left in place and named once."""
        self._name_strays()
        while len(self.history) > self.keep:
            old = self.history.pop(0)
            if read_marker(old.path) != old.step:
                log.warning(f"left {old.path} in place: cannot read it back as a checkpoint")
                continue
            _remove(old.path)

    def _name_strays(self) -> None:
        for path in strays(self.folder):
            if path not in self.named:
                self.named.add(path)
                log.warning(f"{path}: not a committed checkpoint; ignored, never deleted")

    # --- resuming ---

    def resume(self, resume: str | None, parts: dict[str, Any]) -> Committed | None:
        """`never` (or `null`) -> start over; a path -> that checkpoint; `auto` -> the newest
        committed one that loads. Step folders newer than the start are moved aside (rank 0);
        starting over, or from another run folder's checkpoint, moves all of this folder's
        aside."""
        start = self._load(resume, parts)
        foreign = start is not None and not self._holds(start.path)
        if self.env.is_main:
            if foreign:
                assert start is not None
                log.info(
                    f"starting from another run folder's checkpoint {start.path} (step "
                    f"{start.step}); this run's checkpoints go to {self.folder}"
                )
            step = start.step if start else 0
            self._move_newer_aside(-1 if foreign or start is None else step, step)
            self.history = committed(self.folder)
        return start

    def newest_before(self, step: int) -> Committed | None:
        """The newest checkpoint of this run's line older than `step` (rank 0 keeps the line, every
        rank gets the answer): where a rollback goes."""
        found = None
        if self.env.is_main:
            found = next((c for c in reversed(self.history) if c.step < step), None)
        return broadcast_object(found, self.env)

    def load_to_roll_back(self, target: Committed, parts: dict[str, Any]) -> tuple[Change, ...]:
        """Load `target` into `parts` (all ranks): a rollback. Nothing is moved aside (the run's
        line goes on from it, later checkpoints come after) and nothing is said of the config,
        whose differences from the checkpoint's, returned, this run applied already."""
        changes = self._compare(target.path, self._stored_config(target.path), quiet=True)
        load(target.path, parts)
        return changes

    def _holds(self, path: Path) -> bool:
        """This run folder's, an abandoned branch of it included."""
        return self.folder.resolve() in path.resolve().parents

    def _load(self, resume: str | None, parts: dict[str, Any]) -> Committed | None:
        if resume in (None, "never"):
            return None
        if resume != "auto":
            path = Path(resume)
            check(path, parts)  # cut off or incomplete: said as such, before any comparison
            changes = self._compare(path, self._stored_config(path))
            return Committed(path, load(path, parts), changes)
        return self._newest_good(parts)

    def _newest_good(self, parts: dict[str, Any]) -> Committed | None:
        """`auto`: the newest committed checkpoint that loads, skipping damaged ones (a marker
        that does not read back, files that do not load). None only for a folder where no run
        has worked before; a folder with history is refused rather than trained from step 0."""
        # Rank 0's list for all: every rank tries the same checkpoints in the same order.
        marked = [p for p in step_folders(self.folder) if (p / MARKER).exists()]
        found: list[Path] = broadcast_object(marked if self.env.is_main else None, self.env)
        damaged = 0
        for path in reversed(found):
            try:
                step = check(path, parts)  # a damaged marker, missing parts: said as such
                changes = self._compare(path, self._stored_config(path))  # a refusal ends it
                load(path, parts)  # DCP shares a failure with every rank
                return Committed(path, step, changes)
            except CheckpointError as error:
                damaged += 1
                if self.env.is_main:
                    log.warning(f"skipped: {error}")
        self._refuse_a_fresh_start(damaged)
        return None

    def _refuse_a_fresh_start(self, damaged: int) -> None:
        """Raise unless this folder holds no earlier work: nothing is trained, nothing moved."""
        ways_on = (
            "set checkpoint.resume=never to start over in this run folder, or start a new one "
            "(hydra.run.dir=...)"
        )
        if damaged:
            raise CheckpointError(
                f"checkpoint.resume=auto: every checkpoint in {self.folder} is damaged "
                f"({damaged} found), nothing trained or moved; {ways_on}"
            )
        run_dir = self.folder.parent
        # Rank 0 reads the folder (every event file) and decides for all (its `restarted`).
        work = None
        if self.env.is_main and self.restarted:
            log.info(f"no checkpoint in {self.folder} yet: the restarted job starts over")
        elif self.env.is_main:
            work = earlier_work(run_dir, len(step_folders(self.folder)))
        work = broadcast_object(work, self.env)
        if work:
            raise CheckpointError(
                f"checkpoint.resume=auto: run folder {run_dir} holds an earlier run's work "
                f"({', '.join(work)}) but no checkpoint to continue from, nothing trained; "
                f"{ways_on}"
            )

    def _stored_config(self, path: Path) -> str | None:
        """Rank 0 reads it, every rank gets it: all ranks judge the same text alike."""
        if self.env.is_main:
            try:
                found: tuple[str | None, str | None] = (read_config(path), None)
            except CheckpointError as error:
                found = (None, str(error))
        else:
            found = (None, None)
        stored, error = broadcast_object(found, self.env)
        if error is not None:
            raise CheckpointError(error)
        return stored

    def _compare(self, path: Path, stored: str | None, quiet: bool = False) -> tuple[Change, ...]:
        """Refuse what this run must not continue (unless checkpoint.strict=false); name what
        changes. A checkpoint without a stored config cannot be compared: said, not refused."""
        if stored is None:
            if self.env.is_main and not quiet:
                log.warning(f"checkpoint {path} holds no config: it cannot be compared")
            return ()
        found = resume_config.compare(resume_config.flat(stored), self.config)
        if found.refused and self.strict:
            raise ConfigMismatch(resume_config.refusal(str(path), found.refused))
        if self.env.is_main and not quiet:
            if found.refused:
                log.warning(resume_config.forced(str(path), found.refused))
            if found.applied:
                log.info(resume_config.applied_line(found.applied))
        return found.applied + found.refused

    def _move_newer_aside(self, after: int, step: int) -> None:
        """Every step folder past `after`, committed, damaged or cut off."""
        newer = [path for path in step_folders(self.folder) if _step_of(path) > after]
        if newer:
            aside = move_aside(self.folder, newer)
            names = ", ".join(path.name for path in newer)
            which = "" if after < 0 else "newer "  # all of them: the run continues another's
            log.info(
                f"moved {len(newer)} {which}checkpoint(s) ({names}) aside to {aside}: this run "
                f"continues from step {step}, and checkpoint.resume=auto follows it"
            )
