"""`dpt-shards`: an image folder or a COCO set (both splits), or text as windows of token ids
(`--text`), as WebDataset shards (dpt/data/shard_writer.py); errors as one line on stderr,
exit 1."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from dpt.commands.command import run_command
from dpt.commands.text_args import FLAGS, add_extensions, extensions
from dpt.data.shard_writer import Split, write_shards
from dpt.errors import DptError
from dpt.observe.logs import setup_logging

# COCO's split folders and what dataset=shards reads each as.
COCO_SPLITS = {"train2017": "train", "val2017": "val"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpt-shards",
        description="Write an image folder or a COCO set as WebDataset shards, with an index "
        "(index.json, and a wids descriptor per split); the same input gives the same bytes.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--image-folder",
        metavar="ROOT",
        help="ROOT/train/<class>/<images> (and ROOT/val/<class>/<images>)",
    )
    source.add_argument(
        "--coco", metavar="ROOT", help="ROOT/annotations/instances_<split>.json and ROOT/<split>/"
    )
    source.add_argument(
        "--text", metavar="ROOT", help="a text file or a folder of them (as dataset=text reads)"
    )
    add_extensions(parser)
    parser.add_argument("--tokenizer", default="bytes", metavar="FILE",
                        help="--text: bytes (default) or a tokenizers JSON file")  # fmt: skip
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="--text: tokens a sample trains on (model.block_size)")  # fmt: skip
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="--text without val.txt, val/: the last share of ids")  # fmt: skip
    parser.add_argument("--out", required=True, metavar="DIR", help="the shards' folder")
    parser.add_argument("--shard-size-mb", type=float, default=256.0, metavar="N",
                        help="about N MB of images per shard (default 256)")  # fmt: skip
    return parser.parse_args(argv)


def splits_of(args: argparse.Namespace) -> tuple[list[Split], list[str]]:
    """The splits to write and the class names in label order."""
    if args.image_folder is not None:
        from dpt.data.folder_layout import scan_layout

        layout = scan_layout(args.image_folder, val_fraction=0.0, seed=0)
        splits = [Split("train", layout.train, "train")]
        if layout.val:
            splits.append(Split("val", layout.val, "val"))
        return splits, layout.classes
    from dpt.data.coco import CocoClassification

    root = Path(args.coco)
    present = [s for s in COCO_SPLITS if (root / "annotations" / f"instances_{s}.json").is_file()]
    if not present:
        raise DptError(f"--coco {root}: no annotations/instances_train2017.json or _val2017.json")
    sets = [CocoClassification(root, split) for split in present]
    pairs = zip(present, sets, strict=True)
    splits = [Split(name, data.samples, COCO_SPLITS[name]) for name, data in pairs]
    return splits, sets[0].classes


def write_text(args: argparse.Namespace) -> None:
    """The text's token ids, as dataset=text makes them, in windows of --block-size + 1."""
    from dpt.data.shard_writer import write_token_shards
    from dpt.data.text import tokenize
    from dpt.data.text_files import text_files
    from dpt.data.tokenizer import load_tokenizer

    if args.block_size is None or args.block_size < 1:
        raise DptError("--text needs --block-size N (N >= 1: model.block_size of the runs)")
    train, val = text_files(Path(args.text), extensions(args), FLAGS)
    tokenizer = load_tokenizer(args.tokenizer, FLAGS.tokenizer)
    parts = tokenize(train, val, tokenizer, args.val_fraction, FLAGS)
    described = {k: v for k, v in tokenizer.describe().items() if k != "source"}
    text = getattr(tokenizer, "text", None)  # a tokenizers file's, kept beside the shards
    write_token_shards(Path(args.out), parts, args.block_size, described, text,
                       int(args.shard_size_mb * 2**20))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    """`dpt-shards`: errors as one line on stderr (exit 1), never a traceback."""
    args = parse_args(argv)
    setup_logging("dpt-shards")
    logging.getLogger("dpt").setLevel(logging.INFO)

    def body() -> None:
        if args.shard_size_mb <= 0:
            raise DptError(f"--shard-size-mb {args.shard_size_mb:g}: must be > 0")
        if args.text is not None:
            write_text(args)
            return
        splits, classes = splits_of(args)
        write_shards(Path(args.out), splits, classes, int(args.shard_size_mb * 2**20))

    run_command(body, also=(OSError,))


if __name__ == "__main__":
    main()
