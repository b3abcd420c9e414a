"""DataLoaders that shard across ranks: the same code path for one process and for many."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from dpt.contract import DataModule, input_dtype
from dpt.data.position import DataPosition
from dpt.data.seeded import SeededSamples
from dpt.distributed import DistEnv
from dpt.targets import Targets


class Batch(NamedTuple):
    """A batch as the loaders give it to the loop."""

    inputs: torch.Tensor
    targets: torch.Tensor
    skipped: int  # samples left out: unreadable or missing (`Skipped`)


class Missing:
    """What a data set returns for a sample it could not have at all (its shard could not be
    fetched), where None is a sample that came but is unreadable (a corrupt image). Both are
    left out of the batch; only a missing one makes a validation cover less than its split."""


MISSING = Missing()


class Skipped(int):
    """The samples a batch left out (a plain count for the training loop), and how many of them
    were `Missing`."""

    missing: int

    def __new__(cls, count: int, missing: int = 0) -> Skipped:
        skipped = super().__new__(cls, count)
        skipped.missing = missing
        return skipped

    def __reduce__(self) -> tuple[Any, ...]:  # from a loader worker, with its `missing`
        return (Skipped, (int(self), self.missing))


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
    """The loaders' collate_fn: stacks (input, target) pairs, leaving out the None a dataset
    returns for an unreadable sample, and counts those. A batch of only unreadable samples is an
    empty batch of the dataset's input and target shapes: the loop trains on nothing there, but
    every rank still takes the step (ddp's all-reduce stays in step), and validation skips it."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        targets: Targets | None = None,
        input_dtype: torch.dtype | None = None,
    ) -> None:
        self.input_shape = tuple(input_shape)
        self.targets = targets or Targets.labels()
        self.input_dtype = input_dtype or torch.get_default_dtype()

    def __call__(self, samples: Sequence[Any] | StackedBatch) -> Batch:
        if isinstance(samples, StackedBatch):
            return Batch(samples.inputs, samples.labels, 0)
        good = [s for s in samples if s is not None and not isinstance(s, Missing)]
        skipped = Skipped(len(samples) - len(good), sum(isinstance(s, Missing) for s in samples))
        if not good:
            empty = torch.empty((0, *self.input_shape), dtype=self.input_dtype)
            return Batch(empty, self.targets.empty(), skipped)
        inputs = torch.stack([torch.as_tensor(s[0]) for s in good])
        targets = self.targets.stack([s[1] for s in good])
        return Batch(inputs, targets, skipped)


class ShardSampler(Sampler[int]):
    """Every index exactly once across ranks (no padding, unlike DistributedSampler): for eval."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.indices = range(rank, size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def epoch_order(size: int, seed: int, epoch: int) -> list[int]:
    """The epoch's global order: one shuffle of the training set drawn from (seed, epoch) alone
    (as DistributedSampler draws it), the same whatever the world size or batch."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def steps_left(size: int, sample: int, global_batch: int) -> int:
    """Full optimizer steps left in an epoch of `size` samples after its first `sample`: the
    order's last `size % global_batch` samples are not trained on that epoch (every step has
    exactly the global batch, whatever the world size, so the same global batch gives the same
    steps per epoch on every world size)."""
    return max(0, (size - sample) // global_batch)


def rank_share(
    order: Sequence[int], start: int, steps: int, global_batch: int, rank: int, world_size: int
) -> list[int]:
    """Rank `rank`'s samples for `steps` steps from sample `start` of the order. Step k takes the
    order's [start + kG, start + (k+1)G) for global batch G, each rank every world_size-th of
    them, so a rank's consecutive batches of B add up, over the ranks, to consecutive slices of
    the order: `single` with batch 64 sees what 2 ranks with batch 32 (or 4 with 16) see."""
    return list(order[start : start + steps * global_batch][rank::world_size])


# An epoch's global order from (seed, epoch): a data set may give its own (`epoch_order`).
EpochOrder = Callable[[int, int], Sequence[int]]


def order_of(dataset: object, shuffle: bool = True) -> EpochOrder:
    """The training set's `epoch_order(seed, epoch)` where it has one (shards: shuffled with
    locality, see dpt.data.shards.ShardOrder), else one shuffle of all its samples; without
    shuffling (`dataset.shuffle=false`), the samples in index order, every epoch."""
    size = len(dataset)  # type: ignore[arg-type]
    if not shuffle:
        return lambda seed, epoch: range(size)
    own = getattr(dataset, "epoch_order", None)
    if own is not None:
        return own
    return lambda seed, epoch: epoch_order(size, seed, epoch)


class GlobalOrderSampler(Sampler[tuple[int, int]]):
    """This rank's share of the rest of an epoch (`start`), as (epoch, index) pairs: the epoch
    travels with each index into the loader workers, whose dataset copies outlive an epoch
    (persistent_workers), so each sample's augmentation can be seeded from it (SeededSamples)."""

    def __init__(self, size: int, seed: int, rank: int, world_size: int, order: EpochOrder) -> None:
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.order = order
        self.epoch = 0
        self.indices: list[int] = []

    def start(self, epoch: int, sample: int, global_batch: int) -> int:
        """From sample `sample` of `epoch`'s order on; returns the full steps that gives."""
        steps = steps_left(self.size, sample, global_batch)
        order = self.order(self.seed, epoch)
        self.epoch = epoch
        self.indices = rank_share(order, sample, steps, global_batch, self.rank, self.world_size)
        return steps

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, indices = self.epoch, self.indices
        return ((epoch, index) for index in indices)

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Loaders:
    train: DataLoader
    train_sampler: GlobalOrderSampler
    val: DataLoader | None
    batch_size: int  # per rank
    world_size: int

    @property
    def train_size(self) -> int:
        return len(self.train.dataset)  # type: ignore[arg-type]

    def global_batch(self, accum: int) -> int:
        """Samples per optimizer step, world-wide."""
        return self.batch_size * self.world_size * accum

    def steps_per_epoch(self, accum: int) -> int:
        return steps_left(self.train_size, 0, self.global_batch(accum))

    def steps_left(self, position: DataPosition, accum: int) -> int:
        return steps_left(self.train_size, position.sample, self.global_batch(accum))

    def epoch_batches(
        self, position: DataPosition, accum: int
    ) -> Iterator[tuple[list[Batch], float]]:
        """The rest of `position`'s epoch in groups of `accum` batches, with the seconds spent
        waiting for each group; a resumed epoch starts at the sample the checkpoint left it at
        (the sampler skips the samples already trained on: nothing is loaded twice)."""
        if self.train_sampler.start(position.epoch, position.sample, self.global_batch(accum)) == 0:
            return
        group: list[Batch] = []
        fetch_start = time.perf_counter()
        for batch in self.train:
            group.append(batch)
            if len(group) < accum:
                continue
            yield group, time.perf_counter() - fetch_start
            group, fetch_start = [], time.perf_counter()

    def close(self) -> None:
        """End the loaders' worker processes now. Persistent workers otherwise live until the
        loader is collected, and a finalizer's shutdown waits out torch's status interval (5 s
        a worker): the next run in this process (a sweep's next job) would pay it."""
        for loader in (self.train, self.val):
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()  # torch's own: a sentinel to each worker, a join
            if loader is not None:
                loader._iterator = None

    def step_batches(self, epoch: int, sample: int, accum: int, rank: int) -> list[Batch]:
        """Rank `rank`'s micro-batches of the step whose global batch starts at `sample` of
        `epoch`'s order, fetched here, in this process, as its loader fetched them (the same
        samples and augmentation): what a replay of that step's forward needs."""
        sampler = self.train_sampler
        order = sampler.order(sampler.seed, epoch)
        indices = rank_share(order, sample, 1, self.global_batch(accum), rank, self.world_size)
        dataset, collate = self.train.dataset, self.train.collate_fn
        size = self.batch_size
        return [collate(dataset.__getitems__([(epoch, i) for i in indices[k : k + size]]))
                for k in range(0, len(indices), size)]  # fmt: skip


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
    shuffle: bool = True,
    targets: Targets | None = None,
    val_env: DistEnv | None = None,
) -> Loaders:
    """Shard the epoch's global order even in one process, so `single` with batch B*N sees
    exactly the batches that N ddp ranks with batch B see together (same order, same seed)."""
    train_set = SeededSamples(data.train, seed)
    sampler = GlobalOrderSampler(
        len(train_set), seed, env.rank, env.world_size, order_of(data.train, shuffle)
    )
    sampler.start(0, 0, batch_size * env.world_size)  # the loader alone gives epoch 0 (benchmarks)
    common = _loader_options(data, env, seed, worker_init_fn, targets)
    # The sampler gives every rank whole steps: equal batch sizes on every rank, so the
    # all-reduced mean is the big-batch mean.
    train = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True, **common)
    val = None
    if data.val is not None:
        # Validation shards over `val_env` where given (every rank of a pipeline validates
        # with the whole model, while its training batches are its replica's).
        val = _eval_loader(data.val, val_env or env, batch_size, common)
    return Loaders(train, sampler, val, batch_size, env.world_size)


def eval_loader(
    data: DataModule,
    split: Dataset,
    env: DistEnv,
    batch_size: int,
    seed: int,
    targets: Targets | None = None,
) -> DataLoader:
    """A loader of `split` (the data set's val or test) as validation reads its split: every
    sample once over the ranks, in index order, with training's collate and workers."""
    return _eval_loader(split, env, batch_size, _loader_options(data, env, seed, None, targets))


def _eval_loader(
    split: Dataset, env: DistEnv, batch_size: int, options: dict[str, Any]
) -> DataLoader:
    sampler = ShardSampler(len(split), env.rank, env.world_size)  # type: ignore[arg-type]
    return DataLoader(split, batch_size=batch_size, sampler=sampler, **options)


def _loader_options(
    data: DataModule,
    env: DistEnv,
    seed: int,
    worker_init_fn: Callable[[int], None] | None,
    targets: Targets | None,
) -> dict[str, Any]:
    num_workers = data.num_workers
    options: dict[str, Any] = {
        "num_workers": num_workers,
        "collate_fn": DropUnreadable(data.input_shape, targets, input_dtype(data)),
        # Pinned host memory lets the copy to the GPU overlap with compute (non_blocking=True).
        "pin_memory": env.device.type == "cuda",
        # Seeds the workers' own RNGs; training samples' augmentation is seeded per sample.
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
