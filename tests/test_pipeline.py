"""Cutting a model into pipeline stages, in process: the units dpt knows, where the cuts go,
the stages' copies of the model (the whole model's names, a shared matrix kept where it is
used), and the stages run one after another computing what the whole model computes. The runs
on several ranks are in tests/test_pipeline_runs.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dpt.errors import DptError
from dpt.loop.pipeline import bubble
from dpt.models.gpt import GPT
from dpt.models.mlp import MLP
from dpt.models.stages import StageView, plan, stage_model, units


def _gpt(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(32, 8, n_layer, 2, 16, dropout=0.0, bias=True)


def _names(stages: list[list]) -> list[list[str]]:
    return [[unit.name for unit in stage] for stage in stages]


def test_the_units_of_each_model_dpt_cuts() -> None:
    assert [u.name for u in units(_gpt(2))] == ["embed", "h.0", "h.1", "head"]
    assert [u.name for u in units(MLP((4,), 3, [8]))] == ["0", "1", "2"]
    from torchvision.models import resnet18

    names = [u.name for u in units(resnet18(num_classes=3))]
    assert names[0] == "stem" and names[-1] == "head" and "layer3.1" in names
    assert len(names) == 2 + 8  # ResNet-18: 8 residual blocks


def test_stages_are_balanced_by_parameter_count() -> None:
    # 10 -> 100 -> 10: the first Linear holds 1,100 parameters, the last 1,010, ReLU none.
    assert _names(plan(MLP((10,), 10, [100]), 2, None)) == [["0"], ["1", "2"]]
    assert _names(plan(_gpt(4), 3, None)) == [["embed", "h.0"], ["h.1", "h.2"], ["h.3", "head"]]


def test_split_points_name_where_stages_begin() -> None:
    assert _names(plan(_gpt(4), 2, ["h.3"])) == [["embed", "h.0", "h.1", "h.2"], ["h.3", "head"]]
    from torchvision.models import resnet18

    stages = _names(plan(resnet18(num_classes=3), 2, ["layer3"]))  # a layer: its first block
    assert stages[1][0] == "layer3.0"


@pytest.mark.parametrize(
    ("stages", "points", "message"),
    [
        (5, None, "strategy.stages=5: GPT has 4 blocks to put on stages (embed, h.0, h.1, head); "
                  "use at most 4 stages"),
        (2, ["h.7"], "strategy.split_points: 'h.7' names no block of GPT; its blocks: embed, "
                     "h.0, h.1, head"),
        (3, ["h.1"], "strategy.split_points=['h.1']: 3 stages need 2 distinct split points in "
                     "forward order, after the first block (embed, h.0, h.1, head)"),
        (2, ["embed"], "strategy.split_points=['embed']: 2 stages need 1 distinct split points "
                       "in forward order, after the first block (embed, h.0, h.1, head)"),
    ],
)  # fmt: skip
def test_cuts_that_cannot_be_made_are_one_line(
    stages: int, points: list[str] | None, message: str
) -> None:
    with pytest.raises(DptError) as error:
        plan(_gpt(2), stages, points)
    assert str(error.value) == message


def test_a_model_dpt_cannot_cut_is_one_line() -> None:
    with pytest.raises(DptError, match="does not know where to cut Bilinear into stages"):
        units(nn.Bilinear(2, 2, 2))


def test_a_stage_holds_its_units_under_the_whole_models_names() -> None:
    model = _gpt(2)
    first, last = plan(model, 2, None)
    head = stage_model(model, last)
    names = set(head.state_dict())
    assert {"h.1.attn.q_proj.weight", "ln_f.weight", "lm_head.weight"} <= names
    assert not any(name.startswith(("h.0.", "wpe")) for name in names)
    # The head's matrix is the token embedding's: the last stage keeps it under its first name
    # (the optimizer's state is keyed by it), the embedding's lookup is not run there.
    assert "wte.weight" in dict(head.named_parameters())
    tail = set(stage_model(model, first).state_dict())
    assert not any(name.startswith(("h.1.", "ln_f.")) for name in tail)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_stages_one_after_another_compute_the_whole_model(stages: int) -> None:
    model = _gpt(2)
    tokens = torch.randint(0, 32, (3, 8))
    x = tokens
    for kept in plan(model, stages, None):
        x = StageView(stage_model(model, kept), kept, contextlib.nullcontext)(x)
    torch.testing.assert_close(x, model(tokens), rtol=0, atol=0)


def test_a_view_holds_only_its_stages_parameters() -> None:
    model = _gpt(2)
    kept = plan(model, 2, None)[0]
    holder = stage_model(model, kept)
    view = StageView(holder, kept, contextlib.nullcontext)
    assert {id(p) for p in view.parameters()} == {id(p) for p in holder.parameters()}
    assert sum(p.numel() for p in view.parameters()) < sum(p.numel() for p in model.parameters())


def test_the_textbook_bubble() -> None:
    assert bubble(2, 1) == 0.5 and bubble(2, 4) == 0.2 and bubble(4, 4) == 3 / 7
