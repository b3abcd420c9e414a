#!/usr/bin/env python
"""Write tiny Hugging Face model folders with transformers' own `save_pretrained` (nothing is
downloaded), for the docs' walk-through and the tests:

    --kind llama   a 2-layer Llama (grouped-query attention, rotary positions) and a byte-level
                   BPE tokenizer of 300 ids trained on sums (`07+35=042`), as tokenizer.json
    --kind gpt2    a 2-layer GPT-2 of 256 tokens (bytes), GPT-2's own GELU and biases
    --kind bert    a 2-layer BERT-like sequence classifier (2 labels, 50 tokens)
    --kind vit     a 2-layer ViT-like classifier of 32 x 32 images (5 labels)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

# Sums, one a line, in make_text_fixture.py's widths: what the tokenizer is trained on.
SUMS = "".join(f"{a:02d}+{b:02d}={a + b:03d}\n" for a in range(100) for b in range(100))
VOCAB = 300  # the tokenizer's ids; the Llama's embedding has more rows (as real ones pad)
TOKENS = 50  # the sequence classifier's vocabulary
# The Llama's chat template: a turn a line, `u:07+35=` then `a:042` (short: a few tokens of
# its sums-trained tokenizer, where ChatML's markers would take dozens).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


def tokenizer(text: str = SUMS) -> Any:
    """A byte-level BPE of VOCAB ids trained on `text`, as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=alphabet)
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def llama(folder: Path, vocab_size: int = 320, **extra: object) -> Path:
    """A 2-layer Llama (grouped-query attention, rotary positions) with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2} | extra
    config = LlamaConfig(vocab_size=vocab_size, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, **sizes)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    chat = tokenizer()
    chat.chat_template = CHAT_TEMPLATE  # as a chat model's folder has one (dataset=chat uses it)
    chat.save_pretrained(folder)
    return folder


def neox(folder: Path, vocab_size: int = 320) -> Path:
    """A 2-layer GPTNeoX (Pythia's layout: one fused query-key-value projection, the head saved
    as `embed_out`) with the sums' tokenizer."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64)  # fmt: skip
    GPTNeoXForCausalLM(config).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def causal_lm(folder: Path, kind: str, vocab_size: int = 320) -> Path:
    """A tiny causal LM of transformers' `model_type` `kind` (scripts/family_table.py's sizes,
    no dropout: runs on several ranks draw no masks) with the sums' tokenizer."""
    from dpt.models.hf import build_auto
    from scripts.family_table import tiny_config

    config = tiny_config(kind)
    config.vocab_size = vocab_size
    for key in list(config.to_dict()):
        if "dropout" in key or "pdrop" in key:
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    build_auto("AutoModelForCausalLM", config).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def gpt2(folder: Path, vocab_size: int = 256) -> Path:
    """A 2-layer GPT-2 of `vocab_size` tokens (bytes: 256), GPT-2's own GELU and biases."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def bert(folder: Path) -> Path:
    """A 2-layer BERT-like sequence classifier with 2 labels (the data has LABELS)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=TOKENS, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                        num_labels=2)  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def vit(folder: Path) -> Path:
    """A 2-layer ViT-like classifier of 32 x 32 images with 5 labels (the data has 10)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, image_size=32, patch_size=8, num_labels=5)  # fmt: skip
    ViTForImageClassification(config).save_pretrained(folder)
    return folder


KINDS = {"llama": llama, "neox": neox, "gpt2": gpt2, "bert": bert, "vit": vit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the folder to write")
    parser.add_argument("--kind", choices=tuple(KINDS), default="llama", help="llama (default)")
    args = parser.parse_args()
    KINDS[args.kind](args.out)
    print(
        f"wrote {args.out} ({args.kind}: {', '.join(sorted(p.name for p in args.out.iterdir()))})"
    )


if __name__ == "__main__":
    main()
