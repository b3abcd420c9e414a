"""The own-model contract and the one-line errors around it, in process: what a model target
receives, where user code is imported from, how a failed build reads, the run's length, the
best model, and checkpoints written before the best model was a part."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from torch import nn

from dpt import user_code
from dpt.config.build import build
from dpt.contract import class_names, model_kwargs, output_names
from dpt.distributed import DistEnv
from dpt.errors import ConfigError, DptError, one_line
from dpt.loop.parts import RunConfig, planned_steps, run_length
from dpt.models import build_model
from dpt.state import checkpoint
from dpt.state.best_model import BestModel
from dpt.state.stateful import PlainState
from tests.helpers import compose

CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


class NoShapeNet(nn.Module):
    """A user's model that takes only `num_classes` (and its own key)."""

    def __init__(self, num_classes: int, width: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ShapeNet(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.input_shape = input_shape
        self.fc = nn.Linear(input_shape[0], num_classes)


def test_a_model_target_gets_input_shape_only_where_its_signature_takes_it() -> None:
    assert model_kwargs(NoShapeNet, (32,), 10) == {"num_classes": 10}
    assert model_kwargs(ShapeNet, [32], 10) == {"num_classes": 10, "input_shape": (32,)}
    assert model_kwargs(lambda **kw: kw, (3, 8, 8), 2) == {
        "num_classes": 2,
        "input_shape": (3, 8, 8),
    }
    model = build_model(
        OmegaConf.create({"_target_": f"{__name__}.NoShapeNet", "width": 6}), (32,), 3
    )
    assert model(torch.randn(2, 32)).shape == (2, 3)
    assert build_model(
        OmegaConf.create({"_target_": f"{__name__}.ShapeNet"}), (7,), 3
    ).input_shape == (7,)


def test_a_model_whose_constructor_rejects_a_key_is_one_line() -> None:
    node = OmegaConf.create({"_target_": f"{__name__}.NoShapeNet", "depth": 3})
    with pytest.raises(DptError) as caught:
        build_model(node, (32,), 3)
    assert str(caught.value) == (
        f"model._target_={__name__}.NoShapeNet: TypeError: NoShapeNet.__init__() got an "
        "unexpected keyword argument 'depth'"
    )


def test_a_model_that_is_not_a_module_is_one_line() -> None:
    with pytest.raises(DptError, match=r"^model._target_=builtins.dict built a dict, not a torch"):
        build_model(OmegaConf.create({"_target_": "builtins.dict"}), (3,), 2)


def test_a_built_in_group_node_names_its_key_in_a_build_error() -> None:
    cfg = compose("optimizer=sgd")
    cfg.optimizer._target_ = "torch.optim.Nope"
    with pytest.raises(
        ConfigError, match=r"^optimizer._target_=torch.optim.Nope: torch.optim has no Nope$"
    ):
        build(cfg.optimizer)


def test_user_code_is_found_in_the_start_folder_and_in_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_models_abc.py").write_text("class Net:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(user_code.IMPORT_PATH_ENV, "/an/enclosing/run")  # restored after the test
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(ConfigError) as caught:
        user_code.check_importable("my_models_abc.Net", "model._target_")
    assert str(caught.value) == (
        "model._target_=my_models_abc.Net: cannot import my_models_abc; dpt imports your code "
        "from the folder it was started in and from PYTHONPATH (docs/guides/own-model-and-data.md)"
    )
    user_code.add_start_folder()  # the launcher
    assert sys.path[-2:] == [str(tmp_path), "/an/enclosing/run"]  # last: it shadows nothing
    assert os.environ[user_code.IMPORT_PATH_ENV] == os.pathsep.join(
        [str(tmp_path), "/an/enclosing/run"]
    )
    assert user_code.locate("my_models_abc.Net", "model._target_").__name__ == "Net"
    sys.path.remove(str(tmp_path))
    user_code.add_recorded_folders()  # a rank, from the recorded environment
    assert str(tmp_path) in sys.path
    with pytest.raises(
        ConfigError, match=r"^model._target_=my_models_abc.Nope: my_models_abc has no Nope$"
    ):
        user_code.locate("my_models_abc.Nope", "model._target_")
    with pytest.raises(ConfigError, match=r"^dataset._target_=Net: not a dotted path"):
        user_code.check_importable("Net", "dataset._target_")


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("model.hidden_dims=[1,", "model.hidden_dims=[1,: cannot read the value of "
         "model.hidden_dims (no viable alternative at input '[1,')"),
        ("trainer.seed=1)", "trainer.seed=1): cannot read the value of trainer.seed "
         "(extraneous input ')' expecting <EOF>)"),
        ("dataset.root='a", "dataset.root='a: cannot read the value of dataset.root "
         "(unexpected character \"'\" at position 14)"),
    ],
)  # fmt: skip
def test_an_override_hydra_cannot_read_is_named_with_its_key(override: str, line: str) -> None:
    with pytest.raises(Exception) as caught:
        OverridesParser.create().parse_overrides([override])
    text = one_line(caught.value)
    assert text.startswith(f"{line}; Hydra's override syntax: key=value"), text
    assert "\n" not in text


def test_max_steps_sets_the_runs_length_by_itself() -> None:
    class Loaders:  # 10 steps an epoch
        train_size, batch_size = 640, 64

        def steps_per_epoch(self, accum: int) -> int:
            return 10

    settings = RunConfig.of(compose("trainer.max_steps=25", "trainer.epochs=1")).trainer
    assert planned_steps(Loaders(), settings, 1) == 25  # 2.5 epochs, whatever trainer.epochs says
    assert run_length(settings, 25, 10) == (
        "25 steps (trainer.max_steps; 2.5 epochs of 10 steps, trainer.epochs not used)"
    )
    settings = RunConfig.of(compose("trainer.epochs=2")).trainer
    assert planned_steps(Loaders(), settings, 1) == 20
    assert run_length(settings, 20, 10) == "20 steps (2 epochs of 10 steps)"
    settings = RunConfig.of(compose("trainer.epochs=1")).trainer
    assert run_length(settings, 1, 1) == "1 step (1 epoch of 1 step)"


def test_the_best_model_follows_the_watched_metric(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    best = BestModel("val/acc1", "max", True, tmp_path, CPU1)
    assert best.update({"val/acc1": 0.5, "val/loss": 1.0}, 10, 1, model)
    saved = torch.load(tmp_path / "model_best.pt", weights_only=True)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not best.update({"val/acc1": 0.5}, 20, 2, model)  # not better: the file stays
    assert torch.equal(
        torch.load(tmp_path / "model_best.pt", weights_only=True)["weight"], saved["weight"]
    )
    assert best.update({"val/acc1": 0.75}, 30, 3, model)
    assert best.summary() == {"metric": "val/acc1", "mode": "max", "value": 0.75, "step": 30,
                              "epoch": 3, "val": {"val/acc1": 0.75}}  # fmt: skip
    resumed = BestModel("val/acc1", "max", True, tmp_path, CPU1)
    resumed.load_state_dict(best.state_dict())
    assert not resumed.update({"val/acc1": 0.7}, 40, 4, model)
    off = BestModel("val/loss", "min", False, tmp_path / "off", CPU1)
    assert not off.update({"val/loss": 0.1}, 1, 1, model) and off.summary() is None
    assert not BestModel("val/loss", "min", True, tmp_path, CPU1).update({}, 1, 1, model)


def test_a_checkpoint_from_before_the_best_model_loads_with_a_fresh_one(tmp_path: Path) -> None:
    """Parts added later (`optional`) load fresh from checkpoints that lack them; others don't."""
    import torch.distributed.checkpoint as dcp

    class Counter:
        def __init__(self, n: int = 0) -> None:
            self.n = n

        def state_dict(self) -> dict[str, Any]:
            return {"n": self.n}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.n = state["n"]

    folder = tmp_path / "step-00000003"
    dcp.save({"counter": PlainState(Counter(7)).state_dict()}, checkpoint_id=folder, no_dist=True)
    (folder / checkpoint.MARKER).write_text('{"step": 3}')
    best = BestModel("val/loss", "min", True, tmp_path, CPU1)
    counter = Counter()
    assert (
        checkpoint.load(folder, {"counter": PlainState(counter), "best_model": PlainState(best)})
        == 3
    )
    assert counter.n == 7 and best.value is None
    with pytest.raises(checkpoint.CheckpointError, match="lacks other: not written by this dpt"):
        checkpoint.load(folder, {"counter": PlainState(counter), "other": PlainState(Counter())})


def test_class_names_default_to_the_labels_and_must_match_the_count() -> None:
    class Data:
        num_classes = 3

    assert class_names(Data()) == ["0", "1", "2"]  # type: ignore[arg-type]
    data = Data()
    data.classes = ["a", "b"]  # type: ignore[attr-defined]
    with pytest.raises(DptError, match="lists 2 class names for num_classes=3"):
        class_names(data)  # type: ignore[arg-type]


def test_binarys_one_output_is_named_after_the_second_of_two_classes() -> None:
    """task=binary on a data set of two classes (an image folder's, records' words): its one
    output is the probability of label 1; dpt-predict's column is named after that class."""

    class Data:
        num_classes = 2
        classes = ["cat", "dog"]

    assert output_names(Data(), 1, classification=False) == ["dog"]  # type: ignore[arg-type]
    assert class_names(Data()) == ["cat", "dog"]  # type: ignore[arg-type]
    with pytest.raises(DptError, match="lists 2 names for its 3 outputs per sample"):
        output_names(Data(), 3, classification=False)  # type: ignore[arg-type]
