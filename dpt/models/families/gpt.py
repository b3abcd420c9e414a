"""dpt's GPT (dpt/models/gpt.py): blocks `h`, cut between them; Megatron's tensor-parallel plan;
GPT-2's weights read in and written out (transformers' GPT2LMHeadModel)."""

from __future__ import annotations

from typing import Any

from torch import nn

from dpt.models.families.base import Family, Plan, Unit, child, inner
from dpt.models.gpt import FUSED_QKV, GPT, QKV, split_fused_qkv


class GPTFamily(Family):
    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, GPT)

    def blocks(self, model: nn.Module) -> list[nn.Module | None]:
        return list(model.h)  # as the model holds them (wrapped, once recomputed)

    def units(self, model: nn.Module) -> list[Unit]:
        blocks = [Unit(f"h.{i}", (f"h.{i}",), child(f"h.{i}")) for i in range(len(model.h))]
        return [
            Unit("embed", ("wte", "wpe", "drop"), lambda m, x: m.embed(x)),
            *blocks,
            Unit("head", ("ln_f", "lm_head"), lambda m, x: m.head(x)),
        ]

    def tensor_plan(self, model: nn.Module) -> Plan:
        return self._parallelize

    def _parallelize(self, model: nn.Module, mesh: Any, split_logits: bool) -> None:
        from dpt.models.tensor_styles import (
            Replicated,
            pre_norm_block,
            split,
            styles,
            vocabulary_ends,
        )

        tp, Replicate, Shard = styles()
        ends = vocabulary_ends("wte", "ln_f", "lm_head", split_logits)
        split(model, mesh, {**ends, "wpe": Replicated()})
        for block in self.blocks(model):
            if block is None:
                continue
            attention_input = tp.PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            split(inner(block), mesh, pre_norm_block(
                ("ln_1", "ln_2"), ("attn", QKV, "proj"), attention_input, ("mlp", ("fc",), "proj")
            ))  # fmt: skip

    def lora_targets(self, model: nn.Module) -> tuple[str, ...]:
        return (QKV[0], QKV[2])  # the query and value projections

    def weights_in(self, model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """GPT-2's layout (transformers' or OpenAI's names, Conv1D's transposed matrices), or
        dpt's own of before, when the attention's projection was one (`qkv`)."""
        from dpt.models.gpt2_weights import from_gpt2, is_gpt2_layout

        if is_gpt2_layout(state):
            return from_gpt2(state, model)
        state = dict(state)
        split_fused_qkv(state)
        return state

    def refused_checkpoint(self, model: nn.Module, stored: set[str]) -> str | None:
        if not any(key.endswith(f".attn.{FUSED_QKV}.weight") for key in stored):
            return None
        return (
            "this checkpoint was written while dpt's GPT fused its attention's projections "
            f"(attn.{FUSED_QKV}): its optimizer state cannot resume; start from its weights "
            "with model.init_from=<its run folder>, which splits them"
        )

    def as_transformers(self, model: nn.Module) -> nn.Module:
        """transformers' GPT2LMHeadModel with the run's weights."""
        from transformers import GPT2Config, GPT2LMHeadModel

        from dpt.models.gpt2_weights import to_gpt2

        state, config = to_gpt2(model.state_dict(), model)
        gpt2 = GPT2LMHeadModel(GPT2Config(**config))
        gpt2.load_state_dict(state)
        return gpt2
