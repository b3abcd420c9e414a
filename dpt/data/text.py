"""`dataset=text`: a `.txt` file or a folder of them, tokenized once into memory-mapped token files,
and read as windows of `block_size + 1` tokens (the input, and the targets one token later).

- Training text: `dataset.root` itself (a file), or every file under it with one of
  `dataset.extensions` (`.txt` by default; sorted, hidden ones and a `val` folder or `val.txt`
  left out, and so are `test.txt` and `test/`). Validation: `<root>/val.txt` (`val<ext>`) or
  `<root>/val/` where there is one, else the last `dataset.val_fraction` of the training tokens.
- Test (dpt-evaluate's alone): `<root>/test.txt` (`test<ext>`) or `<root>/test/`, tokenized
  (and cached) only when asked for.
- Tokens are cached in `dataset.cache_dir` (default `$XDG_CACHE_HOME/dpt/tokens`) under a key of
  the texts' contents and the tokenizer's: the same text and tokenizer are tokenized once,
  whichever run, rank or world asks; a changed text or tokenizer is tokenized anew. Every rank
  builds the same files: one tokenizes (under a lock), the others wait and read.
- Windows do not overlap (window i starts at token i x block_size); dpt shuffles their order per
  epoch from the seed, as for any data set: a resume on any world size reads the same windows.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dpt.data.loaders import StackedBatch
from dpt.data.splits import TEST, VAL
from dpt.data.text_files import (
    CONFIG,
    EXTENSIONS,
    Spelling,
    held_out_names,
    split_files,
    text_files,
)
from dpt.data.tokenizer import Tokenizer, load_tokenizer
from dpt.errors import DptError
from dpt.loggers import ONCE_LOGGER_NAME
from dpt.targets import Targets

log = logging.getLogger("dpt")
once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it

HASH_CHUNK = 1 << 20  # bytes read at a time while hashing


def window_count(tokens: int, block_size: int) -> int:
    """How many windows of `block_size + 1` tokens a text of `tokens` holds: window i starts at
    token i x block_size (windows share one token: the last target is the next first input)."""
    return (tokens - 1) // block_size


def window(i: int, block_size: int) -> slice:
    """Window i's tokens (dataset=text and dpt-shards' token shards cut the same ones)."""
    return slice(i * block_size, (i + 1) * block_size + 1)


class TokenWindows(Dataset):
    """Windows of `block_size + 1` tokens of one token file: item i is (tokens[i*T : i*T + T],
    tokens[i*T + 1 : i*T + T + 1]) as int64, T = block_size. A batch is fetched in one indexing
    op (`__getitems__`), as dpt's in-memory data sets are."""

    def __init__(self, path: Path, count: int, dtype: str, block_size: int) -> None:
        self.path, self.count, self.dtype, self.block_size = path, count, dtype, block_size
        self.tokens = _open(path, dtype, count)

    def __len__(self) -> int:
        return window_count(self.count, self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.__getitems__([index])
        return batch.inputs[0], batch.labels[0]

    def __getitems__(self, indices: Sequence[int]) -> StackedBatch:
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.block_size
        window = torch.from_numpy(
            self.tokens[starts + np.arange(self.block_size + 1)].astype(np.int64)
        )
        return StackedBatch(window[:, :-1], window[:, 1:])

    def __getstate__(self) -> dict[str, Any]:
        # A loader worker started by spawn opens the file itself (a memmap does not pickle).
        return {k: v for k, v in vars(self).items() if k != "tokens"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self.tokens = _open(self.path, self.dtype, self.count)


def _open(path: Path, dtype: str, count: int) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class TextData:
    """What dpt.contract.DataModule asks, for a language model: one class per token."""

    def __init__(
        self,
        root: str,
        tokenizer: str | None,
        block_size: int,
        val_fraction: float,
        cache_dir: str | None,
        num_workers: int,
        seed: int,
        extensions: Sequence[str] = EXTENSIONS,
    ) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        train_files, val_files = text_files(Path(root), tuple(extensions))
        cache = Path(cache_dir) if cache_dir else default_cache_dir()
        tokens = cached_tokens(train_files, val_files, self.tokenizer, cache, val_fraction)
        self.train = _windows(tokens, "train", block_size, root)
        self.val = _windows(tokens, VAL, block_size, root) if tokens.get(VAL) else None
        self.input_shape: tuple[int, ...] = (block_size,)
        self.input_dtype = torch.long  # token ids
        self.num_classes = self.tokenizer.vocab_size  # one class a token: the model's outputs
        self.target_spec = Targets(integer=True, shape=(block_size,), classes=self.num_classes)
        self.num_workers = num_workers
        # What the test split is read with, on first use (training never asks for it).
        self.root, self.extensions, self.cache = root, tuple(extensions), cache
        self.block_size = block_size
        train_tokens = tokens["train"]["count"]
        val_tokens = tokens[VAL]["count"] if tokens.get(VAL) else 0
        name, ids = self.tokenizer.name, self.tokenizer.vocab_size
        once.info(f"text: {train_tokens:,} training tokens ({len(self.train):,} windows of "
                 f"{block_size + 1}), {val_tokens:,} validation tokens; tokenizer {name} "
                 f"({ids:,} ids)")  # fmt: skip

    @functools.cached_property
    def test(self) -> TokenWindows | None:
        """`<root>/test.txt` or `<root>/test/`'s windows; None where there is neither."""
        files = split_files(Path(self.root), self.extensions, TEST)
        if not files:
            return None
        # Cached as a text of its own (a training text's role in the cache: no share held out).
        tokens = cached_tokens(files, [], self.tokenizer, self.cache, val_fraction=0.0)
        return _windows({TEST: tokens["train"]}, TEST, self.block_size, self.root)

    def missing_split(self, split: str) -> str:
        """Why there is no `split` (dpt.data.splits), naming the held-out texts there are."""
        root = Path(self.root)
        if not root.is_dir():
            return f"the text {root} is one file: no {split} split (a folder holds {split}.txt)"
        has = ", ".join(["training texts", *held_out_names(root, self.extensions)])
        ext = next(iter(self.extensions))
        return f"the text folder {root} has no {split}{ext} nor {split}/ (it has {has})"


def _windows(tokens: dict[str, Any], role: str, block_size: int, root: str) -> TokenWindows:
    found = tokens[role]
    windows = TokenWindows(Path(found["path"]), found["count"], found["dtype"], block_size)
    if len(windows) == 0:
        where = {VAL: "validation text", TEST: "test text"}.get(role, "text")
        raise DptError(
            f"dataset.root={root}: the {where} has {found['count']} tokens, shorter than one "
            f"window of dataset.block_size + 1 = {block_size + 1} tokens"
        )
    return windows


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dpt" / "tokens"


# --- which files --------------------------------------------------------------------------------


# --- the token cache ------------------------------------------------------------------------------


def cached_tokens(
    train: list[Path], val: list[Path], tokenizer: Tokenizer, cache: Path, val_fraction: float
) -> dict[str, Any]:
    """The token files of these texts (made once, under a lock: ranks and runs share them):
    {role: {path, count, dtype}}, role train and (where there is validation) val."""
    key = _key(train, val, tokenizer, val_fraction)
    cache.mkdir(parents=True, exist_ok=True)
    meta = cache / f"{key}.json"
    with _locked(cache / f"{key}.lock"):
        if not meta.is_file():
            _tokenize(train, val, tokenizer, cache / key, val_fraction, meta)
    return json.loads(meta.read_text())


def _key(train: list[Path], val: list[Path], tokenizer: Tokenizer, val_fraction: float) -> str:
    digest = hashlib.sha256(f"{tokenizer.fingerprint()}|{val_fraction if not val else ''}".encode())
    for role, files in (("train", train), (VAL, val)):
        for path in files:
            digest.update(f"|{role}|{path.name}|".encode())
            with path.open("rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    digest.update(chunk)
    return digest.hexdigest()[:24]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def tokenize(
    train: list[Path],
    val: list[Path],
    tokenizer: Tokenizer,
    val_fraction: float,
    spelling: Spelling = CONFIG,
) -> dict[str, np.ndarray]:
    """The texts' token ids by role: train, and val (from the validation texts, or the last
    `val_fraction` of the training ids; none where neither gives any)."""
    dtype = token_dtype(tokenizer.vocab_size)
    files = f"{len(train)} training and {len(val)} validation" if val else f"{len(train)}"
    log.info(f"tokenizing {files} file(s) with {tokenizer.name}")  # said by the rank that does
    ids = _encode(train, tokenizer, dtype)
    if ids.size == 0:
        where = train[0].parent if len(train) > 1 else train[0]
        raise DptError(f"{spelling.root.format(where)}: the text is empty")
    if val:
        return {"train": ids, VAL: _encode(val, tokenizer, dtype)}
    if val_fraction > 0:
        cut = len(ids) - int(len(ids) * val_fraction)
        return {"train": ids[:cut], VAL: ids[cut:]}
    return {"train": ids}


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id: half the bytes for up to 65,536 ids."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _tokenize(
    train: list[Path], val: list[Path], tokenizer: Tokenizer, stem: Path, val_fraction: float,
    meta: Path,
) -> None:  # fmt: skip
    record: dict[str, Any] = {}
    for role, tokens in tokenize(train, val, tokenizer, val_fraction).items():
        path = stem.with_suffix(f".{role}.bin")
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tokens.tofile(tmp)
        os.replace(tmp, path)
        record[role] = {"path": str(path), "count": int(tokens.size), "dtype": str(tokens.dtype)}
    tmp = meta.with_name(f".{meta.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, meta)  # last: the files are complete once it is there


def _encode(files: list[Path], tokenizer: Tokenizer, dtype: str) -> np.ndarray:
    parts = [tokenizer.encode_array(path.read_text(encoding="utf-8", errors="replace"), dtype)
             for path in files]  # fmt: skip
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
