"""dpt.state.sharded_load: a transformers folder's tensors read into a model built on the meta
device, each rank its rows. A tensor every rank holds whole (a buffer) is read whole: a 0-dim
one too (BatchNorm's count of batches, in transformers' ResNet), which has no slice to read."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpt.state.sharded_load import load_shards


def _convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))


def test_a_folders_whole_tensors_load_a_0_dim_buffer_too(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    saved = _convnet()
    saved(torch.randn(2, 3, 6, 6))  # running statistics and a count of 1
    state = {k: v.contiguous() for k, v in saved.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    torch.manual_seed(1)
    fresh = _convnet()
    fresh(torch.randn(2, 3, 6, 6))
    fresh.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    load_shards(fresh, tmp_path, {key: key for key in state})
    loaded = fresh.state_dict()
    assert int(loaded["1.num_batches_tracked"]) == 1
    assert all(torch.equal(loaded[key], value) for key, value in state.items())
