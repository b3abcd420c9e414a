"""docs/guides/tasks.md, run word for word in a fresh folder: the tutorial's SimpleNet and
RandomDataset, their class bodies unchanged, trained with task=binary from YAML files of their
own keys under single, dp and ddp, then `dpt-predict`; and the example's other problems."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, Result, load_weights, max_abs_diff, run_docs_block

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Result]]:
    """A folder laid out like a clone (examples/), where every line ran as written."""
    return run_docs_block("tasks", tmp_path_factory.mktemp("tasks"))


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


@pytest.mark.timeout(600)
def test_simplenet_trains_with_bce_under_single_dp_and_ddp(
    project: tuple[Path, dict[str, Result]],
) -> None:
    folder, _ = project
    assert (folder / "simple.py").read_text() == (REPO / "examples/tasks/simple.py").read_text()
    for run in ("single", "dp", "ddp"):
        metrics = _metrics(folder / "outputs" / run)
        assert metrics["task"] == "binary" and metrics["steps"] == 35  # 5 epochs of 1000 / 128
        assert metrics["val"]["val/acc"] > 0.9, (run, metrics["val"])
    assert _metrics(folder / "outputs" / "ddp")["world_size"] == 2
    # 2 x 64 = 128: ddp ends with the single run's weights (Adam, 35 steps; measured 1.6e-7)
    single = load_weights(folder / "outputs" / "single")
    assert max_abs_diff(load_weights(folder / "outputs" / "ddp"), single) < 1e-5


@pytest.mark.timeout(600)
def test_predict_writes_each_inputs_probability(project: tuple[Path, dict[str, Result]]) -> None:
    folder, _ = project
    sys.path.insert(0, str(folder))
    try:
        from simple import SimpleNet
    finally:
        sys.path.remove(str(folder))
    model = SimpleNet(10, 32, 1)
    model.load_state_dict(torch.load(folder / "outputs/ddp/model_best.pt", weights_only=True))
    inputs = torch.load(folder / "points.pt", weights_only=True)
    with torch.no_grad():
        expected = torch.sigmoid(model(inputs))[:, 0]
    with open(folder / "outputs/ddp/points.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["path"] for row in rows] == [f"points.pt:{i}" for i in range(5)]
    found = torch.tensor([float(row["probability"]) for row in rows])
    assert torch.allclose(found, expected, atol=1e-6)


@pytest.mark.timeout(600)
def test_the_other_problems_train(project: tuple[Path, dict[str, Result]]) -> None:
    folder, _ = project
    line = load_weights(folder / "outputs" / "line")  # y = x . [1.5, -2, 0.5, 3] + 0.7 + noise
    assert torch.allclose(line["0.weight"][0], torch.tensor([1.5, -2.0, 0.5, 3.0]), atol=0.05)
    assert abs(float(line["0.bias"][0]) - 0.7) < 0.05
    assert _metrics(folder / "outputs" / "line")["val"]["val/r2"] > 0.99
    tags = _metrics(folder / "outputs" / "tags")
    assert tags["best"]["metric"] == "val/map" and tags["val"]["val/map"] > 0.9
    focal = _metrics(folder / "outputs" / "focal")
    assert (focal["best"]["metric"], focal["best"]["mode"]) == ("val/brier", "min")
    assert focal["val"]["val/acc"] > 0.9


# --- Language models ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def language_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Result]]:
    """docs/guides/language-models.md's lines, as written, from a folder laid out like a clone."""
    return run_docs_block("lm", tmp_path_factory.mktemp("lm"))


@pytest.mark.timeout(600)
def test_the_language_model_section_trains_samples_and_streams(
    language_model: tuple[Path, dict[str, Result]],
) -> None:
    folder, results = language_model
    tokenizer = json.loads((folder / "my_text" / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE"
    run = folder / "outputs" / "gpt"
    metrics = _metrics(run)
    assert (metrics["task"], metrics["world_size"], metrics["steps"]) == ("language_model", 2, 40)
    assert metrics["tokens_per_s"] > 0 and metrics["tflops"] > 0  # a CPU: TFLOP/s, no MFU
    assert "val/perplexity" in metrics["val"]
    data = json.loads((run / "data.json").read_text())
    assert data["tokenizer"] == {"kind": "tokenizers", "vocab_size": 300, "file": "tokenizer.json"}
    assert (run / "tokenizer.json").read_bytes() == (folder / "my_text/tokenizer.json").read_bytes()
    generated = next(r for c, r in results.items() if c.startswith("dpt-generate")).stdout
    assert generated.startswith("12+34=") and len(generated.strip()) > len("12+34=")
    streamed = _metrics(folder / "outputs" / "gpt_shards")
    assert streamed["steps"] == 20 and streamed["task"] == "language_model"
    # What every rank says alike, rank 0 says once; rank 1 keeps it in its log file. The loop's
    # pace after its first window is there beside the whole run's.
    console = next(r for c, r in results.items() if "outputs/gpt " in f"{c} ").stdout
    said = [line for line in console.splitlines() if "text: " in line]
    assert len(said) == 1 and said[0].startswith("[rank 0] text: "), console
    assert "text: " in (run / "logs" / "rank1.log").read_text()
    assert metrics["steady_tokens_per_s"] > 0 and "| loop " in console
