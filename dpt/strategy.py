"""How the model is spread over devices: single, DataParallel, DistributedDataParallel."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dpt.config import COMM_HOOK_NAMES
from dpt.distributed import DistEnv
from dpt.errors import DptError

log = logging.getLogger("dpt")

# `strategy.comm_hook`: the names live in dpt.config (checked there before any process starts,
# without torch); each maps to torch's `<name>_compress_hook`.
COMM_HOOKS: dict[str, Callable[..., Any]] = {
    name: getattr(default_hooks, f"{name}_compress_hook") for name in COMM_HOOK_NAMES
}


class Strategy:
    """Wraps the model. Which strategies run one process per device is a property of their config
    schema (`dpt.config.is_distributed`), known without importing torch."""

    name: ClassVar[str] = "single"

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        return model

    def global_batch(self, batch_size: int, env: DistEnv) -> int:
        """Samples per optimizer step over the whole world (before gradient accumulation)."""
        return batch_size * env.world_size


class Single(Strategy):
    name = "single"


class DataParallel(Strategy):
    """One process; `batch_size` is the whole batch, which DataParallel splits over the GPUs."""

    name = "dp"

    def __init__(self, device_ids: list[int] | None) -> None:
        self.device_ids = None if device_ids is None else list(device_ids)

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        gpus = torch.cuda.device_count() if env.device.type == "cuda" else 0
        if self.device_ids is not None:
            if max(self.device_ids, default=0) >= gpus:
                raise DptError(
                    f"strategy.device_ids={self.device_ids}: only {gpus} GPU(s) "
                    f"visible on {env.device.type}"
                )
            return nn.DataParallel(model, device_ids=self.device_ids)
        if gpus < 2:
            log.warning(
                "strategy=dp: %d GPU(s) on %s, DataParallel needs 2 or more; running as single",
                gpus,
                env.device.type,
            )
            return model
        return nn.DataParallel(model)


class DDP(Strategy):
    """One process per device; `batch_size` is per process; gradients are all-reduced in buckets."""

    name = "ddp"

    def __init__(
        self,
        bucket_cap_mb: float,
        gradient_as_bucket_view: bool,
        static_graph: bool,
        find_unused_parameters: bool,
        comm_hook: str | None,
    ) -> None:
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {', '.join(COMM_HOOKS)} or None")
        self.bucket_cap_mb = bucket_cap_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook = comm_hook

    def wrap(self, model: nn.Module, env: DistEnv) -> nn.Module:
        if not torch.distributed.is_initialized():
            return model  # a world of one: nothing to synchronise
        ddp = DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            # Gradients live in the communication buckets: one copy less per step.
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters,
        )
        if self.comm_hook is not None:
            # state=None: the hooks then use the default process group (the training world).
            ddp.register_comm_hook(state=None, hook=COMM_HOOKS[self.comm_hook])
        return ddp
