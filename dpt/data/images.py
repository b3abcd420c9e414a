"""Image decoding (libjpeg-turbo with a PIL fallback) and the ImageNet-style transforms."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from dpt.config.datasets import BAD_IMAGE_POLICIES
from dpt.errors import ConfigError, DptError

log = logging.getLogger("dpt")

# ImageNet statistics: what torchvision's pretrained classifiers expect.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_JPEG_SOI = b"\xff\xd8\xff"  # start-of-image marker plus the first byte of the next marker
_JPEG_SOS = b"\xff\xda"  # start of scan: entropy-coded data follows
_JPEG_EOI = b"\xff\xd9"  # end of image
# What read_image_rgb and the crop decoder (dpt/data/crop_decode.py) say of a JPEG cut short.
JPEG_TRUNCATED = "JPEG is truncated (no end-of-image marker after the last scan)"
# decode_jpeg's messages start with the C++ source location ("decode_jpeg, /.../x.cpp:171, ").
_CPP_LOCATION = re.compile(r"^.*?\.cpp:\d+, ")


class ImageDecodeError(OSError):
    """A file that cannot be read or decoded as an image (missing, truncated, corrupt)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        # The bare cause, without the path, for callers that print the path themselves.
        self.reason = message if reason is None else reason


def read_image_rgb(path: str | os.PathLike[str]) -> torch.Tensor:
    """Decode an image file to a uint8 RGB tensor of shape (3, H, W).

    JPEGs go through `torchvision.io.decode_jpeg` (libjpeg-turbo), which also turns grayscale and
    CMYK JPEGs into RGB; anything else (PNG, ...) or a JPEG it rejects goes through PIL. Raises
    `ImageDecodeError` for every kind of unreadable file, including a missing one.
    """
    return decode_image_rgb(read_file(path), path)


def read_file(path: str | os.PathLike[str]) -> bytearray:
    """A file's bytes; ImageDecodeError for a file that cannot be read (missing, a folder...)."""
    try:
        with open(path, "rb") as f:
            # A bytearray, because torch.frombuffer warns about read-only buffers such as bytes.
            return bytearray(f.read())
    except OSError as e:
        raise _error(path, e.strerror or str(e)) from e


def decode_image_rgb(data: bytearray, source: str | os.PathLike[str]) -> torch.Tensor:
    """`read_image_rgb` of bytes already read (a shard's member): `source` names them in errors."""
    if not data:
        raise _error(source, "empty file")
    if data.startswith(_JPEG_SOI):
        return _decode_jpeg(data, source)
    return _decode_with_pil(data, source)


def _decode_jpeg(data: bytearray, path: str | os.PathLike[str]) -> torch.Tensor:
    # torchvision 0.29 raises on a truncated JPEG, but libjpeg itself only warns ("Premature end
    # of JPEG file") and fills the rest with grey, so this check does not rely on the build turning
    # that warning into an error. It also keeps truncated files away from the PIL fallback, which
    # accepts them if someone set ImageFile.LOAD_TRUNCATED_IMAGES.
    if not _has_end_marker(data):
        raise _error(path, JPEG_TRUNCATED)
    try:
        # mode=RGB matters: UNCHANGED returns 1 channel for grayscale and raw (Adobe-inverted)
        # CMYK as 4 channels; RGB converts both, matching PIL's convert("RGB").
        return decode_jpeg(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError as e:
        jpeg_reason = _CPP_LOCATION.sub("", str(e))
    try:
        # Rare JPEG variants libjpeg-turbo's torchvision build refuses; PIL may still read them.
        return _decode_with_pil(data, path)
    except ImageDecodeError:
        raise _error(path, jpeg_reason) from None


def _has_end_marker(data: bytearray) -> bool:
    # Inside entropy-coded data every 0xFF byte is followed by 0x00 (byte stuffing), so an EOI
    # with no SOS after it ends the last scan: the real end of the image (an EXIF thumbnail's
    # EOI is followed by the main image's SOS). Bytes after EOI are tolerated. Searching from
    # the end for EOI, then forward from it, reads a few bytes instead of the file twice.
    last_end = data.rfind(_JPEG_EOI)
    return last_end != -1 and data.find(_JPEG_SOS, last_end) == -1 and _JPEG_SOS in data


def _decode_with_pil(data: bytearray, path: str | os.PathLike[str]) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(data)) as img:
            # convert() forces the full decode, so a truncated file fails here (as long as
            # ImageFile.LOAD_TRUNCATED_IMAGES is left False, its default).
            rgb = img.convert("RGB")
    except UnidentifiedImageError as e:
        # Its message names the BytesIO object, not the file: say what it means instead.
        raise _error(path, "not a known image format") from e
    except Exception as e:  # PIL's plugins raise OSError, ValueError, SyntaxError, EOFError, ...
        raise _error(path, str(e) or type(e).__name__) from e
    return F.pil_to_tensor(rgb)


def _error(path: str | os.PathLike[str], reason: str) -> ImageDecodeError:
    return ImageDecodeError(f"cannot read image {os.fspath(path)}: {reason}", reason)


def check_bad_image_policy(policy: str) -> None:
    """`dataset.on_bad_image` of dpt's image data sets: one ConfigError line naming the key."""
    if policy not in BAD_IMAGE_POLICIES:
        raise ConfigError(
            f"dataset.on_bad_image={policy}: must be one of {', '.join(BAD_IMAGE_POLICIES)}"
        )


class UnreadableImageError(DptError, RuntimeError):
    """A bad image file with `on_bad_image="error"`: stops the run, naming the file."""


class BadImages:
    """The `on_bad_image` policy of an image data set, shared by its samples: for a missing,
    truncated or corrupt file, "skip" makes `read` return None (the loaders' collate function
    drops it) and logs one warning per file per process; "error" raises UnreadableImageError."""

    def __init__(self, policy: str) -> None:
        check_choice("on_bad_image", policy, BAD_IMAGE_POLICIES)
        self.policy = policy
        self._warned: set[str] = set()

    def load(self, path: str, decoder: Decoder) -> torch.Tensor | None:
        """`decoder` of the file's bytes, or None for a bad file under "skip"."""
        try:
            return decoder(read_file(path), path)
        except ImageDecodeError as e:
            self.report(path, e.reason)
            return None

    def decode(self, decoder: Decoder, data: bytearray, source: str) -> torch.Tensor | None:
        """`decoder(data, source)` (a shard's member), or None for bad bytes under "skip"."""
        try:
            return decoder(data, source)
        except ImageDecodeError as e:
            self.report(source, e.reason)
            return None

    def report(self, path: str, reason: str) -> None:
        if self.policy == "error":
            raise UnreadableImageError(f"unreadable image {path}: {reason}")
        # Once per file: a bad file is hit again every epoch and would flood the log.
        if path not in self._warned:
            self._warned.add(path)
            log.warning(f"skipping unreadable image {path}: {reason}")


# Encoded bytes (and what to call them in errors) to the model's input.
Decoder = Callable[[bytearray, str], torch.Tensor]


class DecodeThen:
    """A Decoder that decodes the whole image (`decode_image_rgb`), then applies `transform`
    to the uint8 tensor: for a transform given as a callable of tensors."""

    def __init__(self, transform: Callable[[torch.Tensor], Any] | None) -> None:
        self.transform = transform

    def __call__(self, data: bytearray, source: str) -> torch.Tensor:
        image = decode_image_rgb(data, source)
        return image if self.transform is None else self.transform(image)


class LabelledImageFiles(Dataset):
    """A data set of image files with labels (COCO's, an image folder's): `samples` holds
    (path, label) pairs; each is decoded and transformed by `decoder`, or None where the file
    is unreadable and `bad_images` says skip. Subclasses fill `samples`, `decoder` and
    `bad_images`: dpt's own data sets decode no more than the crop needs
    (dpt/data/crop_decode.py); a transform of tensors goes through `DecodeThen`."""

    samples: list[tuple[str, int]]
    decoder: Decoder
    bad_images: BadImages

    def __len__(self) -> int:
        return len(self.samples)

    def image_path(self, index: int) -> Path:
        """The file behind sample `index`."""
        return Path(self.samples[index][0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | None:
        path, label = self.samples[index]
        # Random transforms draw from torch's global generator, which SeededSamples seeds per
        # (epoch, sample): augmentation resumes exactly, whatever the loader workers.
        image = self.bad_images.load(path, self.decoder)
        return None if image is None else (image, label)


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def train_transform(image_size: int) -> v2.Compose:
    """Random-resized crop and flip of a uint8 CHW tensor, then float32 ImageNet normalization."""
    return v2.Compose(
        [
            v2.RandomResizedCrop(image_size, antialias=True),
            v2.RandomHorizontalFlip(),
            *_to_normalized_float(),
        ]
    )


def val_transform(image_size: int) -> v2.Compose:
    """Resize the short side to image_size*256/224, center-crop, normalize (the ImageNet recipe)."""
    return v2.Compose(
        [
            v2.Resize(int(image_size * 256 / 224), antialias=True),
            v2.CenterCrop(image_size),
            *_to_normalized_float(),
        ]
    )


def _to_normalized_float() -> list[v2.Transform]:
    # Crops and resizes run on uint8 first: a quarter of the memory traffic of float32.
    return [
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
    ]
