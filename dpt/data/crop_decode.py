"""Training and validation samples decoded from JPEG bytes with no more decoding than they need.

`train_transform(S)` decodes the whole JPEG, then `RandomResizedCrop` keeps a random box of 8% to
100% of the image and resamples it to S x S. `RandomResizedCropDecode` makes the same draws and
decodes the box alone: dpt's box decoder (dpt/data/_jpeg_box.c, compiled by setup.py against the
system's libjpeg-turbo) only entropy-decodes the rows above the box, transforms and colour-
converts only the columns it spans, and stops after its last row; its pixels are the whole
decode's, cropped, bit for bit (tests/test_jpeg_box.py). When the box is at least 2S (4S, 8S)
pixels on both sides it is decoded at 1/2 (1/4, 1/8) of the image's size (DCT scaling: the
inverse transform of each 8x8 block is computed at 4x4, 2x2 or 1x1, and colour conversion runs on
fewer pixels) and still holds at least S x S pixels, so the output loses nothing. The box is then
resampled by torch's antialiased bilinear kernel on uint8 (the one torchvision's `resize` runs),
then flipped and converted to normalized float32 in one vectorized pass (dpt/data/_normalize.c,
torch's float rounding bit for bit; torch's passes where it was not built).

Where the box decoder was not built (no compiler or no libjpeg-turbo headers at install time) or
does not take the JPEG (CMYK, not 8-bit, a libjpeg error), the general decoders make the same
sample from more decoding, and name what is wrong with a bad file: PIL's `Image.draft` for a
reduction, read_image_rgb's own decoder (`decode_jpeg`) for the whole image otherwise. Images
that are not JPEGs (PNG, ...) are decoded whole by PIL.

What is kept, exactly: the random draws. The crop box comes from torchvision's own
`RandomResizedCrop.get_params` (the draws of `v2.RandomResizedCrop.make_params`, in the same
order: scale and log-ratio per attempt, then top and left), then the flip's `torch.rand(1)`, all
from torch's global generator, which dpt seeds per sample (dpt/data/seeded.py). A sample is a
deterministic function of (bytes, generator state) and leaves the generator where
`train_transform(S)` leaves it: augmentation resumes exactly, and the crops' scale, aspect ratio,
position and flip follow the same distributions.

What differs from the tensor path: when a reduction is used, the box is resampled from the
DCT-reduced image (each reduced pixel is about the mean of a block of the full one), and its
edges are rounded to that image's pixel grid: at most half a reduced pixel, which is at most half
an output pixel. The crop moves by that much, so pixels differ slightly (mean absolute difference
about 0.01-0.1 of the normalized values, by how detailed the image is; tests/test_crop_decode.py);
the distributions of the crops and of the pixels do not. Without a reduction the output is
`train_transform(S)`'s to float rounding. Grayscale and CMYK JPEGs come out RGB.

What it buys, on 640x480 photo-like JPEGs, one thread (docs/performance.md section 3): at 224 px the
whole sample runs at about 0.94 of decoding the image alone (0.63 through the general decoders); at
128 px, where 3 crops in 4 also decode at 1/2, faster than decoding alone. What is left at 224 px:
the entropy (Huffman) decoding of every row down to the box's last, which a JPEG without restart
markers does not let any decoder skip, is most of the box's decode (together about 2/3 of a whole
decode); resampling the box takes about 0.25 ms, torchvision's draws 0.05-0.1 ms, the flip and
normalization 0.03-0.05 ms (0.11-0.14 ms as torch's flip copy, converting copy and two in-place
passes; the ratio was 0.84-0.89 with them) (a whole decode: 1.4 ms on the same core).

Tried, and slower: libjpeg-turbo also scales by M/8 for M = 3, 5, 6, 7, which would decode every
crop larger than S at just over S pixels; but its inverse transforms at those sizes are plain C
(8/8, 4/8 and 2/8 are SIMD), and with 4:2:0 chroma it transforms the chroma at 2M/8 (10x10 to
14x14 outputs per block), so a 640x480 image decodes 1.4-1.8x slower at 5/8-7/8 than at 8/8, and
the sample at 224 px ran at 0.71 of decoding alone against 0.81 with powers of two only. PIL's
`resize(box=...)` would crop and resample in one pass, but its portable C kernel is about 3x
slower than torch's vectorized uint8 one (0.7 ms against 0.24 ms for a 300 px box to 224 px).

Validation keeps `val_transform(S)` on the whole decoded image: what `dpt-predict` computes
from a file, pixel for pixel.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
import torch.nn.functional as nnf
from PIL import Image, UnidentifiedImageError
from torchvision.transforms import RandomResizedCrop

from dpt.data.images import (
    _JPEG_SOI,
    IMAGENET_MEAN,
    IMAGENET_STD,
    JPEG_TRUNCATED,
    _decode_jpeg,
    _error,
    _has_end_marker,
)

try:  # dpt's compiled box decoder (setup.py), where libjpeg-turbo's headers were there to build it
    from dpt.data import _jpeg_box
except ImportError:  # the general decoders: the same samples, from more decoding
    _jpeg_box = None
try:  # the crop to normalized float32 in one pass (setup.py), where a compiler was there
    from dpt.data import _normalize
except ImportError:  # torch's passes: the same floats, more slowly
    _normalize = None

# Whether JPEG boxes are decoded alone (dpt.data._jpeg_box) in this installation.
BOX_DECODER = _jpeg_box is not None

Bytes = bytes | bytearray | memoryview
Box = tuple[int, int, int, int]  # left, top, right, bottom, as PIL's

# libjpeg's DCT scalings that are SIMD (and all that PIL's draft asks for), largest first.
REDUCTIONS = (8, 4, 2, 1)
# v2.RandomResizedCrop's and v2.RandomHorizontalFlip's defaults, which train_transform uses.
CROP_SCALE = [0.08, 1.0]
CROP_RATIO = [3.0 / 4.0, 4.0 / 3.0]
FLIP_P = 0.5


def jpeg_reduction(width: int, height: int, min_width: int, min_height: int) -> int:
    """The largest of REDUCTIONS that keeps a `width` x `height` region at least `min_width` x
    `min_height` pixels once the image is decoded at 1/reduction of its size."""
    for reduction in REDUCTIONS:
        if width >= reduction * min_width and height >= reduction * min_height:
            return reduction
    return 1


class RandomResizedCropDecode:
    """`train_transform(image_size)(read_image_rgb(...))` on the bytes of an image: the same random
    draws, only the crop of a JPEG decoded, at the lowest resolution it allows. Returns float32
    (3, S, S), ImageNet-normalized; raises `ImageDecodeError` for bytes that are not a readable
    image."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self._normalize = _Normalize()

    def __call__(self, data: Bytes, source: str) -> torch.Tensor:
        size = self.image_size
        encoded = _Encoded(data, source)
        # The draws, in v2.RandomResizedCrop's order, then v2.RandomHorizontalFlip's.
        top, left, h, w = RandomResizedCrop.get_params(encoded.header, CROP_SCALE, CROP_RATIO)
        flip = bool(torch.rand(1) < FLIP_P)
        crop = encoded.crop(left, top, w, h, jpeg_reduction(w, h, size, size))
        return self._normalize(_resize(crop, size), flip)


class _Encoded:
    """An image's bytes, opened lazily (only the header is read): its size, then the pixels of a
    box at a JPEG's DCT reduction, from dpt's box decoder where it takes the JPEG, else from PIL
    (a reduction, or another format) or read_image_rgb's decoder (a whole JPEG)."""

    def __init__(self, data: Bytes, source: str) -> None:
        # A bytearray: what torch.frombuffer takes without warning about a read-only buffer.
        self.buffer = data if isinstance(data, bytearray) else bytearray(data)
        self.source = source
        if not self.buffer:
            raise _error(source, "empty file")
        self.is_jpeg = self.buffer.startswith(_JPEG_SOI)
        self.reduction = 1
        self.img: Image.Image | None = None
        self.whole: torch.Tensor | None = None  # the whole image, once decoded whole
        self.header: Image.Image | torch.Tensor  # what torchvision's get_params reads the size of
        size = _box_decodable_size(self.buffer) if self.is_jpeg else None
        self.box_decodable = size is not None
        if size is not None:
            self.size = size  # (width, height)
            # get_params reads a tensor's shape only: a meta tensor has one and no memory.
            self.header = torch.empty((3, size[1], size[0]), dtype=torch.uint8, device="meta")
        else:
            self._open_general()

    def _open_general(self) -> None:
        """Opens the image for the general decoders: PIL reads its header."""
        self.box_decodable = False
        self.img = self._open()
        if self.img is not None:
            self.header, self.size = self.img, self.img.size  # (width, height), before draft
        else:
            # A JPEG PIL cannot even open goes to read_image_rgb's decoder, which names the
            # problem (truncation, decode_jpeg's reason) or, for a variant only it reads,
            # decodes it.
            self.whole = self.header = _decode_jpeg(self.buffer, self.source)
            self.size = (self.whole.shape[-1], self.whole.shape[-2])

    def crop(self, left: int, top: int, width: int, height: int, reduction: int) -> torch.Tensor:
        """The box (in the image's pixels) decoded at 1/reduction where the decoder allows, as
        uint8 (3, h, w) RGB, a view of (h, w, 3) pixels: what torch's uint8 resampling is
        fastest on."""
        if self.box_decodable:
            box = _reduced_box(left, top, width, height, reduction)
            pixels = _decode_box(self.buffer, box, reduction)
            if pixels is not None:
                return pixels
            self._open_general()  # libjpeg refused it: the general decoders name the problem
        reduction = self.draft(reduction)
        return self.pixels(_reduced_box(left, top, width, height, reduction))

    def _open(self) -> Image.Image | None:
        try:
            return Image.open(io.BytesIO(self.buffer))
        except Exception as e:  # PIL's plugins raise OSError, ValueError, SyntaxError, ...
            if self.is_jpeg:
                return None
            if isinstance(e, UnidentifiedImageError):  # its message names a BytesIO object
                raise _error(self.source, "not a known image format") from e
            raise _error(self.source, str(e) or type(e).__name__) from e

    def draft(self, reduction: int) -> int:
        """Has a JPEG decode at 1/reduction of its size; returns the reduction PIL set up."""
        if reduction == 1 or self.img is None or self.img.format != "JPEG":
            return 1
        width, height = self.size
        # draft() picks the largest of 8, 4, 2, 1 that divides the size into at least the size
        # asked for, so asking for the size at 1/reduction gets that reduction.
        drafted = self.img.draft("RGB", (width // reduction, height // reduction))
        if drafted is not None:  # None: a layout draft does not handle, decoded whole
            _, (_, _, reduced_width, _) = drafted  # the image's width at the reduced scale
            self.reduction = round(width / reduced_width)
        return self.reduction

    def pixels(self, box: Box) -> torch.Tensor:
        """The `box` of the image decoded by the general decoders at the reduction."""
        if self.img is None or (self.is_jpeg and self.reduction == 1):
            # A whole JPEG: read_image_rgb's own decoder (decode_jpeg, whose libjpeg-turbo gives
            # PIL's pixels about 15% sooner, PIL as its fallback), with its checks and messages.
            if self.whole is None:
                self.whole = _decode_jpeg(self.buffer, self.source)
            return self.whole[:, box[1] : box[3], box[0] : box[2]]
        if self.is_jpeg and not _has_end_marker(self.buffer):
            # As read_image_rgb: PIL's own message would depend on ImageFile.LOAD_TRUNCATED_IMAGES,
            # and that setting would let a truncated file through.
            raise _error(self.source, JPEG_TRUNCATED)
        return _to_tensor(_load(self.img, self.source, box))


class _Normalize:
    """uint8 (3, S, S), any strides, flipped left-right or not, to contiguous float32
    (x / 255 - mean) / std."""

    def __init__(self) -> None:
        std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
        self.scale = 1.0 / (255.0 * std)
        self.bias = -torch.tensor(IMAGENET_MEAN).view(3, 1, 1) / std
        # The same float32 constants for the compiled pass (exact as Python floats).
        self.constants = (*self.scale.flatten().tolist(), *self.bias.flatten().tolist())

    def __call__(self, image: torch.Tensor, flip: bool) -> torch.Tensor:
        pixels = image.permute(1, 2, 0)  # (h, w, 3): how the resize leaves a box's pixels
        if _normalize is not None and pixels.is_contiguous():
            # One vectorized pass (dpt/data/_normalize.c): 0.03-0.05 ms at 224 px against
            # 0.11-0.14 ms for the passes below, the same floats bit for bit.
            height, width, _ = pixels.shape
            out = torch.empty((3, height, width), dtype=torch.float32)
            _normalize.normalize(pixels.numpy(), height, width, flip, *self.constants, out.numpy())
            return out
        if flip:
            image = image.flip(-1)
        out = image.to(torch.float32, memory_format=torch.contiguous_format)
        # Three vectorized passes in place, measured at 0.05 ms for 224 px: less than half of
        # one addcmul from the uint8 (0.11 ms), which torch runs unvectorized on mixed dtypes.
        return out.mul_(self.scale).add_(self.bias)


def _resize(image: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (3, h, w) to (3, size, size) by torch's antialiased bilinear kernel: what
    RandomResizedCrop(antialias=True) asks torch for, uint8 included."""
    # A batch of one with the whole image's batch stride: `image[None]` would get stride 3, and
    # torch would take an (h, w, 3) image for a planar one and resample it into a planar tensor,
    # through a scalar copy (about 0.1 ms at 224 px); this way it stays (h, w, 3) throughout.
    batch = image.permute(1, 2, 0).unsqueeze(0).permute(0, 3, 1, 2)
    return nnf.interpolate(batch, (size, size), mode="bilinear", antialias=True)[0]


def _box_decodable_size(data: bytearray) -> tuple[int, int] | None:
    """(width, height) of a JPEG that dpt's box decoder takes (8-bit, YCbCr, grey or RGB, and
    whole: a truncated one goes to the general decoders, which name it); else None."""
    if _jpeg_box is None or not _has_end_marker(data):
        return None
    return _jpeg_box.size(data)


def _decode_box(data: bytearray, box: Box, reduction: int) -> torch.Tensor | None:
    """`box` of the image decoded at 1/reduction, from dpt's box decoder, as uint8 (3, h, w)
    over (h, w, 3) pixels; None where libjpeg stopped on an error."""
    left, top, right, bottom = box
    width, height = right - left, bottom - top
    pixels = _jpeg_box.decode(data, left, top, width, height, reduction)
    if pixels is None:
        return None
    return torch.frombuffer(pixels, dtype=torch.uint8).view(height, width, 3).permute(2, 0, 1)


def _reduced_box(left: int, top: int, width: int, height: int, reduction: int) -> Box:
    """The crop box on the image decoded at 1/reduction of its size, each edge rounded to the
    nearest pixel of that image (torch's resampling takes whole pixels): at most half a reduced
    pixel off. Rounding is monotone and shifts by whole pixels, so the box stays at least
    width / reduction wide (a box of reduction * S keeps S) and inside the reduced image, which
    is ceil(size / reduction) pixels."""
    if reduction == 1:
        return left, top, left + width, top + height
    x0, y0, x1, y1 = (
        _round_half_up(edge / reduction) for edge in (left, top, left + width, top + height)
    )
    return x0, y0, x1, y1


def _round_half_up(value: float) -> int:
    return int(value + 0.5)  # round() goes to even on halves: biased towards even positions


def _load(img: Image.Image, source: str, box: Box) -> Image.Image:
    """The decoded image's `box`, in RGB; decoding errors as ImageDecodeError."""
    try:
        img.load()
    except Exception as e:  # PIL's decoders raise OSError, ValueError, SyntaxError, EOFError, ...
        raise _error(source, str(e) or type(e).__name__) from e
    region = img.crop(box)
    # After the crop: grayscale, CMYK, palette or 16-bit pixels converted one by one, as
    # read_image_rgb's convert("RGB") of the whole image would, but only where they are kept.
    return region if region.mode == "RGB" else region.convert("RGB")


def _to_tensor(img: Image.Image) -> torch.Tensor:
    """An RGB image as uint8 (3, H, W) over its (H, W, 3) pixels, without a transposing copy."""
    pixels = np.asarray(img)
    with warnings.catch_warnings():
        # The array is read-only (PIL hands out bytes); the tensor is only read, never written.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(pixels).permute(2, 0, 1)
