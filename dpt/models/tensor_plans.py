"""Tensor-parallel plans: how a model's layers split over the ranks of the mesh's tensor
dimension (`strategy.tensor_parallel`), with sequence parallelism between them.

Each family with a plan says it (dpt/models/families: dpt's GPT, Llama-shaped transformers
models): Megatron's splits as torchtitan plans Llama, queries, keys, values and the MLP's first
projections by columns (each rank whole heads, a slice of the MLP's width), the attention's and
the MLP's output projections by rows (their partial sums reduce-scattered over the sequence),
the norms on each rank's part of the sequence (`SequenceParallel`), the token embedding by rows
of the vocabulary and the head by columns, its logits left split over the vocabulary for a
loss that computes on the split (torch's `loss_parallel`, as torchtitan does: no rank holds the
whole vocabulary's logits), gathered whole otherwise. The residual stream between blocks stays
a DTensor split over the sequence.

A plan is torch's own machinery (dpt/models/tensor_styles.py); a model without one is refused in
one line, before any rank starts (`check_splits`, on the model the launcher builds on the meta
device; dpt's own models from their config alone: dpt.config.tensor_parallel), with the widths
that must divide by the degree.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dpt.config.tensor_parallel import indivisible
from dpt.errors import DptError
from dpt.models.families import family_of
from dpt.models.families.base import Plan
from dpt.models.weights import tied_twins


def plan_of(model: nn.Module) -> Plan | None:
    """The function that splits `model` over a 1-D tensor mesh; None where dpt has no plan."""
    return family_of(model).tensor_plan(model)


def parallelize(model: nn.Module, mesh: Any, split_logits: bool = False) -> None:
    """Split `model`'s layers over `mesh` (the tensor dimension) in place; tied parameters (a
    head sharing the embedding's matrix) stay one. `split_logits`: the head's logits stay split
    over the vocabulary in training, each rank its slice (the loss computed on the split, under
    torch's `loss_parallel`); whole otherwise, and in evaluation."""
    plan = plan_of(model)
    if plan is None:
        raise DptError(no_plan(model))
    tied = tied_twins(model)
    plan(model, mesh, split_logits)
    for name, twin in tied.items():  # parallelize_module gave each its own DTensor
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(twin))


def no_plan(model: nn.Module) -> str:
    return f"strategy.tensor_parallel: {family_of(model).no_plan_reason(model)}"


def check_splits(model: nn.Module, degree: int) -> None:
    """One line where `model` (built on the meta device, beforehand) has no plan, or a width the
    plan splits does not divide by `degree`."""
    if plan_of(model) is None:
        raise DptError(f"strategy.tensor_parallel={degree}: "
                       f"{family_of(model).no_plan_reason(model)}")  # fmt: skip
    for key, width in family_of(model).split_widths(model).items():
        if width % degree:
            raise DptError(indivisible(degree, key, width))
