"""What failed in a rank, in one line: a loader worker, the data set, the model's forward or the
loss, an allocation; the same line under every strategy and launcher (the traceback goes to the
rank's log file).
"""

from __future__ import annotations

import re
from types import TracebackType

from torch import nn

from dpt.errors import loader_worker_error

_ALLOCATION = (
    re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes"),  # CPU
    re.compile(r"out of memory\. Tried to allocate ([\d.]+ [KMGT]iB)"),  # CUDA
    re.compile(r"Unable to allocate ([\d.]+ [KMGT]iB)"),  # numpy
    re.compile(r"MPS backend out of memory"),
)
_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]+)\.")
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "OptimizedModule")


def describe(error: BaseException) -> str:
    """`the model's forward (Net) raised RuntimeError: ...`, `loader worker 1 could not allocate
    111.8 GiB`, ...: where it happened, then what happened."""
    text = str(error).strip()
    killed = _killed_loader_worker(error)
    if killed is not None:
        return killed
    worker = loader_worker_error(text)
    if worker is not None:
        where, what = f"loader worker {worker[0]}", worker[1]
    else:
        where, what = _where(error.__traceback__), f"{type(error).__name__}: {_first_line(text)}"
    allocation = _allocation(text)
    if allocation is not None:
        subject = where or "this rank"
        return f"{subject} could not allocate {allocation}: {what}"
    return f"{where} raised {what}" if where else what


def _killed_loader_worker(error: BaseException) -> str | None:
    """torch's "DataLoader worker (pid N) is killed by signal: Killed." (the cause of its "exited
    unexpectedly"): on Linux the kernel's OOM killer sends that SIGKILL when memory runs out."""
    cause: BaseException | None = error
    while cause is not None:
        found = _KILLED.search(str(cause))
        if found:
            pid, how = found.groups()
            if how == "Killed":
                return (
                    f"loader worker (pid {pid}) was killed (SIGKILL: most likely out of memory; "
                    "lower trainer.batch_size, the input size or dataset.num_workers)"
                )
            return f"loader worker (pid {pid}) died: {how}"
        cause = cause.__cause__
    return None


def _where(tb: TracebackType | None) -> str:
    """The outermost module call the error went through (the model or the loss), else the data
    set whose item was being read in this process; empty when neither."""
    for frame, _ in _frames(tb):
        code = frame.f_code
        if code.co_name in ("_call_impl", "_wrapped_call_impl") and "nn/modules/module" in (
            code.co_filename.replace("\\", "/")
        ):
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and type(module).__name__ not in _WRAPPERS:
                kind = "the loss" if isinstance(module, nn.modules.loss._Loss) else (
                    "the model's forward")  # fmt: skip
                return f"{kind} ({_class_name(module)})"
        if code.co_name == "fetch" and "utils/data/_utils/fetch" in code.co_filename:
            dataset = getattr(frame.f_locals.get("self"), "dataset", None)
            return f"the data set ({type(dataset).__name__})"
    return ""


def _frames(tb: TracebackType | None) -> list[tuple[object, int]]:
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames


def _class_name(module: nn.Module) -> str:
    """The user's class name, also for the subclass FSDP2 makes of it (`FSDPNet`)."""
    return next(c.__name__ for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))


def _allocation(text: str) -> str | None:
    for pattern in _ALLOCATION:
        found = pattern.search(text)
        if found is None:
            continue
        if not found.groups():
            return "memory"
        amount = found.group(1)
        return human_bytes(int(amount)) if amount.isdigit() else amount
    return None


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    raise AssertionError("unreachable")


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
