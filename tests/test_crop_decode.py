"""dpt.data.crop_decode: the same random draws as train_transform, outputs close to it (equal where
no reduction is used), the reduction chosen and used, bad bytes named, and validation's decode."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from dpt.data import crop_decode
from dpt.data.crop_decode import (
    RandomResizedCropDecode,
    jpeg_reduction,
)
from dpt.data.images import ImageDecodeError, read_image_rgb, train_transform

SEEDS = range(12)


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour patches (about 40 px) on a left-to-right ramp: photo-like, and asymmetric,
    so a flip that disagrees shows."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(height // 40, 2), max(width // 40, 2), 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), np.float32)
    ramp = np.linspace(-60, 60, width, dtype=np.float32)[None, :, None]
    return Image.fromarray(np.clip(0.7 * smooth + ramp + 40, 0, 255).astype(np.uint8))


def _encoded(img: Image.Image, fmt: str = "JPEG", **options: object) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


IMAGES: dict[str, Callable[[], bytes]] = {
    "640x480": lambda: _encoded(_photo(640, 480), quality=90),
    "333x500": lambda: _encoded(_photo(333, 500), quality=90),
    "100x80, smaller than the output": lambda: _encoded(_photo(100, 80), quality=90),
    "1024x768 progressive": lambda: _encoded(_photo(1024, 768), quality=90, progressive=True),
    "grayscale": lambda: _encoded(_photo(640, 480).convert("L"), quality=90),
    "CMYK": lambda: _encoded(_photo(640, 480).convert("CMYK"), quality=90),
    "PNG with alpha": lambda: _encoded(_photo(300, 200).convert("RGBA"), "PNG"),
}


@pytest.fixture(scope="module", params=list(IMAGES))
def image_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("images") / request.param.split(",")[0].replace(" ", "_")
    path.write_bytes(IMAGES[request.param]())
    return path


def _tolerance(reference: torch.Tensor, reduction: int) -> float:
    """How far the reduced decode may be from the tensor path, mean absolute difference of the
    normalized outputs. Without a reduction, the same libjpeg-turbo decode and the same torch
    kernel: float rounding only. With one, each crop edge is rounded to the reduced image's pixel
    grid, at most half an output pixel, so the difference is bounded by half the image's mean
    gradient per output pixel; plus resampling from block means instead of pixels, measured at
    0.005-0.015 on these images (0.02 allowed). The largest measured ratio to this bound is 0.45."""
    if reduction == 1:
        return 1e-5
    dx = (reference[:, :, 1:] - reference[:, :, :-1]).abs().mean()
    dy = (reference[:, 1:] - reference[:, :-1]).abs().mean()
    return 0.5 * float(dx + dy) + 0.02


BOX_DECODER, GENERAL_DECODERS = "box decoder", "general decoders"


@pytest.fixture(params=[BOX_DECODER, GENERAL_DECODERS])
def decoders(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which decoders a JPEG goes through: dpt's box decoder (skipped where it was not built), or
    the ones an installation without the compiled parts uses (PIL's draft, decode_jpeg, torch's
    normalization)."""
    if request.param == BOX_DECODER and not crop_decode.BOX_DECODER:
        pytest.skip("the box decoder was not built")
    if request.param == GENERAL_DECODERS:
        monkeypatch.setattr(crop_decode, "_jpeg_box", None)
        monkeypatch.setattr(crop_decode, "_normalize", None)
    return request.param


GENERATOR = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize(("height", "width"), [(224, 224), (5, 7), (1, 1), (3, 1100)])
def test_the_compiled_normalization_is_torchs_bit_for_bit(
    height: int, width: int, flip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if crop_decode._normalize is None:
        pytest.skip("dpt.data._normalize was not built")
    normalize = crop_decode._Normalize()
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=GENERATOR)
    image = pixels.permute(2, 0, 1)  # as the resize leaves it: planes over (h, w, 3) pixels
    planar = image.contiguous()  # another layout: torch's passes
    compiled, other_layout = normalize(image, flip), normalize(planar, flip)
    monkeypatch.setattr(crop_decode, "_normalize", None)
    expected = normalize(image, flip)
    assert expected.is_contiguous() and compiled.is_contiguous()
    assert compiled.dtype == torch.float32 and compiled.shape == (3, height, width)
    assert torch.equal(compiled, expected) and torch.equal(other_layout, expected)
    unflipped = normalize(image, False)
    assert torch.equal(expected, unflipped.flip(-1) if flip else unflipped)


def _calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[tuple[Any, ...]]:
    """The arguments and the result, `(*args, result)`, of each call of `owner.name` from here
    to the end of the test."""
    calls: list[tuple[Any, ...]] = []
    function = getattr(owner, name)

    def spy(*args: Any) -> Any:
        result = function(*args)
        calls.append((*args, result))
        return result

    monkeypatch.setattr(owner, name, spy)
    return calls


def _cuts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """(left, top, width, height, reduction, box) of each crop put on the decoded pixel grid: the
    crop drawn, the reduction it is decoded at on either path (the box decoder's, or the one
    PIL's draft set up; where the box decoder leaves an image to the others, the last one), and
    the box cut from the pixels at that reduction."""
    return _calls(monkeypatch, crop_decode, "_reduced_box")


@pytest.mark.parametrize("size", [224, 64])
def test_same_draws_and_close_output_as_train_transform(
    image_file: Path, size: int, decoders: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuts = _cuts(monkeypatch)
    decode, transform = RandomResizedCropDecode(size), train_transform(size)
    data = image_file.read_bytes()
    for seed in SEEDS:
        torch.manual_seed(seed)
        expected = transform(read_image_rgb(image_file))
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        got = decode(data, str(image_file))
        assert torch.equal(torch.get_rng_state(), state), f"seed {seed}: other draws"
        assert got.shape == (3, size, size) and got.dtype == torch.float32
        assert got.is_contiguous()
        difference = (got - expected).abs().mean().item()
        assert difference <= _tolerance(expected, cuts[-1][4]), f"seed {seed}"
        # The flip agrees: the image is a left-to-right ramp, so a wrong one is far off.
        assert (got.flip(-1) - expected).abs().mean().item() > 5 * difference + 0.1


@pytest.mark.parametrize(("size", "reductions"), [(64, {2, 4}), (224, {1})])
def test_only_what_the_crop_needs_is_decoded(
    size: int, reductions: set[int], decoders: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crops of a 640x480 JPEG are decoded at 1/2 and 1/4 of its size where they are 2 and 4
    times the output on both sides (every crop at 64 px), whole-size elsewhere. The box decoder
    decodes the crop's box alone, at that scale; without it PIL's draft decodes the whole image
    at that scale, and decode_jpeg the whole image where there is no reduction."""
    cuts = _cuts(monkeypatch)
    loads = _calls(monkeypatch, crop_decode, "_load")
    wholes = _calls(monkeypatch, crop_decode, "_decode_jpeg")
    if decoders == BOX_DECODER:
        boxes = _calls(monkeypatch, crop_decode._jpeg_box, "decode")
    data = _encoded(_photo(640, 480), quality=90)
    for seed in SEEDS:
        torch.manual_seed(seed)
        RandomResizedCropDecode(size)(data, "x.jpg")
    used = [reduction for *_, reduction, _ in cuts]
    assert len(used) == len(SEEDS) and reductions <= set(used)
    assert used == [jpeg_reduction(w, h, size, size) for _, _, w, h, *_ in cuts]
    if decoders == BOX_DECODER:
        expected = [(x0, y0, x1 - x0, y1 - y0, r) for *_, r, (x0, y0, x1, y1) in cuts]
        assert [args[1:-1] for args in boxes] == expected
        assert loads == [] and wholes == []
    else:
        sizes = [img.size for img, *_ in loads]
        assert sizes == [(640 // r, 480 // r) for r in used if r > 1]
        assert len(wholes) == used.count(1)


@pytest.mark.parametrize(
    ("width", "height", "reduction"),
    [
        (448, 448, 2),  # exactly 2S: 1/2 keeps S
        (447, 448, 1),  # 2S - 1 on one side: 1/2 would leave S - 1 (upsampled)
        (448, 447, 1),
        (895, 900, 2),
        (896, 896, 4),
        (1792, 1792, 8),
        (10_000, 1792, 8),  # never more than libjpeg's 1/8
        (224, 224, 1),
        (100, 80, 1),  # smaller than S
    ],
)
def test_jpeg_reduction_keeps_at_least_the_output_size(
    width: int, height: int, reduction: int
) -> None:
    assert jpeg_reduction(width, height, 224, 224) == reduction


def test_reduced_box_stays_at_least_s_and_inside() -> None:
    # Edges at 2.5 and 450.5 reduced pixels round up; the size stays 448 / 2 = 224.
    assert crop_decode._reduced_box(5, 3, 448, 448, 2) == (3, 2, 227, 226)
    # The right edge of a 641-px image at 1/2: 320.5 rounds to 321 = ceil(641 / 2).
    assert crop_decode._reduced_box(193, 0, 448, 460, 2) == (97, 0, 321, 230)


def test_same_seed_same_output_bit_for_bit(decoders: str) -> None:
    data = _encoded(_photo(640, 480), quality=90)
    for size in (224, 64):
        outputs = []
        for _ in range(2):
            torch.manual_seed(3)
            outputs.append(RandomResizedCropDecode(size)(data, "x.jpg"))
        assert torch.equal(*outputs)


def test_takes_bytes_bytearray_and_memoryview(decoders: str) -> None:
    data = _encoded(_photo(320, 240), quality=90)
    outputs = []
    for buffer in (data, bytearray(data), memoryview(data)):
        torch.manual_seed(0)
        outputs.append(RandomResizedCropDecode(32)(buffer, "x.jpg"))
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def _corrupt(part: bytes, offset: int, length: int) -> bytes:
    """A 256x256 JPEG with `length` bytes of `part` (a marker) overwritten with 0xFF."""
    data = bytearray(_encoded(_photo(256, 256), quality=90))
    start = data.find(part) + offset
    data[start : start + length] = b"\xff" * length
    return bytes(data)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty file"),
        (
            _encoded(_photo(64, 64), quality=90)[:-500],
            "JPEG is truncated (no end-of-image marker after the last scan)",
        ),
        (b"definitely not an image" * 10, "not a known image format"),
    ],
    ids=["empty", "truncated", "garbage"],
)
def test_bad_bytes_raise_image_decode_error(data: bytes, reason: str, decoders: str) -> None:
    with pytest.raises(ImageDecodeError) as caught:
        RandomResizedCropDecode(32)(data, "a/b.jpg")
    assert str(caught.value) == f"cannot read image a/b.jpg: {reason}"
    assert caught.value.reason == reason


@pytest.mark.parametrize(
    "data",
    [_corrupt(b"\xff\xc4", 5, 16), _corrupt(b"\xff\xc0", 5, 4), _corrupt(b"\xff\xda", 6, 1)],
    ids=["Huffman table", "frame header", "scan header"],
)
def test_corrupt_jpegs_are_named_as_read_image_rgb_names_them(
    data: bytes, tmp_path: Path, decoders: str
) -> None:
    """Decoded whole (224 px from 256: no crop is 448 px): read_image_rgb's own decoder and
    message, also for a header PIL cannot open; decoded reduced (16 px: every crop of a 256 px
    image is at least 32 px, so at 1/2 or less): PIL's message. The box decoder hands all three
    on: the first two it does not take, the third (a scan that names a Huffman table the file
    does not define) it stops on."""
    path = tmp_path / "a.jpg"
    path.write_bytes(data)
    with pytest.raises(ImageDecodeError) as tensor_path:
        read_image_rgb(path)
    with pytest.raises(ImageDecodeError) as whole:
        RandomResizedCropDecode(224)(data, str(path))
    assert str(whole.value) == str(tensor_path.value)
    with pytest.raises(ImageDecodeError, match=rf"^cannot read image {path}: \S"):
        RandomResizedCropDecode(16)(data, str(path))
