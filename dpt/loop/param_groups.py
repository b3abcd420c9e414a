"""The optimizer's parameter groups: `optimizer.groups` (a learning-rate multiplier and a weight
decay per name pattern, the first match wins) and `optimizer.layer_decay` (timm's layer-wise
decay: the further a block is from the head, the smaller its learning rate). Only parameters
that train are handed over (frozen ones and a LoRA run's base hold no optimizer state).

Each group is named (`name`: its pattern, `default` for the rest, with `@<layer>` under layer
decay): TensorBoard's `optim/lr/<name>` and the start line use it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from dpt.errors import DptError
from dpt.models import unwrap
from dpt.models.blocks import blocks
from dpt.models.freezing import matches, top_modules

DEFAULT_GROUP = "default"  # the parameters no `optimizer.groups` pattern matches


def layer_ids(model: nn.Module) -> tuple[dict[str, int], int]:
    """Each parameter's layer as timm counts them: 0 before the first block (embeddings), block
    i at i + 1, n + 1 after the last (norm, head); and n + 1. Empty for a model without blocks."""
    found = blocks(model)
    if not found:
        return {}, 0
    owner = {id(p): i + 1 for i, block in enumerate(found) for p in block.parameters()}
    ids: dict[str, int] = {}
    seen_block = False
    for name, p in model.named_parameters():
        layer = owner.get(id(p))
        seen_block = seen_block or layer is not None
        ids[name] = layer if layer is not None else (len(found) + 1 if seen_block else 0)
    return ids, len(found) + 1


def check_groups(model: nn.Module, patterns: Sequence[str], layer_decay: float | None) -> None:
    """Before any rank starts (on the meta model): each pattern matches a parameter, and layer
    decay has blocks to count."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(matches(name, pattern) for name in names):
            raise DptError(f"optimizer.groups: match '{pattern}' matches no parameter of the "
                           f"model ({top_modules(names)})")  # fmt: skip
    if layer_decay is not None and not blocks(model):
        raise DptError(
            f"optimizer.layer_decay={layer_decay}: dpt knows no blocks of "
            f"{type(model).__name__} to count layers by; leave it null, or use optimizer.groups"
        )


def param_groups(
    model: nn.Module, groups: Iterable[Any], layer_decay: float | None, lr: float
) -> list[dict[str, Any]]:
    """The optimizer's groups of trainable parameters, each with its `lr` (and `weight_decay`
    where the group sets one) and its `name`; empty groups left out. `model`: as wrapped
    (names are the bare module's: FSDP2 keeps them, DDP and compile are unwrapped)."""
    bare = unwrap(model)
    ids, top = layer_ids(bare) if layer_decay is not None else ({}, 0)
    groups = list(groups)
    made: dict[tuple[int, int], dict[str, Any]] = {}
    for name, p in bare.named_parameters():
        if not p.requires_grad:
            continue
        index = next((i for i, g in enumerate(groups) if matches(name, g.match)), len(groups))
        layer = ids.get(name, top)
        group = made.get((index, layer))
        if group is None:
            group = made[(index, layer)] = _group(groups, index, layer, top, layer_decay, lr)
        group["params"].append(p)
    return [made[key] for key in sorted(made)]


def _group(
    groups: list[Any], index: int, layer: int, top: int, layer_decay: float | None, lr: float
) -> dict[str, Any]:
    scale, extra, name = 1.0, {}, DEFAULT_GROUP
    if index < len(groups):
        chosen = groups[index]
        scale, name = float(chosen.lr_scale), str(chosen.match)
        if chosen.weight_decay is not None:
            extra["weight_decay"] = float(chosen.weight_decay)
    if layer_decay is not None:
        scale *= layer_decay ** (top - layer)
        name = f"{name}@{layer}"
    return {"params": [], "lr": lr * scale, "name": name, **extra}


def group_lrs(optimizer: Any) -> dict[str, float]:
    """Each named group's current learning rate (a group split in two by adamw_gpt, once)."""
    return {group.get("name", str(i)): group["lr"]
            for i, group in enumerate(optimizer.param_groups)}  # fmt: skip
