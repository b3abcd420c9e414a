"""DataLoaders that shard across ranks: the same code path for one process and for many."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from dpt.distributed import DistEnv
from dpt.state import DataPosition


class DataModule(Protocol):
    """What a `dataset` config builds: datasets plus what the model needs to know about them."""

    train: Dataset
    val: Dataset | None
    input_shape: tuple[int, ...]
    num_classes: int
    num_workers: int


Batch = tuple[torch.Tensor, torch.Tensor, int]


class StackedBatch(NamedTuple):
    """A batch an in-memory dataset fetched in one indexing op (its `__getitems__`)."""

    inputs: torch.Tensor
    labels: torch.Tensor


class InMemoryDataset(TensorDataset):
    """Inputs and labels held as two tensors. The DataLoader asks for a whole batch at once
    (`__getitems__`): two indexing ops instead of one per sample, then a stack per batch."""

    def __getitems__(self, indices: list[int]) -> StackedBatch:
        index = torch.as_tensor(indices)
        inputs, labels = self.tensors
        return StackedBatch(inputs[index], labels[index])


class DropUnreadable:
    """The loaders' collate_fn: stacks (input, label) pairs, leaving out the None a dataset
    returns for an unreadable sample, and counts those. A batch of only unreadable samples is an
    empty batch of the dataset's input shape: the loop trains on nothing there, but every rank
    still takes the step (ddp's all-reduce stays in step), and validation skips it."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        self.input_shape = tuple(input_shape)

    def __call__(self, samples: Sequence[Any] | StackedBatch) -> Batch:
        if isinstance(samples, StackedBatch):
            return samples.inputs, samples.labels, 0
        good = [s for s in samples if s is not None]
        if not good:
            empty = torch.empty((0, *self.input_shape))
            return empty, torch.empty(0, dtype=torch.long), len(samples)
        inputs = torch.stack([torch.as_tensor(s[0]) for s in good])
        labels = torch.as_tensor([int(s[1]) for s in good], dtype=torch.long)
        return inputs, labels, len(samples) - len(good)


class ShardSampler(Sampler[int]):
    """Every index exactly once across ranks (no padding, unlike DistributedSampler): for eval."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way: a resumed run skips the indices it
    has already trained on without loading them."""

    start_index = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start_index :])

    def __len__(self) -> int:
        return super().__len__() - self.start_index


@dataclass
class Loaders:
    train: DataLoader
    train_sampler: ResumableSampler
    val: DataLoader | None
    batch_size: int

    @property
    def train_size(self) -> int:
        return len(self.train.dataset)  # type: ignore[arg-type]

    def batches_per_epoch(self) -> int:
        """Full batches per rank in a whole epoch (the last partial batch is dropped)."""
        return self.train_sampler.num_samples // self.batch_size

    def start_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        self.train_sampler.start_index = skip_batches * self.batch_size

    def steps_per_epoch(self, accum: int) -> int:
        return self.batches_per_epoch() // accum

    def epoch_batches(
        self, position: DataPosition, accum: int
    ) -> Iterator[tuple[list[Batch], float]]:
        """The rest of `position`'s epoch in groups of `accum` batches, with the seconds spent
        waiting for each group; a resumed epoch starts where the checkpoint left it (the sampler
        skips the indices already seen: nothing is loaded twice)."""
        self.start_epoch(position.epoch, skip_batches=position.step_in_epoch * accum)
        remaining = self.steps_per_epoch(accum) - position.step_in_epoch
        group: list[Batch] = []
        fetch_start = time.perf_counter()
        for batch in self.train:
            group.append(batch)
            if len(group) < accum:
                continue
            yield group, time.perf_counter() - fetch_start
            group, remaining = [], remaining - 1
            if remaining == 0:
                return
            fetch_start = time.perf_counter()


class ToDevice:
    """Moves a batch's inputs to the rank's device: pinned batches copy while the GPU computes
    (non_blocking), and convnets get channels_last images when the model asks for them."""

    def __init__(self, device: torch.device, channels_last: bool = False) -> None:
        self.device, self.channels_last = device, channels_last
        self.non_blocking = device.type == "cuda"

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        inputs = inputs.to(self.device, non_blocking=self.non_blocking)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs


def build_loaders(
    data: DataModule,
    env: DistEnv,
    batch_size: int,
    seed: int,
    worker_init_fn: Callable[[int], None] | None = None,
) -> Loaders:
    """Shard with DistributedSampler even in one process, so `single` with batch B*N sees exactly
    the batches that N ddp ranks with batch B see together (same permutation, same seed)."""
    sampler = ResumableSampler(
        data.train, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed
    )
    common = _loader_options(data, env, seed, worker_init_fn)
    # drop_last: equal batch sizes on every rank, so the all-reduced mean is the big-batch mean.
    train = DataLoader(data.train, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    val = None
    if data.val is not None:
        val_sampler = ShardSampler(len(data.val), env.rank, env.world_size)
        val = DataLoader(data.val, batch_size=batch_size, sampler=val_sampler, **common)
    return Loaders(train, sampler, val, batch_size)


def _loader_options(
    data: DataModule, env: DistEnv, seed: int, worker_init_fn: Callable[[int], None] | None
) -> dict[str, Any]:
    num_workers = data.num_workers
    options: dict[str, Any] = {
        "num_workers": num_workers,
        "collate_fn": DropUnreadable(data.input_shape),
        # Pinned host memory lets the copy to the GPU overlap with compute (non_blocking=True).
        "pin_memory": env.device.type == "cuda",
        # Seeds the workers' RNGs (random crops, flips) from the run's seed.
        "generator": torch.Generator().manual_seed(seed + env.rank),
    }
    if num_workers > 0:
        options["worker_init_fn"] = worker_init_fn
        if sys.platform == "linux":
            # Ranks started by elastic_launch inherit its "spawn" method, so each loader worker
            # would re-import torch (seconds each); fork is what workers get under torchrun.
            options["multiprocessing_context"] = "fork"
        # Workers live across epochs: no re-spawn (and no dataset re-pickling) every epoch.
        options["persistent_workers"] = True
        options["prefetch_factor"] = 4
    return options
