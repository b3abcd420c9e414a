#!/usr/bin/env python
"""A hand-written training loop for a transformers causal LM: the plain yardstick of the
benchmark's `hf` section.

Written as a careful user writes one, with nothing of dpt: the model folder loaded with
`AutoModelForCausalLM.from_pretrained` (float32, SDPA attention, no key/value cache: training),
peft's LoRA on it where `--lora-rank` is set (`get_peft_model`), the token file read through a
memory map in windows of `block_size + 1` tokens at non-overlapping offsets (window i starts at
token i x block_size), the epoch's order one `torch.randperm` drawn from the seed (the order
DistributedSampler and dpt draw), a batch fetched in one indexing op, the cross-entropy of the
logits against the next tokens, the gradients' norm clipped at 1.0 (`clip_grad_norm_`, as
Trainer does by default), `torch.optim.AdamW` over the parameters that train, and the loss read
back only every --log-every steps.

    python benchmarks/plain_hf.py --model FOLDER --tokens FILE --count N --steps 200
    python benchmarks/plain_hf.py ... --lora-rank 8          # peft's LoRA on q_proj and v_proj

`--out FILE` writes, as JSON, the wall-clock time (time.time()) when the first optimizer step
returned and at every logging step, and each logging window's mean loss.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the shared token reader, wherever this file is started
    sys.path.insert(0, str(REPO))

from benchmarks.token_windows import Windows  # noqa: E402

CLIP_NORM = 1.0  # the gradients' norm is clipped at transformers' Trainer's default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common(p)
    return p.parse_args(argv)


def add_common(p: argparse.ArgumentParser) -> None:
    """The options this loop and benchmarks/hf_trainer.py share: the same run, two ways."""
    p.add_argument("--model", type=Path, required=True, help="a transformers model folder")
    p.add_argument("--tokens", type=Path, required=True, help="the token file (dpt's)")
    p.add_argument("--count", type=int, required=True, help="tokens in the file")
    p.add_argument("--dtype", default="uint16", help="one token's type in the file")
    p.add_argument("--block-size", type=int, default=64, help="tokens a window trains on")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lora-rank", type=int, default=0, help="0: every weight trains")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-targets", nargs="+", default=["q_proj", "v_proj"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="the stamps and losses, as JSON")


def order(size: int, seed: int, epoch: int) -> list[int]:
    """The epoch's order of the windows: one shuffle drawn from (seed, epoch)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def load_model(args: argparse.Namespace) -> torch.nn.Module:
    """The folder's causal LM as training wants it; with peft's LoRA where asked."""
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa")  # fmt: skip
    model.config.use_cache = False  # no key/value cache is built at every training forward
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                          target_modules=list(args.lora_targets))  # fmt: skip
        model = get_peft_model(model, lora)
    return model


def train(args: argparse.Namespace) -> None:
    data = Windows(args.tokens, args.count, args.dtype, args.block_size)
    model = load_model(args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    stamps: dict[int, float] = {}
    losses: dict[int, float] = {}
    window_loss = torch.zeros(())
    step, epoch, first_step = 0, 0, 0.0
    model.train()
    while step < args.steps:
        indices = order(len(data), args.seed, epoch)
        for k in range(0, len(indices) - args.batch_size + 1, args.batch_size):
            inputs, targets = data.batch(indices[k : k + args.batch_size])
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, CLIP_NORM)
            optimizer.step()
            step += 1
            if step == 1:
                first_step = time.time()
            window_loss += loss.detach()
            if step % args.log_every == 0:
                mean_loss = window_loss.item() / args.log_every  # the only read-back
                stamps[step], losses[step] = time.time(), mean_loss
                window_loss.zero_()
                print(f"epoch {epoch + 1} | step {step}/{args.steps} | loss {mean_loss:.4f}")
            if step == args.steps:
                break
        epoch += 1
    if args.out is not None:
        record = {"stamps": stamps, "losses": losses, "first_step": first_step}
        args.out.write_text(json.dumps(record))


def main() -> None:
    train(parse_args())


if __name__ == "__main__":
    main()
