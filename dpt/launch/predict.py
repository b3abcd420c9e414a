"""The `dpt-predict` command: a finished run's model on image files.

`dpt-predict RUN_DIR PATH... [--csv OUT] [--top-k K] [--last]` rebuilds the model from the run
folder (`.hydra/config.yaml`), loads `model_best.pt` (or `model.pt`), applies the run's
validation transform (`data.json`, see dpt/state/results.py) and prints the top-k classes of each
image. Images in folders named after the run's classes (`root/val/<class>/...`) are also scored.

torch is imported only after the arguments are parsed: `--help` and bad arguments answer fast.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpt import user_code
from dpt.data.folder_layout import images_under
from dpt.errors import DptError, could_not_write, one_line
from dpt.state.results import BEST_MODEL, DATA_FILE, LAST_MODEL, RunData, read_run_data

if TYPE_CHECKING:
    import torch
    from torch import nn

CONFIG_FILE = Path(".hydra") / "config.yaml"
BATCH_SIZE = 64
# Models whose `weights` key names a pretrained file that only initialises them: the run's own
# state_dict replaces it, so prediction must not need that file (nor spend time reading it).
PRETRAINED_WEIGHTS_TARGETS = (
    "dpt.models.resnet.resnet",
    "dpt.models.classifiers.torchvision_classifier",
)


# --- the model and its transform, without the command line ----------------------------------------


def weights_file(run_dir: Path, last: bool = False) -> tuple[Path, str | None]:
    """The weights to load and, where `model_best.pt` was asked for but is absent, a notice."""
    best, final = run_dir / BEST_MODEL, run_dir / LAST_MODEL
    if not last and best.is_file():
        return best, None
    if not final.is_file():
        raise DptError(
            f"{final} not found: the run has not finished (model.pt is written at its end)"
        )
    if last:
        return final, None
    return final, f"{best} not found: using {final} (the last epoch's weights)"


@dataclass
class Predictor:
    """A run's model (eval mode, on `device`) and validation transform.

    `Predictor.from_run(run_dir)`, then `predict(predictor.load(path))`-style use:
    `load` turns one image file into the model's input, `predict` a batch of inputs into class
    probabilities (on the CPU, float32, rows summing to 1)."""

    model: nn.Module
    transform: Any  # a callable: uint8 (3, H, W) RGB tensor -> the model's input
    classes: list[str]
    device: torch.device
    weights: Path  # the file the model's weights came from
    notice: str | None = None  # why `weights` is not the file asked for
    channels_last: bool = False
    # The run's trainer.precision, as validation ran it (bf16 autocast): the same predictions.
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    @classmethod
    def from_run(
        cls, run_dir: str | os.PathLike[str], last: bool = False, device: str | None = None
    ) -> Predictor:
        run_dir = _run_folder(Path(run_dir))
        data = read_run_data(run_dir)
        transform = build_transform(run_dir, data)
        weights, notice = weights_file(run_dir, last)
        model_cfg = model_config(run_dir)
        model = build_run_model(model_cfg, data)
        load_state(model, weights)
        target = pick_device(device)
        precision = _run_precision(run_dir)
        return cls(
            model=model.to(target).eval(),
            transform=transform,
            classes=data.classes,
            device=target,
            weights=weights,
            notice=notice,
            channels_last=bool(model_cfg.get("channels_last", False)),
            autocast=_autocast(precision, target),
        )

    def load(self, path: str | os.PathLike[str]) -> torch.Tensor:
        """One image file as the model's input; `ImageDecodeError` where it cannot be read."""
        from dpt.data.images import read_image_rgb

        return self.transform(read_image_rgb(path))

    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """Class probabilities `(batch, num_classes)` of a batch of transformed inputs."""
        import torch

        inputs = inputs.to(self.device, non_blocking=True)
        if self.channels_last and inputs.dim() == 4:  # as training fed it (dpt.data.loaders)
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        with torch.no_grad(), self.autocast():
            logits = self.model(inputs).float()
        return torch.softmax(logits, dim=1).cpu()


def _run_folder(run_dir: Path) -> Path:
    if not run_dir.exists():
        raise DptError(f"{run_dir}: no such run folder")
    if not run_dir.is_dir():
        raise DptError(f"{run_dir} is not a folder: give the run folder (it holds data.json)")
    return run_dir


def build_transform(run_dir: Path, data: RunData) -> Any:
    """The run's validation transform, built from its `_target_` node."""
    if data.val_transform is None:
        raise DptError(
            f"{run_dir / DATA_FILE} records no val_transform (the run's data set gave none): "
            "dpt-predict needs a data set with a `val_transform` (see dpt/contract.py)"
        )
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dpt.config import build

    try:
        return build(OmegaConf.create(data.val_transform))
    except (HydraException, OmegaConfBaseException) as error:
        raise DptError(f"cannot build the run's val_transform: {one_line(error)}") from error


def model_config(run_dir: Path) -> Any:
    """The `model` node of the run's composed config (its interpolations still resolvable)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dpt.config import register_configs

    register_configs()  # the `${dpt.cores:N}` resolver, for nodes that refer to others
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise DptError(f"{path} not found: the run's config, which says how to build its model")
    try:
        cfg = OmegaConf.load(path)
        model = cfg.model
    except (OSError, ValueError, OmegaConfBaseException) as error:
        raise DptError(f"{path} is unreadable: {one_line(error)}") from error
    if model.get("_target_") in PRETRAINED_WEIGHTS_TARGETS and model.get("weights"):
        model.weights = None
    return model


def _run_precision(run_dir: Path) -> str:
    from omegaconf import OmegaConf

    return str(OmegaConf.select(OmegaConf.load(run_dir / CONFIG_FILE), "trainer.precision") or "32")


def _autocast(precision: str, device: torch.device) -> Callable[[], Any]:
    """Validation's autocast on this device; fp32 where it has none (16-mixed off CUDA)."""
    from dpt.loop.precision import Precision

    try:
        return Precision(precision, device).autocast
    except DptError:
        return contextlib.nullcontext


def build_run_model(model_cfg: Any, data: RunData) -> nn.Module:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dpt.models import build_model

    try:
        return build_model(model_cfg, tuple(data.input_shape), data.num_classes)
    except (HydraException, OmegaConfBaseException) as error:
        raise DptError(f"cannot build the run's model: {one_line(error)}") from error


def load_state(model: nn.Module, path: Path) -> None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise DptError(f"{path} is not a loadable state_dict: {_first_line(error)}") from error
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as error:
        raise DptError(
            f"{path} does not fit the model of the run's config: {_first_line(error)}"
        ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def pick_device(name: str | None = None) -> torch.device:
    """`name`, or what a run's `trainer.device=auto` takes: CUDA, then MPS, then CPU."""
    import torch

    from dpt.distributed import available_accelerator

    return torch.device(name or available_accelerator())


# --- which files ----------------------------------------------------------------------------------


def image_files(paths: Sequence[str]) -> list[Path]:
    """Files named as given, and the image files under folders (recursively, sorted), once each."""
    found: dict[Path, None] = {}  # ordered, without repeats
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found.update(dict.fromkeys(_images_under(path)))
        elif path.exists():
            found[path] = None  # named by the user: read it whatever its suffix
        else:
            raise DptError(f"{path}: no such file or folder")
    if not found:
        raise DptError(
            f"no image found under {', '.join(paths)} (files whose suffix is an image format's, "
            "as dataset=image_folder reads them: .jpg, .png, .webp, ...)"
        )
    return list(found)


def _images_under(folder: Path) -> list[Path]:
    """The image files a data set would read there (dpt.data.folder_layout), sorted."""
    try:
        return sorted(Path(path) for path in images_under(folder))
    except OSError as error:
        raise DptError(f"cannot read {error.filename}: {error.strerror or error}") from error


# --- predicting -----------------------------------------------------------------------------------


@dataclass
class Prediction:
    path: Path
    probabilities: torch.Tensor  # (num_classes,)


@dataclass
class Tally:
    """What the summary line reports."""

    predicted: int = 0
    unreadable: int = 0
    correct: int = 0
    labelled: bool = True  # every predicted image lies in a folder named after a class


def predictions(
    predictor: Predictor, files: Sequence[Path], tally: Tally, batch_size: int = BATCH_SIZE
) -> Iterator[Prediction]:
    """Each readable file's prediction, in order; a warning on stderr for each unreadable one."""
    # Decoding and resizing run in torch and libjpeg, which release the GIL: threads overlap them.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for start in range(0, len(files), batch_size):
            batch = files[start : start + batch_size]
            loaded = list(pool.map(lambda p: _load_or_warn(predictor, p), batch))
            readable = [(p, x) for p, x in zip(batch, loaded, strict=True) if x is not None]
            tally.unreadable += len(batch) - len(readable)
            yield from _predict_batch(predictor, readable)


def _load_or_warn(predictor: Predictor, path: Path) -> torch.Tensor | None:
    from dpt.data.images import ImageDecodeError

    try:
        return predictor.load(path)
    except ImageDecodeError as error:
        print(f"Warning: skipped {path}: {error.reason}", file=sys.stderr)
        return None


def _predict_batch(
    predictor: Predictor, readable: list[tuple[Path, torch.Tensor]]
) -> Iterator[Prediction]:
    import torch

    if not readable:
        return
    inputs = [x for _, x in readable]
    if all(x.shape == inputs[0].shape for x in inputs):
        probabilities = predictor.predict(torch.stack(inputs))
    else:  # a transform without a fixed output size: one image at a time
        probabilities = torch.cat([predictor.predict(x.unsqueeze(0)) for x in inputs])
    for (path, _), row in zip(readable, probabilities, strict=True):
        yield Prediction(path, row)


def count(prediction: Prediction, classes: list[str], tally: Tally) -> None:
    """Score a prediction against its folder's name, while every folder so far is a class."""
    tally.predicted += 1
    folder = prediction.path.parent.name
    if folder not in classes:
        tally.labelled = False
    elif tally.labelled:
        tally.correct += classes[int(prediction.probabilities.argmax())] == folder


# --- printing -------------------------------------------------------------------------------------


def format_line(
    prediction: Prediction, classes: list[str], top_k: int, path_width: int, class_width: int
) -> str:
    """`data/val/cat/001.jpg  cat 0.912  dog 0.071  bird 0.017`, aligned in columns."""
    values, indices = prediction.probabilities.topk(top_k)
    cells = [
        f"{classes[int(i)]:<{class_width}} {float(p):.3f}"
        for p, i in zip(values, indices, strict=True)
    ]
    return f"{prediction.path!s:<{path_width}}  {'  '.join(cells)}".rstrip()


def summary(tally: Tally) -> str | None:
    skipped = (
        f"{tally.unreadable} unreadable image{'s' if tally.unreadable != 1 else ''} skipped"
        if tally.unreadable
        else ""
    )
    if tally.labelled and tally.predicted:
        accuracy = (
            f"accuracy {tally.correct / tally.predicted:.4f} on {tally.predicted} "
            f"image{'s' if tally.predicted != 1 else ''} (labels from their folder names)"
        )
        return f"{accuracy}; {skipped}" if skipped else accuracy
    return skipped or None


@contextlib.contextmanager
def csv_rows(path: str | None) -> Iterator[Callable[[Prediction, list[str]], None]]:
    """A writer of `path,class,probability` rows (top-1) into `path`; one that writes nothing
    where no file was asked for. Only the file's own errors become "could not write" (not, say,
    a closed stdout)."""
    if path is None:
        yield lambda prediction, classes: None
        return
    with _writing(path):
        f = open(path, "w", newline="")  # noqa: SIM115  (closed below, its errors reported)
        rows = csv.writer(f)
        rows.writerow(["path", "class", "probability"])

    def write(prediction: Prediction, classes: list[str]) -> None:
        p, i = prediction.probabilities.max(dim=0)
        with _writing(path):
            rows.writerow([str(prediction.path), classes[int(i)], f"{float(p):.6f}"])

    try:
        yield write
    finally:
        with _writing(path):
            f.close()


@contextlib.contextmanager
def _writing(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as error:  # e.g. a full disk
        raise DptError(could_not_write(path, error)) from error


# --- the command ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpt-predict",
        description="Predict the classes of images with a finished run's model.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds data.json)")
    parser.add_argument(
        "paths", metavar="PATH", nargs="+", help="image files, or folders searched recursively"
    )
    parser.add_argument("--csv", metavar="OUT", help="also write path,class,probability (top-1)")
    parser.add_argument(
        "--top-k", type=int, default=3, metavar="K", help="classes printed per image (default 3)"
    )
    parser.add_argument(
        "--last", action="store_true", help="use model.pt (the last epoch), not model_best.pt"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    if args.top_k < 1:
        raise DptError(f"--top-k {args.top_k}: must be 1 or more")
    _run_folder(Path(args.run_dir))  # the cheap checks first: loading the model takes seconds
    files = image_files(args.paths)
    predictor = Predictor.from_run(args.run_dir, last=args.last)
    if predictor.notice:
        print(f"Note: {predictor.notice}", file=sys.stderr)
    classes = predictor.classes
    top_k = min(args.top_k, len(classes))
    path_width = max(len(str(p)) for p in files)
    class_width = max((len(c) for c in classes), default=0)
    tally = Tally()
    with csv_rows(args.csv) as write_row:
        for prediction in predictions(predictor, files, tally):
            count(prediction, classes, tally)
            print(format_line(prediction, classes, top_k, path_width, class_width))
            write_row(prediction, classes)
    line = summary(tally)
    if line:
        print(line)
    if not tally.predicted:
        raise DptError(
            f"could not read any image ({tally.unreadable} unreadable, see the warnings above)"
        )


def main(argv: Sequence[str] | None = None) -> None:
    """`dpt-predict`: errors as one line on stderr (exit 1), never a traceback."""
    args = parse_args(argv)
    user_code.add_start_folder()  # a run's own model or transform imports as under `dpt`
    try:
        run(args)
    except DptError as error:
        print(f"Error: {one_line(error)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `dpt-predict ... | head`: the reader has what it wanted
        _silence_stdout()
        sys.exit(1)


def _silence_stdout() -> None:
    # Python flushes stdout at exit, which would raise again into the closed pipe.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    main()
