"""Frozen parameters (`finetune.freeze`): a pretrained backbone that keeps its weights while a
fresh head, or the layers left free, train.

A pattern names parameters (`fc.weight`, `*.bias`) or the modules above them, from the model's
top (`conv1`, `layer[1-3]`, `h.0`): fnmatch, as `optimizer.groups`' patterns. BatchNorm's running
statistics are buffers, not parameters: they still follow the data in train mode.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from dpt.errors import DptError

MODULES_SHOWN = 8  # top-level modules shown where a pattern matches nothing


def matches(name: str, pattern: str) -> bool:
    """A parameter's name, or a module's above it (its first parts), matches the pattern."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def freeze(model: nn.Module, patterns: Sequence[str]) -> None:
    """`requires_grad` off for each parameter a pattern of `patterns` matches; a pattern that
    matches none, or patterns that leave nothing to train, are refused in one line."""
    named = dict(model.named_parameters())
    for pattern in patterns:
        if not any(matches(name, pattern) for name in named):
            raise DptError(f"finetune.freeze: {pattern!r} matches no parameter of the model "
                           f"({top_modules(named)})")  # fmt: skip
    frozen = {name for name in named if any(matches(name, p) for p in patterns)}
    if all(name in frozen or not p.requires_grad for name, p in named.items()):
        raise DptError(f"finetune.freeze=[{', '.join(patterns)}] leaves no parameter to train")
    for name in frozen:
        named[name].requires_grad_(False)


def top_modules(names: Sequence[str] | dict[str, object]) -> str:
    """`its modules: bn1, conv1, ...`: where a pattern of names matched none."""
    tops = sorted({name.split(".")[0] for name in names})
    if not tops:
        return "it has none"
    more = ", ..." if len(tops) > MODULES_SHOWN else ""
    return f"its modules: {', '.join(tops[:MODULES_SHOWN])}{more}"


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(parameters that train, all parameters), in numbers (a shared one counted once; a
    sharded one whole: a DTensor's numel is its global size)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
