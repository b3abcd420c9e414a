"""Run `train.py` the way a user does, in its own process group, with a hard timeout."""

from __future__ import annotations

import contextlib
import csv
import ipaddress
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.warm_starts import WarmProcess, warm_start
from tests.worlds import in_resident_rank

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BIN = Path(sys.executable).parent  # the environment's commands: dpt, dpt-predict, ...

# Small and quick: 20 steps of batch 64 on the synthetic task.
# A process a test started: Popen, or a warm start's stand-in for it (tests/warm_starts.py).
Process = subprocess.Popen[str] | WarmProcess

FAST = ["dataset.num_samples=2048", "dataset.num_val_samples=256", "trainer.log_every_n_steps=5"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def start(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> Process:
    """In a session of its own, so that everything it starts can be found and killed; `python
    train.py` forked from a preloaded interpreter where that cannot differ
    (tests/warm_starts.py)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if cmd[:2] == [sys.executable, str(TRAIN)] and (warm := warm_start(cmd, env, cwd)):
        return warm
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_cmd(
    cmd: list[str],
    timeout: float = 120,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: Path = REPO,
    daemon: bool = False,
) -> Result:
    """Run a command; on timeout kill its whole process group (workers included) and fail.
    `daemon`: it starts a server that outlives it (`ray start`), which the test stops."""
    proc = start(cmd, env, cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        report = _failure_report(Result(proc.returncode, stdout, stderr))
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{report}") from None
    if not daemon:
        assert_no_leftovers(proc.pid)
    result = Result(proc.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{_failure_report(result)}")
    return result


def _failure_report(result: Result, last: int = 15) -> str:
    """stderr's last lines first (where a failed run says why), then everything: a CI log that
    shows only the start of a long message still shows the reason."""
    tail = "\n".join(result.stderr.splitlines()[-last:])
    return f"--- stderr's last {last} lines ---\n{tail}\n--- all output ---\n{result.output}"


def session_members(session: int) -> list[int]:
    """Live processes of a session (field 6 of /proc/<pid>/stat), zombies excluded."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[3]) == session and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def assert_no_leftovers(session: int, grace_s: float = 10.0) -> None:
    """Every process a command started (workers, loader workers) must be gone once it returns."""
    deadline = time.monotonic() + grace_s
    while (left := session_members(session)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        os.killpg(session, signal.SIGKILL)
        raise AssertionError(f"processes left behind: {left}")


def train(
    run_dir: Path | None,
    *overrides: str,
    timeout: float = 120,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> Result:
    cmd = [sys.executable, str(TRAIN), *overrides]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    return run_cmd(cmd, timeout=timeout, env=env, check=check)


def run_until(
    run_dir: Path,
    overrides: list[str],
    marker: str,
    on_marker: Callable[[Process, str], None],
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> Result:
    """Start `train.py`, call `on_marker(proc, line)` on the first stdout line containing
    `marker` (e.g. to kill something), then wait for the end. Fails if the run ends first."""
    cmd = [sys.executable, str(TRAIN), *overrides, f"hydra.run.dir={run_dir}"]
    return cmd_until(cmd, marker, on_marker, timeout, env)


def cmd_until(
    cmd: list[str],
    marker: str,
    on_marker: Callable[[Process, str], None],
    timeout: float = 180,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> Result:
    """`run_until` for any command (torchrun, ...), started in `cwd`."""
    proc = start(cmd, env, cwd)
    timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                on_marker(proc, line)
                break
        else:
            raise AssertionError(f"the run ended before {marker!r}:\n{''.join(lines)}")
        stdout, stderr = proc.communicate()
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert_no_leftovers(proc.pid)
    return Result(proc.returncode, "".join(lines) + stdout, stderr)


_RANK_PID = re.compile(r"\[rank (\d+)\] pid (\d+) \|")


def rank_pid(run_dir: Path, rank: int) -> int:
    """A rank's pid, from the start line in its log (`[rank 1] pid 4242 | strategy=...`)."""
    log = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return int(dict(_RANK_PID.findall(log))[str(rank)])


def is_running(pid: int) -> bool:
    """Running, not ended and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def junk_files(folder: Path) -> None:
    """Every file under `folder` overwritten with as many bytes of junk (markers included)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            path.write_bytes(bytes((7 * i + 3) % 256 for i in range(max(path.stat().st_size, 1))))


def file_tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def tb_points(folder: Path, tag: str) -> list[tuple[int, float]]:
    """A TensorBoard folder's (step, value) points of `tag`; [] where it has none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def load_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def committed_checkpoints(run_dir: Path) -> list[Path]:
    """The run's committed checkpoint folders, oldest first."""
    return sorted(p.parent for p in (run_dir / "checkpoints").glob("step-*/COMMITTED"))


def read_checkpoint(path: Path, decoded: bool = True) -> dict[str, Any]:
    """A DCP checkpoint folder as one nested dict, its JSON parts decoded (for inspection)."""
    import json
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=True)
    if not decoded:
        return state
    return {
        name: json.loads(part["json"]) if isinstance(part, dict) and "json" in part else part
        for name, part in state.items()
    }


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# BatchNorm's running statistics: buffers, not weights (dpt's state dicts name them so).
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def weight_and_statistics_diff(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(the weights' largest absolute difference, BatchNorm statistics' largest relative one).
    Running statistics accumulate each step's batch variance, whose float32 sums another world
    size orders otherwise: about 1e-7 of their size a step, the rounding of float32 itself."""
    assert a.keys() == b.keys()
    weights = [k for k in a if not k.endswith(STATISTICS)]
    stats = [k for k in a if k.endswith(STATISTICS)]
    weight_diff = max((a[k] - b[k]).abs().max().item() for k in weights)
    relative = [((a[k] - b[k]).abs() / b[k].abs().clamp_min(1.0)).max().item() for k in stats]
    return weight_diff, max(relative, default=0.0)


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses and ports process `pid` listens on, in its own network namespace."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        with contextlib.suppress(OSError):  # closed while we looked
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    found.add((_proc_net_address(address), int(port, 16)))
    return found


def _proc_net_address(hex_address: str) -> str:
    """/proc/net/tcp{,6} write addresses as 32-bit words in host byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


# Where free_port picks: below the kernel's ephemeral range, from which every outgoing connection
# (a Gloo rank's, an MLflow client's, the other pytest worker's) takes its local port. A port
# picked there is free when picked, but may be an outgoing connection's by the time a rank binds
# it ("cannot listen on 127.0.0.1:33031: Address already in use", once in a suite run).
_PICKED_PORTS = (20000, 32768)


def free_port() -> int:
    """A port free on 127.0.0.1 now (for commands that must be told one), which no outgoing
    connection will take before it is bound."""
    low, high = _PICKED_PORTS
    with contextlib.suppress(OSError, ValueError):
        first = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        high = min(high, int(first))
    picker = random.SystemRandom()  # not the tests' seeded generators
    for _ in range(100):
        port = picker.randrange(low, high) if low < high else 0
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return s.getsockname()[1]
    raise AssertionError(f"no free port on 127.0.0.1 in {low}..{high}")


def summary(sweep: Path) -> list[dict[str, str]]:
    """The rows of a sweep's summary.csv."""
    with open(sweep / "summary.csv") as f:
        return list(csv.DictReader(f))


def hydra_sweep(folder: Path) -> Path:
    """The one sweep `-m` made from `folder` in Hydra's own place, `multirun/<date>/<time>`
    (no hydra.sweep.dir: as a user starts it)."""
    found = sorted((folder / "multirun").glob("*/*"))
    assert len(found) == 1, found
    return found[0]


def job_tb(sweep: Path, job: int) -> Path:
    """Job `job`'s TensorBoard folder in a sweep: `<sweep>/tb/<job> <swept key=value,...>/`."""
    found = [p for p in (sweep / "tb").iterdir() if p.is_dir() and p.name.split(" ")[0] == str(job)]
    assert len(found) == 1, found
    return found[0]


def compose(*overrides: str) -> Any:
    """The config `train.py` would run with these overrides, composed in this process (as
    often as needed: Hydra's global state is cleared before and after, for the next test)."""
    from hydra.core.global_hydra import GlobalHydra

    from dpt.launch.cli import compose_from_argv

    GlobalHydra.instance().clear()
    try:
        return compose_from_argv(list(overrides))
    finally:
        GlobalHydra.instance().clear()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU ops on one intra-op thread for the `with`: small models gain nothing from
    threads, and on a busy 2-core machine (the other pytest worker's runs) a thread pool waiting
    for its slowest thread makes a step many times slower. What dpt gives each rank of a world
    that fills the machine (dpt/loop/train.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def collector_as_found() -> Iterator[None]:
    """Python's garbage collector after the block as before it, for runs hosted by a process
    that hosts many (a pytest worker, a resident rank). A run freezes what its start-up made
    (dpt/loop/collector.py), and where an earlier run had frozen, first unfreezes and collects
    the whole process, as a sweep's next job does to free the last one's objects: here 0.2 to
    0.4 s of a core for every run after the first (a million objects). The block's freeze is
    undone, not collected: the next run starts as in a fresh process, and what the block left
    is freed by the collector's own passes."""
    import gc

    frozen = gc.get_freeze_count()
    try:
        yield
    finally:
        if not frozen:
            gc.unfreeze()


@contextlib.contextmanager
def joined_world(rank: int, world: int, port: int) -> Iterator[Any]:
    """This process as rank `rank` of a CPU world on 127.0.0.1:`port` (for mp.spawn tests).

    The rank does all its work inside the `with`: on success a spawned rank then leaves at once,
    without the interpreter's finalization, as dpt's own local ranks do (a forked
    multiprocessing child ends with `os._exit`). Under torch 2.14 a spawned Gloo rank that
    finalizes can abort there ("terminate called without an active exception", SIGABRT) after
    its work is done: 9 of 25 two-rank worlds here, 0 of 25 leaving this way. Its CPU threads
    are limited as dpt limits a local rank's (the cores shared among the world's ranks): more
    threads than cores, with the other pytest worker's runs beside them, make every step wait
    for a thread that lost its core.
    """
    import multiprocessing

    from dpt.distributed import destroy_process_group, env_from_environment, init_process_group
    from dpt.loop.train import limit_cpu_threads

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    env = env_from_environment("cpu")
    if multiprocessing.parent_process() is not None:  # not the test process's own threads
        limit_cpu_threads(env)
    init_process_group(env, timeout_s=60)
    try:
        yield env
    finally:
        destroy_process_group()
    if multiprocessing.parent_process() is not None and not in_resident_rank():
        # a rank spawned for one world, never the test process nor a resident rank
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def build_trainer(run_dir: Path, env: Any, *overrides: str) -> Any:
    """A Trainer built as a rank builds it, from `train.py`'s config with these overrides."""
    from dpt.loop.parts import RunConfig, build_parts
    from dpt.loop.trainer import Trainer

    cfg = RunConfig.of(compose(*overrides))
    return Trainer(build_parts(cfg, env, run_dir, run_dir / f"rank{env.rank}.log"))


@contextlib.contextmanager
def dpt_logger_kept() -> Iterator[None]:
    """The `dpt` logger as it was before the block: a command run in process (dpt-shards'
    `main`) sets it up for the whole process (a console handler, INFO, no propagation), and the
    next test in the same worker would print, or miss in caplog, what it logs."""
    logger = logging.getLogger("dpt")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    try:
        yield
    finally:
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def write_shards(*args: str) -> None:
    """`dpt-shards ARGS` in process, the `dpt` logger left as it was."""
    from dpt.commands.shards import main

    with dpt_logger_kept():
        main(list(args))


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """`folder` as a real file system of `size` (tmpfs, e.g. "64k"), to fill; unmounted after.
    Fails (never skips) where it cannot be mounted: these tests need root, as CI has."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        import pytest

        pytest.fail(f"cannot mount a small tmpfs (root needed): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


# The pages whose command blocks the tests run: README.md and every page of the docs site.
DOC_PAGES = (REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")))


def docs_block(tag: str) -> list[str]:
    """The command lines of the ```bash <tag> blocks of the docs' pages, in order, comments
    dropped."""
    text = "".join(page.read_text() for page in DOC_PAGES)
    blocks = text.split(f"```bash {tag}\n")[1:]
    text = "\n".join(block.split("```", 1)[0] for block in blocks)
    lines = (line.split(" # ", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def run_docs_block(tag: str, root: Path) -> tuple[Path, dict[str, Result]]:
    """The docs' ```bash <tag> lines run word for word from `root` (laid out like a clone:
    examples/, scripts/), `cd` followed; returns the last folder and each command's result."""
    import shlex

    shutil.copytree(REPO / "examples", root / "examples")
    (root / "scripts").symlink_to(REPO / "scripts")
    programs = {"python": [sys.executable]} | {
        name: [str(BIN / name)] for name in ("dpt", "dpt-shards", "ray")
    }
    cwd, results = root, {}
    for command in docs_block(tag):
        args = shlex.split(command)
        if args[0] == "cd":
            cwd = cwd / args[1]
            continue
        # In this process where a Python start adds nothing: a run of no other process, the
        # commands that train nothing, a helper script.
        if args[0] == "dpt" and runs_in_process(args[1:], cwd):
            result = train_in_process(*args[1:], cwd=cwd, import_from=(cwd,), script="dpt")
        elif args[0] in IN_PROCESS_COMMANDS:
            result = command_in_process(*args, cwd=cwd, import_from=(cwd,))
        elif args[0] == "python" and args[1] != "train.py":
            result = python_in_process(*args[1:], cwd=cwd)
        else:
            program = programs.get(args[0], [args[0]])
            result = run_cmd(program + args[1:], timeout=240, cwd=cwd,
                             daemon=args[:2] == ["ray", "start"])  # fmt: skip
        assert result.returncode == 0, result.output  # run_cmd checked it already
        results[command] = result
    return cwd, results


# --- runs of a spawned world, and one-process runs in this process ------------------------------


class _Tee:
    """Writes to several streams (a run's console lines: kept for the test, and shown)."""

    def __init__(self, *streams: Any) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def isatty(self) -> bool:
        return False


@dataclass
class WorldRun:
    """One run of a spawned world (`run_world`): what a rank of `python train.py strategy=ddp`
    runs (`run_worker`: resume, checkpoints, model.pt, metrics.json, TensorBoard, its log),
    minus Hydra's `.hydra/` files. `copy_from`: a run folder rank 0 copies to `run_dir` first
    (a stopped run resumed in a copy); `prepare`: what rank 0 then does to it (damage it, ...).
    Each rank's console lines go to `<out>.rank<r>`."""

    name: str
    run_dir: Path
    cfg: dict[str, Any]
    out: Path
    copy_from: Path | None = None
    prepare: Callable[[Path], None] | None = None  # rank 0's, on the folder, after the copy

    @property
    def stdout(self) -> str:
        """The console lines of every rank, rank 0's first (a launcher's stdout, in rank order)."""
        files = sorted(self.out.parent.glob(f"{self.out.name}.rank*"))
        return "".join(f.read_text() for f in files)


def world_run(
    name: str,
    run_dir: Path,
    *overrides: str,
    copy_from: Path | None = None,
    prepare: Callable[[Path], None] | None = None,
) -> WorldRun:
    """A run for `run_world`, its config composed here (as `train.py` composes it). `prepare`:
    a module-level function (it goes to the ranks by name) rank 0 calls on the run folder first."""
    from dpt.launch.launchers import resolved

    return WorldRun(name, run_dir, resolved(compose(*overrides)), run_dir.parent / f"{name}.out",
                    copy_from, prepare)  # fmt: skip


def run_world(world: int, runs: list[WorldRun], timeout: float = 540) -> None:
    """`runs` one after the other in this pytest worker's resident CPU world of `world` ranks
    (tests/worlds.py: started once for the session), each rank in a process of its own as the
    local launcher starts it. A run that fails fails the test (its traceback in the error)."""
    spawn(world_rank_runs, world, runs, nprocs=world, timeout=timeout)


def spawn(fn: Callable[..., Any], *args: Any, nprocs: int, timeout: float = 540) -> None:
    """`fn(rank, *args)` on every rank of this pytest worker's resident world of `nprocs` ranks:
    `torch.multiprocessing.spawn(fn, args, nprocs)` without a start-up per call. `fn` does its
    work inside `joined_world`. Tests about processes (kills, signals, peak memory) spawn their
    own."""
    from tests.worlds import world

    world(nprocs).run(fn, *args, timeout=timeout)


def shared_port(rank: int, where: Path) -> int:
    """A port free on 127.0.0.1 now, for a world that meets again: rank 0 picks it and writes
    it to `where`, the other ranks read it there (a port picked minutes before it is used, when
    the world was spawned, may have been taken since)."""
    if rank == 0:
        picked = where.with_name(f"{where.name}.tmp")
        picked.write_text(str(free_port()))
        picked.rename(where)  # whole, or not there yet
    while not where.exists():
        time.sleep(0.01)
    return int(where.read_text())


def world_rank_runs(rank: int, world: int, runs: list[WorldRun]) -> None:
    """Rank `rank`'s part of `runs`, in a process spawned for a world of `world` (`run_world`);
    for a test's own world function, which may go on (`joined_world`, on a `shared_port`)."""
    from dpt.launch.launchers import run_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    done: list[Path] = []
    for run in runs:
        # Every rank's previous run over (its last writes, TensorBoard's included): a file
        # barrier, the world's process group being gone between runs.
        while not all(marker.exists() for marker in done):
            time.sleep(0.01)
        if rank == 0 and run.copy_from is not None:
            shutil.copytree(run.copy_from, run.run_dir)
        if rank == 0 and run.prepare is not None:
            run.prepare(run.run_dir)
        # The run's port, once rank 0 has made its folder ready: no rank reads it before.
        port = shared_port(rank, run.out.parent / f"{run.out.name}.port")
        os.environ["MASTER_PORT"] = str(port)
        console = run.out.parent / f"{run.out.name}.rank{rank}"
        with open(console, "w") as kept, contextlib.redirect_stdout(_Tee(kept, sys.stdout)), \
                loader_workers_ended(), collector_as_found():  # fmt: skip
            run_worker(run.cfg, str(run.run_dir))
        (run.out.parent / f"{run.out.name}.done{rank}").touch()
        done = [run.out.parent / f"{run.out.name}.done{r}" for r in range(world)]
    while not all(marker.exists() for marker in done):  # the last run over on every rank
        time.sleep(0.01)


def train_rank(env: Any, run_dir: Path, *overrides: str) -> dict[str, Any]:
    """This rank's part of `train.py ARGS`'s run in a spawned world (`joined_world`), its
    config kept where Hydra keeps it (`.hydra/config.yaml`, by rank 0): dpt-predict,
    dpt-generate and dpt-export build the model from it."""
    from omegaconf import OmegaConf

    from dpt.distributed import broadcast_object
    from dpt.launch.launchers import resolved
    from dpt.loop.train import train

    # Composed once, by rank 0, as the launcher composes a run's config once for its ranks
    # (Hydra's composition: 0.2-0.3 s of a core, which every other rank would pay again).
    composed = resolved(compose(*overrides)) if env.is_main else None
    cfg = OmegaConf.create(broadcast_object(composed, env))
    if env.is_main:
        keep_config(cfg, run_dir)
    with collector_as_found():
        return train(cfg, env, run_dir)


def keep_config(cfg: Any, run_dir: Path) -> None:
    """A run's config where Hydra keeps it (`.hydra/config.yaml`), where dpt-predict,
    dpt-generate and dpt-export read it: a run hosted here has no Hydra job to write it."""
    from omegaconf import OmegaConf

    from dpt.commands.run_model import CONFIG_FILE

    (run_dir / CONFIG_FILE).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / CONFIG_FILE)


def run_here(run_dir: Path, *overrides: str) -> tuple[dict[str, Any], str]:
    """What `python train.py strategy=single ...` runs, in this process (one thread, as a
    one-process run on a machine shared with the other pytest worker gains nothing from more),
    without Hydra's `.hydra/` files: the run's summary and its console lines."""
    import io

    from dpt.launch.launchers import resolved

    kept = io.StringIO()
    with contextlib.redirect_stdout(_Tee(kept, sys.stdout)):
        summary = run_config_here(resolved(compose(*overrides)), run_dir)
    return summary, kept.getvalue()


def run_config_here(
    cfg: dict[str, Any], run_dir: Path, hydra_config: bool = False
) -> dict[str, Any]:
    """A resolved config's one-process run in this process, as `run_here` runs it (one thread,
    the run's loader workers ended with it, the process left as it was found); returns the
    run's summary. `hydra_config`: the config also kept where Hydra keeps it
    (`.hydra/config.yaml`), which dpt-export, dpt-generate and the run's resume read."""
    from omegaconf import OmegaConf

    from dpt.launch.launchers import run_worker

    if hydra_config:
        keep_config(OmegaConf.create(cfg), run_dir)
    with dpt_logger_kept(), one_thread(), loader_workers_ended(), collector_as_found():
        return run_worker(cfg, str(run_dir))


@contextlib.contextmanager
def loader_workers_ended() -> Iterator[None]:
    """The loader workers the block's runs started end with the block, as they do when a rank's
    process ends. Left to the garbage collector, the shutdown of each persistent worker, run
    from a finalizer, waits out torch's status interval (5 s): 20 s for 2 loaders of 2 workers.
    Shut down outside a collection, it takes milliseconds. The block's iterators are noted as
    they start (torch's class wrapped for the block), not searched for among the process's
    objects (`gc.get_objects`: 0.25 s in a pytest worker, twice a run); loaders that were
    running before the block are left alone."""
    import weakref

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter as LoaderIter

    started: list[weakref.ref[Any]] = []
    init = LoaderIter.__init__

    def noted(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        started.append(weakref.ref(self))

    LoaderIter.__init__ = noted  # type: ignore[method-assign]
    try:
        yield
    finally:
        LoaderIter.__init__ = init  # type: ignore[method-assign]
        for ref in started:
            if (found := ref()) is not None:
                found._shutdown_workers()


# --- `python train.py ARGS` in this process ------------------------------------------------------


def train_in_process(
    *argv: str, cwd: Path = REPO, import_from: tuple[Path, ...] = (), script: str = str(TRAIN)
) -> Result:
    """`python SCRIPT ARGV` (train.py), started in `cwd` with `PYTHONPATH=import_from`, run in
    this process through the command's entry point, `dpt.launch.cli.main` (not `cli.entry`,
    which ends its process with os._exit): a command that is answered, or runs, without starting
    any other process saves the start of a Python process.

    It runs as in a process of its own: `sys.argv`, the current folder and the import path as
    the command's process has them (`import_from` first, where PYTHONPATH puts it); stdout and
    stderr, Python's writes and those to the file descriptors (torch's C++ code) after them; the
    root logger as a fresh interpreter has it (no handler: a
    warning logged reaches stderr through logging's last resort); the interpreter's default
    warning filters, a warning written to stderr (not recorded by pytest); an exception that
    escapes written as the interpreter writes it, exit 1; SystemExit's code as the process would
    exit with it (`cli.entry` ends so). Hydra's global state is cleared before and after.
    Whatever the command changed in this process is put back, and what it must not leave behind
    is checked (`process_state_kept`).
    """
    from dpt.launch.cli import main

    return _in_process(main, script, argv, cwd, import_from)


def run_train(run_dir: Path, *overrides: str, timeout: float = 120) -> Result:
    """`python train.py OVERRIDES hydra.run.dir=RUN_DIR`, unchecked: in this process where the
    command may run there (`runs_in_process`: one process, no loader workers), else as a process
    of its own (a world's ranks)."""
    argv = [*overrides, f"hydra.run.dir={run_dir}"]
    if runs_in_process(argv, REPO):
        return train_in_process(*argv)
    return train(None, *argv, timeout=timeout, check=False)


def refused_in_process(run_dir: Path, *overrides: str) -> Result:
    """`python train.py OVERRIDES hydra.run.dir=RUN_DIR` for a command that is refused before
    its run or at the start of a one-process run (before any loader worker starts), run in this
    process (`train_in_process`); its exit status and output as the process would have them."""
    argv = [*overrides, f"hydra.run.dir={run_dir}"]
    assert runs_in_process(argv, REPO, loader_workers=True), argv
    return train_in_process(*argv)


# The commands that train nothing (they read a run folder or a text): run in the test's process
# through their entry point (`command_in_process`), with the argv of the printed line.
IN_PROCESS_COMMANDS = ("dpt-predict", "dpt-generate", "dpt-export", "dpt-evaluate", "dpt-tokenizer")


def command_in_process(
    program: str, *argv: str, cwd: Path = REPO, import_from: tuple[Path, ...] = ()
) -> Result:
    """`PROGRAM ARGV` (one of IN_PROCESS_COMMANDS) as `train_in_process` runs `train.py`: its
    installed entry point (the package's console_scripts, where pip found it), called in this
    process as in a process of its own."""
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="console_scripts", name=program)
    return _in_process(entry.load(), program, argv, cwd, import_from)


def python_in_process(*args: str, cwd: Path = REPO) -> Result:
    """`python SCRIPT.py ARGS` or `python -c CODE` (a docs line's helper script, which trains
    nothing) run in this process as the interpreter runs it: the script as `__main__`, its
    folder (or, for -c, the current one) first on the import path."""
    import runpy

    if args[0] == "-c":
        code = args[1]

        def main() -> None:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})

        return _in_process(main, "-c", args[2:], cwd, (cwd,))
    script = (cwd / args[0]).resolve()

    def run_script() -> None:
        runpy.run_path(str(script), run_name="__main__")

    return _in_process(run_script, args[0], args[1:], cwd, (script.parent,))


def _in_process(
    main: Callable[[], None], script: str, argv: tuple[str, ...], cwd: Path,
    import_from: tuple[Path, ...],
) -> Result:  # fmt: skip
    """`main()` with `sys.argv = [script, *argv]`, as `train_in_process` says."""
    import io
    import traceback
    import warnings

    from hydra.core.global_hydra import GlobalHydra

    from dpt.launch import run_lock
    from dpt.launch.process_exit import exit_code

    out, err = io.StringIO(), io.StringIO()
    with process_state_kept(import_from), _fd_output() as fd_output, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():  # fmt: skip
        os.chdir(cwd)
        sys.argv = [script, *argv]
        sys.path[:0] = [str(folder) for folder in import_from]
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        _interpreter_warning_filters(err)
        GlobalHydra.instance().clear()
        locks = run_lock.held()
        try:
            main()
            code = 0
        except SystemExit as stop:
            code = exit_code(stop)
        except Exception:  # as the interpreter reports an exception that ends a program
            traceback.print_exc()
            code = 1
        finally:
            GlobalHydra.instance().clear()
        if code != 0:  # a failed command's process ends, and the kernel releases its locks
            for folder in set(run_lock.held()) - set(locks):
                run_lock.release(folder)
    fd_out, fd_err = fd_output
    return Result(code, out.getvalue() + fd_out, err.getvalue() + fd_err)


@contextlib.contextmanager
def _fd_output() -> Iterator[list[str]]:
    """What the block writes to file descriptors 1 and 2 directly (C++ code of torch's, a child
    process), past `sys.stdout` and `sys.stderr`: [stdout, stderr], filled as the block ends."""
    import tempfile

    written: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield written
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            for file in (out, err):
                file.seek(0)
                written.append(file.read().decode(errors="replace"))


def _interpreter_warning_filters(stream: Any) -> None:
    """Python's default warning filters (no -W, no PYTHONWARNINGS), a warning written to
    `stream` as the interpreter writes it to stderr. Inside `warnings.catch_warnings()`, which
    puts pytest's filters and its recording back."""
    import warnings

    warnings.resetwarnings()
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)

    def show(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
        stream.write(warnings.formatwarning(message, category, filename, lineno))

    warnings.showwarning = show


@contextlib.contextmanager
def process_state_kept(user_code: tuple[Path, ...] = ()) -> Iterator[None]:
    """This process as it was before the block, for a command run in it: the environment, the
    import path, `sys.argv`, the current folder, the modules imported from `user_code` (a user's
    own modules: dropped, so that the next command imports its own), the loggers that were there
    (handlers, level, propagation; handlers added are closed), the signal handlers, torch's CPU
    threads, the random generators (Python's, NumPy's, torch's: a data set built to check a task
    seeds them), Hydra's run and job state and its config store, the garbage collector's freeze
    (`collector_as_found`). Fails if the block left threads
    or child processes running, or a run folder locked."""
    import random

    import numpy as np
    from hydra.core.config_store import ConfigStore
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.plugins import Plugins
    from hydra.core.utils import JobRuntime

    from dpt.launch import run_lock

    environ, path, argv, cwd = dict(os.environ), list(sys.path), list(sys.argv), os.getcwd()
    modules = set(sys.modules)
    loggers = _loggers_state()
    handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
    torch_threads = torch.get_num_threads()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    hydra_cfg, job_runtime = HydraConfig.instance().cfg, JobRuntime.instance().conf.copy()
    Plugins.instance()  # Hydra's plugins imported, their configs stored: those stay
    import dpt.launch.cli  # noqa: F401  (dpt's schemas stored at import: those stay too)

    store = _tree_copy(ConfigStore.instance().repo)
    threads, children, locks = set(threading.enumerate()), _children(), run_lock.held()
    try:
        with collector_as_found():
            yield
    finally:
        os.chdir(cwd)
        sys.argv[:] = argv
        sys.path[:] = path
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
        roots = tuple(str(folder.resolve()) + os.sep for folder in user_code)
        for name in set(sys.modules) - modules:
            file = getattr(sys.modules[name], "__file__", None)
            if roots and file and os.path.realpath(file).startswith(roots):
                del sys.modules[name]
        _restore_loggers(loggers)
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        HydraConfig.instance().cfg = hydra_cfg
        JobRuntime.instance().conf = job_runtime
        ConfigStore.instance().repo = store
    left = {t for t in threading.enumerate() if t not in threads and t.is_alive()}
    assert not left, f"threads left running: {left}"
    new_children = _children() - children
    for pid in new_children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not new_children, f"child processes left running: {new_children}"
    assert run_lock.held() == locks, f"run folders left locked: {run_lock.held()}"


def _children() -> set[int]:
    """The live child processes of this process (of any of its threads)."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(pid) for pid in (task / "children").read_text().split())
    return {pid for pid in found if is_running(pid)}


def _tree_copy(tree: Any) -> Any:
    """A copy of nested dicts, the leaves shared (Hydra's config store: storing a config changes
    only its dicts, and ConfigStore.load gives copies of the nodes)."""
    return {k: _tree_copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _loggers_state() -> dict[str, tuple[Any, ...]]:
    """Every logger's handlers, level, propagation and whether it is disabled, by name ("" for
    the root)."""
    loggers = {"": logging.root}
    loggers.update((name, logger) for name, logger in logging.Logger.manager.loggerDict.items()
                   if isinstance(logger, logging.Logger))  # fmt: skip
    return {
        name: (logger, list(logger.handlers), logger.level, logger.propagate, logger.disabled)
        for name, logger in loggers.items()
    }


def _restore_loggers(saved: dict[str, tuple[Any, ...]]) -> None:
    """The loggers `_loggers_state` saw, as it saw them; handlers added to them since, closed
    (Hydra's console handler on the root, dpt's on `dpt`). Loggers made since are left as they
    are: those of modules first imported meanwhile (torch's) are set up by the import, as in any
    process that imports them."""
    for logger, handlers, level, propagate, disabled in saved.values():
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled


def runs_in_process(
    argv: list[str], folder: Path, import_from: tuple[Path, ...] = (), loader_workers: bool = False
) -> bool:
    """Whether the command `train.py ARGV` (or `dpt ARGV`), run from `folder`, may run in this
    process (`train_in_process`): it runs no rank beside the command's own process (no ddp or
    fsdp world, no torchrun, no sweep, no loader worker processes) and this machine has no GPU
    (`trainer.device=auto` would put CUDA into the test process, which forks later); a command
    refused before any run, or one that only prints its config, too. `loader_workers`: a command
    refused at its start may ask for loader workers, which it never starts."""
    if {"-m", "--multirun"} & set(argv):
        return False
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dpt.config.strategies import is_distributed
    from dpt.errors import DptError

    try:
        with contextlib.chdir(folder), process_state_kept(import_from):  # a relative --config-dir
            sys.path[:0] = [str(path) for path in import_from]
            cfg = compose(*argv)
    except (DptError, HydraException, OmegaConfBaseException):  # refused before any run
        return True
    if cfg is None:  # --cfg, --help: the config printed, nothing run
        return True
    return (
        not torch.cuda.is_available()
        and not is_distributed(cfg.strategy)
        and cfg.launcher._target_.endswith(".LocalLauncher")
        and (loader_workers or cfg.dataset.num_workers == 0)
    )


def colour_images(
    root: Path, per_class: dict[str, int], colours: dict[str, tuple[int, int, int]], size: int
) -> Path:
    """An image folder: `root`/<split>/<class>/<i>.png, `per_class[split]` images of each class,
    each its colour with a little noise (more for each next one)."""
    from PIL import Image

    for split, count in per_class.items():
        for name, colour in colours.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                noise = Image.effect_noise((size, size), 20).convert("RGB")
                Image.blend(Image.new("RGB", (size, size), colour), noise, 0.1 + 0.05 * i).save(
                    folder / f"{i}.png"
                )
    return root
