"""Shards in the WebDataset tar convention, written deterministically.

Each split becomes `<split>-000000.tar`, `<split>-000001.tar`, ... of about `shard_bytes` each.
A sample is two members with one key: `<key>.<ext>` (the image file's bytes, as they are: no
decoding, no re-encoding) and `<key>.cls` (its label, as decimal text). The key is the sample's
index in the split (8 digits), so the samples' order in the shards is the data set's own order.

The same input gives byte-identical files: members in a fixed order, with a fixed time, owner
and mode (tar's headers otherwise carry the clock and the user). Each split also gets a wids
descriptor (`<split>.json`, "wids-shard-index-v1": every shard's file name, sample count, size
and MD5, which wids' ShardListDataset and dpt read), and the folder an `index.json` naming the
splits' descriptors and the class names in label order. Every file is written under a temporary
name and renamed once complete: a writer killed midway leaves no shard that looks whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

log = logging.getLogger("dpt")

INDEX = "index.json"
WIDS_KIND = "wids-shard-index-v1"
DPT_KIND = "dpt-shards-v1"


@dataclass(frozen=True)
class Split:
    """One split to write: its name, its (image file, label) pairs in the data set's order, and
    its role ("train" or "val": what `dataset=shards` reads it as)."""

    name: str
    samples: Sequence[tuple[str, int]]
    role: str


@dataclass(frozen=True)
class ShardInfo:
    url: str  # relative to the descriptor: the folder can move, or be served over HTTP
    nsamples: int
    filesize: int
    md5sum: str


def write_shards(
    out: Path, splits: Iterable[Split], classes: Sequence[str], shard_bytes: int
) -> dict[str, list[ShardInfo]]:
    """Write every split's shards, descriptors and the index into `out`; returns the shards."""
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[ShardInfo]] = {}
    roles: dict[str, str] = {}
    for split in splits:
        roles[split.role] = split.name
        shards = _write_split(out, split, shard_bytes)
        _write_json(out / f"{split.name}.json", _descriptor(split.name, shards, classes))
        written[split.name] = shards
        log.info(f"{split.name}: {sum(s.nsamples for s in shards)} samples in {len(shards)} shards")
    index = {"__kind__": DPT_KIND, "classes": list(classes),
             "splits": {name: f"{name}.json" for name in written}, **roles}  # fmt: skip
    _write_json(out / INDEX, index)
    return written


# One sample: its key and its members, (extension, bytes) in the order they are written.
Sample = tuple[str, list[tuple[str, bytes]]]


def _write_split(out: Path, split: Split, shard_bytes: int) -> list[ShardInfo]:
    # A bar on a terminal (disable=None: none in a log file), for sets of millions of images.
    progress = tqdm(split.samples, desc=split.name, unit="img", disable=None, leave=False)
    return _write_samples(out, split.name, _images(split.name, progress), shard_bytes)


def _images(split: str, samples: Iterable[tuple[str, int]]) -> Iterator[Sample]:
    """Each image file as its bytes (`<key>.<ext>`) and its label (`<key>.cls`)."""
    for index, (path, label) in enumerate(samples):
        try:
            data = Path(path).read_bytes()
        except OSError as error:  # a truncated file is copied as it is; a missing one cannot be
            log.warning(f"{split}: left out {path}: {error.strerror}")
            continue
        ext = Path(path).suffix.lower().lstrip(".") or "bin"
        yield f"{index:08d}", [(ext, data), ("cls", str(label).encode())]


def _write_samples(
    out: Path, split: str, samples: Iterable[Sample], shard_bytes: int
) -> list[ShardInfo]:
    """The samples in order, cut into shards of about `shard_bytes`: a shard ends before the
    sample whose first member (the image, the tokens) would take it past the bound; what it
    holds counts that member and a tar header per member (image shards are cut where they
    always were)."""
    shards: list[ShardInfo] = []
    batch: list[Sample] = []
    size = 0
    for sample in samples:
        payload = len(sample[1][0][1])
        if batch and size + payload > shard_bytes:
            shards.append(_write_shard(out, split, len(shards), batch))
            batch, size = [], 0
        batch.append(sample)
        size += payload + len(sample[1]) * tarfile.BLOCKSIZE
    if batch:
        shards.append(_write_shard(out, split, len(shards), batch))
    return shards


def _write_shard(out: Path, split: str, number: int, samples: list[Sample]) -> ShardInfo:
    name = f"{split}-{number:06d}.tar"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for ext, data in members:
                _add(tar, f"{key}.{ext}", data)
    content = buffer.getvalue()
    _write_file(out / name, content)
    return ShardInfo(name, len(samples), len(content), hashlib.md5(content).hexdigest())


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A member with nothing of this machine or this moment in its header."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def _descriptor(split: str, shards: list[ShardInfo], classes: Sequence[str]) -> dict[str, object]:
    return {
        "__kind__": WIDS_KIND,
        "wids_version": 1,
        "name": split,
        "classes": list(classes),
        "shardlist": [vars(shard) for shard in shards],
    }


def _write_json(path: Path, value: object) -> None:
    _write_file(path, (json.dumps(value, indent=1) + "\n").encode())


def _write_file(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# index.json's `kind` of token shards (`dpt-shards --text`); images where it has none.
TOKENS = "tokens"
TOKEN_MEMBER = "tokens"  # a sample's one member: block_size + 1 ids, little-endian


def write_token_shards(
    out: Path,
    parts: dict[str, np.ndarray],
    block_size: int,
    tokenizer: dict[str, object],
    tokenizer_text: str | None,
    shard_bytes: int,
) -> dict[str, list[ShardInfo]]:
    """Each role's windows of `block_size + 1` token ids (window i starts at id i x
    block_size, as dataset=text reads them) as shards of `<key>.tokens` members, and an index
    saying so (kind, block size, dtype, vocabulary, tokenizer: its file beside the index)."""
    from dpt.data.text import window, window_count  # torch: only for text, not for images

    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for role, ids in parts.items():
        dtype = np.dtype(ids.dtype).newbyteorder("<")
        samples = ((f"{i:08d}", [(TOKEN_MEMBER, ids[window(i, block_size)].astype(dtype)
                                  .tobytes())])
                   for i in range(window_count(len(ids), block_size)))  # fmt: skip
        shards = _write_samples(out, role, samples, shard_bytes)
        _write_json(out / f"{role}.json", _descriptor(role, shards, []))
        written[role] = shards
        log.info(f"{role}: {sum(s.nsamples for s in shards)} windows in {len(shards)} shards")
    if tokenizer_text is not None:
        _write_file(out / str(tokenizer["file"]), tokenizer_text.encode())
    index = {"__kind__": DPT_KIND, "kind": TOKENS, "block_size": block_size,
             "dtype": str(next(iter(parts.values())).dtype), "tokenizer": tokenizer,
             "classes": [], "splits": {role: f"{role}.json" for role in written},
             **{role: role for role in written}}  # fmt: skip
    _write_json(out / INDEX, index)
    return written
