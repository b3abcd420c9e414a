"""The `dataset=image_folder` module: `<root>/train/<class>/<images>`, validation from
`<root>/val/<class>/<images>` or a seeded split of train, and a test split from
`<root>/test/<class>/<images>` for dpt-evaluate (the layout: dpt/data/folder_layout.py)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dpt.data.crop_decode import RandomResizedCropDecode
from dpt.data.folder_layout import Layout, scan_layout, scan_test, split_folders
from dpt.data.images import (
    BadImages,
    Decoder,
    DecodeThen,
    LabelledImageFiles,
    check_bad_image_policy,
    val_transform,
)
from dpt.loggers import ONCE_LOGGER_NAME

once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it

Sample = tuple[torch.Tensor, int]


class ImageFolderDataset(LabelledImageFiles):
    """(path, label) pairs decoded and transformed by `decoder` (or `transform`); `classes`,
    `class_to_idx`, `samples` and `targets` as in torchvision's ImageFolder.

    `on_bad_image`: "skip" returns None for a missing, truncated or corrupt file (the loaders'
    collate function drops it) and warns once per file per process; "error" raises
    UnreadableImageError naming the file.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        classes: Sequence[str],
        transform: Callable[[torch.Tensor], Any] | None = None,
        on_bad_image: str = "skip",
        decoder: Decoder | None = None,
    ) -> None:
        self.samples: list[tuple[str, int]] = list(samples)
        self.targets: list[int] = [label for _, label in self.samples]
        self.classes: list[str] = list(classes)
        self.class_to_idx: dict[str, int] = {name: i for i, name in enumerate(self.classes)}
        self.transform = transform
        # `decoder` (bytes to input) where given, else the whole image decoded, then `transform`.
        self.decoder = decoder or DecodeThen(transform)
        self.bad_images = BadImages(on_bad_image)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(images={len(self)}, classes={len(self.classes)})"


class ImageFolderData:
    """The `dataset=image_folder` module: train and val sets with their transforms."""

    def __init__(
        self,
        root: str,
        val_fraction: float,
        image_size: int,
        num_workers: int,
        on_bad_image: str,
        seed: int,
    ) -> None:
        check_bad_image_policy(on_bad_image)
        layout = scan_layout(root, val_fraction, seed)
        self.root = layout.root
        self.classes: list[str] = layout.classes
        self.train = ImageFolderDataset(
            layout.train, layout.classes, on_bad_image=on_bad_image,
            decoder=RandomResizedCropDecode(image_size),
        )  # fmt: skip
        self.val: ImageFolderDataset | None = None
        if layout.val_source != "none":
            self.val = ImageFolderDataset(
                layout.val, layout.classes, val_transform(image_size), on_bad_image
            )
        self.input_shape: tuple[int, ...] = (3, image_size, image_size)
        self.num_classes = len(layout.classes)
        self.num_workers = num_workers
        self.image_size, self.on_bad_image = image_size, on_bad_image  # the test split's too
        # dpt-predict rebuilds the validation transform from this node (see dpt/contract.py).
        self.val_transform = {"_target_": "dpt.data.images.val_transform", "image_size": image_size}
        _log_layout(layout, val_fraction, seed)

    @functools.cached_property
    def test(self) -> ImageFolderDataset | None:
        """`<root>/test/<class>/<images>`, through the validation transform; None without a
        test folder. Scanned on first use: training never reads it."""
        samples = scan_test(self.root, self.classes)
        if samples is None:
            return None
        return ImageFolderDataset(
            samples, self.classes, val_transform(self.image_size), self.on_bad_image
        )

    def missing_split(self, split: str) -> str:
        """Why there is no `split` (dpt.data.splits), naming the folders there are."""
        has = ", ".join(split_folders(self.root))
        return f"the image folder {self.root} has no {split}/ folder (it has {has})"


def _log_layout(layout: Layout, val_fraction: float, seed: int) -> None:
    classes = f"in {len(layout.classes)} classes"
    train_dir = os.path.join(layout.root, "train")
    if layout.val_source == "split":
        once.info(
            f"image_folder train: {len(layout.train)} images {classes} ({train_dir}, "
            f"{len(layout.val)} held out for validation)"
        )
        once.info(
            f"image_folder val: {len(layout.val)} images {classes}, a seeded split of "
            f"{train_dir} (dataset.val_fraction={val_fraction:g}, trainer.seed={seed})"
        )
        return
    once.info(f"image_folder train: {len(layout.train)} images {classes} ({train_dir})")
    if layout.val_source == "folder":
        val_dir = os.path.join(layout.root, "val")
        once.info(f"image_folder val: {len(layout.val)} images {classes} ({val_dir})")
    else:
        once.info("image_folder val: none (no val/ folder and dataset.val_fraction=0)")
