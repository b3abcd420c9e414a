"""The `dataset=shards` module: WebDataset tar shards written by `dpt-shards`, read from a local
folder, an HTTP(S) URL or an object store (fsspec), through a cache bounded in bytes.

Samples are numbered as the writer laid them out: the shards of a split in their index's order,
each shard's samples in tar order. Each shard is opened with wids' indexed tar reader (an mmap
and an index of its members), so sample `i` is read directly, without streaming the shard.

The training order of an epoch is a pure function of (seed, epoch), like `epoch_order` for files,
but with locality: the shards in a seeded order, then their samples shuffled within windows of
`shuffle_window` consecutive samples (`ShardOrder`). At any moment the ranks read from the one
or two shards under the current window, so a node downloads each shard once per epoch and the
cache only has to hold a few. The order does not depend on the world size or the loader workers,
so a resume on any world size continues it exactly.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset
from wids.wids import IndexedTarSamples

from dpt.data.crop_decode import RandomResizedCropDecode
from dpt.data.images import BadImages, Decoder, DecodeThen, check_bad_image_policy, val_transform
from dpt.data.loaders import MISSING
from dpt.data.shard_cache import ShardCache
from dpt.data.shard_fetch import (
    FetchPolicy,
    ShardUnavailable,
    SourceUnreachable,
    is_local,
    join_url,
    local_path,
    read_bytes,
)
from dpt.data.shard_writer import DPT_KIND, INDEX, TOKEN_MEMBER, TOKENS, WIDS_KIND
from dpt.data.tokenizer import BYTES, ByteTokenizer, FileTokenizer, Tokenizer
from dpt.errors import ConfigError, DptError
from dpt.loggers import ONCE_LOGGER_NAME
from dpt.seeding import derived_seed
from dpt.targets import Targets

log = logging.getLogger("dpt")
once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it

# Shards a loader worker keeps open at once: the window's one or two, and the next one.
OPEN_SHARDS = 3
# A tag in the seeds of the order: its streams apart from the augmentation's (seed, epoch, index).
_ORDER_TAG = 0x5A4D


@dataclass(frozen=True)
class Shard:
    """One shard as the split's descriptor lists it."""

    url: str
    nsamples: int
    filesize: int
    md5sum: str | None


@dataclass(frozen=True)
class ShardIndex:
    """What `dpt-shards` wrote: the class names and each role's ("train", "val") shards; for
    token shards (`kind`), their block size, dtype and tokenizer."""

    root: str
    classes: list[str]
    splits: dict[str, list[Shard]]
    kind: str = "images"
    fields: dict[str, Any] | None = None  # the index's other keys (token shards' settings)


def read_index(root: str, policy: FetchPolicy) -> ShardIndex:
    """`<root>/index.json` and the descriptors it names; one line for anything missing."""
    index = _read_json(join_url(root, INDEX), DPT_KIND, policy)
    splits: dict[str, list[Shard]] = {}
    for role in ("train", "val"):
        name = index.get(role)
        if name is None:
            continue
        descriptor_url = join_url(root, index["splits"][name])
        descriptor = _read_json(descriptor_url, WIDS_KIND, policy)
        splits[role] = [
            Shard(join_url(root, s["url"]), int(s["nsamples"]), int(s["filesize"]), s.get("md5sum"))
            for s in descriptor["shardlist"]
        ]
    if "train" not in splits:
        raise DptError(f"dataset.root={root}: {INDEX} names no train split")
    return ShardIndex(root, list(index["classes"]), splits, index.get("kind", "images"), index)


def _read_json(url: str, kind: str, policy: FetchPolicy) -> dict[str, Any]:
    try:
        value = json.loads(read_bytes(url, policy, what="file"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DptError(f"{url}: not valid JSON ({error})") from None
    if not isinstance(value, dict) or value.get("__kind__") != kind:
        raise DptError(f"{url}: not a {kind} file (written by dpt-shards?)")
    return value


class ShardOrder:
    """An epoch's order of a split's samples, from (seed, epoch) alone: the shards in a seeded
    order, their samples concatenated, then shuffled within consecutive windows of `window`
    samples (window 1: each shard's samples in their order; window >= the split: a full
    shuffle)."""

    def __init__(self, counts: Sequence[int], window: int) -> None:
        self.starts = [0]
        for count in counts:
            self.starts.append(self.starts[-1] + count)
        self.window = window

    def __call__(self, seed: int, epoch: int) -> list[int]:
        shards = _permutation(len(self.starts) - 1, seed, epoch, -1)
        samples = torch.cat([torch.arange(self.starts[s], self.starts[s + 1]) for s in shards])
        windows = samples.split(self.window)
        shuffled = [w[_permutation(len(w), seed, epoch, k)] for k, w in enumerate(windows)]
        return torch.cat(shuffled).tolist()


def _permutation(size: int, seed: int, epoch: int, part: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(derived_seed(_ORDER_TAG, seed, epoch, part))
    return torch.randperm(size, generator=generator)


class ShardedSamples(Dataset):
    """One split's samples, each read from its shard through the cache: item `i` is what
    `item` makes of its tar members, or None where its whole shard cannot be had and
    `on_bad_image` says skip.

    The cache and the open shards are made in the process that reads (each loader worker), on
    first use: open files and locks are not carried across a fork or a pickle."""

    def __init__(
        self,
        shards: Sequence[Shard],
        on_bad_image: str,
        cache: Callable[[], ShardCache],
        shuffle_window: int,
    ) -> None:
        self.shards = list(shards)
        self.bad_images = BadImages(on_bad_image)
        self.make_cache = cache
        self.epoch_order = ShardOrder([s.nsamples for s in self.shards], shuffle_window)
        self._pid = -1
        self._cache: ShardCache | None = None
        self._open: OrderedDict[int, IndexedTarSamples] = OrderedDict()
        self._unavailable: set[int] = set()  # shards this process could not have

    def __len__(self) -> int:
        return self.epoch_order.starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pid=-1, _cache=None, _open=OrderedDict())
        return state

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, sample within it) of sample `index`."""
        shard = bisect.bisect_right(self.epoch_order.starts, index) - 1
        return shard, index - self.epoch_order.starts[shard]

    def __getitem__(self, index: int) -> Any:
        shard, k = self.locate(index)
        samples = self._samples(shard)
        if samples is None:
            return MISSING
        # wids' keys: the members' extensions with their dot, and "__key__"
        return self.item(samples[k], self.shards[shard].url)

    def item(self, sample: dict[str, Any], url: str) -> Any:
        raise NotImplementedError

    def _samples(self, shard: int) -> IndexedTarSamples | None:
        """Shard `shard` open and indexed, or None where it cannot be had and bad data is
        skipped (said once per process; its samples count as unreadable)."""
        if self._pid != os.getpid():  # a fresh loader worker: nothing of its parent's is reused
            self._pid, self._cache, self._open = os.getpid(), self.make_cache(), OrderedDict()
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        if shard in self._unavailable:
            return None
        try:
            samples = self._open_shard(shard)
        except SourceUnreachable:
            raise  # not one damaged shard: the run cannot go on without the source
        except ShardUnavailable as error:
            if self.bad_images.policy == "error":
                raise
            self._unavailable.add(shard)
            log.warning(f"skipping {error} (its {self.shards[shard].nsamples} samples)")
            return None
        self._open[shard] = samples
        if len(self._open) > OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return samples

    def _open_shard(self, shard: int) -> IndexedTarSamples:
        info = self.shards[shard]
        assert self._cache is not None
        stream: BinaryIO = self._cache.open(info.url, info.filesize, info.md5sum)
        try:
            return IndexedTarSamples(stream=stream, expected_size=info.nsamples)
        except (AssertionError, ValueError, OSError) as error:
            # wids asserts on a sample count that does not match; a bad header is a ValueError.
            stream.close()
            reason = str(error) or type(error).__name__
            raise ShardUnavailable(
                f"shard {info.url}: not a readable tar shard ({reason})"
            ) from None


class ShardedImages(ShardedSamples):
    """Item `i` is (the decoded, transformed image, its label), or None where the image cannot
    be read and `on_bad_image` says skip."""

    def __init__(self, shards: Sequence[Shard], decode: Decoder, *args: Any) -> None:
        super().__init__(shards, *args)
        self.decode = decode

    def item(self, sample: dict[str, Any], url: str) -> tuple[torch.Tensor, int] | None:
        members = sorted(e for e in sample if e != "__key__")
        images = [e for e in members if e != ".cls"]
        if ".cls" not in sample or not images:
            raise DptError(
                f"shard {url}: sample {sample['__key__']} has members {members}; "
                "dataset=shards reads <key>.<image extension> and <key>.cls (as dpt-shards writes)"
            )
        label = int(sample[".cls"].getvalue())
        ext = images[0]
        source = f"{url}/{sample['__key__']}{ext}"
        # A bytearray: the decoders hand it to torch.frombuffer, which warns on read-only bytes.
        image = self.bad_images.decode(self.decode, bytearray(sample[ext].getvalue()), source)
        return None if image is None else (image, label)


class ShardedTokens(ShardedSamples):
    """Item `i` is a window of `block_size + 1` token ids (`<key>.tokens`, as `dpt-shards
    --text` writes them): the input and, one token later, the targets, as dataset=text gives."""

    def __init__(self, shards: Sequence[Shard], dtype: str, *args: Any) -> None:
        super().__init__(shards, *args)
        self.dtype = np.dtype(dtype).newbyteorder("<")

    def item(self, sample: dict[str, Any], url: str) -> tuple[torch.Tensor, torch.Tensor]:
        member = f".{TOKEN_MEMBER}"
        if member not in sample:
            raise DptError(f"shard {url}: sample {sample['__key__']} has no {member} member")
        ids = np.frombuffer(sample[member].getvalue(), dtype=self.dtype).astype(np.int64)
        window = torch.from_numpy(ids)
        return window[:-1], window[1:]


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/dpt/shards`, else `~/.cache/dpt/shards`: the node's, for its ranks."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dpt", "shards")


class ShardsData:
    """The `dataset=shards` module: the index's train and val splits, decoded and transformed
    as `dataset=image_folder` does: random-resized crop and flip for training, decoding no more
    than the crop needs; validation as `dpt-predict` sees an image (`val_transform`)."""

    def __init__(
        self,
        root: str,
        image_size: int,
        num_workers: int,
        on_bad_image: str,
        shuffle_window: int,
        cache_dir: str | None,
        cache_limit_gb: float,
        retries: int,
        outage_s: float,
        max_skipped_fraction: float,
        timeout_s: float,
        seed: int,
    ) -> None:
        check_bad_image_policy(on_bad_image)
        policy = FetchPolicy(retries=retries, outage_s=outage_s, timeout_s=timeout_s)
        # Skipped damaged shards beyond this share of an epoch stop the run (dpt.loop.trainer).
        self.max_skipped_fraction = max_skipped_fraction
        root = os.path.abspath(local_path(root)) if is_local(root) else root
        index = read_index(root, policy)
        cache = _CacheFactory(cache_dir or default_cache_dir(), cache_limit_gb, policy)
        _check_cache_limit(index, cache_limit_gb)
        self.root, self.classes = root, index.classes
        self.num_workers = num_workers
        if index.kind == TOKENS:
            self._tokens(index, on_bad_image, cache, shuffle_window, policy)
            _log_splits(index, None if is_local(root) else cache)
            return
        self.train = ShardedImages(
            index.splits["train"], RandomResizedCropDecode(image_size), on_bad_image, cache,
            shuffle_window,
        )  # fmt: skip
        self.val: ShardedImages | None = None
        if "val" in index.splits:
            self.val = ShardedImages(
                index.splits["val"], DecodeThen(val_transform(image_size)), on_bad_image, cache,
                shuffle_window,
            )  # fmt: skip
        self.input_shape: tuple[int, ...] = (3, image_size, image_size)
        self.num_classes = len(index.classes)
        # Known from the index: reading a sample to find out would fetch a shard.
        self.target_spec = Targets.labels(self.num_classes)
        self.val_transform = {"_target_": "dpt.data.images.val_transform", "image_size": image_size}
        _log_splits(index, None if is_local(root) else cache)

    def _tokens(
        self, index: ShardIndex, on_bad_image: str, cache: _CacheFactory, shuffle_window: int,
        policy: FetchPolicy,
    ) -> None:  # fmt: skip
        """Token shards (`dpt-shards --text`): windows of token ids for a language model, as
        dataset=text gives them, with the tokenizer they were made with."""
        fields = index.fields or {}
        block_size, dtype = int(fields["block_size"]), str(fields["dtype"])
        self.train = ShardedTokens(index.splits["train"], dtype, on_bad_image, cache,
                                   shuffle_window)  # fmt: skip
        self.val = None
        if "val" in index.splits:
            self.val = ShardedTokens(index.splits["val"], dtype, on_bad_image, cache,
                                     shuffle_window)  # fmt: skip
        self.tokenizer = shards_tokenizer(index.root, fields["tokenizer"], policy)
        self.input_shape = (block_size,)
        self.input_dtype = torch.long
        self.num_classes = self.tokenizer.vocab_size
        self.classes = None
        self.target_spec = Targets(integer=True, shape=(block_size,), classes=self.num_classes)


def shards_tokenizer(root: str, described: dict[str, Any], policy: FetchPolicy) -> Tokenizer:
    """The tokenizer token shards were made with: bytes, or the tokenizers file beside them."""
    if described.get("kind", BYTES) == BYTES:
        return ByteTokenizer()
    text = read_bytes(join_url(root, described["file"]), policy, what="tokenizer").decode()
    return FileTokenizer.from_text(text, described["file"])


def _check_cache_limit(index: ShardIndex, limit_gb: float) -> None:
    """The cache must hold at least the largest shard (a local folder is read in place)."""
    if is_local(index.root):
        return
    largest = max((s for shards in index.splits.values() for s in shards), key=lambda s: s.filesize)
    if largest.filesize > limit_gb * 1e9:
        raise ConfigError(
            f"dataset.cache_limit_gb={limit_gb:g} is smaller than shard {largest.url} "
            f"({largest.filesize / 1e9:.3g} GB); raise it (to a few shards at least)"
        )


@dataclass(frozen=True)
class _CacheFactory:
    """Makes a process's ShardCache (picklable: loader workers get this, not a cache)."""

    cache_dir: str
    limit_gb: float
    policy: FetchPolicy

    def __call__(self) -> ShardCache:
        return ShardCache(Path(self.cache_dir), int(self.limit_gb * 1e9), self.policy)


def _log_splits(index: ShardIndex, cache: _CacheFactory | None) -> None:
    where = (
        "" if cache is None else f", cached in {cache.cache_dir} (at most {cache.limit_gb:g} GB)"
    )
    for role, shards in index.splits.items():
        samples = sum(s.nsamples for s in shards)
        size = sum(s.filesize for s in shards) / 1e9
        once.info(
            f"shards {role}: {samples} samples in {len(shards)} shards ({size:.3g} GB, "
            f"{len(index.classes)} classes) from {index.root}{where}"
        )
