"""A user's own data set: images listed in CSV files (`path,label` rows), read with torchvision.

dpt calls `ListedImages` with its config's keys (`conf/dataset/listed_images.yaml`) and
`seed=`; it returns what dpt.contract.DataModule describes. Random augmentation draws from torch's
global generator, which dpt seeds per sample: a resumed run sees the same crops and flips.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def train_transform(image_size: int) -> v2.Compose:
    return v2.Compose(
        [
            v2.RandomResizedCrop(image_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )


def val_transform(image_size: int) -> v2.Compose:
    """One decoded image (uint8, 3 x H x W) to the model's input: what dpt-predict applies too."""
    return v2.Compose(
        [
            v2.Resize(image_size, antialias=True),
            v2.CenterCrop(image_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )


class CsvImages(Dataset):
    def __init__(self, listing: Path, classes: list[str], transform: v2.Compose) -> None:
        with open(listing, newline="") as f:
            rows = list(csv.DictReader(f))
        self.samples = [(listing.parent / row["path"], classes.index(row["label"])) for row in rows]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | None:
        path, label = self.samples[index]
        try:
            image = decode_image(str(path), mode=ImageReadMode.RGB)
        except (OSError, RuntimeError):  # unreadable: dpt skips it and counts it
            return None
        return self.transform(image), label


class ListedImages:
    """`root/train.csv` and `root/val.csv`; the class names are the labels' sorted values."""

    def __init__(self, root: str, image_size: int, num_workers: int, seed: int) -> None:
        root_path = Path(root)
        with open(root_path / "train.csv", newline="") as f:
            self.classes = sorted({row["label"] for row in csv.DictReader(f)})
        self.train = CsvImages(root_path / "train.csv", self.classes, train_transform(image_size))
        self.val = CsvImages(root_path / "val.csv", self.classes, val_transform(image_size))
        self.input_shape = (3, image_size, image_size)
        self.num_classes = len(self.classes)
        self.num_workers = num_workers
        # How dpt-predict rebuilds the validation transform (a Hydra `_target_` node).
        self.val_transform = {"_target_": "listed_images.val_transform", "image_size": image_size}


def write_listing(image_folder: str) -> None:
    """`python listed_images.py FOLDER`: FOLDER/train.csv and val.csv from its class folders."""
    root = Path(image_folder)
    for split in ("train", "val"):
        with open(root / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "label"])
            for path in sorted((root / split).glob("*/*")):
                writer.writerow([path.relative_to(root).as_posix(), path.parent.name])


if __name__ == "__main__":
    import sys

    write_listing(sys.argv[1])
