"""A strategy's keys (dpt/config/strategies.py): dpt's own, and the PyTorch wrapper's, passed on
by name. A wrapper's key added to the schema and the option's YAML reaches the wrapper, and
validation and the reference follow from the schema: nothing else changes."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dpt.config.build import build
from dpt.distributed import DistEnv
from tests.helpers import compose

CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


def test_every_wrapper_key_of_ddp_and_fsdp_is_a_keyword_of_its_wrapper() -> None:
    for option, wrapper in (("ddp", DistributedDataParallel.__init__), ("fsdp", fully_shard)):
        strategy = build(compose(f"strategy={option}").strategy)
        keywords = set(inspect.signature(wrapper).parameters)
        assert strategy.wrapper, option
        assert set(strategy.wrapper) <= keywords, (option, set(strategy.wrapper) - keywords)


def test_a_ddp_key_reaches_distributed_data_parallel(monkeypatch) -> None:
    """strategy.init_sync: added as its dataclass field and its YAML line alone. DDP skips
    its start-up broadcast of rank 0's parameters where it is false."""
    import torch.nn.parallel.distributed as ddp_module

    synced: list[bool] = []
    monkeypatch.setattr(ddp_module, "_sync_module_states", lambda **_: synced.append(True))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for value in ("true", "false"):
            strategy = build(compose("strategy=ddp", f"strategy.init_sync={value}").strategy)
            assert isinstance(strategy.wrap(nn.Linear(2, 2), CPU1, "32"), DistributedDataParallel)
    finally:
        dist.destroy_process_group()
    assert synced == [True]  # at true only
