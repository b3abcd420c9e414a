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
from typing import Any

import torch
from torch import nn

from dpt.models import bare_name
from dpt.state.model_state import SAFETENSORS_SUFFIX, safetensors_files, stored_shapes

SAFETENSORS_GLOB = f"*{SAFETENSORS_SUFFIX}"


def safetensors_folder(source: str | None) -> Path | None:
    """`source` where it is a folder of safetensors files that is neither a run folder (a run's
    `model.pt` holds its weights) nor a checkpoint; None otherwise (a folder of other weights
    too: transformers reads those whole)."""
    folder = Path(source) if source is not None else None
    if folder is None or not folder.is_dir() or not any(folder.glob(SAFETENSORS_GLOB)):
        return None
    return folder if safetensors_files(folder, source) else None


def materialize(model: nn.Module, device: torch.device) -> None:
    """The sharded meta model's storage on `device` (each rank: its shards), initialised as
    transformers initialises a model: the weights, and the buffers computed at construction
    that the meta device lost (the rotary frequencies)."""
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    if init is not None:
        with torch.no_grad():
            model.apply(init)


def load_shards(model: nn.Module, folder: Path, keys: dict[str, str]) -> None:
    """The tensors `keys` names (the model's name: the files' name for it) of the folder's
    safetensors into the sharded model: each rank reads only its rows
    of each tensor (FSDP2 shards dim 0), through safetensors' slices of the memory-mapped file.
    The file is mapped again for each tensor: pages a rank touched are unmapped with it, not
    resident until the last tensor (one mapping for all measured 1.1-1.2 of the model per rank
    against 0.65)."""
    from safetensors import safe_open

    owners = {key: file for file in sorted(folder.glob(SAFETENSORS_GLOB))
              for key in stored_shapes([file])}  # fmt: skip
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            stored = keys.get(bare_name(name))  # recomputation's wrapper: not in the files
            if stored is not None:
                with safe_open(str(owners[stored]), framework="pt") as opened:
                    _copy_own_rows(tensor, opened, stored)


def _copy_own_rows(tensor: torch.Tensor, opened: Any, key: str) -> None:
    """This rank's part of `tensor` (a DTensor sharded on dim 0, or a whole one) from the file
    (`opened`, its tensor `key`)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):  # whole on each rank: a buffer, a 0-dim one (BatchNorm's
        tensor.copy_(opened.get_tensor(key))  # count) too, which has no slice
        return
    stored = opened.get_slice(key)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    local = tensor.to_local()
    if local.numel():
        rows = stored[offset[0] : offset[0] + shape[0]]
        local.copy_(rows.reshape(local.shape))
