"""The text flags dpt-tokenizer and dpt-shards share: `--text ROOT`, `--ext EXT` (as
dataset=text's `root` and `extensions`), and how their errors name them."""

from __future__ import annotations

import argparse

from dpt.data.text_files import EXTENSIONS, Spelling

FLAGS = Spelling(root="--text {}", extensions="--ext {}", tokenizer="--tokenizer {}")


def add_extensions(parser: argparse.ArgumentParser) -> None:
    """`--ext .py --ext .md`: which files of a text folder are read."""
    default = " ".join(EXTENSIONS)
    parser.add_argument("--ext", action="append", metavar="EXT", dest="extensions",
                        help="with --text: a folder's files to read, by extension; again for "
                             f"more (default {default}, as dataset.extensions)")  # fmt: skip


def extensions(args: argparse.Namespace) -> tuple[str, ...]:
    """`--ext` as given (a missing dot added: `py` is `.py`), or dataset.extensions' default."""
    return tuple(e if e.startswith(".") else f".{e}" for e in args.extensions or EXTENSIONS)


def as_config(args: argparse.Namespace) -> str:
    """The same choice of files for dataset=text: ` dataset.extensions=[.py]`, or nothing."""
    chosen = extensions(args)
    return "" if chosen == EXTENSIONS else f" dataset.extensions=[{','.join(chosen)}]"
