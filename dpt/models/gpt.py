"""A decoder-only transformer in the GPT-2 shape (`model=gpt`): token and position embeddings,
`n_layer` pre-norm blocks of causal self-attention (`scaled_dot_product_attention`) and an MLP,
a final LayerNorm, and a head that shares the token embedding's weights. GPT-2's initialisation:
normal(0, 0.02), the residual projections scaled by 1/sqrt(2 n_layer).

Its blocks (`GPT.h`) are dpt's units for fsdp and activation checkpointing (dpt/models/blocks.py).
`flops_per_token` counts the training FLOPs per token (the PaLM paper's appendix B: 6N plus
attention's 12 L H Q T), from which dpt reports MFU.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dpt.config.models import GELU_APPROXIMATIONS
from dpt.errors import DptError
from dpt.models import packed


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: one projection to queries, keys and values, PyTorch's
    fused attention (flash or memory-efficient kernels where the device has them)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: packed examples' attention (dpt.models.packed); None: causal."""
        batch, steps, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        heads = [t.view(batch, steps, self.n_head, width // self.n_head).transpose(1, 2)
                 for t in (q, k, v)]  # fmt: skip
        y = F.scaled_dot_product_attention(
            *heads, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
        )  # fmt: skip
        y = y.transpose(1, 2).contiguous().view(batch, steps, width)
        return self.proj_dropout(self.proj(y))


class FeedForward(nn.Module):
    """fc, GELU (`gelu`: F.gelu's `approximate`, `"tanh"` for GPT-2's gelu_new), proj."""

    def __init__(self, n_embd: int, dropout: float, bias: bool, gelu: str = "none") -> None:
        super().__init__()
        self.gelu = gelu
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.gelu)))


class Block(nn.Module):
    """x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float, bias: bool, gelu: str = "none"
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = SelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = FeedForward(n_embd, dropout, bias, gelu)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size), T at most `block_size`."""

    def __init__(
        self,
        num_outputs: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
        bias: bool,
        vocab_size: int | None = None,
        gelu: str = "none",
    ) -> None:
        """`num_outputs`: the data's vocabulary; `vocab_size`, where given, the embedding's rows
        (more pads it, e.g. GPT-2's 50257 to 50304, a multiple of 64 that kernels like).
        `gelu`: the MLP's GELU, exact (`"none"`) or tanh-approximated (`"tanh"`, GPT-2's own,
        which loading GPT-2's weights needs: dpt/models/gpt2_weights.py)."""
        super().__init__()
        if n_embd % n_head:
            raise DptError(f"model.n_embd={n_embd}: must be a multiple of model.n_head={n_head}")
        if gelu not in GELU_APPROXIMATIONS:
            allowed = ", ".join(repr(name) for name in GELU_APPROXIMATIONS)
            raise DptError(f"model.gelu={gelu!r}: one of {allowed}")
        self.vocab_size, self.block_size = vocab_size or num_outputs, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        # Kept to write the model back as GPT-2 (its config names them): gpt2_weights.to_gpt2.
        self.dropout_p, self.gelu = dropout, gelu
        self.wte = nn.Embedding(self.vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout, bias, gelu) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, self.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds and reads out tokens
        self.apply(_init_weights)
        for name, parameter in self.named_parameters():  # GPT-2: residual projections scaled
            if name.endswith("proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T), or packed examples' ids and positions (B, 2, T)."""
        tokens, positions = packed.split(idx)
        x = self.embed(tokens, positions)
        if positions is None:
            for block in self.h:
                x = block(x)
        else:  # each example attends to itself alone
            mask = packed.attention_mask(positions)
            for block in self.h:
                x = block(x, mask)
        return self.head(x)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> the first block's input (B, T, n_embd); a pipeline's first stage.
        `positions`: each token's (packed examples'); None: 0 .. T - 1."""
        steps = idx.shape[1]
        if steps > self.block_size:
            raise DptError(
                f"a sequence of {steps} tokens is longer than model.block_size={self.block_size}"
            )
        if positions is None:
            positions = torch.arange(steps, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output -> logits; a pipeline's last stage."""
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        """Parameters without the position embedding (the tied head counted once): the N of
        the FLOPs count, as nanoGPT and the PaLM paper count it."""
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()

    def flops_per_token(self, steps: int) -> float:
        """Training FLOPs per token of sequences of `steps` tokens (forward and backward):
        6N for the weights' multiply-adds, 12 L H Q T for attention's scores and values (PaLM,
        appendix B: L layers, H heads of size Q)."""
        head = self.n_embd // self.n_head
        return 6.0 * self.num_params() + 12.0 * self.n_layer * self.n_head * head * steps


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
