"""`dataset=custom`: plain `torch.utils.data.Dataset` classes of yours, one for training and one
for validation, each built from its own config node (`dataset.train`, `dataset.val`); no wrapper
object needed. The input shape and what the targets are come from the first readable training
sample. `dataset.test`, the same for a test split, is built only when dpt-evaluate asks for it."""

from __future__ import annotations

import functools
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from dpt.config.build import build_as
from dpt.contract import first_sample, takes_keyword
from dpt.data.splits import SPLITS, TEST, split_of
from dpt.errors import DptError
from dpt.targets import Targets
from dpt.user_code import locate

TEST_KEY = f"dataset.{TEST}"


class CustomData:
    """What dpt.contract.DataModule asks, made of two Dataset classes' objects."""

    def __init__(
        self,
        train: DictConfig,
        val: DictConfig | None,
        num_classes: int | None,
        classes: list[str] | None,
        num_workers: int,
        seed: int,
        test: DictConfig | None = None,
    ) -> None:
        self.test_node, self.seed = test, seed  # built on first use: training never reads it
        self.train = build_dataset(train, "dataset.train", seed)
        self.val = None if val is None else build_dataset(val, "dataset.val", seed)
        inputs, target = first_sample(self.train, "dataset.train")
        self.input_shape: tuple[int, ...] = tuple(torch.as_tensor(inputs).shape)
        self.target_spec = Targets.of(target).with_classes(num_classes)
        self.num_classes = num_classes
        self.classes = None if classes is None else list(classes)
        self.num_workers = num_workers

    @functools.cached_property
    def test(self) -> Dataset | None:
        """`dataset.test`'s Dataset; None where it is null."""
        if self.test_node is None:
            return None
        return build_dataset(self.test_node, TEST_KEY, self.seed)

    def missing_split(self, split: str) -> str:
        """Why there is no `split` (dpt.data.splits): its node is null."""
        has = ", ".join(f"dataset.{name}" for name in SPLITS if split_of(self, name) is not None)
        return f"the data set has no {split} split: dataset.{split} is null (it has {has})"


def build_dataset(node: DictConfig, key: str, seed: int) -> Dataset:
    """One Dataset of yours, built with its node's keys (and `seed=` where it takes one)."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise DptError(f"{key}: expected a node with a _target_ (your Dataset class) and its keys")
    factory = locate(str(node._target_), f"{key}._target_")
    extra: dict[str, Any] = {"seed": seed} if takes_keyword(factory, "seed") else {}
    dataset = build_as(node, key, **extra)
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise DptError(
            f"{key}._target_={node._target_} built a {type(dataset).__name__}, not a map-style "
            "Dataset (it needs __getitem__ and __len__)"
        )
    return dataset
