"""Tiny Hugging Face model folders for the tests (scripts/make_hf_fixture.py writes them with
transformers' own `save_pretrained`), and a data set of token ids with labels for the sequence
classifier."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from scripts import make_hf_fixture
from scripts.make_hf_fixture import TOKENS, VOCAB, bert, causal_lm, gpt2, llama, neox, vit

__all__ = ["VOCAB", "bert", "causal_lm", "gpt2", "llama", "neox", "vit"]
# A tenth of the sums (what the tokenizer learned on), and products: small texts, quick runs.
SUMS = make_hf_fixture.SUMS[: len(make_hf_fixture.SUMS) // 10]
OTHER_TEXT = "".join(f"{a:02d}*{b:02d}={a * b:04d}\n" for a in range(30) for b in range(30))
LENGTH, LABELS = 12, 3  # the sequence classifier's data


class LabelledTokens(Dataset):
    """Token ids (LENGTH,) labelled by which third of the vocabulary their first token is in."""

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, TOKENS, (num_samples, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        ids = self.ids[index]
        return ids, int(ids[0]) * LABELS // TOKENS
