"""What a run leaves for using its model without dpt's source: `<run>/data.json`.

It holds the task's kind and the names of the model's outputs (the class names in label order,
or the target columns', labels' or values' names), one input's shape, one target's shape and
the validation transform (a `_target_` node, and its text for people), written by rank 0 before
the first step. With `.hydra/config.yaml` (the model's and the task's config) and `model.pt` /
`model_best.pt` it is all that `dpt-predict` reads. A run of before tasks wrote no `task`: it
was classification.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpt.config.tasks import CLASSIFICATION
from dpt.errors import DptError

DATA_FILE = "data.json"
LAST_MODEL = "model.pt"
BEST_MODEL = "model_best.pt"
METRICS_FILE = "metrics.json"  # the run's results, written at its end
HF_CONFIG_FILE = "hf_config.json"  # a transformers model's config (model=hf), kept to rebuild it
# How dataset=chat made text of its rows (chat template, special tokens, or prompt template):
# dpt-generate renders a prompt as training did.
CHAT_FORMAT_FILE = "chat_format.json"


@dataclass
class RunData:
    classes: list[str]  # the names of the model's outputs: classes, columns, labels, values
    input_shape: list[int]
    val_transform: dict[str, Any] | None  # a `_target_` node; None: the data set gave none
    val_transform_text: str | None  # repr() of the built transform
    task: str = CLASSIFICATION  # the task's kind (dpt.config.tasks)
    target_shape: list[int] = field(default_factory=list)  # one target's; [] for a label
    # The model's outputs per sample (a language model's vocabulary, whose tokens `classes`
    # does not list); None: len(classes), as runs before language models wrote it.
    num_outputs: int | None = None
    # A language model's tokenizer: {"kind": "bytes" | "tokenizers", "vocab_size", "file"}
    # (the file beside data.json in the run folder).
    tokenizer: dict[str, Any] | None = None

    @property
    def num_classes(self) -> int:
        """The model's outputs per sample (one per class for classification)."""
        return self.num_outputs if self.num_outputs is not None else len(self.classes)


def write_run_data(run_dir: Path, data: RunData, files: dict[str, bytes] | None = None) -> None:
    """data.json, and the `files` a run keeps beside it (a language model's tokenizers file:
    dpt-generate decodes with it, wherever the run folder goes)."""
    from dpt.state.checkpoint import write_atomically  # torch: only where a rank writes

    for name, content in (files or {}).items():
        write_atomically(run_dir / name, lambda f, c=content: f.write(c), name)
    text = (json.dumps(asdict(data), indent=2) + "\n").encode()
    write_atomically(run_dir / DATA_FILE, lambda f: f.write(text), "data")


def read_run_data(run_dir: Path) -> RunData:
    path = run_dir / DATA_FILE
    try:
        raw = json.loads(path.read_text())
        return RunData(
            classes=[str(c) for c in raw["classes"]],
            input_shape=[int(n) for n in raw["input_shape"]],
            val_transform=raw.get("val_transform"),
            val_transform_text=raw.get("val_transform_text"),
            task=str(raw.get("task", CLASSIFICATION)),
            target_shape=[int(n) for n in raw.get("target_shape", [])],
            num_outputs=raw.get("num_outputs"),
            tokenizer=raw.get("tokenizer"),
        )
    except FileNotFoundError:
        raise DptError(
            f"{path} not found: not a run folder of this dpt version (or the run never started)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DptError(f"{path} is unreadable: {error}") from error
