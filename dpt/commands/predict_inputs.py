"""Which files `dpt-predict` reads, and the model's inputs that tensor files hold.

Image files, and folders searched recursively for them (as dataset=image_folder reads them);
tensor files (`.pt`, `.npy`, `.csv`) hold the model's inputs themselves, one sample per row; a
run of texts (dataset=records) reads text files (`.txt`, a text a line; a table file's text
column), tokenized as it trained. The module docstring of dpt/commands/predict.py says what each
holds and how a row is named.

torch and numpy are imported inside the readers: `dpt-predict --help` answers before either
loads.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpt.data.folder_layout import images_under
from dpt.data.row_files import BUILDERS
from dpt.errors import DptError, first_line, torch_load_reason

if TYPE_CHECKING:
    import torch

    from dpt.data.tokenizer import Tokenizer

# Files that hold the model's inputs themselves, one sample per row (not images to transform).
TENSOR_SUFFIXES = (".pt", ".npy", ".csv")
# Files of texts, for a run whose inputs are a tokenizer's ids: a text a line, or table files.
TEXT_SUFFIXES = (".txt", *BUILDERS)


def is_tensor_file(path: Path) -> bool:
    """A file of the model's inputs themselves (`.pt`, `.npy`, `.csv`), not an image."""
    return path.suffix.lower() in TENSOR_SUFFIXES


def input_files(
    paths: Sequence[str], images: bool = True, suffixes: Sequence[str] = TENSOR_SUFFIXES
) -> list[Path]:
    """Files named as given, and under folders (recursively, sorted) the image files (`images`)
    or the files of `suffixes` (a run without val transform: tensor files, or texts), once
    each."""
    found: dict[Path, None] = {}  # ordered, without repeats
    for name in paths:
        path = Path(name)
        if path.is_dir():
            under = _images_under(path) if images else _files_under(path, suffixes)
            found.update(dict.fromkeys(under))
        elif path.exists():
            found[path] = None  # named by the user: read it whatever its suffix
        else:
            raise DptError(f"{path}: no such file or folder")
    if not found and images:
        raise DptError(
            f"no image found under {', '.join(paths)} (files whose suffix is an image format's, "
            "as dataset=image_folder reads them: .jpg, .png, .webp, ...)"
        )
    if not found:
        why = "the run takes texts" if suffixes == TEXT_SUFFIXES else \
            "the run's data set gave no val_transform"  # fmt: skip
        what = "texts" if suffixes == TEXT_SUFFIXES else "the model's inputs"
        raise DptError(f"no input file found under {', '.join(paths)} ({why}: "
                       f"{', '.join(suffixes)} files of {what})")  # fmt: skip
    return list(found)


def _images_under(folder: Path) -> list[Path]:
    """The image files a data set would read there (dpt.data.folder_layout), sorted."""
    try:
        return sorted(Path(path) for path in images_under(folder))
    except OSError as error:
        raise DptError(f"cannot read {error.filename}: {error.strerror or error}") from error


def _files_under(folder: Path, suffixes: Sequence[str]) -> list[Path]:
    try:
        return sorted(p for p in folder.rglob("*")
                      if p.is_file() and p.suffix.lower() in suffixes)  # fmt: skip
    except OSError as error:
        raise DptError(f"cannot read {error.filename}: {error.strerror or error}") from error


# --- texts ----------------------------------------------------------------------------------------


def read_texts(path: Path, tokenizer: Tokenizer, column: str, length: int) -> torch.Tensor:
    """A file's texts as the run's model takes them, `(N, length)` token ids (cut and padded
    as training did): a `.txt` file's lines (an empty one skipped), or a table file's `column`
    (the run's dataset.text)."""
    from dpt.data.records import token_ids
    from dpt.data.row_files import rows_of

    suffix = path.suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise DptError(f"{path}: the run's model takes texts: {', '.join(TEXT_SUFFIXES)} files "
                       "(a text a line, or a table file's text column)")  # fmt: skip
    if suffix == ".txt":
        try:
            texts = [line for line in path.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise DptError(f"{path} is unreadable: {first_line(error)}") from error
        return token_ids(tokenizer, texts, length)
    rows = rows_of(path, named=str(path))
    for where, row in rows:
        if column not in row:
            raise DptError(f"{where}: no column {column!r} (the run's dataset.text; the row has "
                           f"{', '.join(map(str, row))})")  # fmt: skip
    return token_ids(tokenizer, [row[column] for _, row in rows], length)


# --- tensor files ---------------------------------------------------------------------------------


def read_inputs(path: Path, input_shape: Sequence[int]) -> torch.Tensor:
    """The inputs a tensor file holds, `(N, *input_shape)`; one line where it cannot be read or
    its shape is not the model's input's."""
    import torch

    suffix = path.suffix.lower()
    if suffix == ".csv":
        inputs = _read_csv(path, input_shape)
    elif suffix == ".npy":
        inputs = _read_npy(path)
    else:
        try:
            inputs = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
            message = f"{path} is not a tensor file torch.load reads: {torch_load_reason(error)}"
            raise DptError(message) from error
        if not isinstance(inputs, torch.Tensor):
            raise DptError(
                f"{path} holds a {type(inputs).__name__}, not a tensor of inputs "
                f"{_shape_text(('N', *input_shape))}"
            )
    if inputs.dim() != len(input_shape) + 1 or tuple(inputs.shape[1:]) != tuple(input_shape):
        raise DptError(
            f"{path}: inputs of shape {_shape_text(inputs.shape)}, the run's model takes "
            f"{_shape_text(('N', *input_shape))}"
        )
    return inputs


def _read_npy(path: Path) -> torch.Tensor:
    import torch

    try:
        import numpy

        array = numpy.load(path, allow_pickle=False)
        return torch.from_numpy(numpy.ascontiguousarray(array))
    except ImportError as error:
        raise DptError(f"{path}: reading .npy files needs numpy (pip install numpy)") from error
    except (OSError, ValueError, TypeError, EOFError) as error:
        raise DptError(f"{path} is not a .npy file numpy reads: {first_line(error)}") from error


def _read_csv(path: Path, input_shape: Sequence[int]) -> torch.Tensor:
    """Rows of numbers, one sample each; a first line that is not numbers is a header."""
    import torch

    if len(input_shape) != 1:
        raise DptError(
            f"{path}: a .csv file holds one sample per row, for a model whose input is a vector; "
            f"the run's model takes {_shape_text(('N', *input_shape))}: give a .pt or .npy file"
        )
    rows: list[list[float]] = []
    width, first = 0, 0  # the first row's length, and its line
    try:
        with open(path, newline="") as f:
            for line, cells in enumerate(csv.reader(f), start=1):
                if not any(cell.strip() for cell in cells):
                    continue  # an empty line
                try:
                    row = [float(cell) for cell in cells]
                except ValueError:
                    if not rows and not first:
                        first = -1  # the header: only the first line may be one
                        continue
                    text = ",".join(cells)[:60]
                    raise DptError(f"{path}: line {line} is not numbers: {text}") from None
                if not rows:
                    width, first = len(row), line
                elif len(row) != width:
                    raise DptError(
                        f"{path}: line {line} has {len(row)} numbers, line {first} {width}: "
                        "one sample per row, all of one length"
                    )
                rows.append(row)
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise DptError(f"{path} is unreadable: {first_line(error)}") from error
    if not rows:
        return torch.empty((0, *input_shape), dtype=torch.float64)
    return torch.tensor(rows, dtype=torch.float64)


def _shape_text(shape: Sequence[Any]) -> str:
    """`(5, 7)`, `(N, 10)`, `(3,)`."""
    return f"({', '.join(str(n) for n in shape)}{',' if len(shape) == 1 else ''})"
