"""Gradient diagnostics every N steps (issue #28): each parameter group's gradient norm and the
relative size of its update, ||w_after - w_before|| / ||w_before||, as scalars for TensorBoard.

A group is the parameters a module owns directly ("net.0" for "net.0.weight" and "net.0.bias";
the root module's own parameters: "root"). Off by default; on a diagnostics step the norms are
computed on the device with multi-tensor (foreach) kernels and read back to the host once, and
the weights being updated are cloned once, so that their change can be measured.

Under fsdp each rank holds shards (DTensors) of the parameters and gradients: the squared norms
of the local shards are summed over the ranks in one all-reduce per diagnostics step. Under ddp
and single every rank holds the whole tensors: no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from dpt.distributed import is_dtensor, local_part
from dpt.models import unwrap

ROOT = "root"  # the group of the parameters the root module owns itself


def group_of(name: str) -> str:
    """The group of parameter `name`: the path of the module that owns it."""
    return name.rpartition(".")[0] or ROOT


@dataclass
class _Kept:
    """What `before_update` leaves for `after_update`, all on the device (no host sync)."""

    params: list[list[nn.Parameter]]  # per group, those with a gradient: what the step updates
    before: list[torch.Tensor]  # their local parts' values before the update (clones), flat
    grad_squares: torch.Tensor  # per group: sum of the local gradients' squared norms
    weight_squares: torch.Tensor  # per group: sum of the local weights' squared norms
    mesh: DeviceMesh | None  # fsdp: the ranks the shards are spread over; else None


class GradDiagnostics:
    """Per parameter group: the gradient norm and the update/weight ratio on every
    `every_n_steps`-th optimizer step (None: never). The trainer calls `before_update` between
    backward (and clipping) and `optimizer.step()`, and `after_update` right after the step, on
    every rank alike (under fsdp `after_update` is a collective)."""

    def __init__(self, model: nn.Module, every_n_steps: int | None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be None (off) or at least 1, not {every_n_steps}")
        self.model, self.every_n_steps = model, every_n_steps
        # Every group, with or without gradients: the vector all-reduced under fsdp must have
        # the same length on every rank.
        named = unwrap(model).named_parameters()
        self.groups = list(dict.fromkeys(group_of(name) for name, _ in named))
        self._kept: _Kept | None = None

    def due(self, step: int) -> bool:
        """Whether optimizer step number `step` (1-based, the step about to be applied) is a
        diagnostics step: every_n_steps set and step % every_n_steps == 0."""
        return self.every_n_steps is not None and step % self.every_n_steps == 0

    @torch.no_grad()
    def before_update(self) -> None:
        """Called after backward (and after clipping) and before optimizer.step() on a due step:
        records each group's gradient norm and keeps what the update ratio needs (the group's
        weights before the update). Reads the gradients and weights, changes neither."""
        params = self._params_with_grads()
        flat = [p for group in params for p in group]
        weights = [local_part(p.detach()) for p in flat]
        self._kept = _Kept(
            params=params,
            before=[w.clone() for w in weights],
            grad_squares=_squares_by_group([local_part(p.grad) for p in flat], params),
            weight_squares=_squares_by_group(weights, params),
            mesh=_shard_mesh(flat),
        )

    @torch.no_grad()
    def after_update(self) -> dict[str, float]:
        """Called right after optimizer.step() on the same step: returns the scalars to log,
        {"grads/<group>/norm": ..., "grads/<group>/update_ratio": ...} for each group with a
        gradient (update_ratio = ||w_after - w_before|| / ||w_before||, the relative size of
        this step's update), and frees what before_update kept. Non-finite values are reported
        as they are."""
        kept, self._kept = self._kept, None
        if kept is None:  # no before_update on this step: nothing to report
            return {}
        after = [local_part(p.detach()) for group in kept.params for p in group]
        torch._foreach_sub_(kept.before, after)  # in place on our own clones: no more memory
        update_squares = _squares_by_group(kept.before, kept.params)
        squares = torch.stack([kept.grad_squares, kept.weight_squares, update_squares])
        if kept.mesh is not None:
            squares = _summed_over_ranks(squares, kept.mesh)
        grad_norm, weight_norm, update_norm = squares.sqrt().unbind()
        values = torch.stack([grad_norm, update_norm / weight_norm]).tolist()  # the one sync
        return self._scalars(values, [len(group) for group in kept.params])

    def _params_with_grads(self) -> list[list[nn.Parameter]]:
        """The parameters with a gradient, by group (in `self.groups` order). Looked up on each
        call: fsdp swaps the parameter objects between sharded and unsharded ones."""
        by_group: dict[str, list[nn.Parameter]] = {group: [] for group in self.groups}
        for name, param in unwrap(self.model).named_parameters():
            if param.grad is not None:
                by_group[group_of(name)].append(param)
        return list(by_group.values())

    def _scalars(self, values: list[list[float]], counts: list[int]) -> dict[str, float]:
        """The tags and values of the groups that had gradients (the others have no norm)."""
        scalars: dict[str, float] = {}
        for group, norm, ratio, count in zip(self.groups, *values, counts, strict=True):
            if count:
                scalars[f"grads/{group}/norm"] = norm
                scalars[f"grads/{group}/update_ratio"] = ratio
        return scalars


def _squares_by_group(
    tensors: list[torch.Tensor], params: list[list[nn.Parameter]]
) -> torch.Tensor:
    """Each group's sum of squared norms, as one float32 vector on the device: `tensors` are
    the flat list, in the order of `params` (group by group). One foreach kernel for all
    norms; no host sync. A group without tensors sums to 0."""
    sizes = [len(group) for group in params]
    if not tensors:
        return torch.zeros(len(sizes))
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    squares = torch.stack(norms).square()
    return torch.stack([part.sum() for part in squares.split(sizes)])


def _shard_mesh(params: list[nn.Parameter]) -> DeviceMesh | None:
    """The device mesh the parameters are sharded over (fsdp's DTensors), None when every rank
    holds them whole (ddp, single)."""
    sharded = next((p for p in params if is_dtensor(p)), None)
    return sharded.device_mesh if sharded is not None else None  # type: ignore[attr-defined]


def _summed_over_ranks(squares: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sums of squares of the local shards added over the ranks: the whole tensors' ones.
    A collective inside the step, but of one small tensor and on diagnostics steps only, which
    are rare. dpt's fsdp shards over a 1-D mesh of all ranks, each element on one rank only.
    Moved to the mesh's device first: with CPU offload the shards are on the CPU, while NCCL
    reduces only tensors on the GPU."""
    on_mesh = squares.to(mesh.device_type)
    dist.all_reduce(on_mesh, group=mesh.get_group())
    return on_mesh.to(squares.device)
