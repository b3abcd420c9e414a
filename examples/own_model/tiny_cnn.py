"""A user's own model: a small CNN, in the user's own file.

dpt calls it with its config's keys (`conf/model/tiny_cnn.yaml`) and `num_classes=`; it takes no
`input_shape`, so dpt passes none (the global pooling makes it work at any image size).
"""

from __future__ import annotations

from torch import nn


class TinyCNN(nn.Module):
    def __init__(self, num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, images):  # (batch, 3, H, W) -> logits (batch, num_classes)
        return self.head(self.features(images).flatten(1))
