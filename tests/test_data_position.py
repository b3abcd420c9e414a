"""The data position in samples of the epoch's global order, and per-sample seeded augmentation,
in process: what each rank trains on at each step, for several world sizes and batches."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dpt.data.images import train_transform
from dpt.data.loaders import InMemoryDataset, Loaders, build_loaders, epoch_order
from dpt.data.position import DataPosition
from dpt.data.seeded import SeededSamples
from dpt.distributed import DistEnv

SIZE, SEED = 1000, 7  # 1000 is no multiple of the global batches below: a remainder each epoch


@dataclass
class Numbered:
    """Samples whose input is their own index, so a batch shows which samples it holds."""

    num_workers: int = 0

    def __post_init__(self) -> None:
        self.train = InMemoryDataset(torch.arange(SIZE).unsqueeze(1), torch.zeros(SIZE).long())
        self.val = None
        self.input_shape, self.num_classes = (1,), 2


def _loaders(rank: int, world: int, batch: int) -> Loaders:
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                  device=torch.device("cpu"))  # fmt: skip
    return build_loaders(Numbered(), env, batch, SEED)


def _steps(world: int, batch: int, accum: int, position: DataPosition) -> list[list[int]]:
    """The samples of each optimizer step of the rest of `position`'s epoch, all ranks together."""
    per_rank = []
    for rank in range(world):
        batches = _loaders(rank, world, batch).epoch_batches(position, accum)
        per_rank.append([_flat(b[0].flatten().tolist() for b in g) for g, _ in batches])
    assert len({len(steps) for steps in per_rank}) == 1  # every rank takes every step
    return [_flat(step) for step in zip(*per_rank, strict=True)]


def _flat(lists: Iterable[list[int]]) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("start", [0, 25 * 32])
def test_a_global_batch_takes_the_same_samples_whatever_the_world_size(
    accum: int, start: int
) -> None:
    global_batch = 32
    order = epoch_order(SIZE, SEED, epoch=1)
    position = DataPosition(epoch=1, sample=start)
    for world in (1, 2, 4):
        steps = _steps(world, global_batch // world // accum, accum, position)
        assert len(steps) == (SIZE - start) // global_batch
        for k, step in enumerate(steps):
            begin = start + k * global_batch
            assert sorted(step) == sorted(order[begin : begin + global_batch]), (world, k)


def test_steps_per_epoch_count_the_global_order_and_leave_the_remainder_out() -> None:
    for world, batch in ((1, 48), (2, 24), (3, 16), (4, 12)):
        loaders = _loaders(0, world, batch)
        assert loaders.steps_per_epoch(accum=1) == SIZE // 48
        assert loaders.steps_per_epoch(accum=2) == SIZE // 96
    steps = _steps(3, 16, 1, DataPosition(epoch=0))
    seen = _flat(steps)
    assert len(seen) == len(set(seen)) == SIZE - SIZE % 48  # no sample twice, none padded in


def test_another_global_batch_continues_from_the_same_sample() -> None:
    order = epoch_order(SIZE, SEED, epoch=0)
    stopped_at = 10 * 32  # after 10 steps of 32
    steps = _steps(2, 24, 1, DataPosition(epoch=0, sample=stopped_at))  # now 48 a step
    assert len(steps) == (SIZE - stopped_at) // 48
    assert sorted(_flat(steps)) == sorted(order[stopped_at : stopped_at + len(steps) * 48])


def test_each_epoch_has_its_own_order_the_same_on_every_rank() -> None:
    assert sorted(epoch_order(SIZE, SEED, 0)) == list(range(SIZE))
    assert epoch_order(SIZE, SEED, 0) != epoch_order(SIZE, SEED, 1)
    assert epoch_order(SIZE, SEED, 3) == epoch_order(SIZE, SEED, 3)


# --- augmentation seeded per sample -----------------------------------------------------------


class Images(Dataset):
    """A few distinct images through COCO's training augmentation (random crop and flip)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (6, 3, 40, 48), generator=generator, dtype=torch.uint8)
        self.transform = train_transform(16)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index]), index


def _augmented(keys: list[tuple[int, int]], workers: int) -> dict[tuple[int, int], torch.Tensor]:
    # A generator of its own, as dpt's loaders have: the loader's draws leave torch's alone.
    loader = DataLoader(SeededSamples(Images(), SEED), sampler=keys, batch_size=2,
                        num_workers=workers, generator=torch.Generator())  # fmt: skip
    images = torch.cat([inputs for inputs, _ in loader])
    return dict(zip(keys, images, strict=True))


def test_augmentation_depends_on_seed_epoch_and_index_only() -> None:
    keys = [(epoch, index) for epoch in (0, 1) for index in range(6)]
    before = torch.get_rng_state()
    one = _augmented(keys, workers=0)
    assert torch.equal(torch.get_rng_state(), before)  # the training's own stream untouched
    other = _augmented(keys[::-1], workers=2)  # another order, spread over two workers
    for key in keys:
        assert torch.equal(one[key], other[key]), key
    for index in range(6):  # a new epoch, new draws
        assert not torch.equal(one[(0, index)], one[(1, index)]), index
    reseeded = SeededSamples(Images(), SEED + 1)
    assert not torch.equal(reseeded[(0, 0)][0], one[(0, 0)])
