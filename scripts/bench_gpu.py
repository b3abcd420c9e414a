"""The GPU path, in-process: ResNet-18 in bf16 and channels_last on synthetic 224 px batches that
already sit on the device (the model's ceiling), against the same training step fed from JPEG
files decoded on the GPU in batches (`decode_jpeg(list, device="cuda")`).

Every function takes the device, so the same code runs (slowly, with small sizes) on a CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from bench_common import Stat, paired_ratios
from bench_pipeline import files_of, gpu_batch_transform
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg, read_file

Batches = Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]


class JpegBytes(Dataset):
    """File bytes and a label: the loader workers only read, the GPU decodes."""

    def __init__(self, files: list[Path], length: int) -> None:
        self.files, self.length = files, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return read_file(str(self.files[index % len(self.files)])), index % 10


def _collate(
    samples: list[tuple[torch.Tensor, int]],
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    # One tensor for the whole batch: one shared-memory block (and file descriptor) per batch
    # instead of one per image, which is what exhausts descriptors at 256 images a batch.
    sizes = [len(s[0]) for s in samples]
    return torch.cat([s[0] for s in samples]), sizes, torch.tensor([s[1] for s in samples])


def synthetic_batches(device: torch.device, batch: int, image_size: int) -> Batches:
    inputs = torch.randn(batch, 3, image_size, image_size, device=device)
    inputs = inputs.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (batch,), device=device)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield inputs, labels

    return batches


def jpeg_batches(
    root: Path, device: torch.device, batch: int, image_size: int, workers: int
) -> Batches:
    loader = DataLoader(
        JpegBytes(files_of(root), length=batch * 1000),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        collate_fn=_collate,
        pin_memory=False,  # compressed bytes go to the decoder, not to a kernel
        persistent_workers=workers > 0,
        drop_last=True,
    )
    transform = gpu_batch_transform(image_size)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for flat, sizes, labels in loader:
            data = list(torch.split(flat, sizes))
            images = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
            inputs = transform(images).contiguous(memory_format=torch.channels_last)  # type: ignore[arg-type]
            yield inputs, labels.to(device, non_blocking=True)

    return batches


def images_per_s(
    device: torch.device, batches: Batches, model: torch.nn.Module, steps: int, warmup: int
) -> float:
    """bf16 autocast training steps (Adam, cross-entropy); timed after `warmup` steps."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start, seen = 0.0, 0
    for step, (inputs, labels) in enumerate(batches(), start=1):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step == warmup:
            sync()
            start = time.perf_counter()
        elif step > warmup:
            seen += len(labels)
        if step == warmup + steps:
            break
    sync()
    return seen / (time.perf_counter() - start)


def measure(
    root: Path,
    device: torch.device,
    batch: int = 256,
    image_size: int = 224,
    steps: int = 50,
    rounds: int = 3,
    workers: int = 8,
) -> dict[str, Stat]:
    """Synthetic on-device batches against GPU-decoded JPEGs, alternating round by round."""
    torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick the fastest kernels
    model = torchvision.models.resnet18(num_classes=10).to(device)
    model = model.to(memory_format=torch.channels_last)
    sources = {
        "synthetic": synthetic_batches(device, batch, image_size),
        "jpeg_gpu_decode": jpeg_batches(root, device, batch, image_size, workers),
    }
    rates: dict[str, list[float]] = {name: [] for name in sources}
    for _ in range(rounds):
        for name, batches in sources.items():
            rates[name].append(images_per_s(device, batches, model, steps, warmup=5))
    return {
        "synthetic": Stat.of(rates["synthetic"]),
        "jpeg_gpu_decode": Stat.of(rates["jpeg_gpu_decode"]),
        "jpeg_vs_synthetic": paired_ratios(rates["jpeg_gpu_decode"], rates["synthetic"]),
    }
