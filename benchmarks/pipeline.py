"""Section `pipeline`, the input pipeline of one loader worker: images per second of dpt's
training sample on the same photo-sized JPEGs in each form dpt reads them: files
(`CocoClassification.__getitem__`, what `dataset=coco` trains on), and the same images as
WebDataset shards written by `dpt-shards`, read from a folder and over HTTP through dpt's shard
cache (`ShardsData.train[i]`, what `dataset=shards` trains on). Each against decoding alone, and
against the recipes dpt's sample replaced (the whole image decoded, then `train_transform`; PIL's
classic recipe); at 224 px and at 128 px (where 3 crops in 4 also decode at half the size);
where CUDA is, batched decoding on the GPU too. Report: benchmarks/report/pipeline.py.

A DataLoader worker runs one intra-op thread, so everything here runs with one thread. Every
sample is drawn as training draws it, from torch's generator seeded with the sample's index
(dpt/data/seeded.py seeds it per sample), so every contender makes the same crops: a ratio
compares the same work. The files are made up (a smooth colour field plus grain, 640x480,
quality 90: about the size and entropy of a COCO photo) and laid out as COCO.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

from benchmarks.runner import Say, Stat, alternate, paired_ratios, run_process, time_calls
from dpt.data.coco import CocoClassification
from dpt.data.crop_decode import BOX_DECODER, RandomResizedCropDecode
from dpt.data.images import IMAGENET_MEAN, IMAGENET_STD, read_image_rgb, train_transform
from dpt.data.shard_cache import CacheStats
from dpt.data.shards import ShardsData

SPLIT = "train2017"  # the COCO split that dpt-shards --coco writes as the training split
SIZE, SMALL_SIZE = 224, 128  # at 128 px from 640x480, 3 crops in 4 decode reduced
# The rows the report reads by name (the variant column): dpt's training sample in each form.
SAMPLE = "dpt train sample"  # from files: CocoClassification with dpt's decoder
LOCAL_SHARDS = "dpt train sample, local shards"
HTTP_SHARDS = "dpt train sample, shards over HTTP"
HTTP_SMALL_CACHE = "dpt train sample, shards over HTTP, cache < set"
DECODE_ONLY = "decode only"
# The decoders of dpt's samples (dpt.data.crop_decode): its box decoder where it was built, else
# PIL's draft for a reduced decode and decode_jpeg for a whole one.
REDUCED = "dpt box decoder" if BOX_DECODER else "PIL draft / decode_jpeg"
COUNTS = ("hits", "misses", "bytes_downloaded", "evictions")  # CacheStats' counters


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """(3) images/s per loader worker: dpt's sample from files and from shards, local and over
    HTTP, against decode-only and the recipes it replaced."""
    # A pass takes ~0.2 s, and on a shared 2-core VM one in a few runs up to 30 % slow or fast,
    # the next one not: many rounds (cheap: ~3 s each) for medians that hold to a few percent.
    count, rounds = (6, 1) if args.smoke else (12, 2) if args.quick else (100, 30)
    root = make_jpegs(tmp / "coco", count)
    shards = write_shards(root, tmp / "shards", tmp / "dpt-shards.txt")
    sizes = shard_sizes(shards)
    say(f"  {count} JPEGs of 640x480 written, as {len(sizes)} shards too; timing one worker")
    with serve_folder(shards) as url:
        inputs = Inputs(root, shards, url, tmp / "caches", sum(sizes), max(sizes))
        rows = measure_cpu(inputs, rounds=rounds)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        rows += measure_gpu_decode(root, SIZE, batch=128, rounds=rounds, device=cuda)
    shard_info = {"count": len(sizes), "bytes": sum(sizes), "largest": max(sizes)}
    return {"pipeline": rows, "pipeline_files": count, "pipeline_shards": shard_info}


def make_jpegs(root: Path, count: int, size: tuple[int, int] = (640, 480), seed: int = 0) -> Path:
    """`count` JPEGs under root/train2017/ and a one-category COCO annotation file; returns root."""
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


# --- the shards ---------------------------------------------------------------------------------


def write_shards(root: Path, out: Path, console: Path) -> Path:
    """The COCO set under `root` as shards in `out`, by `dpt-shards` itself. Shards of a quarter
    of the set (2 MB for 100 files): 4 to 6 shards, more than the 3 a reader keeps open, so every
    pass opens each shard again, through the cache for a remote one, as an epoch over a large
    set does. A subprocess: dpt-shards sets up the `dpt` logger of the process it runs in."""
    total = sum(path.stat().st_size for path in files_of(root))
    shard_mb = total / 4 / 2**20  # dpt-shards' MB are MiB
    cmd = [sys.executable, "-m", "dpt.commands.shards", "--coco", str(root), "--out", str(out),
           "--shard-size-mb", f"{shard_mb:.6f}"]  # fmt: skip
    run_process(cmd, console, dict(os.environ), timeout_s=300, what="dpt-shards")
    return out


def shard_sizes(out: Path) -> list[int]:
    """Bytes of each training shard, as the split's descriptor lists them."""
    descriptor = json.loads((out / f"{SPLIT}.json").read_text())
    return [int(shard["filesize"]) for shard in descriptor["shardlist"]]


@contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """`folder` over HTTP on loopback (the test suite's server: Python's http.server in a thread
    of this process) for the length of a `with`: its URL."""
    from tests.http_server import serve  # the repo's tests are a package; the benchmark runs there

    with serve(folder) as served:
        yield served.url


@dataclass(frozen=True)
class Inputs:
    """The section's images in every form: files laid out as COCO, the same as shards in a
    folder and served over HTTP; a folder for the shard caches (each contender its own)."""

    root: Path
    shards: Path
    url: str
    caches: Path
    set_bytes: int  # all training shards
    largest: int  # the largest shard: a cache must hold it


@dataclass(frozen=True)
class CacheProbe:
    """A remote ShardsData's cache: its limit, and its counters in this (the reading) process."""

    data: ShardsData
    limit_bytes: int

    def counts(self) -> dict[str, int]:
        # The cache is made on the first read of the process; before that, nothing was counted.
        cache = self.data.train._cache
        stats = cache.stats if cache is not None else CacheStats()
        return {key: getattr(stats, key) for key in COUNTS}


def shards_data(root: str, image_size: int, cache_dir: Path, limit_bytes: int) -> ShardsData:
    """`dataset=shards` as a run builds it; bad data raises (a skipped sample would time as
    fast)."""
    return ShardsData(
        root=root, image_size=image_size, num_workers=0, on_bad_image="error", shuffle_window=1,
        cache_dir=str(cache_dir), cache_limit_gb=limit_bytes / 1e9, retries=0, outage_s=0.0,
        max_skipped_fraction=0.0, timeout_s=30.0, seed=0,
    )  # fmt: skip


# --- the contenders -----------------------------------------------------------------------------


def contender_name(decoder: str, what: str, size: int | None = None) -> str:
    return f"{decoder}: {what}" + (f", {size} px" if size else "")


DECODE_JPEG_ONLY = contender_name("decode_jpeg", DECODE_ONLY)
PIL_ONLY = contender_name("PIL", DECODE_ONLY)


@dataclass(frozen=True)
class Contender:
    """One row of the section: `sample(i)` for every file i per pass, its images/s as a ratio,
    round by round, to the contender named `baseline` (a decode-only row) and to `also_vs`
    (dpt's sample from files at the same size), where given."""

    decoder: str
    what: str
    sample: Callable[[int], Any]
    size: int | None = None  # output pixels; None: decoding alone
    baseline: str = DECODE_JPEG_ONLY
    also_vs: str | None = None
    cache: CacheProbe | None = None  # a remote shard reader's cache

    @property
    def name(self) -> str:
        return contender_name(self.decoder, self.what, self.size)


def cpu_contenders(inputs: Inputs) -> list[Contender]:
    """The rows, in the report's order; each a function of the sample index that reads its file
    or shard (a loader worker's work for one sample). A new kind of input adds its contenders
    here."""
    files = files_of(inputs.root)
    return [
        Contender(
            "decode_jpeg",
            DECODE_ONLY,
            lambda i: decode_jpeg(read_file(str(files[i])), mode=ImageReadMode.RGB),
        ),
        # dpt's sample in every form first, next to decode-only in each round: the ratios the
        # targets judge are taken between neighbours in time.
        *dpt_samples(inputs, SIZE, remote=True),
        # At 128 px most crops decode reduced: the sample against decode-only where it pays.
        *dpt_samples(inputs, SMALL_SIZE, remote=False),
        whole_decode_sample(inputs, SMALL_SIZE),
        *other_recipes(inputs),
    ]


def other_recipes(inputs: Inputs) -> list[Contender]:
    """At 224 px, from files: dpt's decoder without its data set, the recipes it replaced, and
    PIL's classic one against PIL's own decode."""
    files = files_of(inputs.root)
    crop_flip = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])
    reduced = RandomResizedCropDecode(SIZE)
    pil_train = v2.Compose(
        [
            v2.RandomResizedCrop(SIZE, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    sample = contender_name(REDUCED, SAMPLE, SIZE)
    return [
        # dpt's decoder on the bytes in hand, no data set around it.
        Contender(
            REDUCED,
            "decoder alone",
            lambda i: reduced(files[i].read_bytes(), str(files[i])),
            SIZE,
            also_vs=sample,
        ),
        whole_decode_sample(inputs, SIZE),
        Contender(
            "decode_jpeg",
            "crop+flip, uint8 out",
            lambda i: crop_flip(read_image_rgb(files[i])),
            SIZE,
            also_vs=sample,
        ),
        Contender("PIL", DECODE_ONLY, lambda i: _pil_rgb(files[i]), baseline=PIL_ONLY),
        Contender(
            "PIL",
            "train transform",
            lambda i: pil_train(_pil_rgb(files[i])),
            SIZE,
            baseline=PIL_ONLY,
            also_vs=sample,
        ),
    ]


def dpt_samples(inputs: Inputs, size: int, remote: bool) -> list[Contender]:
    """dpt's training sample from files, from local shards and (`remote`) from the shards over
    HTTP: through a cache that holds the set (hits once warm), and through one of half the set
    (every shard evicted before it is read again: a download each time)."""
    files = CocoClassification(
        inputs.root, SPLIT, decoder=RandomResizedCropDecode(size), on_bad_image="error"
    )
    local = shards_data(str(inputs.shards), size, inputs.caches / f"local-{size}", 0)
    sample = contender_name(REDUCED, SAMPLE, size)
    rows = [
        Contender(REDUCED, SAMPLE, lambda i: files[i], size),
        Contender(REDUCED, LOCAL_SHARDS, lambda i: local.train[i], size, also_vs=sample),
    ]
    if remote:
        caches = {
            HTTP_SHARDS: ("http", 2 * inputs.set_bytes),
            HTTP_SMALL_CACHE: ("http-small", _small_cache(inputs)),
        }
        for what, (folder, limit) in caches.items():  # a fresh cache folder each
            data = shards_data(inputs.url, size, inputs.caches / f"{folder}-{size}", limit)
            probe = CacheProbe(data, limit)
            rows.append(
                Contender(REDUCED, what, data.train.__getitem__, size, also_vs=sample, cache=probe)
            )
    return rows


def _small_cache(inputs: Inputs) -> int:
    """Half the set (at least its largest shard): read in order, every shard is evicted before
    its next turn, so each pass downloads the whole set again."""
    limit = max(inputs.set_bytes // 2, inputs.largest)
    if limit >= inputs.set_bytes:  # one shard: no limit below the set holds it
        raise RuntimeError("pipeline: the shards are too few for a cache smaller than the set")
    return limit


def whole_decode_sample(inputs: Inputs, size: int) -> Contender:
    """The sample dpt's decoder replaced: the whole JPEG decoded (`decode_jpeg`), then
    `train_transform`, through the same data set class."""
    whole = CocoClassification(
        inputs.root, SPLIT, transform=train_transform(size), on_bad_image="error"
    )
    sample = contender_name(REDUCED, SAMPLE, size)
    return Contender(
        "decode_jpeg", "train_transform after a whole decode", lambda i: whole[i], size,
        also_vs=sample,
    )  # fmt: skip


def _pil_rgb(path: Path) -> Image.Image:
    with Image.open(path) as img:
        return img.convert("RGB")  # convert() decodes the whole image


# --- measuring ----------------------------------------------------------------------------------


def measure_cpu(inputs: Inputs, rounds: int) -> list[dict[str, Any]]:
    """Images/s of one worker per contender, each round one pass over the files per contender;
    a remote reader's cache counters per pass."""
    contenders = cpu_contenders(inputs)
    count = len(files_of(inputs.root))
    counts: dict[str, list[dict[str, int]]] = {c.name: [] for c in contenders}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what a DataLoader worker runs with; later sections get it back

    def one_pass(contender: Contender) -> float:
        before = contender.cache.counts() if contender.cache else {}
        (elapsed,) = time_calls(lambda: [_seeded(contender.sample, i) for i in range(count)], 1)
        if contender.cache:
            after = contender.cache.counts()
            counts[contender.name].append({k: after[k] - before[k] for k in COUNTS})
        return count / elapsed

    try:  # a warmup round first: the page cache, the allocators, a remote reader's downloads
        passes = {c.name: functools.partial(one_pass, c) for c in contenders}
        rates = alternate(passes, rounds, warmup=1)
        check_same_crops(contenders, count)
    finally:
        torch.set_num_threads(threads)
    return [_row(c, rates, counts[c.name]) for c in contenders]


def _seeded(sample: Callable[[int], Any], index: int) -> Any:
    # As SeededSamples seeds a training sample (CPU generator only: torch.manual_seed would also
    # queue CUDA's seeding): every contender draws the same crop and flip for sample `index`.
    torch.default_generator.manual_seed(index)
    return sample(index)


def check_same_crops(contenders: list[Contender], count: int) -> None:
    """dpt's sample from every form equals the one from files (same bytes, same draws), for the
    first and the last sample: a ratio between them compares the same work."""
    for reference in (c for c in contenders if c.what == SAMPLE):
        for other in (c for c in contenders if c.also_vs == reference.name):
            if not other.what.startswith(SAMPLE):
                continue  # another recipe: other pixels, same crop
            for index in (0, count - 1):
                expected, got = _seeded(reference.sample, index), _seeded(other.sample, index)
                if got is None or not torch.equal(expected[0], got[0]):
                    raise RuntimeError(f"pipeline: {other.name} differs from files at {index}")


def _row(
    contender: Contender, rates: dict[str, list[float]], passes: list[dict[str, int]]
) -> dict[str, Any]:
    values = rates[contender.name]
    row: dict[str, Any] = {
        "decoder": contender.decoder,
        "what": contender.what,
        "size": contender.size,
        "images_s": Stat.of(values),
        "vs_decode": paired_ratios(values, rates[contender.baseline]),
        "baseline": contender.baseline,
    }
    if contender.also_vs is not None:
        row["vs_sample"] = paired_ratios(values, rates[contender.also_vs])
    if contender.cache is not None:
        row["cache"] = _cache_summary(contender.cache.limit_bytes, passes)
    return row


def _cache_summary(limit_bytes: int, passes: list[dict[str, int]]) -> dict[str, Any]:
    """The first (warmup) pass's counters, a cold cache's, and the timed passes' summed."""
    timed = {key: sum(p[key] for p in passes[1:]) for key in COUNTS}
    opened = timed["hits"] + timed["misses"]
    return {
        "limit_bytes": limit_bytes,
        "first_pass": passes[0],
        "timed": timed,
        "timed_passes": len(passes) - 1,
        "hit_rate": timed["hits"] / opened if opened else 0.0,
        "first_hit_rate": CacheStats(passes[0]["hits"], passes[0]["misses"]).hit_rate,
    }


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
            "size": image_size if name != "decode only" else None,
            "images_s": Stat.of(values),
            "vs_decode": paired_ratios(values, rates["decode only"]),
        }
        for name, values in rates.items()
    ]
