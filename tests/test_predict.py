"""`dpt-predict` on a run folder made by hand: a ResNet-18 on 32x32 images, three classes."""

from __future__ import annotations

import csv
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from dpt.data.images import read_image_rgb, val_transform
from dpt.launch.predict import Predictor, main
from dpt.models import build_model
from dpt.state.results import BEST_MODEL, LAST_MODEL, RunData, write_run_data
from tests.helpers import REPO, compose, run_cmd

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
    (folder / ".hydra").mkdir()
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
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
        "dpt.launch.predict.pick_device", lambda name=None: torch.device(name or "cpu")
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
    result = run_cmd(
        [
            str(Path(sys.executable).parent / "dpt-predict"),
            str(run.folder),
            str(run.images / "dog"),
        ],
        timeout=120,
        cwd=REPO,
    )
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


RUN_FILES = (".hydra/config.yaml", "data.json", LAST_MODEL, BEST_MODEL)


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
