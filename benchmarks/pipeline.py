"""Section `pipeline`, the input pipeline of one loader worker: JPEG images per second for the
training sample (decode, random-resized crop, flip, normalize) against decoding alone, on the same
photo-sized files; the sample decoded at no more resolution than its crop needs
(dpt.data.crop_decode) against both; where CUDA is, batched decoding on the GPU too. Report:
benchmarks/report/pipeline.py.

A DataLoader worker runs one intra-op thread, so everything here runs with one thread. The files
are made up (a smooth colour field plus grain, 640x480, quality 90: about the size and entropy of
a COCO photo) and laid out as COCO, so the dpt variant is `CocoClassification.__getitem__` itself.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

from benchmarks.runner import Say, Stat, alternate, paired_ratios, time_calls
from dpt.data.coco import CocoClassification
from dpt.data.crop_decode import RandomResizedCropDecode
from dpt.data.images import IMAGENET_MEAN, IMAGENET_STD, read_image_rgb, train_transform

SPLIT = "train"


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """(3) images/s per loader worker: training transform against decode-only."""
    count, rounds = (6, 1) if args.smoke else (12, 2) if args.quick else (100, 5)
    root = make_jpegs(tmp / "coco", count)
    say(f"  {count} JPEGs of 640x480 written; timing one worker")
    rows = measure_cpu(root, image_size=224, rounds=rounds)
    if torch.cuda.is_available():
        rows += measure_gpu_decode(root, 224, batch=128, rounds=rounds, device=torch.device("cuda"))
    return {"pipeline": rows, "pipeline_files": count}


def make_jpegs(root: Path, count: int, size: tuple[int, int] = (640, 480), seed: int = 0) -> Path:
    """`count` JPEGs under root/train/ and a one-category COCO annotation file; returns root."""
    rng = np.random.default_rng(seed)
    (root / SPLIT).mkdir(parents=True)
    (root / "annotations").mkdir()
    width, height = size
    images, annotations = [], []
    for i in range(1, count + 1):
        name = f"{i:012d}.jpg"
        _photo_like(rng, width, height).save(root / SPLIT / name, quality=90)
        images.append({"id": i, "file_name": name, "width": width, "height": height})
        box = [width / 4, height / 4, width / 2, height / 2]
        annotations.append(
            {"id": i, "image_id": i, "category_id": 1, "bbox": box, "area": box[2] * box[3]}
        )
    coco = {"images": images, "annotations": annotations, "categories": [{"id": 1, "name": "x"}]}
    (root / "annotations" / f"instances_{SPLIT}.json").write_text(json.dumps(coco))
    return root


def _photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    # Pure noise compresses to ~5x a photo's size and flat colour to a tenth: a smooth field with
    # grain lands where photos do (about 50-100 kB at 640x480, quality 90).
    coarse = rng.integers(0, 256, (height // 40, width // 40, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), np.float32)
    grain = rng.normal(0.0, 6.0, smooth.shape)
    return Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8))


def files_of(root: Path) -> list[Path]:
    return sorted((root / SPLIT).glob("*.jpg"))


@dataclass(frozen=True)
class Contender:
    """One row of the section: `sample(i)` for every file i per pass, its images/s as a ratio,
    round by round, to the contender named `baseline` (and to `also_vs`, where given)."""

    decoder: str
    what: str
    sample: Callable[[int], Any]
    baseline: str = "decode_jpeg: decode only"
    also_vs: str | None = None

    @property
    def name(self) -> str:
        return f"{self.decoder}: {self.what}"


def cpu_contenders(root: Path, image_size: int) -> list[Contender]:
    """The rows, in the report's order; each a function of the sample index that reads its file
    (a loader worker's work for one sample). A new kind of input adds its contenders here."""
    files = files_of(root)
    dataset = CocoClassification(root, SPLIT, transform=train_transform(image_size))
    crop_flip = v2.Compose(
        [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
    )
    reduced = RandomResizedCropDecode(image_size)
    pil_train = v2.Compose(
        [
            v2.RandomResizedCrop(image_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    sample = "decode_jpeg: dpt train sample"
    return [
        Contender(
            "decode_jpeg",
            "decode only",
            lambda i: decode_jpeg(read_file(str(files[i])), mode=ImageReadMode.RGB),
        ),
        Contender("decode_jpeg", "dpt train sample", lambda i: dataset[i]),
        Contender(
            "decode_jpeg", "crop+flip, uint8 out", lambda i: crop_flip(read_image_rgb(files[i]))
        ),
        # Decoding at 1/2, 1/4, 1/8 where the crop allows (PIL's draft), decode_jpeg elsewhere.
        Contender(
            "PIL draft / decode_jpeg",
            "reduced decode",
            lambda i: reduced(files[i].read_bytes(), str(files[i])),
            also_vs=sample,
        ),
        Contender("PIL", "decode only", lambda i: _pil_rgb(files[i]), "PIL: decode only"),
        Contender(
            "PIL",
            "train transform",
            lambda i: pil_train(_pil_rgb(files[i])),
            "PIL: decode only",
            also_vs=sample,
        ),
    ]


def _pil_rgb(path: Path) -> Image.Image:
    with Image.open(path) as img:
        return img.convert("RGB")  # convert() decodes the whole image


def measure_cpu(root: Path, image_size: int, rounds: int) -> list[dict[str, Any]]:
    """Images/s of one worker per contender, each round one pass over the files per contender."""
    torch.manual_seed(0)
    contenders = cpu_contenders(root, image_size)
    count = len(files_of(root))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what a DataLoader worker runs with; later sections get it back

    def one_pass(sample: Callable[[int], Any]) -> float:
        (elapsed,) = time_calls(lambda: [sample(i) for i in range(count)], 1)
        return count / elapsed

    try:  # a warmup round first: the page cache, the allocators
        passes = {c.name: functools.partial(one_pass, c.sample) for c in contenders}
        rates = alternate(passes, rounds, warmup=1)
    finally:
        torch.set_num_threads(threads)
    return [_row(c, rates) for c in contenders]


def _row(contender: Contender, rates: dict[str, list[float]]) -> dict[str, Any]:
    values = rates[contender.name]
    row = {
        "decoder": contender.decoder,
        "what": contender.what,
        "images_s": Stat.of(values),
        "vs_decode": paired_ratios(values, rates[contender.baseline]),
        "baseline": contender.baseline,
    }
    if contender.also_vs is not None:
        row["vs_sample"] = paired_ratios(values, rates[contender.also_vs])
    return row


def gpu_batch_transform(image_size: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The training transform on decoded images on the device: a random-resized crop per image,
    then flip and normalize the whole batch (bf16 is what the model eats)."""
    crop = v2.RandomResizedCrop(image_size, antialias=True)
    flip = v2.RandomHorizontalFlip()
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)

    def transform(images: list[torch.Tensor]) -> torch.Tensor:
        batch = torch.stack([flip(crop(img)) for img in images]).float().div_(255)
        return (batch - mean.to(batch.device)) / std.to(batch.device)

    return transform


def measure_gpu_decode(
    root: Path, image_size: int, batch: int, rounds: int, device: torch.device
) -> list[dict[str, Any]]:
    """Batched `decode_jpeg(list, device=...)` alone and with the training transform on the device;
    the compressed bytes are already in host memory (what loader workers would hand over)."""
    data = [read_file(str(p)) for p in files_of(root)]
    batches = [[data[(k * batch + i) % len(data)] for i in range(batch)] for k in range(4)]
    transform = gpu_batch_transform(image_size)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def decode(items: list[torch.Tensor]) -> list[torch.Tensor]:
        return decode_jpeg(items, mode=ImageReadMode.RGB, device=device)  # type: ignore[return-value]

    def rate(fn: Callable[[list[torch.Tensor]], Any]) -> float:
        sync()
        (elapsed,) = time_calls(lambda: ([fn(b) for b in batches], sync()), 1)
        return len(batches) * batch / elapsed

    variants = {"decode only": decode, "train transform": lambda b: transform(decode(b))}
    contenders = {name: functools.partial(rate, fn) for name, fn in variants.items()}
    rates = alternate(contenders, rounds, warmup=1)
    return [
        {
            "decoder": f"decode_jpeg batched on {device.type}",
            "what": name,
            "images_s": Stat.of(values),
            "vs_decode": paired_ratios(values, rates["decode only"]),
        }
        for name, values in rates.items()
    ]
