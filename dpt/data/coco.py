"""COCO detection annotations turned into image classification: one label per image, or each
image's set of categories as a K-hot row (multilabel)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from pycocotools.coco import COCO

from dpt.config.datasets import LABEL_POLICIES
from dpt.data.crop_decode import RandomResizedCropDecode

# BAD_IMAGE_POLICIES and UnreadableImageError were defined here before the image folder data
# set shared them: re-exported (`X as X`) for code that imports them from here.
from dpt.data.images import BAD_IMAGE_POLICIES as BAD_IMAGE_POLICIES
from dpt.data.images import (
    BadImages,
    Decoder,
    DecodeThen,
    LabelledImageFiles,
    check_choice,
    val_transform,
)
from dpt.data.images import UnreadableImageError as UnreadableImageError
from dpt.errors import DptError
from dpt.loggers import ONCE_LOGGER_NAME
from dpt.targets import Targets

once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it


Annotation = dict[str, Any]
Sample = tuple[torch.Tensor, int]
# One image's label: an int (first, largest), or its categories' labels in ascending order (all).
Label = int | tuple[int, ...]


class CocoClassification(LabelledImageFiles):
    """One label per COCO image, picked from its non-crowd object annotations, or all of them.

    Reads `<root>/annotations/instances_<split>.json` and the images in `<root>/<split>/`
    (`ann_file` / `image_dir` override either path). Category ids (1..90 with gaps in COCO) map
    to labels 0..K-1 in ascending id order; `classes` holds the names in label order.

    `label_policy`: "first" takes the image's first non-crowd annotation in the order of the
    file's `annotations` list; "largest" the non-crowd annotation with the largest `area` (ties
    go to the earlier one); "all" every non-crowd annotation's category: the target is then a
    float32 K-hot tensor `(K,)` (1.0 at each of those categories' labels, 0.0 elsewhere; crowd
    annotations count for nothing, as under the other policies), and `targets` / `samples` hold
    each image's labels as an ascending tuple of ints (plain Python: cheap to pickle into loader
    workers; the tensor is made per sample). Images without a non-crowd annotation are left out,
    whatever the policy.

    Order: the kept images sorted by COCO image id, so every process builds the same index
    whatever the order of the JSON file.

    `on_bad_image`: for a missing, truncated or corrupt file, "skip" makes `__getitem__` return
    None (a collate function drops it) and logs one warning per file per process; "error"
    raises UnreadableImageError (a RuntimeError).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        split: str = "train2017",
        label_policy: str = "first",
        transform: Callable[[torch.Tensor], Any] | None = None,
        on_bad_image: str = "skip",
        ann_file: str | os.PathLike[str] | None = None,
        image_dir: str | os.PathLike[str] | None = None,
        decoder: Decoder | None = None,
    ) -> None:
        check_choice("label_policy", label_policy, LABEL_POLICIES)
        self.bad_images = BadImages(on_bad_image)
        self.root = Path(root)
        self.split = split
        self.label_policy = label_policy
        self.transform = transform
        # `decoder` (bytes to input) where given, else the whole image decoded, then `transform`.
        self.decoder = decoder or DecodeThen(transform)
        self.on_bad_image = on_bad_image
        self.ann_file = Path(ann_file or self.root / "annotations" / f"instances_{split}.json")
        self.image_dir = Path(image_dir or self.root / split)
        if not self.ann_file.is_file():
            raise FileNotFoundError(f"COCO annotation file not found: {self.ann_file}")
        if not self.image_dir.is_dir():
            raise FileNotFoundError(f"COCO image folder not found: {self.image_dir}")

        coco = _load_coco(self.ann_file)
        # Ascending category id gives the same label numbering as the usual COCO tooling.
        self.category_ids: list[int] = sorted(coco.cats)
        self.classes: list[str] = [coco.cats[c]["name"] for c in self.category_ids]
        self.class_to_idx: dict[str, int] = {name: i for i, name in enumerate(self.classes)}
        self.cat_id_to_label: dict[int, int] = {c: i for i, c in enumerate(self.category_ids)}

        # Only plain lists are kept (not the COCO object): cheap to pickle into loader workers.
        self.image_ids: list[int] = []
        self.targets: list[Label] = []
        # (path, label), as in torchvision's ImageFolder; (path, labels) under "all"
        self.samples: list[tuple[str, Label]] = []  # type: ignore[assignment]
        for image_id in sorted(coco.imgs):
            anns = coco.imgToAnns.get(image_id, [])
            label: Label
            if label_policy == "all":
                usable = _usable(anns)
                if not usable:
                    continue
                label = tuple(sorted({self._label_of(ann) for ann in usable}))
            else:
                ann = _pick_annotation(anns, label_policy)
                if ann is None:
                    continue
                label = self._label_of(ann)
            path = self.image_dir / coco.imgs[image_id]["file_name"]
            self.image_ids.append(image_id)
            self.targets.append(label)
            self.samples.append((str(path), label))

        left_out = len(coco.imgs) - len(self.image_ids)
        once.info(
            f"coco {split}: kept {len(self.image_ids)} of {len(coco.imgs)} images "
            f"({left_out} without a non-crowd annotation)"
        )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def target_spec(self) -> Targets:
        """What every target is: a label of K classes, or a float K-hot row under "all"."""
        if self.label_policy == "all":
            return Targets(integer=False, shape=(self.num_classes,))
        return Targets.labels(self.num_classes)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any] | None:
        item = super().__getitem__(index)
        if item is None or self.label_policy != "all":
            return item
        image, labels = item
        return image, self.k_hot(labels)

    def k_hot(self, labels: Sequence[int]) -> torch.Tensor:
        """A float32 `(K,)` row: 1.0 at `labels`, 0.0 elsewhere."""
        row = torch.zeros(self.num_classes, dtype=torch.float32)
        row[list(labels)] = 1.0
        return row

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(split={self.split!r}, images={len(self)}, "
            f"classes={self.num_classes}, label_policy={self.label_policy!r}, "
            f"ann_file={str(self.ann_file)!r}, image_dir={str(self.image_dir)!r})"
        )

    def _label_of(self, ann: Annotation) -> int:
        try:
            return self.cat_id_to_label[ann["category_id"]]
        except KeyError:
            raise ValueError(
                f"{self.ann_file}: annotation {ann.get('id')} has category_id "
                f"{ann.get('category_id')}, which is not in 'categories'"
            ) from None


class CocoData:
    """The `dataset=coco` module: train and val splits with their transforms."""

    def __init__(
        self,
        root: str,
        train_split: str,
        val_split: str | None,
        label_policy: str,
        image_size: int,
        num_workers: int,
        on_bad_image: str,
        train_ann_file: str | None,
        train_image_dir: str | None,
        val_ann_file: str | None,
        val_image_dir: str | None,
        seed: int,
    ) -> None:
        common = {"root": root, "label_policy": label_policy, "on_bad_image": on_bad_image}
        try:
            self.train = CocoClassification(
                split=train_split,
                decoder=RandomResizedCropDecode(image_size),
                ann_file=train_ann_file,
                image_dir=train_image_dir,
                **common,
            )
            self.val = (
                None
                if val_split is None
                else CocoClassification(
                    split=val_split,
                    decoder=DecodeThen(val_transform(image_size)),
                    ann_file=val_ann_file,
                    image_dir=val_image_dir,
                    **common,
                )
            )
        except (FileNotFoundError, ValueError) as error:
            raise DptError(f"dataset=coco: {error}") from error
        if self.val is not None and self.val.classes != self.train.classes:
            raise DptError(
                f"dataset=coco: {self.val.ann_file} and {self.train.ann_file} list "
                "different categories"
            )
        self.input_shape: tuple[int, ...] = (3, image_size, image_size)
        self.num_classes = self.train.num_classes
        self.classes = list(self.train.classes)  # the category names: data.json, dpt-predict
        # label_policy=all: K-hot float rows (K,); else one integer label of K classes.
        self.target_spec: Targets = self.train.target_spec
        self.num_workers = num_workers


# The top-level keys of every COCO instances file (pycocotools indexes whichever are present).
COCO_KEYS = ("images", "annotations", "categories")


def _load_coco(ann_file: Path) -> COCO:
    # pycocotools prints progress ("loading annotations into memory...") to stdout.
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(ann_file))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"COCO annotation file is not valid JSON: {ann_file} ({e})") from e
    except (AssertionError, KeyError, TypeError) as e:
        # pycocotools asserts that the top level is an object and indexes by "id"/"image_id".
        raise ValueError(f"not a COCO annotation file: {ann_file} ({type(e).__name__}: {e})") from e
    # `{}` (or any other object) loads without complaint, as an empty set with no categories.
    missing = [key for key in COCO_KEYS if key not in coco.dataset]
    if missing:
        raise ValueError(f"not a COCO annotation file: {ann_file} (no {', '.join(missing)})")
    return coco


def _pick_annotation(anns: Sequence[Annotation], policy: str) -> Annotation | None:
    """The annotation that labels the image under `policy`; None without a non-crowd one.

    `anns` must be in file order: pycocotools' imgToAnns appends in the file's order.
    """
    usable = _usable(anns)
    if not usable:
        return None
    if policy == "first":
        return usable[0]
    # max() returns the first of equal maxima, so ties go to the earlier annotation.
    return max(usable, key=_area)


def _usable(anns: Sequence[Annotation]) -> list[Annotation]:
    """The annotations that may label an image (every policy): the non-crowd ones, in order."""
    return [a for a in anns if not a.get("iscrowd", 0)]


def _area(ann: Annotation) -> float:
    # `area` is the segmentation area in COCO; fall back to the box for files that omit it.
    if "area" in ann:
        return float(ann["area"])
    _, _, w, h = ann.get("bbox", (0, 0, 0, 0))
    return float(w) * float(h)
