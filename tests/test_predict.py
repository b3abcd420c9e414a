"""`dpt-predict` on a run folder made by hand: a ResNet-18 on 32x32 images, three classes."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from dpt.commands.predict import Predictor, main
from dpt.commands.run_model import CONFIG_FILE
from dpt.data.images import read_image_rgb, val_transform
from dpt.models import build_model
from dpt.state.results import BEST_MODEL, LAST_MODEL, RunData, write_run_data
from tests.helpers import (
    REPO,
    command_in_process,
    compose,
    keep_config,
    runs_in_process,
    train_in_process,
)
from tests.task_models import SimpleNet

CLASSES = ["cat", "dog", "bird"]
SIZE = 32
TRANSFORM = {"_target_": "dpt.data.images.val_transform", "image_size": SIZE}


@dataclass
class Run:
    folder: Path
    images: Path  # images/<class>/<file>, plus images/cat/broken.jpg (truncated)
    last: torch.nn.Module  # the model whose state_dict is model.pt
    best: torch.nn.Module  # model_best.pt's

    @property
    def readable(self) -> list[Path]:
        return sorted(p for p in self.images.rglob("*") if p.name in ("a.png", "b.jpg"))


def _model(cfg: object, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg.model, (3, SIZE, SIZE), len(CLASSES)).eval()  # type: ignore[attr-defined]


def _write_images(root: Path) -> None:
    colours = {"cat": (200, 40, 40), "dog": (40, 200, 40), "bird": (40, 40, 200)}
    for index, (name, colour) in enumerate(colours.items()):
        folder = root / name
        folder.mkdir(parents=True)
        # Not square, and not the transform's size: the resize and crop must run.
        Image.new("RGB", (48, 40), colour).save(folder / "a.png")
        noisy = Image.effect_noise((40, 52), 30 + 10 * index).convert("RGB")
        noisy.save(folder / "b.jpg", quality=90)
    whole = io.BytesIO()
    Image.new("RGB", (40, 40), (10, 20, 30)).save(whole, format="JPEG")
    (root / "cat" / "broken.jpg").write_bytes(whole.getvalue()[: len(whole.getvalue()) // 2])
    (root / "cat" / "notes.txt").write_text("not an image: a folder search skips it")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("run")
    cfg = compose("model=resnet18", "dataset=fake_images", f"dataset.image_size={SIZE}")
    keep_config(cfg, folder)
    write_run_data(folder, RunData(CLASSES, [3, SIZE, SIZE], TRANSFORM, "text"))
    last, best = _model(cfg, 0), _model(cfg, 1)
    torch.save(last.state_dict(), folder / LAST_MODEL)
    torch.save(best.state_dict(), folder / BEST_MODEL)
    images = tmp_path_factory.mktemp("images")
    _write_images(images)
    return Run(folder, images, last, best)


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compare with the CPU model's outputs on the CPU: CUDA convolutions use TF32 by default,
    which moves probabilities by about 1e-3 (see test_cuda_gives_about_the_same_outputs)."""
    monkeypatch.setattr(
        "dpt.commands.run_model.pick_device", lambda name=None: torch.device(name or "cpu")
    )


def _expected(model: torch.nn.Module, path: Path) -> torch.Tensor:
    """Softmax of the model's logits on the input validation would give it."""
    with torch.no_grad():
        logits = model(val_transform(SIZE)(read_image_rgb(path)).unsqueeze(0)).float()
    return torch.softmax(logits, dim=1)[0]


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    main([str(a) for a in args])
    captured = capsys.readouterr()
    return captured.out, captured.err


def _error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0].removeprefix("Error: ")


def _rows(out: str) -> dict[str, list[str]]:
    """Prediction lines by path: [class, probability, class, probability, ...]."""
    rows = {}
    for line in out.splitlines():
        if not line.startswith("accuracy"):
            path, *cells = line.split()
            rows[path] = cells
    return rows


# --- the Predictor ------------------------------------------------------------------------------


@pytest.mark.parametrize(("last", "which"), [(False, "best"), (True, "last")])
def test_probabilities_are_the_softmax_of_validations_logits(
    run: Run, last: bool, which: str
) -> None:
    predictor = Predictor.from_run(run.folder, last=last)
    assert predictor.weights == run.folder / (LAST_MODEL if last else BEST_MODEL)
    assert predictor.notice is None and predictor.classes == CLASSES
    paths = run.readable
    got = predictor.predict(torch.stack([predictor.load(p) for p in paths]))
    model = getattr(run, which)
    expected = torch.stack([_expected(model, p) for p in paths])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_best_and_last_weights_give_different_outputs(run: Run) -> None:
    path = run.readable[0]
    best, last = Predictor.from_run(run.folder), Predictor.from_run(run.folder, last=True)
    inputs = best.load(path).unsqueeze(0)
    assert not torch.allclose(best.predict(inputs), last.predict(inputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_about_the_same_outputs(run: Run) -> None:
    cpu, cuda = Predictor.from_run(run.folder), Predictor.from_run(run.folder, device="cuda")
    assert next(cuda.model.parameters()).is_cuda
    inputs = torch.stack([cpu.load(p) for p in run.readable])
    torch.testing.assert_close(cuda.predict(inputs), cpu.predict(inputs), atol=5e-3, rtol=0)


@pytest.mark.parametrize("option", ["channels_last", "activation_checkpointing"])
def test_a_model_trained_with_a_memory_option_loads(run: Run, option: str, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    for name in (".hydra", "data.json", LAST_MODEL):
        source = run.folder / name
        if source.is_dir():
            (folder / name).mkdir()
            cfg = OmegaConf.load(source / "config.yaml")
            cfg.model[option] = True
            OmegaConf.save(cfg, folder / name / "config.yaml")
        else:
            (folder / name).write_bytes(source.read_bytes())
    predictor = Predictor.from_run(folder, last=True)
    path = run.readable[0]
    got = predictor.predict(predictor.load(path).unsqueeze(0))[0]
    torch.testing.assert_close(got, _expected(run.last, path), atol=1e-5, rtol=1e-4)


# --- the command --------------------------------------------------------------------------------


def test_prints_top_k_of_each_image_and_the_accuracy(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    out, err = _main([run.folder, run.images, "--top-k", "2"], capsys)
    rows = _rows(out)
    assert sorted(rows) == [str(p) for p in run.readable]  # the .txt is not searched
    correct = 0
    for path in run.readable:
        expected = _expected(run.best, path)
        values, indices = expected.topk(2)
        cells = rows[str(path)]
        assert cells[0::2] == [CLASSES[int(i)] for i in indices]
        assert [float(p) for p in cells[1::2]] == pytest.approx(values.tolist(), abs=6e-4)
        correct += CLASSES[int(indices[0])] == path.parent.name
    summary = out.strip().splitlines()[-1]
    assert summary == (
        f"accuracy {correct / 6:.4f} on 6 images (labels from their folder names); "
        "1 unreadable image skipped"
    )
    assert err.strip() == f"Warning: skipped {run.images / 'cat' / 'broken.jpg'}: " + (
        "JPEG is truncated (no end-of-image marker after the last scan)"
    )


def test_lines_are_aligned_and_in_sorted_order(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _main([run.folder, run.images / "dog", run.images / "bird"], capsys)
    lines = out.strip().splitlines()[:-1]
    assert [line.split()[0] for line in lines] == [
        str(run.images / "dog" / "a.png"),
        str(run.images / "dog" / "b.jpg"),
        str(run.images / "bird" / "a.png"),
        str(run.images / "bird" / "b.jpg"),
    ]
    columns = {line.index(line.split()[1], len(line.split()[0])) for line in lines}
    assert len(columns) == 1  # the classes start in the same column
    assert all(len(line.split()) == 1 + 2 * 3 for line in lines)  # --top-k 3 by default


def test_top_k_larger_than_the_classes_is_clipped(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = _main([run.folder, run.readable[0], "--top-k", "10"], capsys)
    (line,) = out.strip().splitlines()[:1]
    assert sorted(line.split()[1::2]) == sorted(CLASSES)


def test_csv_has_one_top_1_row_per_readable_image(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "predictions.csv"
    _main([run.folder, run.images, "--csv", out_file, "--last"], capsys)
    with open(out_file, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["path", "class", "probability"]
    assert [row[0] for row in rows[1:]] == [str(p) for p in run.readable]
    for (path, name, probability), image in zip(rows[1:], run.readable, strict=True):
        expected = _expected(run.last, image)
        assert name == CLASSES[int(expected.argmax())], path
        assert float(probability) == pytest.approx(float(expected.max()), abs=1e-5)


def test_no_accuracy_for_images_outside_class_folders(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    elsewhere = tmp_path / "unsorted" / "x.png"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes((run.images / "cat" / "a.png").read_bytes())
    out, err = _main([run.folder, run.images / "dog", elsewhere], capsys)
    lines = out.strip().splitlines()
    assert len(lines) == 3 and not any(line.startswith("accuracy") for line in lines)
    assert err == ""


def test_missing_best_falls_back_to_the_last_with_a_notice(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy_run(run, tmp_path / "run", BEST_MODEL)
    path = run.readable[0]
    _, err = _main([folder, path, "--csv", tmp_path / "p.csv"], capsys)
    assert err == (
        f"Note: {folder / BEST_MODEL} not found: using {folder / LAST_MODEL} "
        "(the last epoch's weights)\n"
    )
    with open(tmp_path / "p.csv", newline="") as f:
        (_, probability) = [row[2] for row in csv.reader(f)]
    assert float(probability) == pytest.approx(float(_expected(run.last, path).max()), abs=1e-5)


def test_runs_as_a_command(run: Run) -> None:
    # the installed console script's entry point, in this process: it trains nothing
    result = command_in_process("dpt-predict", str(run.folder), str(run.images / "dog"))
    assert result.returncode == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[:2]] == [
        str(run.images / "dog" / "a.png"),
        str(run.images / "dog" / "b.jpg"),
    ]
    assert lines[2].startswith("accuracy ") and lines[2].endswith(
        " on 2 images (labels from their folder names)"
    )
    assert result.stderr == ""


# --- errors -------------------------------------------------------------------------------------


RUN_FILES = (str(CONFIG_FILE), "data.json", LAST_MODEL, BEST_MODEL)


def _copy_run(run: Run, folder: Path, *without: str) -> Path:
    """The run's files in `folder`, but for those named."""
    folder.mkdir()
    for name in RUN_FILES:
        if name not in without:
            (folder / name).parent.mkdir(exist_ok=True)
            (folder / name).write_bytes((run.folder / name).read_bytes())
    return folder


def test_run_folder_errors(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    image = run.readable[0]
    missing = tmp_path / "nowhere"
    assert _error([missing, image], capsys) == f"{missing}: no such run folder"
    assert _error([image, image], capsys) == (
        f"{image} is not a folder: give the run folder (it holds data.json)"
    )
    no_data = _copy_run(run, tmp_path / "no_data", "data.json")
    assert _error([no_data, image], capsys) == (
        f"{no_data / 'data.json'} not found: not a run folder of this dpt version "
        "(or the run never started)"
    )
    no_config = _copy_run(run, tmp_path / "no_config", ".hydra/config.yaml")
    assert _error([no_config, image], capsys) == (
        f"{no_config / '.hydra' / 'config.yaml'} not found: the run's config, which says how to "
        "build its model"
    )
    no_model = _copy_run(run, tmp_path / "no_model", LAST_MODEL, BEST_MODEL)
    assert _error([no_model, image], capsys) == (
        f"{no_model / LAST_MODEL} not found: the run has not finished (model.pt is written at "
        "its end)"
    )
    best_only = _copy_run(run, tmp_path / "best_only", LAST_MODEL)
    assert _error([best_only, image, "--last"], capsys) == (
        f"{best_only / LAST_MODEL} not found: the run has not finished (model.pt is written at "
        "its end)"
    )


def test_a_sweep_folder_is_one_line_naming_its_best_run_and_its_jobs(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dpt -m` prints its sweep's folder; given to dpt-predict or dpt-generate, the line says
    which folders inside are runs."""
    from dpt.commands.generate import main as generate

    sweep = tmp_path / "multirun" / "2026-11-27" / "12-00-00"
    sweep.mkdir(parents=True)
    for job in ("0", "1"):
        _copy_run(run, sweep / job)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "best").symlink_to("1")
    expected = (
        f"{sweep} is a sweep folder, not a run folder: give one of its runs: {sweep / 'best'} "
        f"(the best job) or a job's folder ({sweep / '0'}, {sweep / '1'})"
    )
    assert _error([sweep, run.readable[0]], capsys) == expected
    with pytest.raises(SystemExit):
        generate([str(sweep), "--prompt", "hi"])
    assert capsys.readouterr().err.strip() == f"Error: {expected}"


def test_a_run_without_val_transform_is_refused(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy_run(run, tmp_path / "run", "data.json")
    write_run_data(folder, RunData(CLASSES, [3, SIZE, SIZE], None, None))
    assert _error([folder, run.readable[0]], capsys) == (
        f"{folder / 'data.json'} records no val_transform (the run's data set gave none): "
        "dpt-predict needs a data set with a `val_transform` (see dpt/contract.py)"
    )


def test_weights_that_do_not_fit_are_refused(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _copy_run(run, tmp_path / "run", "data.json")
    write_run_data(folder, RunData([*CLASSES, "fish"], [3, SIZE, SIZE], TRANSFORM, None))
    message = _error([folder, run.readable[0]], capsys)
    assert message.startswith(f"{folder / BEST_MODEL} does not fit the model of the run's config:")
    (folder / BEST_MODEL).write_bytes(b"not a state_dict")
    message = _error([folder, run.readable[0]], capsys)
    assert message.startswith(f"{folder / BEST_MODEL} is not a loadable state_dict: ")


def test_path_errors(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.jpg"
    assert _error([run.folder, run.images, missing], capsys) == (
        f"{missing}: no such file or folder"
    )
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "notes.txt").write_text("no image")
    assert _error([run.folder, empty], capsys) == (
        f"no image found under {empty} (files whose suffix is an image format's, as "
        "dataset=image_folder reads them: .jpg, .png, .webp, ...)"
    )
    broken = run.images / "cat" / "broken.jpg"
    with pytest.raises(SystemExit) as exit_info:
        main([str(run.folder), str(broken)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"Warning: skipped {broken}: ")
    assert err[1:] == ["Error: could not read any image (1 unreadable, see the warnings above)"]


@pytest.mark.parametrize("k", ["0", "-2"])
def test_top_k_below_one_is_an_error(run: Run, k: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        _error([run.folder, run.images, "--top-k", k], capsys) == f"--top-k {k}: must be 1 or more"
    )


# --- every task: tiny runs of a user's model and data set (dataset=custom), vectors in ------------

INPUT_DIM, HIDDEN = 10, 16
# task -> its run's outputs per sample, their names (None: "0", "1", ...), the data set's
# targets (tests.task_models.RandomVectors) and the task's overrides.
TASK_RUNS = {
    "binary": (1, None, "binary", ["task=binary"]),
    "multilabel": (4, ["red", "green", "blue", "round"], "multilabel", ["task=multilabel"]),
    "regression": (2, ["x", "y"], "regression", ["task=regression"]),
    "custom": (1, None, "binary", ["task=custom", "task.loss._target_=tests.task_models.focal_loss",
                                   "+task.loss.gamma=2", "task.predict=sigmoid"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def task_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One finished run of each task (4 steps each): `train.py --config-dir` with a dataset and
    a model file per task, as a user writes them, each run in this process (one process, no
    loader workers: `tests.helpers.train_in_process`)."""
    root = tmp_path_factory.mktemp("tasks")
    for group in ("dataset", "model"):
        (root / "conf" / group).mkdir(parents=True)
    for task, (outputs, names, target, overrides) in TASK_RUNS.items():
        vectors = {"_target_": "tests.task_models.RandomVectors", "input_dim": INPUT_DIM,
                   "target": target, "outputs": outputs}  # fmt: skip
        dataset = {"defaults": ["custom", "_self_"], "classes": names,
                   "train": {**vectors, "n_samples": 64},
                   "val": {**vectors, "n_samples": 32}}  # fmt: skip
        model = {"_target_": "tests.task_models.SimpleNet", "input_dim": INPUT_DIM,
                 "hidden_dim": HIDDEN, "output_dim": outputs}  # fmt: skip
        # JSON is YAML: the files as a user would write them, in flow style (not named like
        # dpt's own files: conf/dataset/custom.yaml would hide the one it extends).
        (root / "conf" / "dataset" / f"{task}_vectors.yaml").write_text(json.dumps(dataset))
        (root / "conf" / "model" / f"{task}.yaml").write_text(json.dumps(model))
        argv = ["--config-dir", str(root / "conf"), f"model={task}", f"dataset={task}_vectors",
                *overrides, "trainer.batch_size=16", "trainer.epochs=1", "trainer.device=cpu",
                "checkpoint.enabled=false", f"hydra.run.dir={root / task}"]  # fmt: skip
        assert runs_in_process(argv, REPO)
        result = train_in_process(*argv)
        assert result.returncode == 0, f"{task} run: exit {result.returncode}\n{result.output}"
    return {task: root / task for task in TASK_RUNS}


def _vectors(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, INPUT_DIM, generator=torch.Generator().manual_seed(seed))


def _outputs(
    folder: Path, inputs: torch.Tensor, outputs: int, weights: str = BEST_MODEL
) -> torch.Tensor:
    """The model's outputs on `inputs`: the weights file loaded into a SimpleNet built here."""
    model = SimpleNet(INPUT_DIM, HIDDEN, outputs)
    model.load_state_dict(torch.load(folder / weights, weights_only=True))
    with torch.no_grad():
        return model.eval()(inputs.float())


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _names(path: Path, n: int) -> list[str]:
    return [f"{path}:{row}" for row in range(n)]


def _lines(out: str) -> list[list[str]]:
    return [line.split() for line in out.strip().splitlines()]


@pytest.mark.slow  # reads the module's four training runs
def test_binary_one_column_writes_the_probability_and_the_label_at_the_threshold(
    task_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, inputs = task_runs["binary"], _vectors(12, seed=1)
    torch.save(inputs, tmp_path / "x.pt")
    out, err = _main([folder, tmp_path / "x.pt", "--csv", tmp_path / "p.csv"], capsys)
    probabilities = torch.sigmoid(_outputs(folder, inputs, 1))[:, 0].tolist()
    rows = _read_csv(tmp_path / "p.csv")
    assert rows[0] == ["path", "probability", "predicted"]
    assert [row[0] for row in rows[1:]] == _names(tmp_path / "x.pt", 12)
    for (_, probability, predicted), expected in zip(rows[1:], probabilities, strict=True):
        assert float(probability) == pytest.approx(expected, abs=1e-6)
        assert predicted == str(int(expected > 0.5))
    assert _lines(out) == [
        [name, f"{p:.3f}", str(int(p > 0.5))]
        for name, p in zip(_names(tmp_path / "x.pt", 12), probabilities, strict=True)
    ]
    assert err == ""


def _hand_made(
    source: Path, folder: Path, outputs: int, data: RunData, **task: object
) -> torch.nn.Module:
    """`source`'s run folder with a model of `outputs` outputs (new random weights), `data` and
    these task keys: another run of the same task without training one."""
    cfg = OmegaConf.load(source / CONFIG_FILE)
    cfg.model.output_dim = outputs
    for key, value in task.items():
        cfg.task[key] = value
    keep_config(cfg, folder)
    write_run_data(folder, data)
    torch.manual_seed(3)
    model = SimpleNet(INPUT_DIM, HIDDEN, outputs).eval()
    torch.save(model.state_dict(), folder / LAST_MODEL)
    torch.save(model.state_dict(), folder / BEST_MODEL)
    return model


@pytest.mark.slow  # reads the module's four training runs
def test_binary_columns_write_each_probability_and_the_names_at_the_threshold(
    task_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names, threshold = ["a", "b", "c"], 0.45
    data = RunData(names, [INPUT_DIM], None, None, task="binary", target_shape=[3])
    folder = tmp_path / "run"
    _hand_made(task_runs["binary"], folder, 3, data, threshold=threshold)
    inputs = _vectors(20, seed=2).double()  # a float64 array: cast to the model's float32
    np.save(tmp_path / "x.npy", inputs.numpy())
    out, _ = _main([folder, tmp_path / "x.npy", "--csv", tmp_path / "p.csv"], capsys)
    probabilities = torch.sigmoid(_outputs(folder, inputs, 3)).tolist()
    rows = _read_csv(tmp_path / "p.csv")
    assert rows[0] == ["path", *names, "predicted"]
    assert [row[0] for row in rows[1:]] == _names(tmp_path / "x.npy", 20)
    for row, expected in zip(rows[1:], probabilities, strict=True):
        assert [float(p) for p in row[1:4]] == pytest.approx(expected, abs=1e-6)
        assert row[4] == ";".join(n for n, p in zip(names, expected, strict=True) if p > threshold)
    assert {row[4] for row in rows[1:]} - {""}  # some names picked (and the test meaningful)
    assert _lines(out)[0][1:] == [cell for n, p in zip(names, probabilities[0], strict=True)
                                  for cell in (n, f"{p:.3f}")]  # fmt: skip


@pytest.mark.slow  # reads the module's four training runs
def test_multilabel_writes_the_labels_at_the_threshold_highest_first(
    task_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, inputs = task_runs["multilabel"], _vectors(30, seed=3)
    names = TASK_RUNS["multilabel"][1]
    assert names is not None
    torch.save(inputs, tmp_path / "x.pt")
    args = [folder, tmp_path / "x.pt", "--csv", tmp_path / "p.csv", "--top-k", "1"]  # ignored
    out, _ = _main(args, capsys)
    probabilities = torch.sigmoid(_outputs(folder, inputs, 4)).tolist()
    rows = _read_csv(tmp_path / "p.csv")
    assert rows[0] == ["path", "labels", "probabilities"]
    lines = _lines(out)
    for row, line, expected in zip(rows[1:], lines, probabilities, strict=True):
        picked = sorted(((p, n) for n, p in zip(names, expected, strict=True) if p > 0.5),
                        key=lambda pair: -pair[0])  # fmt: skip
        assert row[1] == ";".join(n for _, n in picked)
        assert [float(p) for p in row[2].split(";") if p] == pytest.approx(
            [p for p, _ in picked], abs=1e-6
        )
        assert line[1:] == ([c for p, n in picked for c in (n, f"{p:.3f}")] or ["-"])
    assert [row[0] for row in rows[1:]] == [line[0] for line in lines]
    assert [row[0] for row in rows[1:]] == _names(tmp_path / "x.pt", 30)
    counts = {len(row[1].split(";")) if row[1] else 0 for row in rows[1:]}
    assert len(counts) > 1  # rows of different label counts: the test says something


@pytest.mark.slow  # reads the module's four training runs
def test_regression_writes_the_values_from_csv_and_npy_rows(
    task_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = task_runs["regression"]
    first, second = _vectors(5, seed=4), _vectors(3, seed=5)
    with open(tmp_path / "x.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow([f"f{i}" for i in range(INPUT_DIM)])  # a header: skipped
        rows.writerows([[repr(v) for v in row] for row in first.tolist()])
    np.save(tmp_path / "y.npy", second.numpy())
    args = [folder, tmp_path / "x.csv", tmp_path / "y.npy", "--csv", tmp_path / "p.csv"]
    out, _ = _main(args, capsys)
    expected = _outputs(folder, torch.cat([first, second]), 2).tolist()
    rows = _read_csv(tmp_path / "p.csv")
    assert rows[0] == ["path", "x", "y"]
    names = _names(tmp_path / "x.csv", 5) + _names(tmp_path / "y.npy", 3)
    assert [row[0] for row in rows[1:]] == names
    for row, values in zip(rows[1:], expected, strict=True):
        assert [float(v) for v in row[1:]] == pytest.approx(values, abs=1e-6)
    lines = _lines(out)  # the values to 6 significant digits
    assert [line[0] for line in lines] == names
    for line, values in zip(lines, expected, strict=True):
        assert [float(v) for v in line[1:]] == pytest.approx(values, rel=1e-5, abs=1e-6)


@pytest.mark.slow  # reads the module's four training runs
def test_a_lone_unnamed_value_is_written_as_value(
    task_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = RunData(["0"], [INPUT_DIM], None, None, task="regression", target_shape=[])
    folder = tmp_path / "run"
    _hand_made(task_runs["regression"], folder, 1, data)
    inputs = _vectors(4, seed=6)
    torch.save(inputs, tmp_path / "x.pt")
    _main([folder, tmp_path / "x.pt", "--csv", tmp_path / "p.csv"], capsys)
    rows = _read_csv(tmp_path / "p.csv")
    assert rows[0] == ["path", "value"]
    expected = _outputs(folder, inputs, 1)[:, 0].tolist()
    assert [float(row[1]) for row in rows[1:]] == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow  # reads the module's four training runs
def test_custom_writes_what_its_predict_gives(
    task_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A focal loss of the user's, task.predict=sigmoid: the probabilities, in a `value` column
    (one output, unnamed), from the last weights as from the best."""
    folder, inputs = task_runs["custom"], _vectors(10, seed=7)
    torch.save(inputs, tmp_path / "x.pt")
    for weights, flags in ((BEST_MODEL, []), (LAST_MODEL, ["--last"])):
        out, _ = _main([folder, tmp_path / "x.pt", "--csv", tmp_path / "p.csv", *flags], capsys)
        expected = torch.sigmoid(_outputs(folder, inputs, 1, weights))[:, 0].tolist()
        rows = _read_csv(tmp_path / "p.csv")
        assert rows[0] == ["path", "value"]
        assert [row[0] for row in rows[1:]] == _names(tmp_path / "x.pt", 10)
        assert [float(row[1]) for row in rows[1:]] == pytest.approx(expected, abs=1e-6)
        printed = [float(line[1]) for line in _lines(out)]  # 6 significant digits
        assert printed == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_run_of_before_tasks_is_classification(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No `task` in its config nor in data.json: a classification run, as before."""
    folder = _copy_run(run, tmp_path / "run", "data.json")
    cfg = OmegaConf.load(folder / CONFIG_FILE)
    del cfg["task"]
    OmegaConf.save(cfg, folder / CONFIG_FILE)
    old = {"classes": CLASSES, "input_shape": [3, SIZE, SIZE], "val_transform": TRANSFORM,
           "val_transform_text": "text"}  # fmt: skip
    (folder / "data.json").write_text(json.dumps(old))
    _main([folder, *run.readable, "--csv", tmp_path / "p.csv"], capsys)
    rows = _read_csv(tmp_path / "p.csv")
    assert rows[0] == ["path", "class", "probability"]
    for (_, name, probability), image in zip(rows[1:], run.readable, strict=True):
        expected = _expected(run.best, image)
        assert name == CLASSES[int(expected.argmax())]
        assert float(probability) == pytest.approx(float(expected.max()), abs=1e-5)


def test_a_classification_run_takes_tensor_files_too(
    run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Transformed images saved as a tensor: rows named FILE:ROW, no accuracy (no labels)."""
    inputs = torch.stack([val_transform(SIZE)(read_image_rgb(p)) for p in run.readable[:2]])
    torch.save(inputs, tmp_path / "x.pt")
    out, _ = _main([run.folder, tmp_path / "x.pt", "--csv", tmp_path / "p.csv"], capsys)
    rows = _read_csv(tmp_path / "p.csv")
    assert [row[0] for row in rows[1:]] == _names(tmp_path / "x.pt", 2)
    with torch.no_grad():
        expected = torch.softmax(run.best(inputs).float(), dim=1)
    for (_, name, probability), row in zip(rows[1:], expected, strict=True):
        assert name == CLASSES[int(row.argmax())]
        assert float(probability) == pytest.approx(float(row.max()), abs=1e-5)
    assert len(_lines(out)) == 2 and not out.startswith("accuracy")


@pytest.mark.slow  # reads the module's four training runs
def test_tensor_file_errors(
    task_runs: dict[str, Path], run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = task_runs["binary"]
    torch.save(torch.zeros(3, 7), tmp_path / "narrow.pt")
    assert _error([folder, tmp_path / "narrow.pt"], capsys) == (
        f"{tmp_path / 'narrow.pt'}: inputs of shape (3, 7), the run's model takes (N, 10)"
    )
    (tmp_path / "narrow.csv").write_text("1,2,3\n4,5,6\n")
    assert _error([folder, tmp_path / "narrow.csv"], capsys) == (
        f"{tmp_path / 'narrow.csv'}: inputs of shape (2, 3), the run's model takes (N, 10)"
    )
    (tmp_path / "ragged.csv").write_text("a,b\n1,2\n\n3\n")
    assert _error([folder, tmp_path / "ragged.csv"], capsys) == (
        f"{tmp_path / 'ragged.csv'}: line 4 has 1 numbers, line 2 2: one sample per row, all "
        "of one length"
    )
    torch.save({"x": torch.zeros(2, 10)}, tmp_path / "dict.pt")
    assert _error([folder, tmp_path / "dict.pt"], capsys) == (
        f"{tmp_path / 'dict.pt'} holds a dict, not a tensor of inputs (N, 10)"
    )
    assert _error([folder, run.readable[0]], capsys) == (  # an image, and no val_transform
        f"{folder / 'data.json'} records no val_transform (the run's data set gave none): "
        "dpt-predict needs a data set with a `val_transform` (see dpt/contract.py)"
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no inputs")
    assert _error([folder, tmp_path / "empty"], capsys) == (
        f"no input file found under {tmp_path / 'empty'} (the run's data set gave no "
        "val_transform: .pt, .npy, .csv files of the model's inputs)"
    )
    assert _error([run.folder, tmp_path / "narrow.csv"], capsys) == (
        f"{tmp_path / 'narrow.csv'}: a .csv file holds one sample per row, for a model whose "
        f"input is a vector; the run's model takes (N, 3, {SIZE}, {SIZE}): give a .pt or .npy file"
    )


@pytest.mark.slow  # reads the module's four training runs
def test_a_folder_of_tensor_files_is_searched(
    task_runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = task_runs["binary"]
    (tmp_path / "in" / "sub").mkdir(parents=True)
    torch.save(_vectors(2, seed=8), tmp_path / "in" / "sub" / "b.pt")
    torch.save(_vectors(1, seed=9), tmp_path / "in" / "a.pt")
    (tmp_path / "in" / "notes.txt").write_text("skipped")
    out, _ = _main([folder, tmp_path / "in"], capsys)
    assert [line[0] for line in _lines(out)] == [
        f"{tmp_path / 'in' / 'a.pt'}:0",
        f"{tmp_path / 'in' / 'sub' / 'b.pt'}:0",
        f"{tmp_path / 'in' / 'sub' / 'b.pt'}:1",
    ]
