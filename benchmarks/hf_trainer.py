#!/usr/bin/env python
"""transformers' `Trainer` on the run of benchmarks/plain_hf.py: the `hf` section's other peer.

The same model folder (loaded and, with `--lora-rank`, wrapped with peft's LoRA as the plain loop
does), the same token file, windows, order, batch, AdamW and learning rate; the rest is
`Trainer` with `TrainingArguments` as a user sets them for this run: on the CPU, no evaluation,
no saving, nothing reported (`report_to="none"`), logging every --log-every steps, loader workers
0, a constant learning rate, no weight decay; and Trainer's own defaults as its users run it:
its optimizer (AdamW, the fused kernel), its clipping of the gradients' norm at 1.0 (the plain
loop and dpt clip at 1.0 too: the same arithmetic), its progress bar.

Each example is a dict: `input_ids` (the window's first T tokens), and its next tokens as both
`labels` (which makes the model compute its loss) and `shift_labels` (which transformers' causal
LM loss takes as they are, without shifting again): the loss over the same T targets as the
plain loop's and dpt's. The training order is the plain loop's (a sampler of that order in place
of Trainer's random one).

    python benchmarks/hf_trainer.py --model FOLDER --tokens FILE --count N --steps 200
    python benchmarks/hf_trainer.py ... --lora-rank 8        # peft's LoRA on q_proj and v_proj

`--out FILE` writes what benchmarks/plain_hf.py writes: the wall-clock time when the first
optimizer step returned and at every logging step (a `TrainerCallback`'s `on_step_end`), and
each logging window's mean loss (Trainer's log history).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the plain loop's data and model, wherever this file is started
    sys.path.insert(0, str(REPO))

from benchmarks.plain_hf import CLIP_NORM, add_common, load_model, order  # noqa: E402
from benchmarks.token_windows import Windows  # noqa: E402


class Examples(Dataset):
    """Trainer's examples: window i as `input_ids`, and its next tokens as the targets."""

    def __init__(self, windows: Windows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows.window([index])[0]
        targets = window[1:]
        return {"input_ids": window[:-1], "labels": targets, "shift_labels": targets}


class InOrder(Sampler[int]):
    """The given order of the examples, in place of Trainer's own shuffle."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common(p)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    stamps: dict[int, float] = {}
    first_step = [0.0]

    class Stamps(TrainerCallback):
        """The wall clock when the first optimizer step returned, and at every logging step."""

        def on_step_end(self, arguments: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                first_step[0] = time.time()
            if state.global_step % args.log_every == 0:
                stamps[state.global_step] = time.time()

    windows = Windows(args.tokens, args.count, args.dtype, args.block_size)
    if args.steps * args.batch_size > len(windows):
        raise SystemExit(f"{args.steps} steps of {args.batch_size} cross an epoch of "
                         f"{len(windows)} windows")  # fmt: skip
    the_order = order(len(windows), args.seed, 0)

    class OrderedTrainer(Trainer):
        def _get_train_sampler(self, train_dataset: Any = None) -> Sampler[int]:
            return InOrder(the_order)

    model = load_model(args)
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as out:  # Trainer wants a folder
        training = TrainingArguments(
            output_dir=out, use_cpu=True, per_device_train_batch_size=args.batch_size,
            max_steps=args.steps, learning_rate=args.lr, weight_decay=args.weight_decay,
            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=CLIP_NORM,
            logging_strategy="steps", logging_steps=args.log_every,
            eval_strategy="no", save_strategy="no", report_to="none",
            dataloader_num_workers=0, dataloader_pin_memory=False, seed=args.seed,
            remove_unused_columns=False,
        )  # fmt: skip
        trainer = OrderedTrainer(model=model, args=training, train_dataset=Examples(windows),
                                 callbacks=[Stamps()])  # fmt: skip
        trainer.train()
    losses = {int(row["step"]): float(row["loss"]) for row in trainer.state.log_history
              if "loss" in row}  # fmt: skip
    if args.out is not None:
        record = {"stamps": stamps, "losses": losses, "first_step": first_step[0]}
        args.out.write_text(json.dumps(record))


def main() -> None:
    train(parse_args())


if __name__ == "__main__":
    main()
