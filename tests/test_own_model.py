"""docs/guides/own-model-and-data.md, run word for word in a fresh folder: the example's own
CNN on an image folder made from the fixture's JPEGs, single and ddp, then `dpt-predict` on the
validation folder; the example's own data set module; and what the runs leave behind."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from dpt.data.images import ImageDecodeError, read_image_rgb, val_transform
from tests.helpers import Result, run_docs_block

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Result]]:
    """A folder laid out like a clone (examples/, scripts/), where every line ran as written."""
    return run_docs_block("own-model", tmp_path_factory.mktemp("own_model"))


def test_the_section_trains_single_and_ddp_with_the_users_own_model(
    project: tuple[Path, dict[str, Result]],
) -> None:
    folder, _ = project
    assert folder.name == "my_project"
    for run in ("single", "ddp", "listed"):
        summary = json.loads((folder / "outputs" / run / "metrics.json").read_text())
        assert summary["steps"] > 0 and math.isfinite(summary["final_loss"])
    assert json.loads((folder / "outputs/ddp/metrics.json").read_text())["world_size"] == 2
    classes = json.loads((folder / "outputs/ddp/data.json").read_text())["classes"]
    assert classes == ["blue", "green", "magenta", "red"]  # the class folders, sorted


def test_predict_on_the_val_folder_equals_the_runs_val_acc1(
    project: tuple[Path, dict[str, Result]],
) -> None:
    folder, results = project
    best = json.loads((folder / "outputs/ddp/metrics.json").read_text())["best"]
    with open(folder / "outputs/ddp/val_predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and set(rows[0]) == {"path", "class", "probability"}
    right = sum(Path(row["path"]).parent.name == row["class"] for row in rows)
    assert right / len(rows) == pytest.approx(best["val"]["val/acc1"], abs=1e-6)
    assert len(rows) == best["val"]["val/samples"]  # the readable images, as validation counts
    printed = next(out for cmd, out in results.items() if "outputs/ddp data" in cmd).stdout
    assert f"accuracy {right / len(rows):.4f}" in printed
    assert all(f" {row['class']} " in printed for row in rows)  # class names, not numbers


def test_model_best_holds_the_best_epochs_weights(
    project: tuple[Path, dict[str, Result]],
) -> None:
    """Its watched metric (val/loss) measured again on the validation folder equals the best
    value metrics.json reports, and the best epoch is the one with the lowest val/loss."""
    folder, _ = project
    best = json.loads((folder / "outputs/single/metrics.json").read_text())["best"]
    assert (best["metric"], best["mode"]) == ("val/loss", "min")
    model = _load_tiny_cnn(folder, folder / "outputs/single/model_best.pt", classes=4)
    classes = json.loads((folder / "outputs/single/data.json").read_text())["classes"]
    losses = []
    for path in sorted((folder / "data/shapes/val").rglob("*.jpg")):
        try:
            image = val_transform(32)(read_image_rgb(path))
        except ImageDecodeError:
            continue  # validation skips unreadable images too
        with torch.no_grad():
            logits = model(image[None]).float()
        label = torch.tensor([classes.index(path.parent.name)])
        losses.append(torch.nn.functional.cross_entropy(logits, label).item())
    assert sum(losses) / len(losses) == pytest.approx(best["value"], abs=1e-5)
    last = json.loads((folder / "outputs/single/metrics.json").read_text())["val"]["val/loss"]
    assert best["value"] <= last


def test_the_users_own_data_set_module_predicts_top_k(
    project: tuple[Path, dict[str, Result]],
) -> None:
    folder, results = project
    data = json.loads((folder / "outputs/listed/data.json").read_text())
    assert data["val_transform"] == {"_target_": "listed_images.val_transform", "image_size": 32}
    printed = next(
        out for cmd, out in results.items() if "outputs/listed" in cmd and "predict" in cmd
    )
    lines = [ln for ln in printed.stdout.splitlines() if ln.startswith("data/shapes/val/red/")]
    assert lines and all(sum(ln.count(f" {c} ") for c in data["classes"]) == 2 for ln in lines)


def _load_tiny_cnn(folder: Path, weights: Path, classes: int) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("tiny_cnn", folder / "tiny_cnn.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TinyCNN(num_classes=classes, width=16)
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model.eval()
