"""The `dpt-predict` command: a finished run's model on image files, texts, or tensor files of
inputs.

`dpt-predict RUN_DIR PATH... [--csv OUT] [--top-k K] [--last]` rebuilds the model and the run's
task from the run folder (`.hydra/config.yaml`, `data.json`: see dpt/state/results.py), loads
`model_best.pt` (or `model.pt`) and prints, for each input, what the task predicts of the
model's outputs (`Task.predict`, after a forward under the run's autocast).

Inputs:
- image files, and folders searched recursively for them, through the run's validation
  transform (`data.json`'s `val_transform`);
- tensor files that already hold the model's inputs, one sample per row: `.pt` (a tensor
  `(N, *input_shape)` saved with `torch.save`, read with `weights_only=True`), `.npy` (a numpy
  array, the same) and `.csv` (rows of numbers, one sample per row, for models whose input is a
  vector; a first line that is not numbers is a header, skipped). A row is named `FILE:ROW` (ROW
  from 0). Float inputs are cast to the model's float type. A run whose data set gave no
  `val_transform` (`dataset=custom`) takes only these (its folders are searched for them); any
  run takes them where their shape is the model's input's;
- a run of texts (`dataset=records`: its inputs its tokenizer's ids) takes texts: `.txt` files
  (a text a line, empty lines skipped) and table files (`.csv`, `.jsonl`, `.json`, `.parquet`:
  the run's `dataset.text` column), each text tokenized, cut and padded as training read it
  (the run's copy of its tokenizer). A text is named `FILE:ROW` (ROW from 0).

What each task prints (one line per input, the path first) and writes with `--csv OUT`; the
output names are `data.json`'s `classes` ("0", "1", ... where the data set named none):
- classification: the top `--top-k` classes with their probabilities (`cat 0.912  dog 0.071`);
  CSV `path,class,probability` (the top class, probability with 6 decimals). Images in folders
  named after the run's classes (`root/val/<class>/...`) are also scored: the last line is the
  accuracy.
- binary: one column: the probability and the prediction at `task.threshold` (`0.734  1`);
  several: `<name> <probability>` per column. CSV `path`, one column per output name holding
  the probability (6 decimals; `probability` for a lone unnamed output), then `predicted`: 0/1
  for one column, for several the names above the threshold joined with `;`.
- multilabel: the labels above `task.threshold`, highest probability first, with their
  probabilities (`-` where none); CSV `path,labels,probabilities`, both joined with `;` in that
  order (probabilities with 6 decimals; empty where no label is predicted).
- regression: the values (6 significant digits); CSV `path`, then one column per output name
  (`value` for a lone unnamed output) holding each value exactly (Python's `repr` of the float).
- custom: like regression, whatever `task.predict` (values, sigmoid or softmax) gave; a task
  class of your own: what its `predict` gives.
`--top-k` is classification's only (the other tasks ignore it). "Above the threshold" is
strictly above, as validation's accuracy and F1 count it (torchmetrics: `preds > threshold`).

A run folder of before tasks (no `task` in data.json nor in its config) is classification.

torch is imported only after the arguments are parsed: `--help` and bad arguments answer fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from dpt import user_code
from dpt.commands.command import run_command
from dpt.commands.predict_inputs import (
    TEXT_SUFFIXES,
    input_files,
    is_tensor_file,
    read_inputs,
    read_texts,
)
from dpt.commands.predict_rows import (
    Prediction,
    Tally,
    count,
    csv_rows,
    format_line,
    layout,
    summary,
)
from dpt.commands.run_model import (
    Predictor,
    no_transform_message,
    run_config,
    run_folder,
    run_tokenizer,
)
from dpt.config.tasks import CLASSIFICATION, LANGUAGE_MODEL
from dpt.errors import DptError
from dpt.state.results import RunData, read_run_data

if TYPE_CHECKING:
    import torch

# The command's API is `main` and `Predictor` (dpt.commands.run_model's, imported from here).

BATCH_SIZE = 64


# --- predicting -----------------------------------------------------------------------------------


def predictions(
    predictor: Predictor,
    files: Sequence[Path],
    tally: Tally,
    batch_size: int = BATCH_SIZE,
    tensors: dict[Path, torch.Tensor] | None = None,
) -> Iterator[Prediction]:
    """Each readable input's prediction, in order; a warning on stderr for each unreadable
    image. `tensors`: the inputs of the tensor files among `files` (`read_inputs`)."""
    tensors = tensors or {}
    # Decoding and resizing run in torch and libjpeg, which release the GIL: threads overlap them.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        start = 0
        while start < len(files):
            if files[start] in tensors:
                yield from _predict_rows(predictor, files[start], tensors[files[start]], batch_size)
                start += 1
                continue
            batch = []  # the images up to the next tensor file
            while start < len(files) and files[start] not in tensors and len(batch) < batch_size:
                batch.append(files[start])
                start += 1
            loaded = list(pool.map(lambda p: _load_or_warn(predictor, p), batch))
            readable = [(p, x) for p, x in zip(batch, loaded, strict=True) if x is not None]
            tally.unreadable += len(batch) - len(readable)
            yield from _predict_batch(predictor, readable)


def _predict_rows(
    predictor: Predictor, path: Path, inputs: torch.Tensor, batch_size: int
) -> Iterator[Prediction]:
    for start in range(0, len(inputs), batch_size):
        rows = predictor.predict(inputs[start : start + batch_size])
        for row, values in enumerate(rows, start=start):
            yield Prediction(path, values, row)


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


# --- the command ----------------------------------------------------------------------------------


# What --help says each task prints and writes (the module docstring says it in full).
EPILOG = """\
per task (the run's; output names from its data.json):
  classification  the top-k classes; CSV path,class,probability (the top class)
  binary          the probability of each column (one column: and its 0/1 at task.threshold);
                  CSV path,<one column per output>,predicted
  multilabel      the labels above task.threshold, highest first (- where none);
                  CSV path,labels,probabilities (each joined with ;)
  regression      the values; CSV path,<one column per output> (value for a lone one)
  custom          what task.predict gives (values, sigmoid, softmax), as regression
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpt-predict",
        description=(
            "Predict with a finished run's model, as its task says (classes, yes/no columns, "
            "labels, values): on images, texts (a run of dataset=records), or tensor files of "
            "the model's inputs."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds data.json)")
    parser.add_argument(
        "paths",
        metavar="PATH",
        nargs="+",
        help="image files, or folders searched recursively; or .pt, .npy, .csv files of the "
        "model's inputs (N, *input_shape), one prediction per row (FILE:ROW); a run whose data "
        "set gave no val_transform takes only these (and searches folders for them); a run of "
        "texts takes .txt files (a text a line) and .csv, .jsonl, .json, .parquet files (its "
        "dataset.text column)",
    )
    parser.add_argument(
        "--csv",
        metavar="OUT",
        help="also write a CSV: path,class,probability (top-1) for classification; the other "
        "tasks' columns below",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=3,
        metavar="K",
        help="classes printed per input (default 3); task=classification only, other tasks "
        "ignore it",
    )
    parser.add_argument(
        "--last", action="store_true", help="use model.pt (the last epoch), not model_best.pt"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    if args.top_k < 1:
        raise DptError(f"--top-k {args.top_k}: must be 1 or more")
    run_dir = run_folder(Path(args.run_dir))  # the cheap checks first: the model takes seconds
    data = read_run_data(run_dir)
    if _takes_texts(data):
        tensors = _texts(args.paths, run_dir, data)
        files = list(tensors)
    else:
        files, tensors = _inputs(args.paths, run_dir, data)
    predictor = Predictor.from_run(run_dir, last=args.last)
    if predictor.notice:
        print(f"Note: {predictor.notice}", file=sys.stderr)
    classes = predictor.classes
    shape = layout(predictor, min(args.top_k, len(classes)))
    names = [
        f"{f}:{len(tensors[f]) - 1}" if f in tensors else str(f)
        for f in files
        if f not in tensors or len(tensors[f])
    ]
    path_width = max((len(name) for name in names), default=0)
    tally = Tally()
    with csv_rows(args.csv, shape) as write_row:
        for prediction in predictions(predictor, files, tally, tensors=tensors):
            if predictor.kind == CLASSIFICATION:
                count(prediction, classes, tally)
            else:
                tally.predicted += 1
                tally.labelled = False
            print(format_line(prediction, shape, path_width))
            write_row(prediction)
    line = summary(tally)
    if line:
        print(line)
    if not tally.predicted and tally.unreadable:
        raise DptError(
            f"could not read any image ({tally.unreadable} unreadable, see the warnings above)"
        )
    if not tally.predicted:
        raise DptError(f"no input to predict: {', '.join(str(f) for f in files)} hold no rows")


def _takes_texts(data: RunData) -> bool:
    """A run whose inputs are its tokenizer's ids of texts (dataset=records), not a language
    model's (dpt-generate's)."""
    return data.tokenizer is not None and data.task != LANGUAGE_MODEL


def _texts(paths: Sequence[str], run_dir: Path, data: RunData) -> dict[Path, torch.Tensor]:
    """The texts of each file (and of the text files under each folder) as the run's ids."""
    files = input_files(paths, images=False, suffixes=TEXT_SUFFIXES)
    column = run_config(run_dir).dataset.get("text", "text")
    tokenizer = run_tokenizer(run_dir, data)
    return {f: read_texts(f, tokenizer, column, data.input_shape[0]) for f in files}


def _inputs(
    paths: Sequence[str], run_dir: Path, data: RunData
) -> tuple[list[Path], dict[Path, torch.Tensor]]:
    """The files to predict, and the tensor files' inputs among them (images are read as they
    are predicted)."""
    files = input_files(paths, images=data.val_transform is not None)
    if data.val_transform is None and not all(is_tensor_file(f) for f in files):
        raise DptError(no_transform_message(run_dir))
    return files, {f: read_inputs(f, data.input_shape) for f in files if is_tensor_file(f)}


def main(argv: Sequence[str] | None = None) -> None:
    """`dpt-predict`: errors as one line on stderr (exit 1), never a traceback."""
    args = parse_args(argv)
    user_code.add_start_folder()  # a run's own model or transform imports as under `dpt`
    run_command(lambda: run(args))


if __name__ == "__main__":
    main()
