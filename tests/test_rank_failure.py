"""What failed in a rank, said in one line (dpt/launch/rank_failure.py): real failures, raised
in this process."""

from __future__ import annotations

import gc
import os
import signal

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dpt.launch.rank_failure import describe


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Boom(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        raise ValueError(f"cannot read sample {index}")


class KillsItsWorker(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def _raised(call: object) -> BaseException:
    with pytest.raises(Exception) as caught:
        call()  # type: ignore[operator]
    return caught.value


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_models_forward_is_named_by_its_class(wrapped: bool) -> None:
    model = nn.DataParallel(Net()) if wrapped else Net()  # the strategy's wrapper is skipped
    error = _raised(lambda: model(torch.zeros(2, 5)))
    assert describe(error) == (
        "the model's forward (Net) raised RuntimeError: mat1 and mat2 shapes cannot be "
        "multiplied (2x5 and 7x3)"
    )


def test_the_loss_is_named_as_the_loss() -> None:
    error = _raised(lambda: nn.CrossEntropyLoss()(torch.zeros(2, 3), torch.zeros(5).long()))
    assert describe(error).startswith("the loss (CrossEntropyLoss) raised ValueError: ")


def test_a_data_set_read_in_the_rank_is_named() -> None:
    error = _raised(lambda: next(iter(DataLoader(Boom(), batch_size=2))))
    assert describe(error) == "the data set (Boom) raised ValueError: cannot read sample 0"


@pytest.mark.timeout(60)
def test_a_loader_workers_exception_names_the_worker() -> None:
    # Garbage of earlier tests in this process, CUDA tensors among it on a GPU machine, is freed
    # here: a forked worker that collected it would free CUDA memory it cannot use, and abort.
    gc.collect()
    error = _raised(lambda: next(iter(DataLoader(Boom(), batch_size=2, num_workers=1))))
    assert describe(error) == "loader worker 0 raised ValueError: cannot read sample 0"


@pytest.mark.slow  # a loader worker process, killed
@pytest.mark.timeout(60)
def test_a_killed_loader_worker_is_said_with_what_to_lower() -> None:
    loader = DataLoader(KillsItsWorker(), batch_size=2, num_workers=1, timeout=30)
    text = describe(_raised(lambda: next(iter(loader))))
    assert text.startswith("loader worker (pid ") and text.endswith(
        ") was killed (SIGKILL: most likely out of memory; lower trainer.batch_size, the input "
        "size or dataset.num_workers)"
    ), text


def test_an_allocation_that_cannot_succeed_is_said_in_words() -> None:
    error = _raised(lambda: torch.empty(2**50, dtype=torch.uint8))  # a pebibyte
    assert describe(error).startswith("this rank could not allocate 1024.0 TiB: RuntimeError: "), (
        describe(error)
    )


def test_anything_else_keeps_its_type_and_first_line() -> None:
    assert describe(ValueError("first\nsecond")) == "ValueError: first"
