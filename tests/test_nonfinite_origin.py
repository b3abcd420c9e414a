"""Naming where a non-finite value appears (dpt.monitor.nonfinite_origin): the first module of a
replayed forward whose output is not finite, the input itself, or the parameters whose gradients
are not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpt.monitor.nonfinite_origin import (
    first_nonfinite_module,
    has_nonfinite,
    nonfinite_parameters,
)


class Divide(nn.Module):
    """x / (x - x): every element becomes NaN or an infinity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x - x)


class Block(nn.Module):
    def __init__(self, broken: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.div = Divide() if broken else nn.Identity()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.div(self.linear(x)), "count": torch.tensor(1)}


class Net(nn.Module):
    def __init__(self, broken: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Block(broken), Block(broken))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = x
        for layer in self.body:
            h = layer(h)["out"] if isinstance(layer, Block) else layer(h)
        return self.head(h), [h]


def all_hooks(model: nn.Module) -> list[dict]:
    return [
        hooks
        for module in model.modules()
        for hooks in (module._forward_hooks, module._forward_pre_hooks)
        if hooks
    ]


def test_the_first_non_finite_module_is_named_by_its_path() -> None:
    model = Net()
    x = torch.randn(3, 4)
    assert first_nonfinite_module(model, lambda: model(x)) == "body.2.div"
    assert all_hooks(model) == []


def test_a_finite_model_names_none_and_runs_without_grad() -> None:
    model = Net(broken=False)
    seen = []
    assert first_nonfinite_module(model, lambda: seen.append(model(torch.randn(3, 4)))) is None
    assert not seen[0][0].requires_grad and all_hooks(model) == []


def test_a_non_finite_input_is_named_input() -> None:
    model = Net(broken=False)
    x = torch.randn(3, 4)
    x[1, 2] = float("inf")
    assert first_nonfinite_module(model, lambda: model(x)) == "input"
    assert first_nonfinite_module(model, lambda: model(x=x)) == "input"  # a keyword too


def test_the_root_is_named_by_its_class() -> None:
    class Root(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x - x)

    model = Root()
    assert first_nonfinite_module(model, lambda: model(torch.ones(2))) == "Root"


def test_hooks_are_removed_when_the_replay_raises() -> None:
    model = Net(broken=False)

    def failing() -> None:
        model(torch.randn(3, 4))
        raise RuntimeError("replay failed")

    with pytest.raises(RuntimeError, match="replay failed"):
        first_nonfinite_module(model, failing)
    assert all_hooks(model) == []


def test_has_nonfinite_looks_inside_containers_and_skips_integers() -> None:
    assert has_nonfinite({"a": [1, (torch.zeros(2), torch.tensor([float("nan")]))]})
    assert not has_nonfinite({"a": [torch.zeros(2), "text", None, torch.arange(3)]})


def test_parameters_with_non_finite_grads_are_named() -> None:
    model = Net(broken=False)
    model(torch.randn(3, 4))[0].sum().backward()
    assert nonfinite_parameters(model) == []
    model.head.bias.grad[0] = float("nan")
    model.body[0].weight.grad[1, 1] = float("inf")
    model.body[3].linear.weight.grad[0, 0] = float("nan")
    assert nonfinite_parameters(model) == ["body.0.weight", "body.3.linear.weight", "head.bias"]
    assert nonfinite_parameters(model, limit=1) == ["body.0.weight"]
