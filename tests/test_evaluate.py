"""`dpt-evaluate` on tiny runs trained in this process: an MLP on an image folder of three
colours (train/, val/, test/), a linear regression on a data set of yours with a `dataset.test`,
a tiny GPT on a text folder with val.txt and test.txt. Its numbers on val are the run's last
validation's; on test it writes the table, the plots and the TensorBoard image; bad input is
one line."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from dpt.commands.evaluate import main
from dpt.data.custom import CustomData
from dpt.data.splits import SPLITS, TEST, TRAIN, VAL, missing_split
from dpt.data.text import TextData
from dpt.data.text_files import text_files
from dpt.errors import DptError
from dpt.launch.launchers import resolved
from tests.helpers import REPO, colour_images, compose, keep_config, run_config_here

COLOURS = {"blue": (30, 40, 220), "green": (40, 200, 50), "red": (220, 40, 30)}  # sorted names
PER_CLASS = {TRAIN: 6, VAL: 3, TEST: 4}  # images a class, a split
COMMON = ["trainer.device=cpu", "checkpoint.enabled=false", "dataset.num_workers=0"]
IMAGES = ["dataset=image_folder", "dataset.image_size=16", "model=resnet18",
          "trainer.batch_size=6", "trainer.epochs=2", "optimizer.lr=0.001"]  # fmt: skip
VECTORS = "{_target_:tests.task_models.RandomVectors,input_dim:4,target:regression,outputs:2"
REGRESSION = ["dataset=custom", "task=regression", "model=mlp", "model.hidden_dims=[]",
              f"dataset.train={VECTORS},n_samples:64}}", f"dataset.val={VECTORS},n_samples:16}}",
              f"dataset.test={VECTORS},n_samples:24}}", "dataset.classes=[x,y]",
              "trainer.batch_size=16", "trainer.epochs=1"]  # fmt: skip
LINES = "".join(f"{a}+{b}={a + b}\n" for a in range(12) for b in range(12))
TINY_GPT = ["model=gpt", "task=language_model", "model.block_size=16", "model.n_layer=1",
            "model.n_head=2", "model.n_embd=16", "trainer.batch_size=8",
            "trainer.max_steps=2"]  # fmt: skip


@dataclass
class Runs:
    images: Path  # the image folder: train/, val/, test/
    classification: Path
    regression: Path
    language_model: Path
    text: Path  # the language model's text folder


def _image_folder(root: Path) -> None:
    """8x8 images of three colours (a little noise each), PER_CLASS of each a split."""
    colour_images(root, PER_CLASS, COLOURS, 8)


def _train(run_dir: Path, *overrides: str) -> Path:
    """A run in this process, and its `.hydra/config.yaml` as Hydra would have written it."""
    cfg = compose(*overrides, *COMMON)  # composed once, for the run and for the file
    run_config_here(resolved(cfg), run_dir)
    keep_config(cfg, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    out = tmp_path_factory.mktemp("evaluate")
    _image_folder(out / "images")
    text = out / "text"
    text.mkdir()
    (text / "train.txt").write_text(LINES)
    (text / f"{VAL}.txt").write_text(LINES[:400])
    (text / f"{TEST}.txt").write_text(LINES[-560:])  # not val's size: which text was read
    texts = ["dataset=text", f"dataset.root={text}", f"dataset.cache_dir={out / 'tokens'}"]
    return Runs(
        images=out / "images",
        classification=_train(out / "cls", *IMAGES, f"dataset.root={out / 'images'}"),
        regression=_train(out / "reg", *REGRESSION),
        language_model=_train(out / "lm", *TINY_GPT, *texts),
        text=text,
    )


def _evaluate(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    main([str(a) for a in args])
    return capsys.readouterr().out


def _error(capsys: pytest.CaptureFixture[str], *args: object) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def _record(run_dir: Path, split: str) -> dict:
    return json.loads((run_dir / f"eval-{split}.json").read_text())


# --- the numbers ----------------------------------------------------------------------------------


@pytest.mark.slow  # reads the module's three training runs
@pytest.mark.parametrize("run", ["classification", "regression", "language_model"])
def test_on_val_its_metrics_are_the_runs_last_validations(
    runs: Runs, run: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """model.pt (`--last`) is the weights the last validation measured."""
    folder = getattr(runs, run)
    out = _evaluate(capsys, folder, "--split", VAL, "--last")
    validated = json.loads((folder / "metrics.json").read_text())["val"]
    record = _record(folder, VAL)
    assert record["samples"] == record["size"] == validated.pop(f"{VAL}/samples")
    got = record["metrics"]
    assert got.keys() == validated.keys()
    for key, value in validated.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
        assert key in out


@pytest.mark.slow  # reads the module's three training runs
def test_on_an_image_folders_test_split_it_writes_the_table_and_the_confusion_matrix(
    runs: Runs, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _evaluate(capsys, runs.classification)  # test: the default
    record = _record(runs.classification, TEST)
    size = PER_CLASS[TEST] * len(COLOURS)
    assert record["split"] == TEST and record["size"] == record["samples"] == size
    assert record["weights"] == str(runs.classification / "model_best.pt")
    assert set(record["metrics"]) == {f"{TEST}/loss", f"{TEST}/acc1"}
    confusion = record["confusion"]
    assert confusion["classes"] == sorted(COLOURS)
    assert sum(map(sum, confusion["counts"])) == size
    correct = sum(confusion["counts"][i][i] for i in range(len(COLOURS)))
    assert record["metrics"][f"{TEST}/acc1"] == pytest.approx(correct / size)
    rows = record["per_class"]
    assert [row["class"] for row in rows] == sorted(COLOURS)
    for row in rows:
        assert set(row) == {"class", "precision", "recall", "f1", "support"}
        assert row["support"] == PER_CLASS[TEST]
        line = next(line for line in out.splitlines() if line.startswith(f"{row['class']} "))
        assert line.split() == [row["class"], f"{row['precision']:.4f}", f"{row['recall']:.4f}",
                                f"{row['f1']:.4f}", str(row["support"])]  # fmt: skip
    png = runs.classification / f"confusion-{TEST}.png"
    assert Image.open(png).format == "PNG"
    assert f"wrote {runs.classification / f'eval-{TEST}.json'}, {png}" in out


@pytest.mark.slow  # reads the module's three training runs
def test_the_confusion_matrix_is_an_image_tensorboard_reads(
    runs: Runs, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _evaluate(capsys, runs.classification, "--split", TEST)
    world = runs.classification / "tb" / "world"
    events = EventAccumulator(str(world), size_guidance={"images": 0})
    events.Reload()
    tag = f"{TEST}/confusion"
    assert tag in events.Tags()["images"]
    image = events.Images(tag)[-1]
    png = runs.classification / f"confusion-{TEST}.png"
    assert image.encoded_image_string == png.read_bytes()
    assert (image.width, image.height) == Image.open(png).size


@pytest.mark.slow  # reads the module's three training runs
def test_a_regression_gets_a_scatter_plot_of_its_test_split_and_its_trackers_all(
    runs: Runs, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = []
    monkeypatch.setattr("dpt.observe.trackers.after_run.log_evaluation",
                        lambda *given: sent.append(given) or ["mlflow"])  # fmt: skip
    out = _evaluate(capsys, runs.regression)
    assert out.endswith("logged to mlflow\n")
    files = [runs.regression / f"eval-{TEST}.json", runs.regression / f"scatter-{TEST}.png"]
    steps = json.loads((runs.regression / "metrics.json").read_text())["steps"]
    assert sent == [(runs.regression, _record(runs.regression, TEST)["metrics"], files, steps)]
    record = _record(runs.regression, TEST)
    assert record["size"] == 24
    assert set(record["metrics"]) == {f"{TEST}/{m}" for m in ("loss", "mse", "mae", "r2")}
    assert Image.open(runs.regression / f"scatter-{TEST}.png").format == "PNG"
    assert f"{TEST}/r2" in out


@pytest.mark.slow  # reads the module's three training runs
def test_a_language_model_gets_loss_and_perplexity_on_test_txt(
    runs: Runs, capsys: pytest.CaptureFixture[str]
) -> None:
    _evaluate(capsys, runs.language_model)
    record = _record(runs.language_model, TEST)
    assert record["size"] == (560 - 1) // 16  # windows of test.txt's bytes (block_size 16)
    metrics = record["metrics"]
    assert set(metrics) == {f"{TEST}/loss", f"{TEST}/perplexity"}
    loss, perplexity = metrics[f"{TEST}/loss"], metrics[f"{TEST}/perplexity"]
    assert perplexity == pytest.approx(math.exp(loss), rel=1e-4)  # of the same tokens


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.slow  # reads the module's three training runs
def test_a_split_the_data_set_lacks_is_one_line_naming_what_it_has(
    runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = tmp_path / "moved"
    for split in (TRAIN, VAL):  # the same images elsewhere, without test/
        shutil.copytree(runs.images / split, moved / split)
    assert _error(capsys, runs.classification, "--data", moved, "--split", TEST) == (
        f"Error: --split {TEST}: the image folder {moved} has no {TEST}/ folder (it has "
        f"{TRAIN}/, {VAL}/)"
    )
    assert _error(capsys, runs.classification, "--data", moved) == (
        f"Error: the image folder {moved} has no {TEST}/ folder (it has {TRAIN}/, {VAL}/): "
        f"--split {VAL} evaluates its validation split"
    )
    _evaluate(capsys, runs.classification, "--data", moved, "--split", VAL)  # what it says works


@pytest.mark.slow  # reads the module's three training runs
def test_a_folder_that_is_no_run_and_a_run_without_weights_are_one_line(
    runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _error(capsys, tmp_path) == (
        f"Error: {tmp_path / 'data.json'} not found: not a run folder of this dpt version (or "
        "the run never started)"
    )
    unfinished = tmp_path / "unfinished"
    shutil.copytree(runs.regression, unfinished, ignore=shutil.ignore_patterns("*.pt"))
    assert _error(capsys, unfinished) == (
        f"Error: {unfinished / 'model.pt'} not found: the run has not finished (model.pt is "
        "written at its end)"
    )


# --- the data sets' test splits, in process ----------------------------------------------------


def test_the_splits_are_named_once() -> None:
    assert SPLITS == (TRAIN, VAL, TEST) == ("train", "val", "test")


def test_help_answers_before_torch_loads() -> None:
    probe = ("import sys\nfrom dpt.commands.evaluate import main\ntry:\n    main(['--help'])\n"
             "except SystemExit:\n    pass\nprint('torch' in sys.modules)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=REPO, timeout=60, check=True)  # fmt: skip
    assert "--split {test,val}" in result.stdout and result.stdout.endswith("False\n")


def test_a_text_folders_test_txt_is_never_a_training_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(LINES)
    (tmp_path / f"{TEST}.txt").write_text(LINES)
    (tmp_path / VAL).mkdir()
    (tmp_path / VAL / "v.txt").write_text(LINES)
    assert text_files(tmp_path) == ([tmp_path / "a.txt"], [tmp_path / VAL / "v.txt"])
    data = TextData(str(tmp_path), None, 16, 0.1, str(tmp_path / "c"), 0, seed=0)
    assert data.test is not None and len(data.test) == (len(LINES) - 1) // 16
    (tmp_path / f"{TEST}.txt").unlink()
    data = TextData(str(tmp_path), None, 16, 0.1, str(tmp_path / "c"), 0, seed=0)
    assert data.test is None
    assert missing_split(data, TEST) == (
        f"the text folder {tmp_path} has no {TEST}.txt nor {TEST}/ (it has training texts, {VAL}/)"
    )


def test_a_chat_folders_test_file_is_its_test_split(tmp_path: Path) -> None:
    from dpt.data.chat import ChatData

    rows = "".join(json.dumps({"prompt": f"{a}+{a}=", "response": str(2 * a)}) + "\n"
                   for a in range(6))  # fmt: skip
    for split in (TRAIN, VAL):
        (tmp_path / f"{split}.jsonl").write_text(rows)
    template = {"prompt": "Q: {prompt}\nA: ", "response": "{response}\n"}
    settings = {"root": str(tmp_path), "tokenizer": None, "block_size": 32, "packing": False,
                "template": template, "chat_template": None, "val_fraction": 0.0,
                "num_workers": 0, "seed": 0}  # fmt: skip
    data = ChatData(**settings)
    assert data.test is None
    assert missing_split(data, TEST) == (
        f"the chat folder {tmp_path} has no {TEST} file ({TEST}.jsonl, {TEST}.json, "
        f"{TEST}.parquet, {TEST}.csv; it has {TRAIN}.jsonl, {VAL}.jsonl)"
    )
    (tmp_path / f"{TEST}.jsonl").write_text(rows[: len(rows) // 2])
    assert len(ChatData(**settings).test) == 3  # one example a window


def test_a_data_set_of_yours_builds_its_test_split_only_when_asked(tmp_path: Path) -> None:
    vectors = {"_target_": "tests.task_models.RandomVectors", "input_dim": 4,
               "target": "regression", "outputs": 2}  # fmt: skip
    train = OmegaConf.create({**vectors, "n_samples": 8})
    test = OmegaConf.create({**vectors, "_target_": "no.such.Module", "n_samples": 4})
    data = CustomData(train, None, None, None, 0, seed=0, test=test)  # not built yet: no error
    with pytest.raises(DptError, match=r"^dataset\.test\._target_"):
        _ = data.test
    data = CustomData(train, None, None, None, 0, seed=0)
    assert data.test is None
    assert missing_split(data, TEST) == (
        f"the data set has no {TEST} split: dataset.{TEST} is null (it has dataset.{TRAIN})"
    )
