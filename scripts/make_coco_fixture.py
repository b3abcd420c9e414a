#!/usr/bin/env python
"""Write a tiny COCO-format data set (real JPEG files) for tests and smoke runs.

Layout, as in COCO 2017:

    OUT/annotations/instances_train2017.json   OUT/train2017/000000000101.jpg ...
    OUT/annotations/instances_val2017.json     OUT/val2017/000000000501.jpg ...

Categories (listed in the JSON out of id order on purpose): 1 red, 3 green, 7 blue,
42 yellow (no annotations), 90 magenta -> labels 0, 1, 2, 3, 4. Each annotation is drawn as a
box of its category's colour on a dark textured background, so a small CNN can learn the task.

Hand-built train images (the rest are one-box "filler" images):

    101  one box (cat 1)                                     first 0, largest 0
    102  boxes cat 3 (area 600), 90 (9900), 7 (2500)         first 1, largest 4
    103  crowd cat 7 (7680), cat 1 (400), cat 3 (2700)       first 0, largest 1
    104  cat 90 and cat 7 with equal areas (tie)             first 4, largest 4
    105  crowd annotations only                              left out
    106  no annotations                                      left out
    107  grayscale JPEG, cat 3                               label 1
    108  CMYK JPEG, cat 7                                    label 2
    109  truncated JPEG (cut halfway), cat 1                 unreadable
    110  file missing, cat 3                                 unreadable
    111  crowd cat 3, cat 90 (big box, area 1500), cat 1 (1600): first 4, largest 0

Val: 501-509 fillers, 510 a PNG saved as .jpg (readable), 511 cat 7 (300) then cat 1 (4000)
(first 2, largest 0), 512 truncated, 513 random bytes, 514 crowd only, 515 no annotations:
13 kept images, 11 of them readable.

Annotation ids decrease along the file, so sorting by id would reverse each image's
annotations: only a reader that keeps file order gets `first` right.

With `--image-folder DIR`, the same files are also laid out as an image folder (what
`dataset=image_folder` reads): DIR/train/<class>/<file> and DIR/val/<class>/<file>, each image
under its `first`-policy label's name (the unreadable files included; images without a label
and the missing file left out; yellow, which labels nothing, has no folder).

Usage: python scripts/make_coco_fixture.py --out DIR [--seed 0] [--image-folder DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

# (id, name, RGB); the order is the JSON order, deliberately not ascending.
CATEGORIES: list[tuple[int, str, tuple[int, int, int]]] = [
    (90, "magenta", (200, 40, 200)),
    (1, "red", (220, 40, 40)),
    (7, "blue", (40, 60, 220)),
    (42, "yellow", (230, 210, 40)),
    (3, "green", (40, 190, 60)),
]
COLORS = {cat_id: rgb for cat_id, _, rgb in CATEGORIES}
LABELS = {cat_id: label for label, cat_id in enumerate(sorted(COLORS))}
USED_CATEGORIES = (1, 3, 7, 90)  # 42 stays without annotations
SIZES = [(64, 48), (80, 96), (160, 120), (96, 96), (128, 72)]  # (width, height)
BBox = tuple[int, int, int, int]  # x, y, width, height, as in COCO


@dataclass
class Ann:
    category_id: int
    bbox: BBox
    area: float | None = None  # None: the box area; set it to mimic a thin, non-box object
    iscrowd: int = 0

    def area_value(self) -> float:
        return float(self.bbox[2] * self.bbox[3]) if self.area is None else self.area


@dataclass
class ImageSpec:
    image_id: int
    size: tuple[int, int]
    anns: list[Ann] = field(default_factory=list)
    # rgb | gray | cmyk | png (PNG bytes named .jpg) | truncated | garbage | missing
    kind: str = "rgb"

    @property
    def file_name(self) -> str:
        return f"{self.image_id:012d}.jpg"


def train_specs(rng: random.Random) -> list[ImageSpec]:
    """The hand-built train images of the module docstring, then 21 fillers."""
    specs = [
        ImageSpec(101, (64, 48), [Ann(1, (4, 4, 56, 40))]),
        ImageSpec(
            102,
            (160, 120),
            [Ann(3, (10, 10, 30, 20)), Ann(90, (40, 20, 110, 90)), Ann(7, (5, 60, 50, 50))],
        ),
        ImageSpec(
            103,
            (80, 96),
            [Ann(7, (0, 0, 80, 96), iscrowd=1), Ann(1, (5, 5, 20, 20)), Ann(3, (30, 30, 45, 60))],
        ),
        ImageSpec(104, (96, 96), [Ann(90, (0, 0, 48, 48)), Ann(7, (48, 48, 48, 48))]),
        ImageSpec(
            105, (128, 72), [Ann(1, (0, 0, 60, 60), iscrowd=1), Ann(3, (60, 0, 60, 60), iscrowd=1)]
        ),
        ImageSpec(106, (64, 48)),
        ImageSpec(107, (80, 96), [Ann(3, (10, 10, 60, 76))], kind="gray"),
        ImageSpec(108, (160, 120), [Ann(7, (20, 10, 120, 100))], kind="cmyk"),
        ImageSpec(109, (160, 120), [Ann(1, (10, 10, 140, 100))], kind="truncated"),
        ImageSpec(110, (64, 48), [Ann(3, (0, 0, 64, 48))], kind="missing"),
        ImageSpec(
            111,
            (128, 72),
            [
                Ann(3, (0, 0, 128, 72), area=9000, iscrowd=1),
                Ann(90, (0, 0, 100, 70), area=1500),
                Ann(1, (70, 20, 40, 40), area=1600),
            ],
        ),
    ]
    return specs + [_filler(image_id, rng) for image_id in range(120, 141)]


def val_specs(rng: random.Random) -> list[ImageSpec]:
    """13 kept images (a prime: no even split over 2 or 3 ranks), 11 of them readable."""
    specs = [_filler(image_id, rng) for image_id in range(501, 510)]
    return [
        *specs,
        ImageSpec(510, (64, 48), [Ann(90, (8, 4, 48, 40))], kind="png"),
        ImageSpec(511, (96, 96), [Ann(7, (70, 70, 20, 15)), Ann(1, (0, 0, 80, 50))]),
        ImageSpec(512, (160, 120), [Ann(90, (20, 20, 120, 80))], kind="truncated"),
        ImageSpec(513, (64, 48), [Ann(7, (0, 0, 64, 48))], kind="garbage"),
        ImageSpec(514, (80, 96), [Ann(1, (0, 0, 80, 96), iscrowd=1)]),
        ImageSpec(515, (96, 96)),
    ]


def _filler(image_id: int, rng: random.Random) -> ImageSpec:
    # Categories cycle so that every used class appears about equally often.
    category_id = USED_CATEGORIES[image_id % len(USED_CATEGORIES)]
    width, height = rng.choice(SIZES)
    w = rng.randint(width // 2, width)
    h = rng.randint(height // 2, height)
    x = rng.randint(0, width - w)
    y = rng.randint(0, height - h)
    return ImageSpec(image_id, (width, height), [Ann(category_id, (x, y, w, h))])


def expected_label(spec: ImageSpec, policy: str) -> int | None:
    """The label `spec` should get under `policy`; None when the image must be left out."""
    usable = [a for a in spec.anns if not a.iscrowd]
    if not usable:
        return None
    if policy == "first":
        return LABELS[usable[0].category_id]
    best = usable[0]
    for ann in usable[1:]:
        if ann.area_value() > best.area_value():  # strict: ties keep the earlier annotation
            best = ann
    return LABELS[best.category_id]


def render(spec: ImageSpec, rng: random.Random) -> Image.Image:
    """A dark textured background with one solid box per annotation, in file order."""
    width, height = spec.size
    # Texture drawn at 1/8 resolution and upsampled: it compresses well and stays deterministic.
    small = (max(1, width // 8), max(1, height // 8))
    noise = Image.frombytes("L", small, rng.randbytes(small[0] * small[1]))
    noise = noise.resize(spec.size, Image.Resampling.BILINEAR).point(lambda v: 30 + v * 40 // 255)
    img = Image.merge("RGB", (noise, noise, noise))
    draw = ImageDraw.Draw(img)
    jitter = rng.randint(-20, 20) if spec.kind == "rgb" else 0  # exact colours where tests look
    for ann in spec.anns:
        x, y, w, h = ann.bbox
        color = tuple(min(255, max(0, c + jitter)) for c in COLORS[ann.category_id])
        draw.rectangle((x, y, x + w - 1, y + h - 1), fill=color)
    return img


def encode(spec: ImageSpec, img: Image.Image, rng: random.Random) -> bytes | None:
    """The bytes of the file for `spec`; None for a file that must not exist."""
    if spec.kind == "missing":
        return None
    if spec.kind == "garbage":
        return b"this is not an image\n" + rng.randbytes(500)
    if spec.kind == "gray":
        img = img.convert("L")
    elif spec.kind == "cmyk":
        img = img.convert("CMYK")  # PIL writes an Adobe (inverted) CMYK JPEG
    buf = io.BytesIO()
    img.save(buf, format="PNG" if spec.kind == "png" else "JPEG", quality=85)
    data = buf.getvalue()
    # Cut halfway: the header is intact, the entropy-coded data and the end marker are not.
    return data[: len(data) // 2] if spec.kind == "truncated" else data


def coco_json(specs: list[ImageSpec], rng: random.Random) -> dict[str, Any]:
    """The COCO annotation file content; images shuffled, annotations interleaved across images."""
    images = [
        {"id": s.image_id, "file_name": s.file_name, "width": s.size[0], "height": s.size[1]}
        for s in specs
    ]
    rng.shuffle(images)
    queues = [[(s.image_id, a) for a in s.anns] for s in specs if s.anns]
    # An annotation for an image that does not exist: readers must ignore it.
    queues.append([(999, Ann(1, (0, 0, 10, 10)))])
    ordered: list[tuple[int, Ann]] = []
    while queues:  # interleave images while keeping each image's own annotation order
        queue = rng.choice(queues)
        ordered.append(queue.pop(0))
        if not queue:
            queues.remove(queue)
    annotations = [
        _ann_json(900_000 - position, image_id, ann)
        for position, (image_id, ann) in enumerate(ordered)
    ]
    categories = [{"id": c, "name": name, "supercategory": "color"} for c, name, _ in CATEGORIES]
    return {
        "info": {"description": "dpt test fixture", "version": "1.0"},
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }


def _ann_json(ann_id: int, image_id: int, ann: Ann) -> dict[str, Any]:
    x, y, w, h = ann.bbox
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": ann.category_id,
        "bbox": [x, y, w, h],
        "area": ann.area_value(),
        "iscrowd": ann.iscrowd,
        "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]],
    }


def write_split(out: Path, split: str, specs: list[ImageSpec], rng: random.Random) -> dict:
    """Write one split's images and annotation file; return what a reader should find."""
    image_dir = out / split
    image_dir.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        data = encode(spec, render(spec, rng), rng)
        if data is not None:
            (image_dir / spec.file_name).write_bytes(data)
    ann_dir = out / "annotations"
    ann_dir.mkdir(parents=True, exist_ok=True)
    content = coco_json(specs, rng)
    (ann_dir / f"instances_{split}.json").write_text(json.dumps(content, indent=1))
    bad_kinds = ("truncated", "garbage", "missing")
    return {
        "first": _labels(specs, "first"),
        "largest": _labels(specs, "largest"),
        "bad_files": [s.file_name for s in specs if s.kind in bad_kinds and s.anns],
        "left_out": sorted(s.image_id for s in specs if expected_label(s, "first") is None),
        "classes": [name for _, name, _ in sorted(CATEGORIES)],
    }


def _labels(specs: list[ImageSpec], policy: str) -> dict[int, int]:
    labels = {s.image_id: expected_label(s, policy) for s in specs}
    return {image_id: label for image_id, label in sorted(labels.items()) if label is not None}


def make_fixture(out: Path, seed: int = 0) -> dict[str, dict]:
    """Write the fixture under `out`; return per split the expected labels per policy
    ({image_id: label}, kept images only), the unreadable files, the left-out image ids and
    the class names in label order."""
    out = Path(out)
    rng = random.Random(seed)
    return {
        "train2017": write_split(out, "train2017", train_specs(rng), rng),
        "val2017": write_split(out, "val2017", val_specs(rng), rng),
    }


def write_image_folder(coco: Path, expected: dict[str, dict], out: Path) -> dict[str, int]:
    """The fixture's labelled files as `out/<train|val>/<class>/<file>`; files per split."""
    counts = {}
    for split, folder in (("train2017", "train"), ("val2017", "val")):
        info, copied = expected[split], 0
        for image_id, label in info["first"].items():
            source = coco / split / f"{image_id:012d}.jpg"
            if not source.exists():  # the fixture's missing file: nothing to copy
                continue
            target = out / folder / info["classes"][label] / source.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            copied += 1
        counts[folder] = copied
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write into")
    parser.add_argument("--seed", type=int, default=0, help="seed for sizes, boxes and texture")
    parser.add_argument(
        "--image-folder",
        type=Path,
        help="also lay the labelled images out as <class>/ folders here",
    )
    args = parser.parse_args(argv)
    expected = make_fixture(args.out, args.seed)
    for split, info in expected.items():
        print(
            f"{split}: {len(info['first'])} kept images, {len(info['bad_files'])} unreadable, "
            f"{len(info['left_out'])} left out"
        )
    if args.image_folder is not None:
        counts = write_image_folder(args.out, expected, args.image_folder)
        print(f"image folder {args.image_folder}: {counts['train']} train, {counts['val']} val")


if __name__ == "__main__":
    main()
