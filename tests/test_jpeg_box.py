"""dpt.data._jpeg_box, the compiled box decoder: a box's pixels are the whole decode's, cropped,
bit for bit (PIL's decode, and PIL's draft at 1/2, 1/4, 1/8), at every edge and corner, for every
JPEG layout it takes; what it does not take comes back as None, never as a crash."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
from PIL import Image

jpeg_box = pytest.importorskip("dpt.data._jpeg_box", reason="the box decoder was not built")

WIDTH, HEIGHT = 203, 141  # no multiple of 8 or 16: the last iMCU row and column are partial
REDUCTIONS = (1, 2, 4, 8)
# How PIL writes each layout; noise makes every pixel differ from its neighbours, so a box edge
# upsampled or transformed without its real neighbours shows.
LAYOUTS: dict[str, dict[str, object]] = {
    "4:2:0": {"subsampling": 2},
    "4:2:2": {"subsampling": 1},
    "4:4:4": {"subsampling": 0},
    "progressive 4:2:0": {"subsampling": 2, "progressive": True},
    "progressive 4:2:2": {"subsampling": 1, "progressive": True},
    "RGB, no colour transform": {"subsampling": 0, "keep_rgb": True},
    "grayscale": {"mode": "L"},
}


@functools.cache
def _jpeg(layout: str, width: int = WIDTH, height: int = HEIGHT) -> bytes:
    options = dict(LAYOUTS[layout])
    noise = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    img = Image.fromarray(noise).convert(str(options.pop("mode", "RGB")))
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90, **options)
    return out.getvalue()


@functools.cache
def _pil_decode(layout: str, reduction: int) -> np.ndarray:
    """The whole image decoded by PIL at 1/reduction (its draft), as (h, w, 3) RGB."""
    with Image.open(io.BytesIO(_jpeg(layout))) as img:
        if reduction > 1:
            img.draft("RGB", (WIDTH // reduction, HEIGHT // reduction))
        pixels = np.asarray(img.convert("RGB"))
    assert pixels.shape == (-(-HEIGHT // reduction), -(-WIDTH // reduction), 3)
    return pixels


def _boxes(width: int, height: int) -> list[tuple[int, int, int, int]]:
    """(left, top, width, height) boxes of a width x height image: the whole image, its corners'
    pixels, its last row and column, odd offsets, boxes across iMCU borders, and random ones."""
    boxes = [
        (0, 0, width, height),
        (0, 0, 1, 1),
        (width - 1, 0, 1, 1),
        (0, height - 1, 1, 1),
        (width - 1, height - 1, 1, 1),
        (width - 1, 0, 1, height),
        (0, height - 1, width, 1),
        (1, 1, width - 2, height - 2),
        (width // 3 | 1, height // 3 | 1, width // 3, height // 3),
        (min(15, width - 2), min(15, height - 2), 2, 2),
        (min(16, width - 1), min(16, height - 1), 1, 1),
        (width // 2, 0, width - width // 2, height // 2),
    ]
    rng = np.random.default_rng(width * height)
    for _ in range(12):
        left, top = int(rng.integers(0, width)), int(rng.integers(0, height))
        right, bottom = int(rng.integers(left, width)), int(rng.integers(top, height))
        boxes.append((left, top, right - left + 1, bottom - top + 1))
    return boxes


def _decode(data: bytes, box: tuple[int, int, int, int], reduction: int) -> np.ndarray:
    left, top, width, height = box
    pixels = jpeg_box.decode(data, left, top, width, height, reduction)
    assert pixels is not None
    return np.frombuffer(pixels, np.uint8).reshape(height, width, 3)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_box_is_the_whole_decode_cropped_bit_for_bit(layout: str, reduction: int) -> None:
    data, whole = _jpeg(layout), _pil_decode(layout, reduction)
    height, width, _ = whole.shape
    for box in _boxes(width, height):
        left, top, w, h = box
        expected = whole[top : top + h, left : left + w]
        np.testing.assert_array_equal(_decode(data, box, reduction), expected, err_msg=str(box))


def test_boxes_deep_in_a_larger_image() -> None:
    """Skipping many iMCU rows and columns (a 1000x750 image) keeps the pixels too."""
    data = _jpeg("4:2:0", 1000, 750)
    with Image.open(io.BytesIO(data)) as img:
        whole = np.asarray(img.convert("RGB"))
    for box in [(613, 517, 211, 199), (999, 749, 1, 1), (0, 700, 1000, 50), (371, 0, 1, 750)]:
        left, top, width, height = box
        expected = whole[top : top + height, left : left + width]
        np.testing.assert_array_equal(_decode(data, box, 1), expected, err_msg=str(box))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_size_is_the_image_size(layout: str) -> None:
    assert jpeg_box.size(_jpeg(layout)) == (WIDTH, HEIGHT)


def test_cmyk_is_left_to_other_decoders() -> None:
    img = Image.fromarray(np.zeros((16, 16, 3), np.uint8)).convert("CMYK")
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90)
    assert jpeg_box.size(out.getvalue()) is None
    assert jpeg_box.decode(out.getvalue(), 0, 0, 16, 16, 1) is None


def _corrupt(data: bytes, marker: bytes, offset: int, length: int) -> bytes:
    """`data` with `length` bytes `offset` bytes after `marker` overwritten with 0xFF."""
    out = bytearray(data)
    start = out.find(marker) + offset
    out[start : start + length] = b"\xff" * length
    return bytes(out)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"definitely not a JPEG" * 10,
        _jpeg("4:2:0")[:100],  # cut in the header
        _corrupt(_jpeg("4:2:0"), b"\xff\xc4", 5, 16),  # a Huffman table
        _corrupt(_jpeg("4:2:0"), b"\xff\xc0", 5, 4),  # the frame header
    ],
    ids=["empty", "garbage", "cut header", "Huffman table", "frame header"],
)
def test_unreadable_headers_have_no_size_and_no_pixels(data: bytes) -> None:
    assert jpeg_box.size(data) is None
    assert jpeg_box.decode(data, 0, 0, 1, 1, 1) is None


@pytest.mark.parametrize("layout", ["4:2:0", "progressive 4:2:0"])
def test_data_that_ends_early_gives_no_pixels(layout: str) -> None:
    """libjpeg would fill the missing rows with grey; the decoder refuses instead, also for a box
    above the cut (a progressive image's later scans refine every row)."""
    data = _jpeg(layout)
    cut = data[: len(data) // 2]
    assert jpeg_box.size(cut) == (WIDTH, HEIGHT)  # the header is whole
    assert jpeg_box.decode(cut, 0, 0, WIDTH, HEIGHT, 1) is None
    if layout.startswith("progressive"):
        assert jpeg_box.decode(cut, 0, 0, 8, 8, 1) is None


def test_damaged_bytes_never_crash() -> None:
    """Bytes overwritten or cut anywhere: pixels of the box's size, or None."""
    data = _jpeg("4:2:0")
    rng = np.random.default_rng(1)
    for _ in range(300):
        damaged = bytearray(data[: int(rng.integers(2, len(data) + 1))])
        for at in rng.integers(0, len(damaged), int(rng.integers(1, 4))):
            damaged[at] = int(rng.integers(0, 256))
        pixels = jpeg_box.decode(bytes(damaged), 20, 10, 50, 40, int(rng.choice(REDUCTIONS[:2])))
        assert pixels is None or len(pixels) == 50 * 40 * 3


@pytest.mark.parametrize(
    "box",
    [(WIDTH - 1, 0, 2, 1), (0, HEIGHT, 1, 1), (-1, 0, 1, 1), (0, 0, 0, 1), (0, 0, 1, -1)],
)
def test_a_box_outside_the_image_is_a_value_error(box: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match=r"^box .* is not inside the image$"):
        jpeg_box.decode(_jpeg("4:2:0"), *box, 1)


def test_the_box_is_checked_against_the_reduced_image() -> None:
    width = -(-WIDTH // 2)  # 102 pixels wide at 1/2
    assert jpeg_box.decode(_jpeg("4:2:0"), width - 1, 0, 1, 1, 2) is not None
    with pytest.raises(ValueError):
        jpeg_box.decode(_jpeg("4:2:0"), width, 0, 1, 1, 2)


@pytest.mark.parametrize("reduction", [0, 3, 16])
def test_only_libjpegs_power_of_two_reductions(reduction: int) -> None:
    with pytest.raises(ValueError, match=rf"^reduction must be 1, 2, 4 or 8, not {reduction}$"):
        jpeg_box.decode(_jpeg("4:2:0"), 0, 0, 1, 1, reduction)
