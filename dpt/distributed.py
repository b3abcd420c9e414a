"""Where this process stands in the world: rank, device, backend, and the process group."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dpt.errors import DptError
from dpt.rendezvous import attempt_store, is_loopback, loopback_store


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def backend(self) -> str:
        # NCCL only talks to CUDA tensors; Gloo covers CPU (and MPS tensors staged via CPU).
        return "nccl" if self.device.type == "cuda" else "gloo"


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def available_accelerator() -> str:
    """CUDA, then MPS, then CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if _mps_available():
        return "mps"
    return "cpu"


def select_device(requested: str, local_rank: int) -> torch.device:
    """`auto` falls back CUDA -> MPS -> CPU; an explicit choice must be available."""
    kind = available_accelerator() if requested == "auto" else requested
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DptError("trainer.device=cuda: no CUDA device is visible")
        if local_rank >= torch.cuda.device_count():
            raise DptError(
                f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if kind == "mps" and not _mps_available():
        raise DptError("trainer.device=mps: MPS is not available on this machine")
    return torch.device(kind)


def env_from_environment(requested_device: str) -> DistEnv:
    """Read the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, ...); absent = one process."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device = select_device(requested_device, local_rank)
    return DistEnv(rank, local_rank, world_size, local_world_size, device)


def init_process_group(env: DistEnv, timeout_s: float) -> None:
    """Join the world described by MASTER_ADDR/MASTER_PORT (env://)."""
    if env.world_size == 1:
        return
    if not dist.is_initialized():  # an engine may have joined it already (Ray Train)
        _join(env, timeout_s)
    global _control_group
    # Small CPU-side agreements (stop signal, non-finite loss) go over Gloo, so that under NCCL
    # they never wait behind, or get ordered with, the gradient all-reduces on the GPU stream.
    _control_group = dist.new_group(backend="gloo") if env.backend == "nccl" else None


def _join(env: DistEnv, timeout_s: float) -> None:
    global _hosted_store
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {"backend": env.backend, "timeout": timeout}
    if env.device.type == "cuda":
        kwargs["device_id"] = env.device  # binds NCCL communicators eagerly to this GPU
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent: its store
        store = attempt_store(env.rank, timeout)  # outlives a restart; one of this attempt's own
    elif is_loopback(os.environ.get("MASTER_ADDR", "")):  # rank 0 hosts it, on loopback only
        port = int(os.environ["MASTER_PORT"])
        store = loopback_store(port, env.rank == 0, timeout, world_size=env.world_size)
    if store is not None:
        kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
        _hosted_store = _HostedStore(store, env.rank, env.world_size)
    dist.init_process_group(**kwargs)


_control_group: Any = None
LEFT_KEY = "dpt/left"  # how many ranks are done with the world's store
LEAVE_WAIT_S = 10.0  # the store's host waits at most this long for the others to be done with it


@dataclass(frozen=True)
class _HostedStore:
    """The world's store where rank 0's process serves it (dpt's loopback and attempt stores)."""

    store: Any
    rank: int
    world_size: int

    def leave(self) -> None:
        """Say this rank is done with the store; on rank 0, its server, wait (LEAVE_WAIT_S at
        most) until the others are too. A rank still polling a store whose server had gone (one
        a step behind under load, its roll-call thread) prints torch's C++ `recvValue failed`
        warnings under the run's own one line."""
        # Polled, not torch's blocking `store.wait`: its timeout prints two C++ warnings.
        with contextlib.suppress(Exception):  # the store is gone: nothing to wait for
            left = self.store.add(LEFT_KEY, 1)
            deadline = time.monotonic() + LEAVE_WAIT_S
            while self.rank == 0 and left < self.world_size:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
                left = self.store.add(LEFT_KEY, 0)


_hosted_store: _HostedStore | None = None


def destroy_process_group(together: bool = True) -> None:
    """Leave the world, and the store rank 0 serves (`_HostedStore.leave`) where this rank ends
    with the others (`together`: its run done, or a stop they agreed on). A rank that failed,
    or ended because another did, does not speak to that store: its server may be gone."""
    global _control_group, _hosted_store
    _control_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
    if _hosted_store is not None and together:
        _hosted_store.leave()
    _hosted_store = None


def all_gather_floats(values: list[float], env: DistEnv) -> list[list[float]]:
    """Every rank's list of floats, on every rank: one small collective (CPU, over Gloo).

    The one collective of the training loop besides the gradients: `dpt.loop.agreement` sends the
    non-finite and stop flags and the metrics window through it once per logging window.
    """
    if not dist.is_initialized():
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(env.world_size)]
    dist.all_gather(rows, mine, group=_control_group)
    return [row.tolist() for row in rows]


def broadcast_object(obj: Any, env: DistEnv) -> Any:
    """Rank 0's value on every rank (identity in a single process)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.device if env.backend == "nccl" else None)
    return box[0]


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a DTensor (fsdp's shards), without importing DTensor (a second of
    start-up): a DTensor exists only once its module was imported (by fsdp, DCP or torchvision)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def copy_whole(parameter: torch.Tensor, full: torch.Tensor) -> None:
    """`full` into `parameter`; a DTensor takes its own shard of it (every rank holds the
    same `full`: nothing is sent)."""
    if is_dtensor(parameter):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(parameter.device, parameter.dtype)
        mine = distribute_tensor(full, parameter.device_mesh, parameter.placements,
                                 src_data_rank=None)  # fmt: skip
        parameter.to_local().copy_(mine.to_local())
    else:
        parameter.copy_(full)
