"""`dataset`: dpt's own data sets (dpt/data), and what a config says of their targets before any
is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from dpt.config.checks import Check, at_least, between, checked, one_of
from dpt.targets import Targets

LABEL_POLICIES = ("first", "largest", "all")  # dataset=coco: which annotation(s) label an image
BAD_IMAGE_POLICIES = ("skip", "error")  # on_bad_image of the image data sets
_EXTENSIONS = Check(lambda exts: bool(exts) and all(str(e).startswith(".") and len(str(e)) > 1
                                                    for e in exts),
                    "each a file name's ending with its dot, e.g. [.txt,.md]")  # fmt: skip


@dataclass
class SyntheticConfig:
    _target_: str = "dpt.data.synthetic.SyntheticData"
    num_samples: int = at_least(1)
    num_val_samples: int = at_least(0)
    input_dim: int = at_least(1)
    num_classes: int = at_least(2)
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


@dataclass
class CocoConfig:
    _target_: str = "dpt.data.coco.CocoData"
    root: str = MISSING
    train_split: str = MISSING
    val_split: str | None = MISSING
    label_policy: str = one_of(LABEL_POLICIES)
    image_size: int = at_least(16)
    # `${dpt.cores:4}` in the YAML: 4, or fewer on a machine with fewer cores (see `cores_at_most`)
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING
    on_bad_image: str = one_of(BAD_IMAGE_POLICIES)
    train_ann_file: str | None = MISSING
    train_image_dir: str | None = MISSING
    val_ann_file: str | None = MISSING
    val_image_dir: str | None = MISSING


@dataclass
class ImageFolderConfig:
    _target_: str = "dpt.data.image_folder.ImageFolderData"
    # <root>/train/<class>/<images>; <root>/val/... and <root>/test/... (dpt-evaluate's) if any
    root: str = MISSING
    val_fraction: float = MISSING  # without <root>/val: this share of train, seeded; 0 = none
    image_size: int = at_least(16)
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING
    on_bad_image: str = one_of(BAD_IMAGE_POLICIES)


@dataclass
class ShardsConfig:
    _target_: str = "dpt.data.shards.ShardsData"
    # a folder, an http(s):// URL or an fsspec URL (s3://...) of dpt-shards' output
    root: str = MISSING
    image_size: int = at_least(16)
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING
    on_bad_image: str = one_of(BAD_IMAGE_POLICIES)
    shuffle_window: int = at_least(1)  # samples shuffled together, after the shards' seeded order
    cache_dir: str | None = MISSING  # null: $XDG_CACHE_HOME/dpt/shards (~/.cache/dpt/shards)
    cache_limit_gb: float = at_least(1e-6)
    retries: int = at_least(0)  # tries after the first for a transfer that comes damaged
    # seconds a source that does not answer (refused, timed out, 5xx) is retried before the
    # run stops with a checkpoint (the same command resumes)
    outage_s: float = at_least(0)
    # share of an epoch's samples that damaged shards may take before the run stops
    max_skipped_fraction: float = at_least(0)
    timeout_s: float = at_least(1e-3)


@dataclass
class FakeImagesConfig:
    _target_: str = "dpt.data.fake_images.FakeImages"
    num_samples: int = at_least(1)
    num_val_samples: int = at_least(0)
    image_size: int = at_least(16)
    num_classes: int = at_least(2)
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


@dataclass
class TextConfig:
    """Text files as windows of token ids (dpt/data/text.py), for task=language_model."""

    _target_: str = "dpt.data.text.TextData"
    # a text file, or a folder of them (val.txt or val/ for validation, test.txt or test/ for
    # dpt-evaluate)
    root: str = MISSING
    extensions: list[str] = checked(_EXTENSIONS)  # a folder's files that are read, by extension
    tokenizer: str | None = MISSING  # bytes (or null): UTF-8 bytes; or a tokenizers JSON file
    block_size: int = MISSING  # tokens a sample trains on (windows of block_size + 1)
    # without val.txt or val/: this share of the tokens, the last
    val_fraction: float = between(0, 1)
    cache_dir: str | None = MISSING  # null: $XDG_CACHE_HOME/dpt/tokens (~/.cache/dpt/tokens)
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


@dataclass
class ChatTemplateConfig:
    """Rows of `prompt` and `response` as text: each put in its part ({prompt}, {response})."""

    prompt: str = MISSING  # e.g. "### Question:\n{prompt}\n### Answer:\n"
    response: str = MISSING  # e.g. "{response}\n": what follows the answer is learned too


@dataclass
class ChatConfig:
    """Chat or instruction rows as windows of token ids, the loss on the answers
    (dpt/data/chat.py), for task=language_model."""

    _target_: str = "dpt.data.chat.ChatData"
    # a .jsonl, .json, .parquet or .csv file, or a folder of train.* and val.* (and test.*,
    # dpt-evaluate's)
    root: str = MISSING
    tokenizer: str | None = MISSING  # bytes (or null), a tokenizers JSON file, or a model folder
    block_size: int = MISSING  # positions a window trains on
    packing: bool = MISSING  # several examples a window (attention kept within each)
    template: ChatTemplateConfig | None = MISSING  # null: rows of `messages` (chat template)
    chat_template: str | None = MISSING  # null: the model folder's, else ChatML
    val_fraction: float = between(0, 1)  # a file alone: this share of its rows, the last
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


@dataclass
class CustomDatasetConfig:
    """Plain `torch.utils.data.Dataset` classes of yours (dpt/data/custom.py): each item an
    (input, target) pair; the input shape is read from the first training sample."""

    _target_: str = "dpt.data.custom.CustomData"
    _recursive_: bool = False  # the nodes below are built by CustomData, each with its own keys
    train: Any = MISSING  # `_target_`: your Dataset class (or function), and its keys
    val: Any = MISSING  # the same for validation, or null: no validation
    test: Any = MISSING  # the same for a test split (built by dpt-evaluate alone), or null: none
    # task=classification: how many classes (labels 0 .. N-1); other tasks read the targets.
    num_classes: int | None = at_least(2)
    classes: list[str] | None = MISSING  # names of the classes or outputs in order; null: 0, 1..
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


@dataclass
class RecordsConfig:
    """Labeled texts as token ids for an encoder's tasks (dpt/data/records.py)."""

    _target_: str = "dpt.data.records.RecordsData"
    # a .csv, .jsonl, .json or .parquet file, or a folder of train.* and val.* (and test.*,
    # dpt-evaluate's)
    root: str = MISSING
    text: str = MISSING  # the column of texts
    # the column of targets: a class (an integer or a word), a list of them (multilabel), or a
    # number with a fraction (regression)
    label: str = MISSING
    tokenizer: str | None = MISSING  # bytes (or null), a tokenizers JSON file, or a model folder
    max_length: int = at_least(2)  # tokens a text is cut or padded to
    val_fraction: float = between(0, 1)  # a file alone: this share of its rows, the last
    num_workers: int = at_least(0)
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


DATASETS: dict[str, type] = {
    "synthetic": SyntheticConfig,
    "coco": CocoConfig,
    "fake_images": FakeImagesConfig,
    "image_folder": ImageFolderConfig,
    "shards": ShardsConfig,
    "custom": CustomDatasetConfig,
    "text": TextConfig,
    "chat": ChatConfig,
    "records": RecordsConfig,
}


def declared_targets(dataset: DictConfig) -> Targets | None:
    """What the samples' targets are, as a config of dpt's own data sets says (None: a data set
    of yours, known only once built; shards, whose index says: images or tokens)."""
    schema = OmegaConf.get_type(dataset)
    if schema is CocoConfig and dataset.label_policy == "all":
        return Targets(integer=False, shape=(-1,))  # K-hot over the categories
    if schema in (SyntheticConfig, FakeImagesConfig):
        return Targets.labels(dataset.num_classes)
    if schema in (CocoConfig, ImageFolderConfig):
        return Targets.labels()
    if schema in (TextConfig, ChatConfig):
        return Targets(integer=True, shape=(dataset.block_size,))  # token ids, one token later
    return None


def no_validation(dataset: DictConfig) -> str | None:
    """The setting that leaves this dataset without a validation split, or None."""
    if dataset.get("num_val_samples", 1) == 0:
        return "dataset.num_val_samples=0"
    if dataset.get("val_fraction", None) == 0 and not (Path(dataset.root) / "val").is_dir():
        return "dataset.val_fraction=0 (with no <root>/val folder)"
    if "val_split" in dataset and dataset.val_split is None:
        return "dataset.val_split=null"
    if OmegaConf.get_type(dataset) is CustomDatasetConfig and dataset.val is None:
        return "dataset.val=null"
    return None
