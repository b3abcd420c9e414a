"""GPT-2's weights in Hugging Face's layout, into dpt's GPT (dpt/models/gpt.py) and back out, as
nanoGPT's `from_pretrained` reads them.

Both sides are plain state dicts: nothing here imports transformers or safetensors, reads a file
or downloads anything (read one with `safetensors.torch.load_file`, write one with
`GPT2LMHeadModel.save_pretrained`). The layouts differ in three ways: GPT-2's linear layers are
Conv1D, their weights stored (in, out), transposed from nn.Linear's (out, in); its modules have
other names, and its `attn.c_attn` fuses what dpt's `attn.q_proj`, `k_proj` and `v_proj` hold
(rows of queries, keys, values); and its model holds the blocks under
`transformer.`. GPT-2 computes its MLP with the tanh GELU (`gelu_new`): build the GPT with
`gelu="tanh"` for its logits to match. A file carries no head count: `n_head` must be the one
the weights were trained with (12 for GPT-2 small), which no shape can check.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from dpt.errors import DptError, some_of
from dpt.models.gpt import FUSED_QKV, GPT, QKV, split_fused_qkv

# GPT-2's Conv1D modules and dpt's nn.Linear in their place; the weights of these are transposed.
_LINEARS = {
    "attn.c_attn": f"attn.{FUSED_QKV}",  # split into q_proj, k_proj, v_proj (and fused back)
    "attn.c_proj": "attn.proj",
    "mlp.c_fc": "mlp.fc",
    "mlp.c_proj": "mlp.proj",
}
# The causal mask older transformers saved as buffers (`h.N.attn.bias`): dpt's attention is
# causal by construction, so they carry nothing to load.
_MASK = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")
_LAYER = re.compile(r"h\.(\d+)\.")
_PREFIX = "transformer."  # GPT2LMHeadModel's; GPT2Model saves its keys without it
_SHOWN = 3  # keys named in a refusal, so that it stays one line
GPT2_END_OF_TEXT = 50256  # GPT-2's <|endoftext|>: its bos and eos id


def is_gpt2_layout(state: dict[str, Tensor]) -> bool:
    """Whether `state` holds GPT-2's modules (its Conv1D attention), not dpt's names."""
    return any(f".{gpt2}." in key for key in state for gpt2 in _LINEARS)


def from_gpt2(state: dict[str, Tensor], model: GPT) -> dict[str, Tensor]:
    """A GPT-2 state dict (GPT2LMHeadModel's or GPT2Model's) -> one that `model` loads with
    `load_state_dict(strict=True)`. The position embedding is cut to `model.block_size`; a
    larger `model.vocab_size` keeps the model's own initial rows past the file's vocabulary."""
    own = model.state_dict()
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        key = key.removeprefix(_PREFIX)
        if key == "lm_head.weight" or _MASK.fullmatch(key):
            continue  # the head is tied to wte, set below from it
        out[_rename(key, to_dpt=True)] = tensor.t().contiguous() if _is_conv1d(key) else tensor
    split_fused_qkv(out)
    _check_keys(out, own, model)
    out["wpe.weight"] = _positions(out["wpe.weight"], model.block_size)
    out["wte.weight"] = _vocabulary(out["wte.weight"], own["wte.weight"])
    _check_shapes(out, own, model)
    out["lm_head.weight"] = out["wte.weight"]  # the tied head: the same tensor, as the model's
    return out


def to_gpt2(state: dict[str, Tensor], model: GPT) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """`model`'s state dict -> GPT2LMHeadModel's, and the GPT2Config keyword arguments that
    build a model of that shape: `GPT2LMHeadModel(GPT2Config(**config)).load_state_dict(out)`."""
    if model.ln_f.bias is None:
        raise DptError(
            "model.bias=false: GPT-2 has biases in its linear layers and LayerNorms; "
            "only a GPT built with model.bias=true can be written as GPT-2"
        )
    out: dict[str, Tensor] = {}
    for key, tensor in fuse_qkv(state).items():
        if key == "lm_head.weight":
            continue  # tied: GPT-2 saves it as wte's, set below
        gpt2_key = _rename(key, to_dpt=False)
        conv1d = _is_conv1d(gpt2_key)
        out[_PREFIX + gpt2_key] = tensor.t().contiguous() if conv1d else tensor
    out["lm_head.weight"] = out[_PREFIX + "wte.weight"]
    return out, _gpt2_config(model)


def _gpt2_config(model: GPT) -> dict[str, Any]:
    """GPT2Config's names for `model`'s shape; its dropout in all three of GPT-2's places, which
    dpt's one `dropout` covers (embeddings, attention, residual)."""
    return {
        "vocab_size": model.vocab_size,
        "n_positions": model.block_size,
        "n_embd": model.n_embd,
        "n_layer": model.n_layer,
        "n_head": model.n_head,
        "activation_function": "gelu_new" if model.gelu == "tanh" else "gelu",
        "resid_pdrop": model.dropout_p,
        "embd_pdrop": model.dropout_p,
        "attn_pdrop": model.dropout_p,
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default, which dpt's GPT keeps
        "tie_word_embeddings": True,
        # GPT-2's own end-of-text id, where the vocabulary holds it (the export then gives the
        # run's tokenizer's)
        **dict.fromkeys(
            ("bos_token_id", "eos_token_id"),
            GPT2_END_OF_TEXT if model.vocab_size > GPT2_END_OF_TEXT else None,
        ),
    }


def fuse_qkv(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """dpt's separate query, key and value projections as one fused `qkv` (rows in that
    order), GPT-2's `c_attn`."""
    out = dict(state)
    for key in [k for k in state if ".attn.q_proj." in k]:
        parts = [out.pop(key.replace(".q_proj.", f".{name}.")) for name in QKV]
        out[key.replace(".q_proj.", f".{FUSED_QKV}.")] = torch.cat(parts)
    return out


def _rename(key: str, to_dpt: bool) -> str:
    for gpt2, dpt in _LINEARS.items():
        old, new = (gpt2, dpt) if to_dpt else (dpt, gpt2)
        if f".{old}." in key:
            return key.replace(f".{old}.", f".{new}.")
    return key  # wte, wpe, ln_1, ln_2, ln_f: the same names in both


def _is_conv1d(gpt2_key: str) -> bool:
    """A Conv1D weight (GPT-2's name): stored (in, out); the biases need no change."""
    return gpt2_key.endswith(".weight") and any(f".{name}." in gpt2_key for name in _LINEARS)


def _positions(wpe: Tensor, block_size: int) -> Tensor:
    """The first `block_size` positions: a model of shorter sequences needs no more."""
    if wpe.shape[0] < block_size:
        raise DptError(
            f"GPT-2 weights do not fit model=gpt: the file has {wpe.shape[0]} positions, "
            f"fewer than model.block_size={block_size}"
        )
    return wpe[:block_size]


def _vocabulary(wte: Tensor, own: Tensor) -> Tensor:
    """The file's token embedding, padded with the model's own rows to `model.vocab_size` (e.g.
    50257 to 50304): tokens past the file's vocabulary keep their initial values."""
    if wte.shape[0] > own.shape[0]:
        raise DptError(
            f"GPT-2 weights do not fit model=gpt: the file's vocabulary of {wte.shape[0]} tokens "
            f"is larger than model.vocab_size={own.shape[0]}"
        )
    if wte.shape[0] == own.shape[0]:
        return wte
    return torch.cat([wte, own[wte.shape[0] :].to(wte.dtype)])


def _check_keys(out: dict[str, Tensor], own: dict[str, Tensor], model: GPT) -> None:
    """Every key the model has, and none it lacks, in one line that names the first few."""
    missing = [key for key in own if key not in out and key != "lm_head.weight"]
    unexpected = [key for key in out if key not in own]
    if not missing and not unexpected:
        return
    found = (("missing", missing), ("unexpected", unexpected))
    parts = [f"{word} {some_of(keys, _SHOWN)}" for word, keys in found if keys]
    raise DptError(f"GPT-2 weights do not fit model=gpt: {'; '.join(parts)} ({_why(out, model)})")


def _check_shapes(out: dict[str, Tensor], own: dict[str, Tensor], model: GPT) -> None:
    """The same shapes (in the model's order: wte first); only the width can differ here."""
    for key, mine in own.items():
        theirs = out.get(key, mine)  # the tied head is not in `out` yet
        if theirs.shape != mine.shape:
            raise DptError(
                f"GPT-2 weights do not fit model=gpt: {key} is {tuple(theirs.shape)} in the file, "
                f"{tuple(mine.shape)} in the model (model.n_embd={model.n_embd})"
            )


def _why(out: dict[str, Tensor], model: GPT) -> str:
    """The likely cause of a key mismatch: the number of blocks, else model.bias."""
    layers = 1 + max((int(m.group(1)) for key in out if (m := _LAYER.match(key))), default=-1)
    if layers != model.n_layer:
        return f"n_layer={model.n_layer}, the file has {layers} layers"
    return f"model.bias={str(model.ln_f.bias is not None).lower()}; GPT-2 has biases"
