"""Run `train.py` the way a user does, in its own process group, with a hard timeout."""

from __future__ import annotations

import contextlib
import csv
import ipaddress
import logging
import os
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

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BIN = Path(sys.executable).parent  # the environment's commands: dpt, dpt-predict, ...

# Small and quick: 20 steps of batch 64 on the synthetic task.
FAST = ["dataset.num_samples=2048", "dataset.num_val_samples=256", "trainer.log_every_n_steps=5"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def start(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.Popen[str]:
    """In a session of its own, so that everything it starts can be found and killed."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
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
) -> Result:
    """Run a command; on timeout kill its whole process group (workers included) and fail."""
    proc = start(cmd, env, cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        report = _failure_report(Result(proc.returncode, stdout, stderr))
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{report}") from None
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
    on_marker: Callable[[subprocess.Popen[str], str], None],
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> Result:
    """Start `train.py`, call `on_marker(proc, line)` on the first stdout line containing
    `marker` (e.g. to kill something), then wait for the end. Fails if the run ends first."""
    cmd = [sys.executable, str(TRAIN), *overrides, f"hydra.run.dir={run_dir}"]
    proc = start(cmd, env)
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


def free_port() -> int:
    """A port free on 127.0.0.1 now (for commands that must be told one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(sweep: Path) -> list[dict[str, str]]:
    """The rows of a sweep's summary.csv."""
    with open(sweep / "summary.csv") as f:
        return list(csv.DictReader(f))


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
    that fills the machine (dpt/launch/worker.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    from dpt.launch.worker import limit_cpu_threads

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
    if multiprocessing.parent_process() is not None:  # a spawned rank, never the test process
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
    from dpt.launch.shards import main

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


def readme_block(tag: str) -> list[str]:
    """The command lines of README's ```bash <tag> blocks, in order, comments dropped."""
    blocks = (REPO / "README.md").read_text().split(f"```bash {tag}\n")[1:]
    text = "\n".join(block.split("```", 1)[0] for block in blocks)
    lines = (line.split(" # ", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def run_readme_block(tag: str, root: Path) -> tuple[Path, dict[str, Result]]:
    """README's ```bash <tag> lines run word for word from `root` (laid out like a clone:
    examples/, scripts/), `cd` followed; returns the last folder and each command's result."""
    import shlex

    shutil.copytree(REPO / "examples", root / "examples")
    (root / "scripts").symlink_to(REPO / "scripts")
    programs = {"python": [sys.executable], "dpt": [str(BIN / "dpt")],
                "dpt-predict": [str(BIN / "dpt-predict")]}  # fmt: skip
    cwd, results = root, {}
    for command in readme_block(tag):
        args = shlex.split(command)
        if args[0] == "cd":
            cwd = cwd / args[1]
            continue
        results[command] = run_cmd(programs.get(args[0], [args[0]]) + args[1:], timeout=240,
                                   cwd=cwd)  # fmt: skip
    return cwd, results
