"""`dataset=records`: labeled texts (a CSV, JSON lines or Parquet file, or a folder of `train.*`,
`val.*` and `test.*`; dpt/data/row_files.py) as token ids for an encoder's own tasks: the first
thing a BERT user trains.

- `dataset.text` names the column of texts, `dataset.label` the column of targets. What the
  labels are decides the targets: integers or words, one class each (task=classification, or
  task=binary for two), in sorted order (`classes` names them); lists of words or integers, a
  K-hot row over all of them (task=multilabel); numbers with a fraction, the value itself
  (task=regression).
- Each text is tokenized by `dataset.tokenizer` (the model folder's by default, with its special
  tokens: BERT's [CLS] ... [SEP]), cut to `dataset.max_length` tokens and padded with the
  tokenizer's pad id; a transformers classifier leaves the padding out of its attention
  (dpt/models/hf.py).
- The classes come from the training rows; a validation or test label that training never saw
  is refused in one line (its row named).
"""

from __future__ import annotations

import functools
import logging
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from dpt.data.row_files import Rows, missing_split_file, read_rows, test_rows
from dpt.data.tokenizer import Tokenizer, load_tokenizer
from dpt.errors import DptError
from dpt.loggers import ONCE_LOGGER_NAME

once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it


class RecordsData:
    """What dpt.contract.DataModule asks, for texts with labels."""

    def __init__(
        self,
        root: str,
        text: str,
        label: str,
        tokenizer: str | None,
        max_length: int,
        val_fraction: float,
        num_workers: int,
        seed: int,
    ) -> None:
        self.root, self.text_column, self.label_column = Path(root), text, label
        self.tokenizer = load_tokenizer(tokenizer)
        self.max_length, self.num_workers = max_length, num_workers
        train_rows, val_rows = read_rows(self.root, val_fraction)
        if not train_rows:
            raise DptError(f"dataset.root={root}: no training rows")
        self.labels = Labels.of(train_rows, label)
        self.classes = self.labels.names
        self.num_classes = max(len(self.classes), 2)
        self.train = self._records(train_rows)
        self.val = self._records(val_rows) if val_rows else None
        self.input_shape: tuple[int, ...] = (max_length,)
        self.input_dtype = torch.long  # token ids
        once.info(f"records: {len(train_rows):,} training and {len(val_rows):,} validation rows "
                  f"({self.labels.describe()}), texts as {max_length} tokens")  # fmt: skip

    def _records(self, rows: Rows) -> Records:
        return Records(rows, (self.text_column, self.label_column), self.labels, self.tokenizer,
                       self.max_length)  # fmt: skip

    @functools.cached_property
    def test(self) -> Records | None:
        """A folder's `test.<ext>` rows; None where it has none (or root is a file)."""
        rows = test_rows(self.root)
        return None if rows is None else self._records(rows)

    def missing_split(self, split: str) -> str:
        return missing_split_file(self.root, split, "records")


class Labels:
    """How a label column's values become targets: class indices, K-hot rows or values."""

    def __init__(self, kind: str, names: list[str]) -> None:
        self.kind, self.names = kind, names  # kind: classes, multilabel or values
        self._index = {name: i for i, name in enumerate(names)}

    @classmethod
    def of(cls, rows: Rows, column: str) -> Labels:
        values = [_value(where, row, column) for where, row in rows]
        if all(isinstance(v, list) for v in values):
            return cls("multilabel", sorted({str(x) for v in values for x in v}))
        if all(isinstance(v, Real) and not isinstance(v, bool | Integral) for v in values):
            return cls("values", [column])
        if any(isinstance(v, list) for v in values):
            raise DptError(f"dataset.label={column}: some rows hold lists of labels, others "
                           "one; give every row a list (task=multilabel) or one label")  # fmt: skip
        return cls("classes", sorted({str(v) for v in values}, key=_label_order))

    def describe(self) -> str:
        if self.kind == "values":
            return "one value each"
        what = "labels" if self.kind == "multilabel" else "classes"
        return f"{len(self.names)} {what}: {', '.join(self.names[:8])}" + (
            ", ..." if len(self.names) > 8 else ""
        )

    def target(self, where: str, value: Any) -> Any:
        if self.kind == "values":
            return torch.tensor([float(value)])
        if self.kind == "multilabel":
            row = torch.zeros(len(self.names))
            for name in value:
                row[self._position(where, name)] = 1.0
            return row
        return self._position(where, value)

    def _position(self, where: str, name: Any) -> int:
        found = self._index.get(str(name))
        if found is None:
            raise DptError(f"{where}: label {name!r} is not among the training rows' "
                           f"({', '.join(self.names[:8])})")  # fmt: skip
        return found


def _value(where: str, row: dict[str, Any], column: str) -> Any:
    if column not in row:
        raise DptError(f"{where}: no column {column!r} (dataset.label or dataset.text; the row "
                       f"has {', '.join(map(str, row))})")  # fmt: skip
    value = row[column]
    if value is None:
        raise DptError(f"{where}: {column} is empty")
    return value


def _label_order(name: str) -> tuple[bool, float, str]:
    """Numbers in their order (2 before 10), then words."""
    try:
        return False, float(name), name
    except ValueError:
        return True, 0.0, name


def token_ids(tokenizer: Tokenizer, texts: list[Any], max_length: int) -> torch.Tensor:
    """Each text as `max_length` token ids (cut, then padded with the tokenizer's pad id), as
    training reads it (dpt-predict too)."""
    ids = torch.full((len(texts), max_length), tokenizer.pad_id(), dtype=torch.long)
    for i, text in enumerate(texts):
        tokens = tokenizer.encode(str(text))[:max_length]
        ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return ids


class Records(Dataset):
    """Each row's text as `max_length` token ids (cut, then padded), and its target."""

    def __init__(
        self,
        rows: Rows,
        columns: tuple[str, str],
        labels: Labels,
        tokenizer: Tokenizer,
        max_length: int,
    ) -> None:
        """`columns`: the texts' and the labels'."""
        text, label = columns
        self.ids = token_ids(tokenizer, [_value(where, row, text) for where, row in rows],
                             max_length)  # fmt: skip
        self.targets = [labels.target(where, _value(where, row, label)) for where, row in rows]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        return self.ids[index], self.targets[index]
