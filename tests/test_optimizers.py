"""The optimizers a run builds: Adam and AdamW on torch's fused kernel where the parameters'
device has it (`optimizer.fused`, true by default), torch's default where asked or where not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dpt.distributed import DistEnv
from dpt.loop.optimizers import fused_fits
from tests.helpers import build_trainer

CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
SHORT = ["trainer.max_steps=2", "checkpoint.enabled=false"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optimizer", ["adam", "adamw", "adamw_gpt"])
def test_adam_runs_on_the_fused_kernel_unless_told_not_to(tmp_path: Path, optimizer: str) -> None:
    fused = build_trainer(tmp_path / "fused", CPU1, f"optimizer={optimizer}", *SHORT)
    assert fused.parts.optimizer.defaults["fused"] is True
    loop = build_trainer(tmp_path / "loop", CPU1, f"optimizer={optimizer}",
                         "optimizer.fused=false", *SHORT)  # fmt: skip
    assert loop.parts.optimizer.defaults["fused"] is False


def test_the_fused_kernel_is_asked_for_only_where_the_device_has_it() -> None:
    assert fused_fits(nn.Linear(4, 2))
    assert not fused_fits(nn.Linear(4, 2, device="meta"))  # no kernel there: torch's default
    frozen_on_meta = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 2, device="meta"))
    frozen_on_meta[1].requires_grad_(False)
    assert fused_fits(frozen_on_meta)  # only what trains is stepped
