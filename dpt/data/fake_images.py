"""Random images from torchvision's FakeData: image models with no files at all."""

from __future__ import annotations

from typing import Any

import torch
from torchvision.datasets import FakeData
from torchvision.transforms import v2
from torchvision.transforms.functional import to_pil_image

from dpt.data.images import IMAGENET_MEAN, IMAGENET_STD


class OwnGeneratorFakeData(FakeData):
    """torchvision's FakeData, the same images and labels, each drawn from a generator of its
    own. FakeData reseeds torch's global generator for every image, and on a torch built for
    CUDA that also queues CUDA's seeding, which formats the whole call stack each time: ~5 us a
    frame, ~0.2 ms an image at a rank's depth, 1-2 % of a ResNet-18 step at batch 8 on CPU."""

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if index >= len(self):
            raise IndexError(f"{type(self).__name__} index out of range")
        draws = torch.Generator().manual_seed(index + self.random_offset)
        image = to_pil_image(torch.randn(*self.image_size, generator=draws))
        target = torch.randint(0, self.num_classes, (1,), dtype=torch.long, generator=draws)[0]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target.item()


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
        self.train = OwnGeneratorFakeData(
            num_samples, shape, num_classes, transform, random_offset=seed
        )
        self.val = (
            OwnGeneratorFakeData(
                num_val_samples, shape, num_classes, transform, random_offset=seed + 10**6
            )
            if num_val_samples
            else None
        )
        self.input_shape: tuple[int, ...] = shape
        self.num_classes = num_classes
        self.num_workers = num_workers
