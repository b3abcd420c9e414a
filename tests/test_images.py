"""Image workloads end to end: COCO fixture, ResNets, fake images, validation across world sizes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torchvision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.data.fake_images import FakeImages
from dpt.errors import DptError
from dpt.models.resnet import resnet
from scripts.make_coco_fixture import make_fixture
from tests.helpers import (
    FAST,
    WorldRun,
    committed_checkpoints,
    load_weights,
    refused_in_process,
    run_here,
    run_world,
    train,
    world_run,
)

# The 2-rank runs train in one spawned world (one start-up: `ddp_runs` below), the one-process
# runs that are only compared or read in this process (`run_here`: what `train.py
# strategy=single` runs). Processes are started where the test is about one: a SIGKILL, a
# run's last line, or 3 ranks through the launcher.

SMALL = [
    "dataset.image_size=32",
    "dataset.num_workers=1",
    "trainer.batch_size=4",
    "trainer.log_every_n_steps=2",
]


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    make_fixture(root)
    return root


# lr=0 keeps the initial weights, so every world size must report the same numbers.
VALIDATION = ["dataset.num_val_samples=101", "optimizer.lr=0", "trainer.max_steps=2",
              "strategy=ddp", "trainer.batch_size=8"]  # fmt: skip


@pytest.fixture(scope="module")
def ddp_runs(coco: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, WorldRun]:
    """Every 2-rank run of this file, in one world: ResNet-18 on the COCO fixture, the same in
    batches of one image, the validation of 101 samples."""
    root = tmp_path_factory.mktemp("ddp")
    runs = [
        world_run("coco", root / "coco", "experiment=coco_resnet18", f"dataset.root={coco}",
                  *SMALL, "trainer.epochs=1"),
        world_run("ones", root / "ones", "dataset=coco", "model=resnet18", f"dataset.root={coco}",
                  "dataset.image_size=64", "dataset.num_workers=0", "trainer.batch_size=1",
                  "trainer.epochs=1", "trainer.log_every_n_steps=5", "strategy=ddp"),
        world_run("validation-2", root / "validation-2", *FAST, *VALIDATION),
    ]  # fmt: skip
    run_world(2, runs)
    return {run.name: run for run in runs}


@pytest.mark.slow
@pytest.mark.timeout(600)  # the first test of the world builds it
def test_ddp_trains_resnet18_on_the_coco_fixture(coco: Path, ddp_runs: dict[str, WorldRun]) -> None:
    result, tmp_path = ddp_runs["coco"], ddp_runs["coco"].run_dir
    assert "strategy=ddp | world size 2" in result.stdout
    assert (
        "coco train2017: kept 30 of 32 images (2 without a non-crowd annotation)" in result.stdout
    )
    # The truncated and the missing train files: one warning naming each, and a count.
    for name in ("000000000109.jpg", "000000000110.jpg"):
        assert f"skipping unreadable image {coco / 'train2017' / name}" in result.stdout
    assert "2 unreadable samples skipped" in result.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["bad_samples"] == 2
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 8
    # 13 kept val images, 2 unreadable: 11 evaluated, each once, with top-1 and top-5 accuracy.
    assert metrics["val"]["val/samples"] == 11
    assert 0.0 <= metrics["val"]["val/acc1"] <= metrics["val"]["val/acc5"] <= 1.0
    acc = EventAccumulator(str(tmp_path / "tb" / "world"))
    acc.Reload()
    assert {"val/acc1", "val/acc5", "val/loss"} <= set(acc.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
def test_bad_image_with_error_policy_stops_naming_the_file(
    coco: Path, tmp_path: Path, workers: int
) -> None:
    result = train(
        tmp_path,
        "model=resnet18",
        "dataset=coco",
        f"dataset.root={coco}",
        *SMALL,
        f"dataset.num_workers={workers}",
        "dataset.on_bad_image=error",
        "trainer.epochs=1",
        check=False,
    )
    assert result.returncode == 1
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"Error: unreadable image {coco / 'train2017'}/0000000001")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_augmented_coco_stopped_with_2_workers_resumes_with_1_bit_equal(
    coco: Path, tmp_path: Path
) -> None:
    """ResNet-18 with the random-resized crop and flip: each sample's draws come from (seed,
    epoch, index), so a run stopped inside epoch 2 with 2 loader workers and resumed with 1 ends
    bit-equal (tests/test_faults.py kills runs: the resume is the subject here)."""
    # 30 images / batch 4 = 7 steps per epoch: the checkpoint at step 10 is inside epoch 2 (the
    # others: the ends of epochs). Few checkpoints, no validation: ResNet-18's are large.
    common = [
        "experiment=coco_resnet18", f"dataset.root={coco}", *SMALL, "strategy=single",
        "dataset.val_split=null", "trainer.epochs=2", "checkpoint.every_n_steps=10",
    ]  # fmt: skip
    run_here(tmp_path / "full", *common, "dataset.num_workers=2")
    run_here(tmp_path / "cut", *common, "dataset.num_workers=2", "trainer.max_steps=10")
    assert committed_checkpoints(tmp_path / "cut")[-1].name == "step-00000010"
    _, resumed = run_here(tmp_path / "cut", *common, "dataset.num_workers=1")
    assert "resumed from" in resumed and "at step 10" in resumed
    full, cut = load_weights(tmp_path / "full"), load_weights(tmp_path / "cut")
    assert full.keys() == cut.keys()
    for key in full:
        assert torch.equal(full[key], cut[key]), key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_validation_counts_each_sample_once_for_world_sizes_1_2_3(
    ddp_runs: dict[str, WorldRun], tmp_path: Path
) -> None:
    """2 ranks in the world, 3 through the launcher (train.py), 1 in this process."""
    run_here(tmp_path / "1", *FAST, *VALIDATION)
    train(tmp_path / "3", *FAST, *VALIDATION, "launcher.nproc_per_node=3")
    folders = {1: tmp_path / "1", 2: ddp_runs["validation-2"].run_dir, 3: tmp_path / "3"}
    results = {world: json.loads((folder / "metrics.json").read_text())["val"]
               for world, folder in folders.items()}  # fmt: skip
    for world in (1, 2, 3):
        assert json.loads((folders[world] / "metrics.json").read_text())["world_size"] == world
        assert results[world]["val/samples"] == 101
        assert results[world]["val/acc1"] == pytest.approx(results[1]["val/acc1"], abs=1e-6)
        assert results[world]["val/loss"] == pytest.approx(results[1]["val/loss"], rel=1e-5)


@pytest.mark.timeout(60)
def test_fake_images_are_torchvisions_without_touching_the_global_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchvision.datasets import FakeData

    data = FakeImages(6, 2, image_size=16, num_classes=10, num_workers=0, seed=3)
    reference = FakeData(6, (3, 16, 16), 10, data.train.transform, random_offset=3)
    expected = [reference[i] for i in range(6)]
    state = torch.get_rng_state()

    def reseeded(seed: int) -> None:
        raise AssertionError("torch.manual_seed called")

    monkeypatch.setattr(torch, "manual_seed", reseeded)
    for (image, label), (same_image, same_label) in zip(
        (data.train[i] for i in range(6)), expected, strict=True
    ):
        assert torch.equal(image, same_image) and label == same_label
    assert torch.equal(torch.get_rng_state(), state)
    assert data.val is not None and not torch.equal(data.val[0][0], data.train[0][0])
    with pytest.raises(IndexError):
        data.train[6]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resnet18_on_fake_images(tmp_path: Path) -> None:
    run_here(
        tmp_path,
        "model=resnet18",
        "dataset=fake_images",
        "dataset.image_size=32",
        "dataset.num_samples=32",
        "dataset.num_val_samples=8",
        "dataset.num_workers=0",
        "trainer.batch_size=8",
        "trainer.epochs=1",
        "model.channels_last=true",
    )
    state = load_weights(tmp_path)
    assert state["fc.weight"].shape == (10, 512)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model=resnet18"],
            "Error: model=resnet18 takes images (C, H, W), but the dataset "
            "gives inputs of shape (32,) (use model=mlp for vectors)",
        ),
        (
            ["dataset=fake_images", "dataset.image_size=32"],
            "Error: model=mlp takes vectors, but the dataset gives inputs of shape (3, 32, 32) "
            "(use an image model such as model=resnet18)",
        ),
        (
            ["dataset=coco", "dataset.root=/nonexistent/coco"],
            "Error: dataset.root=/nonexistent/coco: folder not found",
        ),
        (["dataset=coco"], "Error: dataset.root: required, set it with dataset.root=..."),
    ],
    ids=["image-model-on-vectors", "mlp-on-images", "missing-root", "no-root"],
)
def test_model_dataset_mismatch_and_missing_paths(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    result = refused_in_process(tmp_path / "run", *overrides)
    assert result.returncode == 1
    assert result.stderr.strip() == message


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_missing_and_truncated_annotation_files(coco: Path, tmp_path: Path) -> None:
    root = tmp_path / "coco"
    (root / "annotations").mkdir(parents=True)
    (root / "train2017").mkdir()
    missing = refused_in_process(tmp_path / "a", "model=resnet18", "dataset=coco",
                                 f"dataset.root={root}")  # fmt: skip
    ann = root / "annotations" / "instances_train2017.json"
    assert missing.stderr.strip() == f"Error: dataset=coco: COCO annotation file not found: {ann}"
    text = (coco / "annotations" / "instances_train2017.json").read_text()
    ann.write_text(text[: len(text) // 2])
    truncated = refused_in_process(tmp_path / "b", "model=resnet18", "dataset=coco",
                                   f"dataset.root={root}")  # fmt: skip
    assert truncated.stderr.strip().startswith(
        f"Error: dataset=coco: COCO annotation file is not valid JSON: {ann}"
    )


def test_local_weights_load_except_a_head_of_another_size(tmp_path: Path) -> None:
    torch.manual_seed(1)
    imagenet = torchvision.models.resnet18(weights=None)  # 1000 classes
    path = tmp_path / "resnet18.pt"
    torch.save(imagenet.state_dict(), path)
    model = resnet((3, 32, 32), 7, "resnet18", weights=str(path), channels_last=False)
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    assert model.fc.weight.shape == (7, 512)
    with pytest.raises(DptError, match=r"model\.weights=.*nope\.pt: file not found"):
        resnet((3, 32, 32), 7, "resnet18", weights=str(tmp_path / "nope.pt"), channels_last=False)
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(DptError, match="does not fit model=resnet18"):
        resnet((3, 32, 32), 7, "resnet18", weights=str(tmp_path / "other.pt"), channels_last=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_batches_of_only_unreadable_images_are_skipped_and_counted(
    ddp_runs: dict[str, WorldRun],
) -> None:
    """Batches of one image (64 px: ResNet-18 trains on one image only with more than one value
    per channel left): the unreadable ones make empty batches, in training (every rank
    still takes the step) and in validation. The documented on_bad_image=skip holds."""
    result = ddp_runs["ones"]
    assert "2 unreadable samples skipped" in result.stdout
    metrics = json.loads((result.run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["bad_samples"] == 2
    assert metrics["samples"] == 28  # 30 kept train images, 2 unreadable: each trained once
    assert metrics["val"]["val/samples"] == 11  # 13 kept val images, 2 unreadable
    assert math.isfinite(metrics["final_loss"])
