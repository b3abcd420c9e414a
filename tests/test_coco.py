"""CocoClassification, the image decoder and transforms, on the fixture of make_coco_fixture.py."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from dpt.data.coco import CocoClassification
from dpt.data.images import ImageDecodeError, read_image_rgb, train_transform, val_transform
from scripts.make_coco_fixture import make_fixture

# torchvision 0.29 deprecates its image decoders (in favour of TorchCodec) on every call.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The image decoding and encoding capabilities of TorchVision:DeprecationWarning"
)


@pytest.fixture(scope="module")
def fixture_info(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("coco")
    return root, make_fixture(root, seed=0)


@pytest.fixture(scope="module")
def root(fixture_info: tuple[Path, dict]) -> Path:
    return fixture_info[0]


def _labels(ds: CocoClassification) -> dict[int, int]:
    return dict(zip(ds.image_ids, ds.targets, strict=True))


def _index(ds: CocoClassification, image_id: int) -> int:
    return ds.image_ids.index(image_id)


# Written out from the annotations built in make_coco_fixture.train_specs, not read from the
# dict make_fixture returns: labels 0..4 are category ids 1, 3, 7, 42, 90.
FIRST = {101: 0, 102: 1, 103: 0, 104: 4, 107: 1, 108: 2, 109: 0, 110: 1, 111: 4}
LARGEST = {101: 0, 102: 4, 103: 1, 104: 4, 107: 1, 108: 2, 109: 0, 110: 1, 111: 0}


@pytest.mark.parametrize(("policy", "expected"), [("first", FIRST), ("largest", LARGEST)])
def test_labels_match_hand_computed(root: Path, policy: str, expected: dict[int, int]) -> None:
    labels = _labels(CocoClassification(root, label_policy=policy))
    assert {i: labels[i] for i in expected} == expected


def test_val_labels_by_policy(root: Path) -> None:
    # 511: cat 7 (area 300) comes first in the file, cat 1 (area 4000) is larger.
    assert _labels(CocoClassification(root, "val2017", "first"))[511] == 2
    assert _labels(CocoClassification(root, "val2017", "largest"))[511] == 0


def test_all_labels_match_generator(fixture_info: tuple[Path, dict]) -> None:
    root, expected = fixture_info
    for split in ("train2017", "val2017"):
        for policy in ("first", "largest"):
            ds = CocoClassification(root, split, policy)
            assert _labels(ds) == expected[split][policy]


def test_classes_targets_and_ids_line_up(root: Path) -> None:
    ds = CocoClassification(root)
    # Sorted by category id (1, 3, 7, 42, 90), not by the JSON order (90, 1, 7, 42, 3).
    assert ds.classes == ["red", "green", "blue", "yellow", "magenta"]
    assert ds.num_classes == 5
    assert ds.category_ids == [1, 3, 7, 42, 90]
    assert ds.cat_id_to_label == {1: 0, 3: 1, 7: 2, 42: 3, 90: 4}
    assert ds.class_to_idx == {"red": 0, "green": 1, "blue": 2, "yellow": 3, "magenta": 4}
    assert len(ds) == len(ds.targets) == len(ds.image_ids) == len(ds.samples) == 30
    assert ds.image_ids == sorted(ds.image_ids)  # the JSON lists images shuffled
    assert all(0 <= t < ds.num_classes for t in ds.targets)
    assert [label for _, label in ds.samples] == ds.targets
    assert ds.image_path(_index(ds, 102)) == root / "train2017" / "000000000102.jpg"


def test_images_without_usable_annotation_left_out(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="dpt"):
        train = CocoClassification(root)
        val = CocoClassification(root, "val2017")
    # 105: crowd annotations only; 106: none; 999: an annotation whose image does not exist.
    assert not {105, 106, 999} & set(train.image_ids)
    assert not {514, 515} & set(val.image_ids)
    assert len(val) == 13
    assert [r.getMessage() for r in caplog.records] == [
        "coco train2017: kept 30 of 32 images (2 without a non-crowd annotation)",
        "coco val2017: kept 13 of 15 images (2 without a non-crowd annotation)",
    ]


def test_grayscale_and_cmyk_come_out_rgb(root: Path) -> None:
    ds = CocoClassification(root)
    gray, label = ds[_index(ds, 107)]
    assert (gray.shape, gray.dtype, label) == ((3, 96, 80), torch.uint8, 1)
    # Green (40, 190, 60) as luma is about 130, copied to all three channels.
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    assert abs(int(gray[0, 48, 40]) - 130) <= 8
    cmyk, label = ds[_index(ds, 108)]
    assert (cmyk.shape, cmyk.dtype, label) == ((3, 120, 160), torch.uint8, 2)
    # Blue (40, 60, 220), stored as Adobe CMYK: the inversion must be undone.
    assert (cmyk[:, 60, 80].int() - torch.tensor([40, 60, 220])).abs().max() <= 12


def test_png_named_jpg_is_read(root: Path) -> None:
    ds = CocoClassification(root, "val2017")
    image, label = ds[_index(ds, 510)]
    assert (image.shape, label) == ((3, 48, 64), 4)
    assert image[:, 24, 32].tolist() == [200, 40, 200]  # lossless PNG: exact magenta


def test_bad_images_skipped_with_one_warning_each(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds = CocoClassification(root)
    bad = {109: "000000000109.jpg", 110: "000000000110.jpg"}  # truncated, missing
    with caplog.at_level(logging.WARNING, logger="dpt"):
        for _ in range(3):  # as if over three epochs
            for image_id in bad:
                assert ds[_index(ds, image_id)] is None
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    for message, name in zip(messages, bad.values(), strict=True):
        assert message.startswith(f"skipping unreadable image {root / 'train2017' / name}: ")
    assert "truncated" in messages[0]


def test_bad_images_raise_with_error_policy(root: Path) -> None:
    ds = CocoClassification(root, on_bad_image="error")
    for name in ("000000000109.jpg", "000000000110.jpg"):
        index = ds.image_ids.index(int(name[:-4]))
        with pytest.raises(RuntimeError, match=f"unreadable image .*{re.escape(name)}"):
            ds[index]
    val = CocoClassification(root, "val2017", on_bad_image="error")
    with pytest.raises(RuntimeError, match=r"000000000513\.jpg: not a known image format"):
        val[_index(val, 513)]


def test_missing_annotation_file(tmp_path: Path) -> None:
    (tmp_path / "train2017").mkdir()
    path = tmp_path / "annotations" / "instances_train2017.json"
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"COCO annotation file not found: {path}")
    ):
        CocoClassification(tmp_path)


def test_missing_image_dir(root: Path, tmp_path: Path) -> None:
    ann_file = root / "annotations" / "instances_train2017.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        CocoClassification(root, ann_file=ann_file, image_dir=tmp_path / "nowhere")


def test_truncated_annotation_json(root: Path, tmp_path: Path) -> None:
    text = (root / "annotations" / "instances_val2017.json").read_text()
    bad = tmp_path / "annotations" / "instances_val2017.json"
    bad.parent.mkdir()
    bad.write_text(text[: len(text) // 2])
    with pytest.raises(
        ValueError, match=re.escape(f"COCO annotation file is not valid JSON: {bad} (")
    ):
        CocoClassification(tmp_path, "val2017", image_dir=root / "val2017")


def test_overridden_paths(root: Path, tmp_path: Path) -> None:
    ann_file = tmp_path / "val.json"
    ann_file.write_text((root / "annotations" / "instances_val2017.json").read_text())
    ds = CocoClassification(tmp_path / "unused", ann_file=ann_file, image_dir=root / "val2017")
    assert len(ds) == 13
    assert ds[0] is not None


def test_unknown_category_rejected(tmp_path: Path) -> None:
    (tmp_path / "train2017").mkdir()
    content = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": 8, "height": 8}],
        "annotations": [{"id": 5, "image_id": 1, "category_id": 9, "area": 4, "iscrowd": 0}],
        "categories": [{"id": 1, "name": "a"}],
    }
    ann_dir = tmp_path / "annotations"
    ann_dir.mkdir()
    (ann_dir / "instances_train2017.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match="category_id 9"):
        CocoClassification(tmp_path)


@pytest.mark.parametrize(
    ("option", "value"), [("label_policy", "biggest"), ("on_bad_image", "ignore")]
)
def test_bad_options(root: Path, option: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{option} must be one of .*; got '{value}'"):
        CocoClassification(root, **{option: value})


def test_pycocotools_output_silenced(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    CocoClassification(root)
    assert capsys.readouterr().out == ""


def test_read_image_rgb_errors(root: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.jpg"
    with pytest.raises(ImageDecodeError, match=re.escape(str(missing))) as info:
        read_image_rgb(missing)
    assert isinstance(info.value, OSError)
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(ImageDecodeError, match="empty file"):
        read_image_rgb(empty)
    with pytest.raises(ImageDecodeError, match="truncated"):
        read_image_rgb(root / "val2017" / "000000000512.jpg")


def test_read_image_rgb_truncated_anywhere(tmp_path: Path) -> None:
    good = tmp_path / "good.jpg"
    Image.new("RGB", (32, 24), (10, 200, 30)).save(good, quality=90)
    data = good.read_bytes()
    assert read_image_rgb(good).shape == (3, 24, 32)
    cut = tmp_path / "cut.jpg"
    for length in (len(data) - 1, len(data) - 2, len(data) * 3 // 4, 200):
        cut.write_bytes(data[:length])
        with pytest.raises(ImageDecodeError):
            read_image_rgb(cut)
    # Bytes after the end marker (padding some writers add) are harmless.
    cut.write_bytes(data + b"\x00" * 16)
    assert read_image_rgb(cut).shape == (3, 24, 32)


def test_read_image_rgb_png_fallback(tmp_path: Path) -> None:
    path = tmp_path / "rgba.png"
    Image.new("RGBA", (10, 6), (1, 2, 3, 128)).save(path)
    image = read_image_rgb(path)
    assert (image.shape, image.dtype) == ((3, 6, 10), torch.uint8)
    assert image[:, 0, 0].tolist() == [1, 2, 3]


def test_transforms(root: Path) -> None:
    ds = CocoClassification(root, transform=train_transform(32))
    image, _ = ds[_index(ds, 102)]  # 160x120: downscaled crop
    assert (image.shape, image.dtype) == ((3, 32, 32), torch.float32)
    image, _ = ds[_index(ds, 101)]  # 64x48: may be upscaled
    assert image.shape == (3, 32, 32)
    raw = read_image_rgb(ds.image_path(_index(ds, 102)))
    out = val_transform(48)(raw)
    assert (out.shape, out.dtype) == ((3, 48, 48), torch.float32)
    # Normalized: a value of 0 maps to -mean/std, so the range is well outside [0, 1].
    assert out.min() < 0
    assert torch.equal(val_transform(48)(raw), out)  # val is deterministic


def test_fixture_is_small_and_deterministic(tmp_path: Path) -> None:
    first = make_fixture(tmp_path / "a", seed=0)
    second = make_fixture(tmp_path / "b", seed=0)
    assert first == second
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.*"))
    assert files_a == files_b
    assert all(
        (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files_a
    )
    assert sum((tmp_path / "a" / f).stat().st_size for f in files_a) < 200_000
