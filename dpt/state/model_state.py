"""A model's weights read from wherever they were written, as one plain state dict: a run
folder (its final `model.pt`, else its newest committed checkpoint), a `.pt` file, a committed
checkpoint (a DCP folder of any world size, read in this one process), a safetensors file, or
a transformers model folder (its safetensors files). Nothing but tensors is ever unpickled."""

from __future__ import annotations

import functools
import io
from pathlib import Path
from typing import Any

import torch

from dpt.errors import DptError, torch_load_reason
from dpt.state.checkpoint import MARKER, checkpoint_dir, committed
from dpt.state.results import DATA_FILE, LAST_MODEL

SAFETENSORS_SUFFIX = ".safetensors"
MODEL_PART = "model"  # the model's entry in a checkpoint (and in a training state file)


def read_model_state(path: Path, key: str) -> dict[str, torch.Tensor]:
    """The weights at `path`; `key` names it in errors (`model.init_from=PATH`)."""
    if path.is_dir():
        return _from_folder(path, key)
    if not path.is_file():
        raise DptError(f"{key}: no such file or folder")
    if path.suffix == SAFETENSORS_SUFFIX:
        return _safetensors([path])
    return _torch_file(path, key)


def _from_folder(path: Path, key: str) -> dict[str, torch.Tensor]:
    if (path / MARKER).is_file():
        return _checkpoint(path)
    if (path / DATA_FILE).is_file():  # a run folder: where it ended
        if (path / LAST_MODEL).is_file():
            return _torch_file(path / LAST_MODEL, key)
        done = committed(checkpoint_dir(path))
        if not done:
            raise DptError(f"{key}: a run folder with neither {LAST_MODEL} nor a checkpoint")
        return _checkpoint(done[-1].path)
    files = sorted(path.glob(f"*{SAFETENSORS_SUFFIX}"))
    if not files:
        raise DptError(
            f"{key}: neither a run folder, a committed checkpoint nor a folder of "
            f"{SAFETENSORS_SUFFIX} weights"
        )
    return _safetensors(files)


def _torch_file(path: Path, key: str) -> dict[str, torch.Tensor]:
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        reason = torch_load_reason(error)
        raise DptError(f"{key}: not a loadable state_dict: {reason}") from error
    state = state.get(MODEL_PART, state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DptError(f"{key}: not a state_dict (a dict of tensors)")
    return state


def _safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for file in files for k, v in load_file(file).items()}


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The model part of a committed checkpoint, whole, in this process (DCP reassembles the
    shards of any number of ranks), as DCP's own dcp_to_torch_save reads one."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    planner = _model_only_planner()(keys={MODEL_PART})
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    return state[MODEL_PART]


@functools.cache
def _model_only_planner() -> type:
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class ModelOnlyPlanner(_EmptyStateDictLoadPlanner):
        """The state dict rebuilt from the checkpoint's metadata, only the model's keys; any
        value that is not a tensor read as data, never as code."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            torch.load(value, weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    return ModelOnlyPlanner
