#!/usr/bin/env python
"""Write a small text with a checkable rule, for language-model tests and smoke runs:

    OUT/train.txt   lines `a+b=c` (a, b in 0..99, c = a + b), shuffled: `07+35=042`
    OUT/val.txt     other such lines, none of them in train.txt

`--val-lines` of the 10,000 sums are held out (drawn with `--seed`), the rest are the training
text: a model that completes held-out prompts `a+b=` learned to add, not to recall. The numbers
have fixed widths: a model reads text from wherever a window starts, and `4+21=` unpadded would
also be the end of `14+21=` or `54+21=` (a prompt without the line before it cannot tell).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

ALL = [f"{a:02d}+{b:02d}={a + b:03d}" for a in range(100) for b in range(100)]


def make_text(out: Path, val_lines: int = 200, seed: int = 0) -> tuple[list[str], list[str]]:
    """Write the two files; returns (training lines, held-out lines)."""
    lines = list(ALL)
    random.Random(seed).shuffle(lines)
    val, train = lines[:val_lines], lines[val_lines:]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text("\n".join(train) + "\n")
    (out / "val.txt").write_text("\n".join(val) + "\n")
    return train, val


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the folder to write")
    parser.add_argument("--val-lines", type=int, default=200, help="sums held out (200)")
    parser.add_argument("--seed", type=int, default=0, help="which sums are held out (0)")
    args = parser.parse_args()
    train, val = make_text(args.out, args.val_lines, args.seed)
    print(f"wrote {args.out}/train.txt ({len(train)} lines) and val.txt ({len(val)} lines)")


if __name__ == "__main__":
    main()
