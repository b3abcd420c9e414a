"""Which files a text is (dataset=text, dpt-tokenizer, dpt-shards), and how the user named
them, for errors: torch-free, so that a command's `--help` and bad arguments answer at once.

A text is `root` itself (a file), or every file under it with one of the extensions (`.txt` by
default; sorted, hidden ones and the `val` and `test` folders or files left out). Validation:
`val<ext>` or a `val/` folder under the root where there is one; the test split (dpt-evaluate's
alone: no training command reads it), `test<ext>` or a `test/` folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dpt.data.splits import TEST, VAL
from dpt.data.tokenizer import KEY as TOKENIZER_KEY
from dpt.errors import DptError

HELD_OUT = (VAL, TEST)  # the splits a folder's files or subfolders of those names are
EXTENSIONS = (".txt",)  # dataset.extensions' default: the files a text folder is read from


@dataclass(frozen=True)
class Spelling:
    """How the user named the text and its tokenizer, for their errors: a run's config keys, or
    a command's flags (dpt-tokenizer, dpt-shards). Each a format string of the value."""

    root: str = "dataset.root={}"
    extensions: str = "dataset.extensions=[{}]"
    tokenizer: str = TOKENIZER_KEY


CONFIG = Spelling()  # dataset=text's keys


def text_files(
    root: Path, extensions: Sequence[str] = EXTENSIONS, spelling: Spelling = CONFIG
) -> tuple[list[Path], list[Path]]:
    """The training texts and the validation texts (none: a share of the training tokens): the
    files with one of `extensions` under `root`, or `root` itself, a file."""
    named = spelling.root.format(root)
    if root.is_file():
        return [root], []
    if not root.is_dir():
        raise DptError(f"{named}: no such file or folder")
    val = split_files(root, extensions, VAL)
    held_out = {*val, *split_files(root, extensions, TEST)}
    train = [p for p in _files_under(root, extensions)
             if p not in held_out and p.relative_to(root).parts[0] not in HELD_OUT]  # fmt: skip
    if not train:
        listed = ", ".join(extensions)
        others = sorted({p.suffix for p in root.rglob("*.*") if p.is_file()} - set(extensions))
        hint = ""
        if others:  # what is there, and how to read it
            read = spelling.extensions.format(others[0])
            hint = f"; it holds {', '.join(others[:5])} files: {read} reads those"
        raise DptError(f"{named}: no {listed} file here{hint}")
    return train, val


def split_files(root: Path, extensions: Sequence[str], split: str) -> list[Path]:
    """A folder's texts of a held-out split (`val`, `test`): `<split><ext>`, else the files
    under `<split>/` (none: the folder has no such split, or `root` is a file)."""
    if not root.is_dir():
        return []
    found = next((root / f"{split}{ext}" for ext in extensions
                  if (root / f"{split}{ext}").is_file()), None)  # fmt: skip
    return [found] if found else _files_under(root / split, extensions)


def held_out_names(root: Path, extensions: Sequence[str]) -> list[str]:
    """The held-out splits' files and folders `root` holds (`val.txt`, `test/`), for a message."""
    names = []
    for split in HELD_OUT:
        files = split_files(root, extensions, split)
        if files:
            names.append(files[0].name if files[0].parent == root else f"{split}/")
    return names


def _files_under(folder: Path, extensions: Sequence[str]) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [p for p in folder.rglob("*") if p.is_file() and p.suffix in extensions]
    return sorted(
        p for p in found if not any(s.startswith(".") for s in p.relative_to(folder).parts)
    )
