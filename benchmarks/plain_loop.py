#!/usr/bin/env python
"""A hand-written data-parallel PyTorch training loop: the yardstick dpt is measured against.

Written the way a careful user writes one, with nothing taken from dpt: DistributedSampler and a
DataLoader, DistributedDataParallel, Adam, cross-entropy; pinned memory and non-blocking copies on
CUDA; the loss stays on the device and is read back only every --log-every steps. The data, model
and seeds are those of dpt's `model=mlp dataset=synthetic` and `model=resnet18 dataset=fake_images`,
so both do the same arithmetic on the same batches (the benchmark checks the losses agree).

    python benchmarks/plain_loop.py --model mlp --steps 200                     # one process
    python benchmarks/plain_loop.py --model resnet18 --nproc 2 --batch-size 32  # DDP on 2 procs
    torchrun --nproc_per_node=2 benchmarks/plain_loop.py --model mlp            # ... or torchrun

`--out FILE` makes rank 0 write, as JSON, the wall-clock time (time.time()) and the window's mean
loss at every logging step, and the time its first optimizer step returned: the benchmark computes
throughput and time-to-first-step from them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("mlp", "resnet18"), default="mlp")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=1, help="processes (DDP when > 1)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--num-samples", type=int, default=None, help="8192 (mlp), 2048 (resnet18)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="rank 0's timestamps, as JSON")
    return p.parse_args()


# --- data and model: the same as dpt's synthetic / fake_images and mlp / resnet18 -------------


def build_data(args: argparse.Namespace) -> Dataset:
    if args.model == "mlp":
        # Gaussian inputs labelled by a random linear teacher, from one seeded generator.
        n = args.num_samples or 8192
        g = torch.Generator().manual_seed(args.seed)
        teacher = torch.randn(32, 10, generator=g)
        x = torch.randn(n + 1024, 32, generator=g)  # dpt draws its 1024 val samples here too
        y = (x @ teacher).argmax(dim=1)
        return TensorDataset(x[:n], y[:n])
    from torchvision.transforms import v2

    transform = v2.Compose(
        [
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    size = (3, args.image_size, args.image_size)
    return FakeImages(args.num_samples or 2048, size, 10, transform, args.seed)


class FakeImages(Dataset):
    """The images and labels of torchvision's FakeData (and of dpt's fake_images), each drawn
    from a generator of its own. FakeData reseeds torch's global generator for every image,
    which on a CUDA build formats the call stack each time: its cost grows with the caller's
    depth and would weigh more in the deeper of the two loops."""

    def __init__(
        self, n: int, size: tuple[int, ...], classes: int, transform: Callable, offset: int
    ) -> None:
        from torchvision.transforms.functional import to_pil_image

        self.n, self.size, self.classes, self.transform, self.offset = (
            n, size, classes, transform, offset
        )  # fmt: skip
        self.to_pil_image = to_pil_image  # imported once, not in every fetch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        draws = torch.Generator().manual_seed(i + self.offset)
        image = self.to_pil_image(torch.randn(*self.size, generator=draws))
        return self.transform(image), int(torch.randint(0, self.classes, (1,), generator=draws))


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "mlp":
        return nn.Sequential(
            nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


# --- the loop -----------------------------------------------------------------------------------


def train(
    rank: int, world_size: int, args: argparse.Namespace, store: dist.Store | None = None
) -> None:
    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", rank)))
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # store=None: torchrun's environment (env://) says where to meet.
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # share the cores

    data = build_data(args)
    sampler = DistributedSampler(
        data, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=args.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.num_workers > 0,
    )
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if world_size > 1:
        model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )

    stamps: dict[int, float] = {}
    losses: dict[int, float] = {}
    window_loss = torch.zeros((), device=device)
    step, epoch, first_step = 0, 0, 0.0
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            inputs = inputs.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            if args.channels_last:
                inputs = inputs.contiguous(memory_format=torch.channels_last)
            with autocast:
                loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == 1:  # what stamped_train.py stamps for dpt: step() has returned
                first_step = time.time()
            window_loss += loss.detach()
            if step % args.log_every == 0:
                mean_loss = window_loss.item() / args.log_every  # the only host-device sync
                stamps[step], losses[step] = time.time(), mean_loss
                window_loss.zero_()
                if rank == 0:
                    print(f"epoch {epoch + 1} | step {step}/{args.steps} | loss {mean_loss:.4f}")
            if step == args.steps:
                break
        epoch += 1

    if rank == 0 and args.out is not None:
        record = {"stamps": stamps, "losses": losses, "world_size": world_size,
                  "first_step": first_step}  # fmt: skip
        args.out.write_text(json.dumps(record))
    if world_size > 1:
        dist.destroy_process_group()


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def spawned(local_rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    train(local_rank, world_size, args, store)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:  # torchrun started us
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    elif args.nproc == 1:
        train(0, 1, args)
    else:
        # This process holds the rendezvous store, on a port the OS picks and keeps: no window
        # in which another program takes a port that was free a moment before.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        mp.spawn(spawned, args=(args.nproc, store.port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
