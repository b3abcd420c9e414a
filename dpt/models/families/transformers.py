"""transformers' models (`model=hf`): blocks are the classes a model names in
`_no_split_modules` (the signal accelerate and FSDP's auto-wrapping use too). A decoder-only
causal LM in Llama's shape (an embedding, decoder layers taking rotary positions, a final norm
and a head: Llama, Mistral, Qwen2, Qwen3) cuts into pipeline stages between its layers and
splits over tensor-parallel ranks as torchtitan plans Llama. Found by structure, whatever its
`model_type`. transformers is never imported here: a model that is one was built by it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpt.config.tasks import LANGUAGE_MODEL
from dpt.models.families.base import (
    Family,
    Plan,
    Unit,
    inner,
    is_conv1d,
    loaded_instance,
    outermost,
)
from dpt.models.gpt import QKV

# The attention's query and value projections as transformers' families name them: separate
# (Llama, Mistral, Qwen, Gemma, OPT; BERT, RoBERTa), or one fused projection of all three
# (GPTNeoX, Falcon; Phi-3; GPT-2's Conv1D, peft's default for it too).
QUERY_VALUE = (("q_proj", "v_proj"), ("query", "value"), ("query_key_value",), ("qkv_proj",),
               ("c_attn",))  # fmt: skip
# One layer projecting queries, keys and values together (GPTNeoX, Falcon; Phi-3; GPT-2's Conv1D).
FUSED_ATTENTION = ("query_key_value", "qkv_proj", "c_attn")


class TransformersFamily(Family):
    def owns(self, model: nn.Module) -> bool:
        return loaded_instance(model, "transformers.modeling_utils", "PreTrainedModel")

    def blocks(self, model: nn.Module) -> list[nn.Module | None]:
        names = frozenset(getattr(model, "_no_split_modules", None) or ())
        return list(outermost(model, lambda c: c.__name__ in names))

    def units(self, model: nn.Module) -> list[Unit] | None:
        """Its embedding, each decoder layer (with the rotary embedding, which holds no
        parameters, so that every stage computes its positions) and its norm with the head."""
        if not is_llama_shaped(model) or _soft_capped(model):
            return None
        layers = [Unit(f"model.layers.{i}", (f"model.layers.{i}", "model.rotary_emb"),
                       functools.partial(_run_layer, index=i))
                  for i in range(len(model.model.layers))]  # fmt: skip
        return [
            Unit("embed", ("model.embed_tokens",), lambda m, x: m.model.embed_tokens(x)),
            *layers,
            Unit("head", ("model.norm", "lm_head"), _run_head),
        ]

    def tensor_plan(self, model: nn.Module) -> Plan | None:
        return self._parallelize if _splits_as_llama(model) else None

    def no_plan_reason(self, model: nn.Module) -> str:
        kind = f"model=hf of model_type={model.config.model_type}"
        instead = "train it with strategy=fsdp or strategy=ddp"
        fused = next((name.rpartition(".")[2] for name, _ in model.named_modules()
                      if name.endswith(FUSED_ATTENTION)), None)  # fmt: skip
        if fused is not None:
            return (f"{kind} projects its attention's queries, keys and values in one layer "
                    f"({fused}), which dpt's plan does not split by heads; {instead}")  # fmt: skip
        if is_llama_shaped(model) and len(model.model.layers) and _normalizes_heads(model):
            return (f"{kind} normalizes each head's queries and keys (q_norm, k_norm), which "
                    f"dpt's plan does not split yet; {instead}")  # fmt: skip
        if _soft_capped(model):
            return (f"{kind} soft-caps its attention scores and logits, which dpt's plan does "
                    f"not split yet; {instead}")  # fmt: skip
        return (
            f"{kind} is not a decoder in Llama's shape (an embedding, decoder layers taking "
            f"rotary positions, a final norm and a head), which dpt's plan splits; {instead}"
        )

    def split_widths(self, model: nn.Module) -> dict[str, int]:
        config = model.config
        heads = int(config.num_attention_heads)
        return {"num_attention_heads": heads,
                "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
                "intermediate_size": int(config.intermediate_size)}  # fmt: skip

    def _parallelize(self, model: nn.Module, mesh: Any) -> None:
        """The attention reads its heads' count from the projections' width, so each rank
        computes its own heads."""
        from dpt.models.tensor_styles import pre_norm_block, split, styles, vocabulary_ends

        tp, Replicate, Shard = styles()
        split(model, mesh, vocabulary_ends("model.embed_tokens", "model.norm", "lm_head"))
        for block in self.blocks(model):
            if block is None:
                continue
            attention_input = tp.PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            split(inner(block), mesh, pre_norm_block(
                ("input_layernorm", "post_attention_layernorm"),
                ("self_attn", QKV, "o_proj"),  # as dpt's GPT names them
                attention_input,
                ("mlp", ("gate_proj", "up_proj"), "down_proj"),
            ))  # fmt: skip

    def names_in(self, model: nn.Module, stored: list[str]) -> dict[str, str]:
        """transformers' own renames of saved names (GPTNeoX saves its head as `embed_out`, the
        model names it `lm_head`), and a base model's names into a model with a head (and the
        reverse), as `from_pretrained` renames them. Tensors that transformers converts (merges
        or splits) are left as stored. transformers 4 renamed nothing of the kind."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError:
            return {}
        renamings = [t for t in get_model_conversion_mapping(model)
                     if isinstance(t, WeightRenaming)]  # fmt: skip
        own = model.state_dict()  # shapes only: on the meta device too
        prefix = getattr(model, "base_model_prefix", None)
        renamed = {key: rename_source_key(key, renamings, [], prefix, own)[0] for key in stored}
        return {key: name for key, name in renamed.items() if name != key}

    def lora_targets(self, model: nn.Module) -> tuple[str, ...]:
        """Its attention's query and value projections, by the names transformers' families
        give them (separate, or one fused projection)."""
        linears = {name.rpartition(".")[2] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) or is_conv1d(module)}  # fmt: skip
        return next((names for names in QUERY_VALUE if set(names) <= linears), ())

    def flops_per_token(self, model: nn.Module) -> Callable[[int], float]:
        return functools.partial(_flops_per_token, model)

    def as_transformers(self, model: nn.Module) -> nn.Module:
        return model

    def peft_task_type(self, task: str) -> str | None:
        return "CAUSAL_LM" if task == LANGUAGE_MODEL else None

    def transformers_config(self, model: nn.Module) -> str:
        return model.config.to_json_string()


def is_llama_shaped(model: nn.Module) -> bool:
    """An embedding, decoder layers taking rotary positions, a final norm and a head."""
    base = getattr(model, "model", None)
    return all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")) \
        and hasattr(model, "lm_head")  # fmt: skip


def _soft_capped(model: nn.Module) -> bool:
    """Gemma 2's logits and attention scores are soft-capped in its forward, with masks of its
    own: units that run its layers and head alone would compute another model."""
    config = model.config
    return any(getattr(config, key, None) for key in ("final_logit_softcapping",
                                                       "attn_logit_softcapping"))  # fmt: skip


def _splits_as_llama(model: nn.Module) -> bool:
    """In Llama's shape, with the layers Llama's plan splits: separate query, key, value and
    output projections, and the MLP's gate, up and down projections."""
    if not is_llama_shaped(model) or _soft_capped(model) or not len(model.model.layers):
        return False
    layer = model.model.layers[0]
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (
        all(hasattr(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        and not _normalizes_heads(model)
    )


def _normalizes_heads(model: nn.Module) -> bool:
    """Qwen3's attention normalizes each head's queries and keys (q_norm, k_norm): split by
    heads it computed other values than one process (2e-4 apart in 4 steps, the matrix)."""
    attention = getattr(model.model.layers[0], "self_attn", None)
    return any(hasattr(attention, name) for name in ("q_norm", "k_norm"))


def _flops_per_token(model: nn.Module, steps: int) -> float:
    """As for dpt's GPT (6N plus attention's 12 L H Q T): N all the model's parameters (a tied
    head once), the attention's sizes from its config."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head = getattr(config, "head_dim", None) or config.hidden_size // heads
    parameters = sum(p.numel() for p in model.parameters())
    return 6.0 * parameters + 12.0 * layers * heads * head * steps


def _positions(x: torch.Tensor) -> torch.Tensor:
    """Position ids (1, T) of hidden states (B, T, C) of a sequence from its start."""
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


def _run_layer(model: nn.Module, x: torch.Tensor, index: int) -> torch.Tensor:
    """Decoder layer `index` on hidden states: causal (no mask), rotary positions from 0."""
    base = model.model
    cos_sin = base.rotary_emb(x, _positions(x))
    return base.layers[index](x, position_embeddings=cos_sin)


def _run_head(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(x))
