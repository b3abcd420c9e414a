"""The `dpt-tokenizer` command: a byte-level BPE trained on your text with Hugging Face
`tokenizers`, for `dataset=text dataset.tokenizer=FILE`.

`dpt-tokenizer --text ROOT --vocab-size N --out FILE` reads the files dataset=text would read
under ROOT (`.txt`, or those `--ext` names, as `dataset.extensions`; or ROOT itself: a file;
validation texts included), learns N - 256 merges on top of the 256 bytes (GPT-2's byte-level
scheme: any text encodes, nothing is unknown) and writes the tokenizer as JSON. The same text and
N give the same file.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from dpt.commands.command import run_command
from dpt.commands.text_args import FLAGS, add_extensions, as_config, extensions
from dpt.data.text_files import EXTENSIONS
from dpt.errors import DptError

log = logging.getLogger("dpt")

BYTE_TOKENS = 256  # a byte-level vocabulary's alphabet: every byte a token before any merge


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpt-tokenizer", description="Train a byte-level BPE tokenizer on your text."
    )
    parser.add_argument("--text", required=True, metavar="ROOT",
                        help="a text file, or a folder of them (as dataset.root)")  # fmt: skip
    add_extensions(parser)
    parser.add_argument("--vocab-size", required=True, type=int, metavar="N",
                        help=f"tokens in all: {BYTE_TOKENS} bytes and N - {BYTE_TOKENS} "
                             "merges")  # fmt: skip
    parser.add_argument("--out", required=True, metavar="FILE", help="the tokenizer's JSON file")
    return parser.parse_args(argv)


def train(root: Path, vocab_size: int, out: Path, exts: tuple[str, ...] = EXTENSIONS) -> int:
    """Write the tokenizer; returns its vocabulary's size (fewer than asked where the text
    has fewer merges to learn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dpt.data.text_files import text_files

    if vocab_size <= BYTE_TOKENS:
        raise DptError(
            f"--vocab-size {vocab_size}: more than {BYTE_TOKENS} (the bytes, then merges)"
        )
    train_files, val_files = text_files(root, exts, FLAGS)
    files = [str(path) for path in [*train_files, *val_files]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )  # fmt: skip
    tokenizer.train(files, trainer)
    if tokenizer.get_vocab_size() == 0:
        raise DptError(f"{FLAGS.root.format(root)}: the text is empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tokenizer.save(str(tmp))
    tmp.replace(out)
    return tokenizer.get_vocab_size()


def main(argv: Sequence[str] | None = None) -> None:
    """`dpt-tokenizer`: errors as one line on stderr (exit 1), never a traceback."""
    args = parse_args(argv)

    def body() -> None:
        size = train(Path(args.text), args.vocab_size, Path(args.out), extensions(args))
        print(f"wrote {args.out}: a byte-level BPE of {size} tokens "
              f"(dataset=text dataset.tokenizer={args.out}{as_config(args)})")  # fmt: skip

    run_command(body)


if __name__ == "__main__":
    main()
