#!/usr/bin/env python
"""Write a small chat data set with a checkable rule, for fine-tuning tests and smoke runs:

    OUT/train.jsonl   one conversation a line: the user asks `07+35=`, the assistant answers `042`
    OUT/val.jsonl     other such conversations, none of them in train.jsonl

Each line is `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}`,
the layout chat data sets share (dataset=chat renders it with the tokenizer's chat template).
`--val-rows` of the `--rows` conversations are held out (drawn with `--seed`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def conversation(a: int, b: int) -> dict[str, list[dict[str, str]]]:
    return {"messages": [{"role": "user", "content": f"{a:02d}+{b:02d}="},
                         {"role": "assistant", "content": f"{a + b:03d}"}]}  # fmt: skip


def make_chat(out: Path, rows: int = 240, val_rows: int = 40, seed: int = 0) -> tuple[int, int]:
    """Write the two files; returns (training rows, held-out rows)."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    chosen = random.Random(seed).sample(pairs, rows)
    val, train = chosen[:val_rows], chosen[val_rows:]
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("val", val)):
        lines = (json.dumps(conversation(a, b)) + "\n" for a, b in part)
        (out / f"{name}.jsonl").write_text("".join(lines))
    return len(train), len(val)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the folder to write")
    parser.add_argument("--rows", type=int, default=240, help="conversations in all (240)")
    parser.add_argument("--val-rows", type=int, default=40, help="of them held out (40)")
    parser.add_argument("--seed", type=int, default=0, help="which sums are drawn (0)")
    args = parser.parse_args()
    train, val = make_chat(args.out, args.rows, args.val_rows, args.seed)
    print(f"wrote {args.out}/train.jsonl ({train} rows) and val.jsonl ({val} rows)")


if __name__ == "__main__":
    main()
