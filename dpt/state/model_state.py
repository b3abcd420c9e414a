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

from dpt.errors import DptError
from dpt.models.weights import MODEL_PART, read_state_file
from dpt.state.checkpoint import MARKER, checkpoint_dir, committed
from dpt.state.results import DATA_FILE, LAST_MODEL

SAFETENSORS_SUFFIX = ".safetensors"


def read_model_state(path: Path, key: str) -> dict[str, torch.Tensor]:
    """The weights at `path`; `key` names it in errors (`model.init_from=PATH`)."""
    files = safetensors_files(path, key)
    return _torch_source(path, key) if files is None else _safetensors(files)


def model_shapes(path: Path, key: str) -> dict[str, torch.Tensor]:
    """The weights at `path` as meta tensors, their names and shapes: for safetensors only
    their headers are read (the pre-run check of a model folder reads no weights)."""
    files = safetensors_files(path, key)
    if files is None:
        return {k: v.to("meta") for k, v in read_model_state(path, key).items()}
    return stored_shapes(files)


def safetensors_files(path: Path, key: str) -> list[Path] | None:
    """The safetensors files `path` is (a file, or a folder of them that is neither a run
    folder nor a checkpoint); None for any other source; refused where it is nothing."""
    if path.is_file():
        return [path] if path.suffix == SAFETENSORS_SUFFIX else None
    if not path.is_dir():
        raise DptError(f"{key}: no such file or folder")
    if (path / MARKER).is_file() or (path / DATA_FILE).is_file():
        return None
    files = sorted(path.glob(f"*{SAFETENSORS_SUFFIX}"))
    if not files:
        raise DptError(
            f"{key}: neither a run folder, a committed checkpoint nor a folder of "
            f"{SAFETENSORS_SUFFIX} weights"
        )
    return files


def stored_shapes(files: list[Path]) -> dict[str, torch.Tensor]:
    """The files' tensors as meta tensors: names and shapes, nothing read but the headers."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            for key in opened.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = opened.get_slice(key).get_shape()
                shapes[key] = torch.empty(shape, device="meta")
    return shapes


def _torch_source(path: Path, key: str) -> dict[str, torch.Tensor]:
    """A torch file, a committed checkpoint or a run folder (`safetensors_files` said no)."""
    if path.is_file():
        return read_state_file(path, key)
    if (path / MARKER).is_file():
        return _checkpoint(path)
    if (path / LAST_MODEL).is_file():  # a run folder: where it ended
        return read_state_file(path / LAST_MODEL, key)
    done = committed(checkpoint_dir(path))
    if not done:
        raise DptError(f"{key}: a run folder with neither {LAST_MODEL} nor a checkpoint")
    return _checkpoint(done[-1].path)


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
