"""A model cut into pipeline stages: its units in forward order, where the cuts go, and the
part of the model one stage holds.

A unit is what a cut may not go through: the GPT's embedding, each of its blocks and its head;
a ResNet's stem, each residual block and its head; each child of an `nn.Sequential` (the MLP).
A stage is a run of consecutive units. A rank's stages are a copy of the whole model with the
other units' modules removed (None, or the stand-in its family names: `Family.absent`), so its
parameters keep the whole model's names:
checkpoints of any number of stages are the same keys, and load at any other number.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dpt.errors import DptError
from dpt.models.families import family_of
from dpt.models.families.base import Unit


def units(model: nn.Module) -> list[Unit]:
    """The model's units in forward order; one line where dpt knows none."""
    found = family_of(model).units(model)
    if found is None:
        raise DptError(
            f"strategy=pipeline: dpt does not know where to cut {type(model).__name__} into "
            "stages (it cuts the GPT between blocks, the ResNets between residual blocks, "
            "Llama-shaped transformers models between decoder layers and any nn.Sequential "
            "between its children)"
        )
    return found


def plan(model: nn.Module, stages: int, split_points: Sequence[str] | None) -> list[list[Unit]]:
    """The units of each of `stages` stages: cut before each split point, or balanced by
    parameter count where none are given."""
    found = units(model)
    names = ", ".join(u.name for u in found)
    if stages > len(found):
        raise DptError(
            f"strategy.stages={stages}: {type(model).__name__} has {len(found)} blocks to put "
            f"on stages ({names}); use at most {len(found)} stages"
        )
    if split_points:
        starts = [_unit_at(point, found, model, names) for point in split_points]
        if len(starts) != stages - 1 or starts != sorted(set(starts)) or 0 in starts:
            raise DptError(
                f"strategy.split_points={list(split_points)}: {stages} stages need "
                f"{stages - 1} distinct split points in forward order, after the first block "
                f"({names})"
            )
    else:
        starts = _balanced_starts([_own_size(u, model) for u in found], stages)
    bounds = [0, *starts, len(found)]
    return [found[a:b] for a, b in itertools.pairwise(bounds)]


def _unit_at(point: str, found: list[Unit], model: nn.Module, names: str) -> int:
    """The index of the unit a split point names: a unit, or a module whose first unit it is
    (a ResNet's `layer3` is `layer3.0`)."""
    for i, unit in enumerate(found):
        if unit.name == point or unit.name.startswith(point + "."):
            return i
    raise DptError(
        f"strategy.split_points: {point!r} names no block of {type(model).__name__}; "
        f"its blocks: {names}"
    )


def _own_size(unit: Unit, model: nn.Module) -> int:
    return sum(p.numel() for name in unit.modules
               for p in model.get_submodule(name).parameters())  # fmt: skip


def _balanced_starts(sizes: list[int], stages: int) -> list[int]:
    """Where stages 2..k begin so that the largest stage holds the fewest parameters
    (contiguous runs, each at least one unit; ties go to the earlier cut)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest largest stage putting the first i units on k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def stage_model(model: nn.Module, kept: Sequence[Unit]) -> nn.Module:
    """A copy of `model` holding only the modules of the `kept` units (the others None), and
    those that share a parameter with them (a GPT's head and token embedding share one: its
    last stage keeps the embedding's module, so the matrix keeps its first name)."""
    stage = copy.deepcopy(model)
    family = family_of(model)
    own = {id(p) for u in kept for name in u.modules
           for p in stage.get_submodule(name).parameters()}  # fmt: skip
    keep = {name for u in kept for name in u.modules}
    for unit in units(stage):
        for name in unit.modules:
            module = stage.get_submodule(name)
            if name in keep or any(id(p) in own for p in module.parameters()):
                continue
            parent, _, child = name.rpartition(".")
            stage.get_submodule(parent).register_module(child, family.absent(module))
    return stage


class StageView(nn.Module):
    """One stage's forward: its units, run in order on the stage's copy of the model. Holds
    only its units' modules, and those that share a parameter with them (a GPT's embedding
    beside its head), so its parameters are the stage's: DDP, fsdp and the schedule see those,
    and fsdp's sharded parameter replaces a shared one in both modules. The copy itself is not
    registered in it."""

    def __init__(
        self, holder: nn.Module, kept: Sequence[Unit], autocast: Callable, tensor_mesh: Any = None
    ) -> None:
        """`tensor_mesh`: the mesh its layers are split over (tensor parallelism), or None."""
        super().__init__()
        own = [holder.get_submodule(name) for unit in kept for name in unit.modules]
        ids = {id(p) for module in own for p in module.parameters()}
        inside = {id(m) for module in own for m in module.modules()}
        sharing = [m for m in holder.modules() if id(m) not in inside
                   and any(id(p) in ids for p in m.parameters(recurse=False))]  # fmt: skip
        self.parts = nn.ModuleList(own + sharing)
        self._holder = (holder,)  # a tuple: not a submodule
        self.kept, self.autocast, self.tensor_mesh = list(kept), autocast, tensor_mesh
        self.family = family_of(holder)

    @property
    def holder(self) -> nn.Module:
        return self._holder[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():  # only the forward: backward runs in the forward's dtypes
            x = self.family.run_stage(self._holder[0], self.kept, self._entering(x))
        return self._leaving(x)

    def _entering(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states from the stage before, whole on each tensor rank: split over the
        sequence, as the blocks' split layers pass them on (token ids enter as they are)."""
        if self.tensor_mesh is None or not x.is_floating_point():
            return x
        from torch.distributed.tensor import DTensor, Replicate, Shard

        whole = DTensor.from_local(x, self.tensor_mesh, [Replicate()], run_check=False)
        return whole.redistribute(self.tensor_mesh, [Shard(1)])

    @staticmethod
    def _leaving(x: torch.Tensor) -> torch.Tensor:
        """What the stage sends on: a plain tensor, whole (the schedule sends no DTensors)."""
        from torch.distributed.tensor import DTensor

        return x.full_tensor() if isinstance(x, DTensor) else x
