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
    """Causal multi-head self-attention: projections to queries, keys and values, PyTorch's
    fused attention (flash or memory-efficient kernels where the device has them).

    The three projections are separate layers (`q_proj`, `k_proj`, `v_proj`, as Llama's): tensor
    parallelism splits each by columns, every rank then holding whole heads of all three (a
    fused matrix split by rows would give a rank queries and keys of different heads). The
    head count is read from the projections' width, so a rank computes its own heads alone."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.head_dim, self.dropout = n_embd // n_head, dropout
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj_dropout = nn.Dropout(dropout)
        # A state dict of the fused layout dpt wrote before (`qkv`) still loads.
        self._register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: packed examples' attention (dpt.models.packed); None: causal."""
        batch, steps = x.shape[:2]
        heads = [proj(x).view(batch, steps, -1, self.head_dim).transpose(1, 2)
                 for proj in (self.q_proj, self.k_proj, self.v_proj)]  # fmt: skip
        y = F.scaled_dot_product_attention(
            *heads, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
        )  # fmt: skip
        y = y.transpose(1, 2).reshape(batch, steps, -1)
        return self.proj_dropout(self.proj(y))


# The fused projection of queries, keys and values that dpt's GPT had before (`attn.qkv`).
FUSED_QKV = "qkv"
QKV = ("q_proj", "k_proj", "v_proj")


def _split_fused_qkv(state: dict[str, torch.Tensor], prefix: str, *_: object) -> None:
    """An attention's fused `qkv` (a model.pt or model.init_from written before the
    projections were split) as its three projections, in place."""
    split_fused_qkv(state, prefix)


def split_fused_qkv(state: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Every fused `qkv` weight and bias under `prefix` (rows of queries, keys, values, in that
    order: GPT-2's `c_attn` too) as `q_proj`, `k_proj`, `v_proj`, in place."""
    for key in [k for k in state if k.startswith(prefix) and f"{FUSED_QKV}." in k]:
        head, _, kind = key.rpartition(f"{FUSED_QKV}.")
        if kind not in ("weight", "bias") or (head and not head.endswith(".")):
            continue  # another layer whose name ends in qkv, or an adapter of the fused one
        for name, part in zip(QKV, state.pop(key).chunk(3), strict=True):
            state[f"{head}{name}.{kind}"] = part


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
            if name.endswith((".attn.proj.weight", ".mlp.proj.weight")):
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
