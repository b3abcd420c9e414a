"""A transformers model's weights under fsdp without a whole copy on any rank: the model is
built on the meta device and sharded there, each rank allocates only its shards and reads only
its rows of each tensor from the folder's memory-mapped safetensors files (safetensors' slices;
no rank ever holds a whole copy). Tensors the files lack, or hold in
another shape (a classification head of another size), keep the model's own initialisation.

Used by dpt.loop.parts where the strategy shards parameters, the world has more than one rank and
the weights are a transformers folder's (`model=hf model.path=...`, or `model.init_from=` such a
folder)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpt.state.results import DATA_FILE

SAFETENSORS_GLOB = "*.safetensors"


def safetensors_folder(source: str | None) -> Path | None:
    """`source` where it is a folder of safetensors files that is not a run folder (a run's
    `model.pt` holds its weights); None otherwise."""
    if source is None:
        return None
    folder = Path(source)
    if not folder.is_dir() or (folder / DATA_FILE).exists():
        return None
    return folder if any(folder.glob(SAFETENSORS_GLOB)) else None


def stored_shapes(folder: Path) -> dict[str, torch.Tensor]:
    """The files' tensors as meta tensors: names and shapes, nothing read but the headers."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(folder.glob(SAFETENSORS_GLOB)):
        with safe_open(str(file), framework="pt") as opened:
            for key in opened.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shape = opened.get_slice(key).get_shape()
                shapes[key] = torch.empty(shape, device="meta")
    return shapes


def materialize(model: nn.Module, device: torch.device) -> None:
    """The sharded meta model's storage on `device` (each rank: its shards), initialised as
    transformers initialises a model: the weights, and the buffers computed at construction
    that the meta device lost (the rotary frequencies)."""
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    if init is not None:
        with torch.no_grad():
            model.apply(init)


def load_shards(model: nn.Module, folder: Path, keys: set[str]) -> None:
    """`keys` of the folder's safetensors into the sharded model: each rank reads only its rows
    of each tensor (FSDP2 shards dim 0), through safetensors' slices of the memory-mapped file."""
    from safetensors import safe_open

    owners = {key: file for file in sorted(folder.glob(SAFETENSORS_GLOB))
              for key in _keys_of(file)}  # fmt: skip
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            key = name.replace(WRAPPED, "")  # recomputation's wrapper: not in the files' names
            if key not in keys:
                continue
            with safe_open(str(owners[key]), framework="pt") as opened:
                _copy_own_rows(tensor, opened.get_slice(key))


WRAPPED = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, in module names


def _keys_of(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as opened:
        return list(opened.keys())


def _copy_own_rows(tensor: torch.Tensor, stored: object) -> None:
    """This rank's part of `tensor` (a DTensor sharded on dim 0, or a whole one) from the file."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        tensor.copy_(stored[:])  # type: ignore[index]
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    local = tensor.to_local()
    if local.numel():
        rows = stored[offset[0] : offset[0] + shape[0]]  # type: ignore[index]
        local.copy_(rows.reshape(local.shape))
