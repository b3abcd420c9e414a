"""Text to token ids and back: bytes by default (256 symbols, nothing to install or train), or a
Hugging Face `tokenizers` file (`dataset.tokenizer=path/tokenizer.json`, e.g. one `dpt-tokenizer`
trained on the user's text). A run keeps what it used (`Tokenizer.describe`, and the file beside
its weights), so that `dpt-generate` decodes with the same one."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpt.errors import DptError

if TYPE_CHECKING:  # numpy is imported where arrays are made: config checks read this module
    import numpy as np

BYTES = "bytes"  # dataset.tokenizer's default: UTF-8 bytes, one token each
RUN_FILE = "tokenizer.json"  # a run's copy of its tokenizers file, beside data.json
# What transformers keeps beside a folder's tokenizer.json: its special tokens (eos, pad, ...)
# and its chat template. A run keeps copies of those its tokenizer's folder has, beside its
# copy of the tokenizer, so that an exported model's folder has them too (dpt-export).
PAD_TOKENS = ("[PAD]", "<pad>", "<|pad|>")  # BERT's, T5's and others' padding tokens
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
KEY = "dataset.tokenizer={}"  # how errors name the file by default: the config's key


class Tokenizer:
    """Encodes text to ids and decodes ids to text; `vocab_size` ids, from 0."""

    name: str
    vocab_size: int

    def encode(self, text: str, special: bool = True) -> list[int]:
        """`special=False`: without the special tokens the tokenizer adds around a text (a
        Llama's BOS): a chat template writes its own, and each of a row's pieces is encoded
        alone (dpt/data/chat.py)."""
        raise NotImplementedError

    def decode(self, ids: list[int], special: bool = False) -> str:
        """`special=True`: special tokens spelled out (`<|im_end|>`: where an answer ends)."""
        raise NotImplementedError

    def encode_array(self, text: str, dtype: str) -> np.ndarray:
        """`encode` as an array of `dtype` (the token file's)."""
        import numpy as np

        return np.asarray(self.encode(text), dtype=dtype)

    def fingerprint(self) -> str:
        """What changes when its encoding changes: part of the token cache's key."""
        raise NotImplementedError

    def pad_id(self) -> int:
        """The id that pads a text to a length (dataset=records): 0 unless the tokenizer has a
        padding token of its own."""
        return 0

    def describe(self) -> dict[str, Any]:
        """What a run records of it (data.json)."""
        return {"kind": self.name, "vocab_size": self.vocab_size}


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: any text, 256 ids, no training; decoding replaces a cut multi-byte
    character (a sample can stop inside one)."""

    name, vocab_size = BYTES, 256

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # no special tokens

    def decode(self, ids: list[int], special: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_array(self, text: str, dtype: str) -> np.ndarray:
        import numpy as np

        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)

    def fingerprint(self) -> str:
        return BYTES


class FileTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` JSON file (BPE, WordPiece, ...)."""

    name = "tokenizers"

    def __init__(self, path: Path, named: str = KEY) -> None:
        """`named`: how errors name the file, a format string (`--tokenizer {}` in a command)."""
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise DptError(f"{named.format(path)}: {_reason(error)}") from error
        self._load(text, named.format(path))
        self.path: Path | None = path

    @classmethod
    def from_text(cls, text: str, name: str) -> FileTokenizer:
        """One read from elsewhere (token shards over HTTP): `name` says where in errors."""
        made = cls.__new__(cls)
        made._load(text, KEY.format(name))
        made.path = None
        return made

    def _load(self, text: str, named: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.text = text
        try:
            self.impl = HFTokenizer.from_str(text)
        except Exception as error:  # the library's own (a Rust panic's text, a JSON error)
            raise DptError(
                f"{named}: not a tokenizers file ({_reason(error)}); write one with "
                "dpt-tokenizer --text ROOT --vocab-size N --out FILE"
            ) from error
        self.vocab_size = self.impl.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.impl.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int], special: bool = False) -> str:
        return self.impl.decode(ids, skip_special_tokens=not special)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def pad_id(self) -> int:
        """Its padding's id (tokenizer.json's `padding`), else its pad token's ([PAD], <pad>)."""
        padding = self.impl.padding
        if padding:
            return int(padding["pad_id"])
        found = (self.impl.token_to_id(token) for token in PAD_TOKENS)
        return next((int(i) for i in found if i is not None), 0)

    def describe(self) -> dict[str, Any]:
        """`file`: its copy's name in a run folder (or beside token shards)."""
        return {**super().describe(), "file": RUN_FILE}

    def companions(self) -> dict[str, bytes]:
        """transformers' files beside a model folder's tokenizer.json (COMPANION_FILES)."""
        if self.path is None or self.path.name != RUN_FILE:
            return {}
        found = (self.path.with_name(name) for name in COMPANION_FILES)
        return {file.name: file.read_bytes() for file in found if file.is_file()}


def load_tokenizer(spec: str | None, named: str = KEY) -> Tokenizer:
    """`dataset.tokenizer`: `bytes` (or null), the path of a tokenizers JSON file, or a model
    folder holding one (transformers' `tokenizer.json`). `named`: how errors name it, a format
    string (`--tokenizer {}` in a command)."""
    if spec in (None, BYTES):
        return ByteTokenizer()
    path = tokenizer_file(spec)
    if Path(spec).is_dir() and not path.is_file():
        raise DptError(f"{named.format(spec)}: a folder without {RUN_FILE}")
    if not path.is_file():
        raise DptError(f"{named.format(spec)}: file not found (or `bytes`)")
    return FileTokenizer(path, named)


def tokenizer_file(spec: str) -> Path:
    """The tokenizers file `dataset.tokenizer` names: the path, or a model folder's own."""
    path = Path(spec)
    return path / RUN_FILE if path.is_dir() else path


def _reason(error: BaseException) -> str:
    text = getattr(error, "strerror", None) or str(error).strip()
    return (text.splitlines() or [type(error).__name__])[0]
