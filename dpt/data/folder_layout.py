"""The `dataset=image_folder` layout, `<root>/train/<class>/<images>` (and `<root>/val/...`, and
`<root>/test/...` for dpt-evaluate), scanned and checked without torch: the launcher calls
`check_layout` before any process starts, so a wrong folder answers in a fraction of a second, as
a one-line ConfigError. The test folder is scanned only when asked for (`scan_test`)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from PIL import Image

from dpt.data.splits import SPLITS, TEST, TRAIN, VAL
from dpt.errors import ConfigError, some_of

# registered_extensions() loads PIL's plugins, which fill Image.OPEN: it must come first. PIL
# writes PDF and Palm files but cannot read them; MPO (multi-picture JPEG) has no opener of its
# own because PIL's JPEG plugin reads it.
_EXTENSION_FORMATS = Image.registered_extensions()
_READABLE_FORMATS = {*Image.OPEN, "MPO"}
IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    ext.lower() for ext, fmt in _EXTENSION_FORMATS.items() if fmt in _READABLE_FORMATS
)

# A layout message lists at most this many class names: a wrong folder can differ in thousands.
_MAX_NAMES = 5

Sample = tuple[str, int]  # (path, label), as in torchvision's ImageFolder
ValSource = Literal["folder", "split", "none"]


@dataclass
class Layout:
    """What `scan_layout` found: class names in label order and the (path, label) lists.

    `val_source`: "folder" (`<root>/val`), "split" (held out of `<root>/train`, seeded) or
    "none" (`val_fraction=0` without `<root>/val`: `val` is empty).
    """

    root: str
    classes: list[str]
    train: list[Sample]
    val: list[Sample] = field(default_factory=list)
    val_source: ValSource = "none"


def check_layout(root: str | os.PathLike[str], val_fraction: float) -> None:
    """Raise ConfigError (one line, starting with the config key) for a layout that cannot be
    trained on; the seed does not matter here: whether a split works does not depend on it."""
    scan_layout(root, val_fraction, seed=0)


def scan_layout(root: str | os.PathLike[str], val_fraction: float, seed: int) -> Layout:
    """The classes (sorted folder names of `<root>/train`) and every image under them, train and
    val sorted by (label, path). Without `<root>/val`, `val_fraction` of each class is held out
    for validation, chosen by `seed` (see `split_off`). Raises ConfigError for a bad layout."""
    root = os.fspath(root)
    _check_fraction(val_fraction)
    if not os.path.isdir(root):
        raise _layout_error(root, "folder not found")
    train_dir = os.path.join(root, TRAIN)
    if not os.path.isdir(train_dir):
        raise _layout_error(root, f"no train/ folder (expected {_expected(train_dir)})")
    classes, train = _scan_split(root, train_dir)
    val_dir = os.path.join(root, VAL)
    if os.path.isdir(val_dir):
        val_classes, val = _scan_split(root, val_dir)
        _check_same_classes(root, train_dir, classes, val_dir, val_classes)
        return Layout(root, classes, train, val, "folder")
    if val_fraction == 0:
        return Layout(root, classes, train)
    train, val = split_off(train, val_fraction, seed, classes)
    if not val:
        raise ConfigError(
            f"dataset.val_fraction={val_fraction:g}: every class in {train_dir} has a single "
            "image, so none can be held out for validation; set dataset.val_fraction=0 or add "
            f"{_expected(os.path.join(root, 'val'))}"
        )
    return Layout(root, classes, train, val, "split")


def scan_test(root: str | os.PathLike[str], classes: list[str]) -> list[Sample] | None:
    """The (path, label) of every image of `<root>/test/<class>/`, labelled as training's
    `classes`; None where there is no test folder. Raises ConfigError for a bad one (its class
    folders must be train/'s)."""
    root = os.fspath(root)
    test_dir = os.path.join(root, TEST)
    if not os.path.isdir(test_dir):
        return None
    test_classes, samples = _scan_split(root, test_dir)
    _check_same_classes(root, os.path.join(root, TRAIN), classes, test_dir, test_classes)
    return samples


def split_folders(root: str | os.PathLike[str]) -> list[str]:
    """The split folders `root` holds (`train/`, `val/`, `test/`), for a message."""
    return [f"{name}/" for name in SPLITS if os.path.isdir(os.path.join(root, name))]


def split_off(
    samples: list[Sample], val_fraction: float, seed: int, classes: list[str]
) -> tuple[list[Sample], list[Sample]]:
    """(train, val): from each class, `round(n * val_fraction)` images go to val (at least one
    when the class has two or more, never all of it), chosen by a shuffle seeded from `seed` and
    the class name: a class's split does not change when other classes are added or removed."""
    by_label: dict[int, list[Sample]] = {}
    for sample in samples:
        by_label.setdefault(sample[1], []).append(sample)
    train: list[Sample] = []
    val: list[Sample] = []
    for label, members in sorted(by_label.items()):
        held_out = _held_out(len(members), val_fraction)
        # A str seed hashes the same in every process (unlike hash(), which is salted per run).
        order = list(range(len(members)))
        random.Random(f"{seed}/{classes[label]}").shuffle(order)
        chosen = set(order[:held_out])
        for i, sample in enumerate(members):
            (val if i in chosen else train).append(sample)
    return train, val


def _held_out(size: int, val_fraction: float) -> int:
    if size < 2 or val_fraction <= 0:
        return 0
    return min(size - 1, max(1, round(size * val_fraction)))


def _check_fraction(val_fraction: float) -> None:
    # Written so that NaN, which compares False with everything, fails too.
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"dataset.val_fraction={val_fraction:g}: must be >= 0 and < 1")


def _scan_split(root: str, split_dir: str) -> tuple[list[str], list[Sample]]:
    """The class names (sorted) and the (path, label) of every image of one split folder."""
    class_dirs, stray = _class_folders(root, split_dir)
    if not class_dirs:
        raise _layout_error(
            root, f"{split_dir} has no class folders (expected {_expected(split_dir)})"
        )
    if stray:
        raise _layout_error(
            root,
            f"{min(stray)} is an image outside any class folder; move it into "
            f"{_expected(split_dir).removesuffix('/<images>')}/",
        )
    classes = sorted(class_dirs)
    samples: list[Sample] = []
    empty: list[str] = []
    for label, name in enumerate(classes):
        try:
            files = sorted(images_under(class_dirs[name]))
        except OSError as e:
            raise _layout_error(root, f"cannot read {e.filename}: {e.strerror or e}") from e
        if not files:
            empty.append(class_dirs[name])
        samples.extend((path, label) for path in files)
    if not samples:
        raise _layout_error(
            root,
            f"no image files in the class folders of {split_dir} (expected "
            f"{_expected(split_dir)}, e.g. .jpg or .png files)",
        )
    if empty:
        more = len(empty) - 1
        others = f" (and {more} more empty class folder{'s' if more > 1 else ''})" if more else ""
        raise _layout_error(
            root, f"class folder {empty[0]} has no image files; add images or remove it{others}"
        )
    return classes, samples


def _class_folders(root: str, split_dir: str) -> tuple[dict[str, str], list[str]]:
    """{class name: folder} of the visible subfolders, and the image files beside them."""
    folders: dict[str, str] = {}
    stray: list[str] = []
    for entry in _entries(root, split_dir):
        if entry.name.startswith("."):
            continue  # .DS_Store, .ipynb_checkpoints, ...
        if _is_dir(entry):
            folders[entry.name] = entry.path
        elif _is_image(entry.name):
            stray.append(entry.path)
    return folders, stray


def images_under(folder: str | os.PathLike[str]) -> list[str]:
    """Every image file below `folder`, in subfolders too, skipping hidden entries (what a data
    set reads there; dpt-predict searches folders with it too). Symlinked folders are followed
    (data sets are often linked together), each real folder once. OSError for a folder that
    cannot be read."""
    found: list[str] = []
    seen: set[tuple[int, int]] = set()
    pending = [os.fspath(folder)]
    while pending:
        current = pending.pop()
        try:
            st = os.stat(current)
        except OSError:
            continue  # a broken link to a folder: nothing to read there
        if (st.st_dev, st.st_ino) in seen:
            continue  # a link loop, or the same folder linked twice
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(current) as entries:
            listed = list(entries)
        for entry in listed:
            if entry.name.startswith("."):
                continue
            if _is_dir(entry):
                pending.append(entry.path)
            elif _is_image(entry.name):
                found.append(entry.path)
    return found


def _entries(root: str, folder: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError as e:
        raise _layout_error(root, f"cannot read {folder}: {e.strerror or e}") from e


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # follows symlinks
    except OSError:
        return False


def _is_image(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_EXTENSIONS


def _check_same_classes(
    root: str, train_dir: str, train: list[str], val_dir: str, val: list[str]
) -> None:
    extra = sorted(set(val) - set(train))
    missing = sorted(set(train) - set(val))
    problems = []
    if extra:
        problems.append(
            f"{val_dir} has classes that {train_dir} lacks: {some_of(extra, _MAX_NAMES)}"
        )
    if missing:
        problems.append(
            f"{val_dir} lacks classes that {train_dir} has: {some_of(missing, _MAX_NAMES)}"
        )
    if problems:
        split = os.path.basename(val_dir)
        raise _layout_error(
            root, "; ".join(problems) + f" ({split}/ must have the same class folders as train/)"
        )


def _expected(split_dir: str) -> str:
    return f"{split_dir}/<class>/<images>"


def _layout_error(root: str, problem: str) -> ConfigError:
    return ConfigError(f"dataset.root={root}: {problem}")
