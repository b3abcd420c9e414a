"""Tiny Hugging Face model folders for the tests (scripts/make_hf_fixture.py writes them with
transformers' own `save_pretrained`), a data set of token ids with labels for the sequence
classifier, and reviews of two classes with a BERT folder whose tokenizer learned them
(dataset=records)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

from scripts import make_hf_fixture
from scripts.make_hf_fixture import TOKENS, VOCAB, bert, causal_lm, gpt2, llama, neox, vit

__all__ = ["VOCAB", "bert", "bert_folder", "causal_lm", "gpt2", "llama", "neox", "reviews", "vit",
           "write_csv"]  # fmt: skip
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


# Reviews of two classes (dataset=records): each class's words, and filler words both use.
WORDS = {"good": ["great", "fine", "lovely", "superb", "bright", "happy"],
         "bad": ["awful", "poor", "dull", "grim", "sad", "broken"]}  # fmt: skip
FILLER = ["the", "a", "film", "day", "was", "very", "and", "it", "quite", "so"]


def reviews(count: int, seed: int) -> list[dict[str, str]]:
    """`count` rows of a text and its label, a separable toy set of the two classes."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        label = rng.choice(sorted(WORDS))
        words = rng.sample(FILLER, 4) + rng.sample(WORDS[label], 2)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_csv(path: Path, rows: list[dict[str, object]]) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def bert_folder(folder: Path, texts: list[str]) -> Path:
    """A 2-layer BERT sequence classifier with a WordPiece tokenizer learned on `texts`."""
    return text_classifier(folder, "bert", texts, num_attention_heads=2)


def text_classifier(
    folder: Path, kind: str, texts: list[str], labels: int = 2, **sizes: object
) -> Path:
    """A tiny sequence classifier of transformers' `model_type` `kind` (scripts/family_table.py's
    sizes, `sizes` over them; `labels` labels, no dropout) with a WordPiece tokenizer learned on
    `texts`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer()
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=120, special_tokens=special)
    )
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=wordpiece, pad_token="[PAD]",
                                   unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")  # fmt: skip
    fast.save_pretrained(folder)
    ids = {
        "pad_token_id": 0,
        "bos_token_id": 2,
        "cls_token_id": 2,
        "eos_token_id": 3,
        "sep_token_id": 3,
    }  # the tokenizer's, where the config names them (ModernBERT's)
    return _classifier(folder, kind, "AutoModelForSequenceClassification", labels,
                       vocab_size=wordpiece.get_vocab_size(), max_position_embeddings=32,
                       **ids, **sizes)  # fmt: skip


def image_classifier(folder: Path, kind: str, labels: int = 2) -> Path:
    """A tiny image classifier of `kind` (32 x 32 images; `labels` labels, no dropout)."""
    return _classifier(folder, kind, "AutoModelForImageClassification", labels)


def _classifier(folder: Path, kind: str, auto: str, labels: int, **sizes: object) -> Path:
    from dpt.models.hf import build_auto
    from scripts.family_table import tiny_config

    config = tiny_config(kind, **sizes)
    config.num_labels = labels
    for key in list(config.to_dict()):
        if "dropout" in key:
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    build_auto(auto, config).save_pretrained(folder)
    return folder
