"""Image-folder runs as a user starts them: exact resume on another world size (augmentation
and loader workers included), and torchvision's classifiers by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts.make_coco_fixture import make_fixture, write_image_folder
from tests.helpers import (
    load_weights,
    max_abs_diff,
    read_checkpoint,
    run_here,
    run_world,
    weight_and_statistics_diff,
    world_run,
)

pytestmark = pytest.mark.slow  # every test here trains ResNets or ranks

# The 2-rank runs train in one spawned world (one start-up for both), the one-process runs in
# this process (`run_here`: what `train.py strategy=single` runs).


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The COCO fixture's labelled JPEGs in class folders, 28 train and 13 val, without its
    truncated training JPEG: a step that drops a sample weighs each rank's mean equally under
    ddp (docs/guides/own-model-and-data.md: Images), so no world size equals another on it."""
    root = tmp_path_factory.mktemp("shapes")
    write_image_folder(root / "coco", make_fixture(root / "coco"), root / "folder")
    (root / "folder" / "train" / "red" / "000000000109.jpg").unlink()
    return root / "folder"


def _data(root: Path) -> list[str]:
    return [
        "model=resnet18",
        "dataset=image_folder",
        f"dataset.root={root}",
        "dataset.image_size=32",
        "optimizer=sgd",
        # Small: ResNet-18 on 8 images a step of these flat colour boxes is chaotic (gradient
        # norms ~100): float rounding alone (ddp's sums in another order) grew to 2e-5 in 7
        # steps at lr 3e-4. At 1e-5 it stays below 1e-6, and a step still moves the weights
        # by more than 1e-5 (the control below), as tests/test_shards_runs.py measured.
        "optimizer.lr=0.00001",
        "trainer.log_every_n_steps=1",
    ]


@pytest.mark.timeout(500)
def test_an_image_folder_run_resumed_on_another_world_size_equals_the_uninterrupted_run(
    tmp_path: Path, shapes: Path
) -> None:
    """28 images at a global batch of 8: 3 steps an epoch, random crops and flips. Stopped at
    step 4 (mid-epoch) as 2 ddp ranks x 4 with 2 loader workers each, resumed as one process x 8
    without workers: the uninterrupted ddp run's weights (BatchNorm synchronised, so that 2 x 4
    is 1 x 8)."""
    common = _data(shapes)
    ddp = ["strategy=ddp", "strategy.sync_batchnorm=true", "launcher.nproc_per_node=2",
           "trainer.batch_size=4", "dataset.num_workers=2"]  # fmt: skip
    single = ["strategy=single", "trainer.batch_size=8", "dataset.num_workers=0"]
    run_world(2, [world_run(name, tmp_path / name, *common, *ddp, f"trainer.max_steps={steps}")
                  for name, steps in (("full", 7), ("cut", 4))])  # fmt: skip
    _, resumed = run_here(tmp_path / "cut", *common, *single, "trainer.max_steps=7")
    assert "resumed from" in resumed and "at step 4" in resumed
    assert "resuming at sample" not in resumed  # the same global batch: same samples
    weights = load_weights(tmp_path / "full")
    # The weights within 1e-6; BatchNorm's running statistics within 2e-6 of their size (sums
    # of squares that one process and 2 ranks round otherwise: tests/helpers.py).
    weight_diff, stats_diff = weight_and_statistics_diff(weights, load_weights(tmp_path / "cut"))
    assert weight_diff < 1e-6 and stats_diff < 2e-6, (weight_diff, stats_diff)
    # The controls: a step moves the weights by more than that (the epoch-end checkpoint of
    # step 6 is far from the end's), and without synchronised BatchNorm ddp 2 x 4 is not 1 x 8
    # (tests/test_sync_batchnorm.py), so the check above is one that can fail.
    step_6 = read_checkpoint(tmp_path / "full" / "checkpoints" / "step-00000006")["model"]
    assert max_abs_diff(weights, step_6) > 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0"])
def test_a_torchvision_classifier_by_name_trains(tmp_path: Path, shapes: Path, name: str) -> None:
    common = [o for o in _data(shapes) if not o.startswith("model=")]
    short = ["trainer.batch_size=4", "trainer.max_steps=2", "dataset.num_workers=0"]
    _, result = run_here(tmp_path, *common, "model=torchvision", f"model.name={name}", *short)
    assert "2 steps (trainer.max_steps" in result
    assert "| step 2/2 |" in result
    weights = load_weights(tmp_path)
    assert any(v.shape[0] == 4 for k, v in weights.items() if k.endswith("weight"))  # 4 classes
    shutil.rmtree(tmp_path / "checkpoints")  # large; nothing reads them
