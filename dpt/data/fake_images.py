"""Random images from torchvision's FakeData: image models with no files at all."""

from __future__ import annotations

import torch
from torchvision.datasets import FakeData
from torchvision.transforms import v2

from dpt.data.images import IMAGENET_MEAN, IMAGENET_STD


class FakeImages:
    """The `dataset=fake_images` module. Labels are random: for speed and plumbing, not accuracy."""

    def __init__(
        self,
        num_samples: int,
        num_val_samples: int,
        image_size: int,
        num_classes: int,
        num_workers: int,
        seed: int,
    ) -> None:
        shape = (3, image_size, image_size)
        transform = v2.Compose(
            [
                v2.PILToTensor(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )
        self.train = FakeData(num_samples, shape, num_classes, transform, random_offset=seed)
        self.val = (
            FakeData(num_val_samples, shape, num_classes, transform, random_offset=seed + 10**6)
            if num_val_samples
            else None
        )
        self.input_shape: tuple[int, ...] = shape
        self.num_classes = num_classes
        self.num_workers = num_workers
