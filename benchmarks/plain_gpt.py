#!/usr/bin/env python
"""A hand-written training loop for a tiny GPT: the yardstick of the benchmark's `gpt` section.

Written as a careful user writes one (nanoGPT's way), with nothing taken from dpt's training
loop: the token file read through a memory map, windows of `block_size + 1` tokens at
non-overlapping offsets (window i starts at token i x block_size), the epoch's order drawn by a
DistributedSampler (each rank every world-th window), a batch fetched in one indexing op,
DistributedDataParallel with its defaults, AdamW (no decay on biases and gains), a linear
warmup then a cosine (LambdaLR), gradient clipping, and the loss read back only every
--log-every steps. Only the model is dpt's (`dpt.models.gpt.GPT`, the same class and
initialisation), so that both loops do the same arithmetic on the same batches (the benchmark
checks that their losses agree).

    python benchmarks/plain_gpt.py --tokens FILE --count N --steps 200             # one process
    python benchmarks/plain_gpt.py --tokens FILE --count N --steps 200 --nproc 2   # DDP, 2 procs

The token file is dpt's (dpt/data/text.py makes it from a text: one id per token, --dtype). The
optimizer and schedule flags are the benchmark's copy of `experiment=gpt_tiny`'s values.
`--out FILE` makes rank 0 write, as JSON, the wall-clock time (time.time()) and the window's mean
loss at every logging step, as benchmarks/plain_loop.py does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the model class of this checkout, wherever this file is started
    sys.path.insert(0, str(REPO))

from benchmarks.token_windows import Windows  # noqa: E402
from dpt.models.gpt import GPT  # noqa: E402  (the model only: nothing of dpt's loop)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=Path, required=True, help="the token file (dpt's)")
    p.add_argument("--count", type=int, required=True, help="tokens in the file")
    p.add_argument("--dtype", default="uint16", help="one token's type in the file")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-bias", action="store_true")
    p.add_argument("--batch-size", type=int, default=32, help="windows per process and step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=1, help="processes (DDP when > 1)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="rank 0's timestamps, as JSON")
    return p.parse_args(argv)


# --- data -----------------------------------------------------------------------------------------


def epoch_batches(data: Windows, sampler: DistributedSampler, batch_size: int) -> list[list[int]]:
    """This rank's batches of the sampler's epoch, the last short one dropped."""
    indices = list(sampler)
    full = len(indices) - batch_size + 1
    return [indices[k : k + batch_size] for k in range(0, full, batch_size)]


# --- the schedule ---------------------------------------------------------------------------------


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warmup to the peak over `warmup` steps, then a cosine down to `floor` x the peak
    at the last step; `step`: the optimizer steps done."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# --- the loop -------------------------------------------------------------------------------------


def train(
    rank: int, world_size: int, args: argparse.Namespace, store: dist.Store | None = None
) -> None:
    if world_size > 1:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # share the cores

    data = Windows(args.tokens, args.count, args.dtype, args.block_size)
    sampler = DistributedSampler(
        range(len(data)), num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: torch.nn.Module = GPT(
        args.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout,
        not args.no_bias,
    )  # fmt: skip
    if world_size > 1:
        model = DistributedDataParallel(model)
    # As nanoGPT: decay on the matrices and embeddings, none on biases and LayerNorm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr,
                                  betas=tuple(args.betas))  # fmt: skip
    floor = args.min_lr / args.lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.warmup_steps, args.steps, floor)
    )

    stamps: dict[int, float] = {}
    losses: dict[int, float] = {}
    window_loss = torch.zeros(())
    step, epoch, first_step = 0, 0, 0.0
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for indices in epoch_batches(data, sampler, args.batch_size):
            inputs, targets = data.batch(indices)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            step += 1
            if step == 1:
                first_step = time.time()
            window_loss += loss.detach()
            if step % args.log_every == 0:
                mean_loss = window_loss.item() / args.log_every  # the only read-back
                stamps[step], losses[step] = time.time(), mean_loss
                window_loss.zero_()
                if rank == 0:
                    print(f"epoch {epoch + 1} | step {step}/{args.steps} | loss {mean_loss:.4f}")
            if step == args.steps:
                break
        epoch += 1

    if rank == 0 and args.out is not None:
        record = {"stamps": stamps, "losses": losses, "world_size": world_size,
                  "first_step": first_step}  # fmt: skip
        args.out.write_text(json.dumps(record))
    if world_size > 1:
        dist.destroy_process_group()


def spawned(local_rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    train(local_rank, world_size, args, store)


def main() -> None:
    args = parse_args()
    if args.nproc == 1:
        train(0, 1, args)
    else:
        # This process holds the rendezvous store, on a port the OS picks and keeps.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        mp.spawn(spawned, args=(args.nproc, store.port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
