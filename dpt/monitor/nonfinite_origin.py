"""Where a non-finite value first appears: a replay of the forward with hooks on every module, and
the parameters whose gradients are not finite.

Both take the unwrapped module (no DDP, DataParallel or torch.compile wrapper: their hooks and
collectives are not for a one-rank replay) and run no collectives, so one rank can call them
alone. The hooks exist only during the replay; normal steps never see them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

INPUT = "input"  # the name reported when the batch reaching the root module is already non-finite


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (fsdp), so checking it needs no collective."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def has_nonfinite(value: Any) -> bool:
    """Whether a tensor, or a tuple, list or dict of them (nested), holds a NaN or an infinity.
    Non-tensors and integer or bool tensors are ignored: they cannot hold either."""
    if isinstance(value, torch.Tensor):
        value = _local(value)
        if value.is_sparse:
            value = value.coalesce().values()
        floating = value.is_floating_point() or value.is_complex()
        return floating and not bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return any(has_nonfinite(item) for item in value.values())
    if isinstance(value, (tuple, list)):
        return any(has_nonfinite(item) for item in value)
    return False


def first_nonfinite_module(model: nn.Module, run_forward: Callable[[], Any]) -> str | None:
    """The path (as in `named_modules`, e.g. "layer2.0.conv1"; the root by its class name) of the
    first module, in execution order, whose output holds a non-finite value; "input" if the
    tensors passed to `model` itself already do; None if the whole forward stays finite.

    `run_forward` replays the step's forward on `model` (the same batch, and RNG state if dropout
    should match), under `torch.no_grad()`; the model's train/eval mode is left as it is. A forward
    hook fires when its module's forward ends, children before parents, so the first one to see a
    non-finite output names the innermost, earliest culprit. The forward runs to its end: under
    fsdp every rank's forward is a sequence of collectives that must not be cut short on one.
    """
    root_name = type(model).__name__
    found: list[str] = []

    def check_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not found and (has_nonfinite(args) or has_nonfinite(kwargs)):
            found.append(INPUT)

    def output_check(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def check_output(module: nn.Module, args: Any, output: Any) -> None:
            if not found and has_nonfinite(output):
                found.append(name)

        return check_output

    handles = [model.register_forward_pre_hook(check_input, with_kwargs=True)]
    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_hook(output_check(name or root_name)))
        with torch.no_grad():
            run_forward()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def nonfinite_parameters(model: nn.Module, limit: int = 3) -> list[str]:
    """Names of the first `limit` parameters whose `.grad` holds a non-finite value: the culprits
    when the forward was finite but the backward was not."""
    names: list[str] = []
    for name, parameter in model.named_parameters():
        if len(names) >= limit:
            break
        if parameter.grad is not None and has_nonfinite(parameter.grad):
            names.append(name)
    return names
