"""`dataset=image_folder`: the layout scan and its one-line errors, the seeded split, decoding,
the bad-image policy, and augmentation that does not depend on the loader's worker count."""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate
from PIL import Image

from dpt.data.folder_layout import IMAGE_EXTENSIONS, Layout, check_layout, scan_layout
from dpt.data.image_folder import ImageFolderData
from dpt.data.images import UnreadableImageError, read_image_rgb
from dpt.data.loaders import build_loaders
from dpt.data.position import DataPosition
from dpt.data.seeded import SeededSamples
from dpt.distributed import DistEnv
from dpt.errors import ConfigError
from dpt.loop.parts import build_data
from tests.helpers import compose

CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


def _image(path: Path, shade: int = 100, size: tuple[int, int] = (24, 20)) -> Path:
    """A small image, JPEG or PNG by its suffix, with a gradient so crops and flips show."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.linear_gradient("L").resize(size).point(lambda v: (v + shade) % 256)
    img = Image.merge("RGB", (img, img.transpose(Image.Transpose.FLIP_LEFT_RIGHT), img))
    img.save(path, format="PNG" if path.suffix.lower() == ".png" else "JPEG", quality=90)
    return path


def _tree(root: Path, counts: dict[str, int], suffix: str = ".jpg") -> Path:
    """`counts[<split>/<class>]` images in each class folder."""
    for folder, count in counts.items():
        for i in range(count):
            _image(root / folder / f"{i:03d}{suffix}", shade=10 * i)
    return root


def _paths(samples: list[tuple[str, int]], root: Path) -> list[tuple[str, int]]:
    return [(str(Path(path).relative_to(root)), label) for path, label in samples]


# --- the layout -------------------------------------------------------------------------------


def test_image_extensions_are_pils_readable_suffixes() -> None:
    assert {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif"} <= IMAGE_EXTENSIONS
    assert all(ext == ext.lower() and ext.startswith(".") for ext in IMAGE_EXTENSIONS)
    assert ".pdf" not in IMAGE_EXTENSIONS  # PIL writes PDFs but cannot read them


def test_scan_sorts_classes_walks_subfolders_and_ignores_other_files(tmp_path: Path) -> None:
    train = tmp_path / "train"
    _image(train / "dog" / "b.jpg")
    _image(train / "dog" / "a.JPEG")  # the suffix is matched in any case
    _image(train / "cat" / "z.png")
    _image(train / "cat" / "indoor" / "y.jpg")  # a subfolder still belongs to its class
    _image(train / "Zebra" / "x.jpg")  # upper case sorts first, as sorted() does
    for ignored in ("dog/notes.txt", "cat/.hidden.jpg", ".DS_Store", "README.txt"):
        (train / ignored).write_text("not an image")
    _image(train / ".ipynb_checkpoints" / "c.jpg")  # hidden folders are not classes
    _image(train / "cat" / ".thumbs" / "t.jpg")
    layout = scan_layout(tmp_path, val_fraction=0, seed=0)
    assert layout.classes == ["Zebra", "cat", "dog"]
    assert _paths(layout.train, tmp_path) == [
        ("train/Zebra/x.jpg", 0),
        ("train/cat/indoor/y.jpg", 1),
        ("train/cat/z.png", 1),
        ("train/dog/a.JPEG", 2),
        ("train/dog/b.jpg", 2),
    ]
    assert (layout.val, layout.val_source) == ([], "none")


def test_val_folder_is_used_and_val_fraction_ignored(tmp_path: Path) -> None:
    _tree(tmp_path, {"train/a": 3, "train/b": 2, "val/a": 1, "val/b": 2})
    layout = scan_layout(tmp_path, val_fraction=0.5, seed=0)
    assert layout.val_source == "folder"
    assert len(layout.train) == 5  # nothing held out of train
    assert _paths(layout.val, tmp_path) == [
        ("val/a/000.jpg", 0),
        ("val/b/000.jpg", 1),
        ("val/b/001.jpg", 1),
    ]


def _no_train(root: Path) -> None:
    (root / "training" / "a").mkdir(parents=True)


def _images_in_train(root: Path) -> None:
    _image(root / "train" / "1.jpg")


def _stray_image(root: Path) -> None:
    _tree(root, {"train/a": 2})
    _image(root / "train" / "stray.png")


def _empty_class(root: Path) -> None:
    _tree(root, {"train/a": 2, "train/b": 0, "train/c": 0})
    (root / "train" / "b").mkdir()
    (root / "train" / "c").mkdir()
    (root / "train" / "c" / "notes.txt").write_text("x")


def _no_images(root: Path) -> None:
    (root / "train" / "a").mkdir(parents=True)
    (root / "train" / "a" / "labels.csv").write_text("x")


def _val_differs(root: Path) -> None:
    _tree(root, {"train/a": 1, "train/b": 1, "val/a": 1, "val/x": 1})


def _val_has_more(root: Path) -> None:
    _tree(root, {"train/a": 1, "val/a": 1, "val/x": 1, "val/y": 1})


def _val_empty(root: Path) -> None:
    _tree(root, {"train/a": 1})
    (root / "val").mkdir()


def _single_images(root: Path) -> None:
    _tree(root, {"train/a": 1, "train/b": 1})


BAD_LAYOUTS: list[tuple[str, Callable[[Path], None], str]] = [
    ("no train folder", _no_train,
     "dataset.root={r}: no train/ folder (expected {r}/train/<class>/<images>)"),
    ("images directly in train", _images_in_train,
     "dataset.root={r}: {r}/train has no class folders (expected {r}/train/<class>/<images>)"),
    ("image beside class folders", _stray_image,
     "dataset.root={r}: {r}/train/stray.png is an image outside any class folder; "
     "move it into {r}/train/<class>/"),
    ("empty class folders", _empty_class,
     "dataset.root={r}: class folder {r}/train/b has no image files; add images or remove it "
     "(and 1 more empty class folder)"),
    ("no image at all", _no_images,
     "dataset.root={r}: no image files in the class folders of {r}/train "
     "(expected {r}/train/<class>/<images>, e.g. .jpg or .png files)"),
    ("val classes differ", _val_differs,
     "dataset.root={r}: {r}/val has classes that {r}/train lacks: x; "
     "{r}/val lacks classes that {r}/train has: b "
     "(val/ must have the same class folders as train/)"),
    ("val has more classes", _val_has_more,
     "dataset.root={r}: {r}/val has classes that {r}/train lacks: x, y "
     "(val/ must have the same class folders as train/)"),
    ("val without class folders", _val_empty,
     "dataset.root={r}: {r}/val has no class folders (expected {r}/val/<class>/<images>)"),
    ("nothing to hold out", _single_images,
     "dataset.val_fraction=0.1: every class in {r}/train has a single image, so none can be "
     "held out for validation; set dataset.val_fraction=0 or add {r}/val/<class>/<images>"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "message"), [c[1:] for c in BAD_LAYOUTS],
                         ids=[c[0] for c in BAD_LAYOUTS])  # fmt: skip
def test_bad_layouts_name_the_path_in_one_line(
    tmp_path: Path, make: Callable[[Path], None], message: str
) -> None:
    make(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_layout(tmp_path, val_fraction=0.1)
    assert str(info.value) == message.format(r=tmp_path)


def test_missing_root_and_bad_fractions(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(
        ConfigError, match=f"^{re.escape(f'dataset.root={missing}')}: folder not found$"
    ):
        check_layout(missing, 0.1)
    _tree(tmp_path, {"train/a": 2})
    for fraction in (1.5, 1.0, -0.1, float("nan")):
        with pytest.raises(ConfigError) as info:
            check_layout(tmp_path, fraction)
        assert str(info.value) == f"dataset.val_fraction={fraction:g}: must be >= 0 and < 1"


def test_many_differing_classes_are_cut_short(tmp_path: Path) -> None:
    _tree(tmp_path, {"train/a": 1, **{f"val/c{i}": 1 for i in range(8)}, "val/a": 1})
    with pytest.raises(ConfigError, match="lacks: c0, c1, c2, c3, c4 and 3 more "):
        check_layout(tmp_path, 0)


# --- the seeded split -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def split_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Sizes that exercise the rounding: 10*0.25=2.5 rounds to 2, 1 keeps its only image, 2 gives
    # one, 3 gives one.
    root = tmp_path_factory.mktemp("split")
    return _tree(root, {"train/a": 10, "train/b": 1, "train/c": 2, "train/d": 3})


def _split(root: Path, seed: int, fraction: float = 0.25) -> Layout:
    return scan_layout(root, fraction, seed)


def test_split_is_seeded_stratified_and_disjoint(split_root: Path) -> None:
    layout = _split(split_root, seed=0)
    assert layout.val_source == "split"
    val_per_class = [sum(1 for _, label in layout.val if label == k) for k in range(4)]
    assert val_per_class == [2, 0, 1, 1]
    assert not set(layout.train) & set(layout.val)
    assert sorted(layout.train + layout.val) == scan_layout(split_root, 0, seed=0).train
    assert layout.val == sorted(layout.val) and layout.train == sorted(layout.train)
    assert _split(split_root, seed=0) == layout  # the same seed: the same split
    others = [_split(split_root, seed=s).val for s in range(1, 6)]
    assert any(val != layout.val for val in others)  # another seed: another split


def test_split_never_takes_a_whole_class(tmp_path: Path) -> None:
    _tree(tmp_path, {"train/a": 3, "train/b": 40})
    layout = scan_layout(tmp_path, 0.9, seed=0)
    val_per_class = [sum(1 for _, label in layout.val if label == k) for k in range(2)]
    assert val_per_class == [2, 36]


def test_split_of_a_class_does_not_move_when_a_class_is_added(tmp_path: Path) -> None:
    _tree(tmp_path, {"train/b": 10, "train/c": 10})
    before = [p for p, _ in scan_layout(tmp_path, 0.3, seed=4).val if "/c/" in p]
    _tree(tmp_path, {"train/a": 10})  # labels shift, but class c keeps its held-out images
    after = [p for p, _ in scan_layout(tmp_path, 0.3, seed=4).val if "/c/" in p]
    assert before == after


# --- the data module --------------------------------------------------------------------------


def _data(root: Path, **overrides: object) -> ImageFolderData:
    options: dict[str, Any] = {"val_fraction": 0.25, "image_size": 16, "num_workers": 0,
                     "on_bad_image": "skip", "seed": 0, **overrides}  # fmt: skip
    return ImageFolderData(root=str(root), **options)


def test_module_decodes_with_train_and_val_transforms(
    split_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="dpt"):
        data = _data(split_root)
    assert caplog.messages == [
        f"image_folder train: 12 images in 4 classes ({split_root / 'train'}, 4 held out for "
        "validation)",
        f"image_folder val: 4 images in 4 classes, a seeded split of {split_root / 'train'} "
        "(dataset.val_fraction=0.25, trainer.seed=0)",
    ]
    assert data.classes == data.train.classes == ["a", "b", "c", "d"]
    assert (data.num_classes, data.input_shape, data.num_workers) == (4, (3, 16, 16), 0)
    assert data.train.targets == [label for _, label in data.train.samples]
    assert data.val is not None and len(data.val) == 4
    image, label = data.train[0]
    assert (image.shape, image.dtype, label) == ((3, 16, 16), torch.float32, 0)
    image, label = data.val[0]
    assert (image.shape, image.dtype, label) == ((3, 16, 16), torch.float32, 0)
    assert torch.equal(data.val[0][0], image)  # validation draws nothing at random
    # dpt-predict's transform, rebuilt from the node, gives exactly what validation gives.
    rebuilt = instantiate(data.val_transform)
    assert torch.equal(rebuilt(read_image_rgb(data.val.samples[0][0])), image)


def test_module_without_validation(split_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dpt"):
        data = _data(split_root, val_fraction=0)
    assert data.val is None and len(data.train) == 16
    assert (
        caplog.messages[-1] == "image_folder val: none (no val/ folder and dataset.val_fraction=0)"
    )


def test_module_rejects_an_unknown_bad_image_policy(split_root: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^dataset.on_bad_image=ignore: must be one of skip, error$"
    ):
        _data(split_root, on_bad_image="ignore")


BAD = ("train/a/001.jpg", "train/b/002.png")  # truncated, not an image at all


@pytest.fixture
def bad_root(tmp_path: Path) -> Path:
    _tree(tmp_path, {"train/a": 3, "train/b": 2, "val/a": 1, "val/b": 1})
    good = (tmp_path / "train" / "a" / "000.jpg").read_bytes()
    (tmp_path / BAD[0]).write_bytes(good[: len(good) // 2])
    (tmp_path / BAD[1]).write_bytes(b"this is not an image")
    return tmp_path


def _bad_indices(data: ImageFolderData, root: Path) -> list[int]:
    paths = [path for path, _ in data.train.samples]
    return [paths.index(str(root / name)) for name in BAD]


def test_bad_images_are_skipped_with_one_warning_each(
    bad_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = _data(bad_root)
    bad = _bad_indices(data, bad_root)
    with caplog.at_level(logging.WARNING, logger="dpt"):
        for _ in range(3):  # as over three epochs
            assert all(data.train[i] is None for i in bad)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"skipping unreadable image {bad_root / BAD[0]}: JPEG is truncated (no end-of-image "
        "marker after the last scan)",
        f"skipping unreadable image {bad_root / BAD[1]}: not a known image format",
    ]
    # The loaders' collate leaves them out and counts them: 6 training images, 2 of them bad.
    loaders = build_loaders(data, CPU1, batch_size=6, seed=0)
    [(inputs, labels, skipped)] = list(loaders.train)
    assert (inputs.shape, labels.shape, skipped) == ((4, 3, 16, 16), (4,), 2)


def test_bad_images_raise_with_the_error_policy(bad_root: Path) -> None:
    data = _data(bad_root, on_bad_image="error")
    for index in _bad_indices(data, bad_root):
        path = re.escape(data.train.samples[index][0])
        with pytest.raises(UnreadableImageError, match=f"^unreadable image {path}: "):
            data.train[index]


def _epoch(data: ImageFolderData, epoch: int, sample: int = 0) -> list[torch.Tensor]:
    loaders = build_loaders(data, CPU1, batch_size=4, seed=5)
    batches = [group[0][0] for group, _ in loaders.epoch_batches(DataPosition(epoch, sample), 1)]
    del loaders
    gc.collect()  # persistent workers stop with their loader
    return batches


def test_augmentation_is_the_same_whatever_the_worker_count(split_root: Path) -> None:
    # `split_root` gives 16 training images without a split: 4 steps of 4 per epoch.
    single = _data(split_root, val_fraction=0, num_workers=0)
    two = _data(split_root, val_fraction=0, num_workers=2)
    for epoch in (0, 1):
        expected = _epoch(single, epoch)
        assert len(expected) == 4
        for got, want in zip(_epoch(two, epoch), expected, strict=True):
            assert torch.equal(got, want)
    # Resumed mid-epoch: the rest of the epoch, bit for bit, drawn the same.
    assert all(
        torch.equal(got, want)
        for got, want in zip(_epoch(single, 1, sample=8), _epoch(single, 1)[2:], strict=True)
    )
    # Drawn from (seed, epoch, index): again the same, but another epoch crops and flips anew.
    seeded = SeededSamples(single.train, seed=5)
    assert torch.equal(seeded[(0, 3)][0], seeded[(0, 3)][0])
    assert not all(torch.equal(seeded[(0, 3)][0], seeded[(e, 3)][0]) for e in range(1, 4))


def test_the_composed_config_builds_the_module(split_root: Path) -> None:
    cfg = compose("dataset=image_folder", f"dataset.root={split_root}", "model=resnet18")
    data, shuffle = build_data(cfg.dataset, seed=0)
    assert isinstance(data, ImageFolderData) and shuffle
    assert data.classes == ["a", "b", "c", "d"]
    assert data.input_shape == (3, cfg.dataset.image_size, cfg.dataset.image_size)
    # The default val_fraction 0.1: one of a's 10, one each of c's 2 and d's 3, none of b's 1.
    assert data.val is not None and len(data.val) == 3
