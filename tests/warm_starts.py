"""Warm starts: `python train.py ...` forked, in a process of its own, from a server that has
imported torch once for the pytest worker.

A test that starts `train.py` for what only a process shows (an exit code, a signal, a kill, the
launcher and its ranks, the console) pays Python's and torch's start-up each time: importing
torch and torch._dynamo (which any optimizer's constructor imports) is about 4.5 s of a core here,
most of a short run's cost, and the suite starts `train.py` some 70 times. Such a start is forked
from this server instead, as Python's forkserver (and dpt's own ranks: dpt/launch/fork_server.py)
fork from a preloaded interpreter: the child is a process of its own, in a session of its own
(`start_new_session`), with the test's argv, environment, working folder and pipes; its exit
status, its signals and what it starts are a process's. It runs `train.py` as `python train.py`
does (`runpy.run_path` as `__main__`, `sys.argv` and `sys.path[0]` set so), and ends through the
interpreter's own exit (threads joined, atexit handlers run, an uncaught KeyboardInterrupt
re-raised as SIGINT).

What differs from a cold start is what happened before `train.py`'s first line: torch, its
compiler stack and Hydra are already imported, with the environment the server started with. So
a start is warm only where that cannot matter: the command is this interpreter running
`train.py`, and its environment differs from the server's only in variables read while running
(`WARM_DIFFERENCES`; where the pytest worker's own environment changed, a test having set a
variable for good, the server is started anew with it); anything else (another PYTHONPATH,
OMP_NUM_THREADS, a command line that is not `python train.py`) starts cold. What is about
start-up itself keeps a cold interpreter: the answers without torch
(tests/test_fast_answers.py), the optional imports (tests/test_metrics_import.py), the docs' and
README's commands run as printed, the console scripts, torchrun, SLURM.

This module imports only the standard library at its top: it is the server's `__main__` too.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# What the server imports once: torch, what every optimizer's constructor imports
# (torch._dynamo), and the config stack every `train.py` starts with.
PRELOAD = ("torch", "torch._dynamo", "hydra", "omegaconf")
# Variables that may differ between the server's environment and a warm start's: read while a
# run runs, never while importing what the server preloaded.
WARM_DIFFERENCES = ("PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", "DPT_TEST_")
_BUSY_POLL_S = 0.05  # how often the server looks for ended children


# --- the client: in the pytest worker ------------------------------------------------------------


class WarmProcess:
    """What tests use of `subprocess.Popen` (text pipes, pid, poll, wait, communicate, signals)
    for a process the server forked: the server waits for it and sends its exit status."""

    def __init__(self, args: list[str], conn: socket.socket, stdout_fd: int, stderr_fd: int):
        self.args = args
        self._conn = conn
        self.pid = int(_recv_line(conn))
        self.stdout = open(stdout_fd, encoding=None, errors="replace")  # noqa: SIM115
        self.stderr = open(stderr_fd, encoding=None, errors="replace")  # noqa: SIM115
        self.returncode: int | None = None
        self._drained: dict[str, list[str]] = {}
        self._drainers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._ended(_recv_line(self._conn))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self._ended(_recv_line(self._conn))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes read to their end (by threads, as Popen does with two pipes), then the exit
        status; a timeout leaves the reading going for the next call, as Popen's does."""
        if not self._drainers:
            for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)):
                self._drained[name] = []
                reader = threading.Thread(
                    target=lambda s=stream, into=self._drained[name]: into.append(s.read()),
                    daemon=True,
                )
                reader.start()
                self._drainers.append(reader)
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._drainers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.stdout.close()
        self.stderr.close()
        return "".join(self._drained["stdout"]), "".join(self._drained["stderr"])

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def _ended(self, status: str) -> None:
        self.returncode = os.waitstatus_to_exitcode(int(status))
        self._conn.close()


class _Server:
    """This pytest worker's server: started on the first warm start, ended with the worker (it
    ends when its stdin, a pipe from this process, reads end of file)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="dpt-warm-"))
        self.address = str(self.folder / "socket")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.address],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            cwd=self.folder,
        )
        ready = self.folder / "ready"
        deadline = time.monotonic() + 120
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm-start server did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def fits(self, env: dict[str, str]) -> bool:
        differing = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k.startswith(WARM_DIFFERENCES) for k in differing)

    def start(self, cmd: list[str], env: dict[str, str], cwd: Path) -> WarmProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.address)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        request = json.dumps({"argv": cmd, "env": env, "cwd": str(cwd)}).encode()
        try:
            socket.send_fds(conn, [request], [stdin, out_w, err_w])
        finally:
            for fd in (stdin, out_w, err_w):
                os.close(fd)
        return WarmProcess(cmd, conn, out_r, err_r)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_server: _Server | None = None


def warm_start(cmd: list[str], env: dict[str, str], cwd: Path) -> WarmProcess | None:
    """`cmd`, this interpreter running a script (`train.py`, as tests.helpers.start asks), with
    the whole environment `env`, forked from this worker's server where a warm start cannot
    differ from a cold one (see the module's docstring); None: start it cold."""
    global _server
    if len(cmd) < 2 or cmd[0] != sys.executable or cmd[1].startswith("-"):
        return None
    if _server is not None and not _server.fits({**os.environ, "PYTHONUNBUFFERED": "1"}):
        close()  # this worker's own environment changed since: a server that has it
    if _server is None:
        _server = _Server()
    if not _server.fits(env):
        return None
    return _server.start(cmd, env, cwd)


def close() -> None:
    """The server ends (the pytest worker's session ends)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def _recv_line(conn: socket.socket) -> str:
    data = conn.recv(64)
    if not data:
        raise RuntimeError("the warm-start server went away")
    return data.decode().strip()


# --- the server: its own process -----------------------------------------------------------------


def _serve(address: str) -> dict[str, Any] | None:
    """Fork a child per request, which sends its pid once it has taken the request's session;
    the server sends its wait status once it ended. Returns the request in a child, None in the
    server once the worker is gone."""
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    Path(address).with_name("ready").touch()
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], _BUSY_POLL_S)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return None  # the pytest worker is gone
        if listener in readable:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _become(request, fds)
                # Its pid once its session exists (Popen returns after the child's setsid too):
                # a test may signal the session at once.
                _tell(conn, os.getpid())
                conn.close()
                return request
            for fd in fds:
                os.close(fd)
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            _tell(conn, status)
            conn.close()


def _tell(conn: socket.socket, number: int) -> None:
    """A pid or a wait status to the test; a test that is gone (failed, timed out) no longer
    listens, and the server goes on."""
    with contextlib.suppress(OSError):
        conn.sendall(f"{number}\n".encode())


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """The child takes the request's session, pipes, folder, environment and command line."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["argv"][1])
    sys.argv = [request["argv"][1], *request["argv"][2:]]
    sys.path[0] = os.path.dirname(script)


# --- the fork server's template: in a warm start -------------------------------------------------
#
# A warm `train.py` that launches ranks starts dpt's fork server (dpt/launch/fork_server.py), which
# Python's forkserver starts as a new interpreter, `python -c "from multiprocessing.forkserver
# import main; main(...)"`: it imported torch and torch._dynamo again, 3.5 s of a core of its
# 4.5 s, on every launch. So before `train.py`'s first line the warm start forks a template of
# itself, torch imported and nothing of the run's yet, which becomes that server if the run starts
# one: it takes the two descriptors, the environment and the folder the launcher would have
# passed to the new interpreter, and runs its `-c` command. It is the launcher's child, as the
# server is; the server's own set-up (it ends with its launcher, its ranks with it) runs as in a
# new interpreter (`sys.orig_argv` says `-c` and the command). Only the first server a run starts
# is warm, and only with the environment the run started with (plus what dpt adds for the server);
# any other spawn is the standard one. A template never used ends with its launcher.

_FORK_SERVER_COMMAND = "from multiprocessing.forkserver import main"
_HIGH_FD = 900  # where the template keeps its descriptors, clear of those it is handed


def _fork_server_template() -> None:
    """In a warm start: fork the template and let the first fork server's spawn use it."""
    import multiprocessing.util as util

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    launcher, started_with = os.getpid(), dict(os.environ)
    template = os.fork()
    if template == 0:
        ours.close()
        _be_template(theirs, launcher)  # never returns
    theirs.close()
    standard = util.spawnv_passfds

    def spawnv_passfds(path: bytes | str, args: list[str], passfds: list[int]) -> int:
        if not (os.fsdecode(args[-1]).startswith(_FORK_SERVER_COMMAND) and ours.fileno() >= 0
                and os.fsdecode(path) == sys.executable
                and _only_server_additions(started_with, dict(os.environ))):  # fmt: skip
            return standard(path, args, passfds)
        handed = {"command": os.fsdecode(args[-1]), "fds": list(passfds), "env": dict(os.environ),
                  "cwd": os.getcwd(), "argv": [os.fsdecode(a) for a in args]}  # fmt: skip
        socket.send_fds(ours, [json.dumps(handed).encode()], list(passfds))
        ours.close()  # the template is the server now: only the first one is warm
        return template

    util.spawnv_passfds = spawnv_passfds  # type: ignore[assignment]


def _only_server_additions(started_with: dict[str, str], now: dict[str, str]) -> bool:
    """Whether `now` is `started_with` plus only what dpt's launcher sets for itself and its
    ranks, read while they run: the start folder for the ranks' imports, Hydra's full errors
    (dpt/launch/cli.py prints the short form itself), the server's launcher and Gloo's and
    NCCL's interfaces."""
    from dpt.launch.fork_server import LOOPBACK_VARIABLES
    from dpt.launch.parent_death import LAUNCHER_PID
    from dpt.user_code import IMPORT_PATH_ENV

    added = (IMPORT_PATH_ENV, "HYDRA_FULL_ERROR", LAUNCHER_PID, *LOOPBACK_VARIABLES)
    differing = {k for k in started_with.keys() | now.keys() if started_with.get(k) != now.get(k)}
    return all(k in added and k not in started_with for k in differing)


def _be_template(conn: socket.socket, launcher: int) -> None:
    """Wait for the launcher's spawn, become the fork server it asked for, and exit as it does."""
    import ctypes
    import fcntl
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: ends with launcher
    if os.getppid() != launcher:
        os._exit(0)
    kept = socket.socket(fileno=fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD, _HIGH_FD))
    conn.close()
    try:
        message, fds, _, _ = socket.recv_fds(kept, 1 << 20, 8)
    except OSError:
        message = b""
    if not message:
        os._exit(0)
    handed = json.loads(message)
    # The descriptors to the numbers the command names (as the spawn's `passfds` keeps them),
    # by way of high numbers so that none overwrites another; all others closed.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, _HIGH_FD + 10) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, number in zip(high, handed["fds"], strict=True):
        os.dup2(fd, number, inheritable=True)
    _close_all_but({0, 1, 2, *handed["fds"]})
    os.chdir(handed["cwd"])
    os.environ.clear()
    os.environ.update(handed["env"])
    sys.argv, sys.orig_argv = ["-c"], handed["argv"]
    code: Any = 0
    try:
        exec(compile(handed["command"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _close_all_but(keep: set[int]) -> None:
    """Every descriptor closed but `keep`, as a spawn with `close_fds` leaves the new process."""
    low = 0
    for fd in sorted(keep):
        if low < fd:  # an empty range would close everything above `low` (close_range(2))
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


if __name__ == "__main__":
    _request = _serve(sys.argv[1])
    if _request is not None:  # a child: run the script as `python train.py` would
        import runpy

        _fork_server_template()
        runpy.run_path(os.path.abspath(_request["argv"][1]), run_name="__main__")
