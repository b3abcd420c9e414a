"""Seeds: one for every generator of a process, and seeds derived from tuples of integers (seed,
epoch, sample index; seed, rank, step) that give unrelated streams for nearby tuples."""

from __future__ import annotations

import hashlib
import random
import struct

import numpy as np
import torch


def derived_seed(*numbers: int) -> int:
    """A 64-bit seed from a tuple of integers (e.g. seed, epoch, sample index): a hash, so that
    nearby tuples give unrelated streams, and the same on every machine and Python version."""
    key = struct.pack(f"<{len(numbers)}q", *numbers)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators (NumPy takes 32 bits)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
