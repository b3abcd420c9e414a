"""Section `gpu`, the GPU path (needs CUDA; skipped, and said so in the report, without it):
ResNet-18 in bf16 and channels_last at 224 px, batch 256. In-process, the model on synthetic
batches that already sit on the device (the model's ceiling) against the same training step fed
from JPEG files decoded on the GPU in batches (`decode_jpeg(list, device="cuda")`); as
subprocesses, dpt against the plain loop on `fake_images`. Report: benchmarks/report/gpu.py.

Every in-process function takes the device, so the same code runs (slowly, with small sizes) on
a CPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg, read_file

from benchmarks.jobs import Job, Workload, child_env, run_rounds
from benchmarks.loops import loop_ratio_row
from benchmarks.pipeline import files_of, gpu_batch_transform, make_jpegs
from benchmarks.runner import Say, Stat, alternate, paired_ratios

Batches = Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor]]]


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """ResNet-18, bf16, channels_last, 224 px on one GPU: dpt against the plain loop on
    synthetic images; the model's ceiling against JPEGs decoded on the GPU."""
    if not torch.cuda.is_available():
        say("  no CUDA device: GPU section skipped")
        return {"gpu": None}
    root = make_jpegs(tmp / "gpu-coco", 200)
    workers = max(1, min(8, (os.cpu_count() or 2) - 2))
    in_process = measure(root, torch.device("cuda"), workers=workers)
    say("  in-process GPU measurements done")
    work = Workload(
        "resnet18", batch_size=256, warmup_steps=10, steps=40, image_size=224, device="cuda",
        precision="bf16-mixed", channels_last=True, num_workers=workers, num_samples=16384,
    )  # fmt: skip
    pair = (Job("plain", "single", 1, work), Job("dpt", "single", 1, work))
    env = child_env(args, "cuda")
    results = run_rounds([pair], max(3, args.rounds), tmp / "gpu", env, say, args.retried)
    return {
        "gpu": {
            "device": torch.cuda.get_device_name(),
            "software": f"torch {torch.__version__}, torchvision {torchvision.__version__}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cores": os.cpu_count(),
            "workers": workers,
            "in_process": in_process,
            "loop": loop_ratio_row(results, *pair),
        }
    }


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

    def rate(batches: Batches) -> float:
        return images_per_s(device, batches, model, steps, warmup=5)

    rates = alternate({name: functools.partial(rate, b) for name, b in sources.items()}, rounds)
    return {
        "synthetic": Stat.of(rates["synthetic"]),
        "jpeg_gpu_decode": Stat.of(rates["jpeg_gpu_decode"]),
        "jpeg_vs_synthetic": paired_ratios(rates["jpeg_gpu_decode"], rates["synthetic"]),
    }
