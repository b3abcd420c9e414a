"""What the meta device tells of a model before the first step, without memory or arithmetic:
its output's shape, and the parameters a step leaves without a gradient (which DDP must be told
of, or it fails at the second step; tests/test_family_matrix.py runs DINOv2 so)."""

from __future__ import annotations

import torch
from torch import nn

from dpt.models.meta import output_shape, unused_parameters


class _Masked(nn.Module):
    """A ViT's mask token in small: a parameter that only masked pretraining uses."""

    def __init__(self) -> None:
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(4))
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, masked: bool = False) -> torch.Tensor:
        if masked:
            x = x + self.mask_token
        return self.head(self.frozen(x))


def test_a_parameter_no_step_reaches_is_found_and_the_weights_are_untouched() -> None:
    model = _Masked()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert unused_parameters(model, (4,)) == ["mask_token"]  # not the frozen layer: no grad asked
    assert output_shape(model, (4,)) == (2,)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and all(p.grad is None for p in model.parameters())


def test_a_forward_the_meta_device_cannot_run_tells_nothing() -> None:
    class Data(nn.Module):  # reads a value: no meta tensor has one
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale if x.sum().item() > 0 else x

    assert unused_parameters(Data(), (3,)) is None
