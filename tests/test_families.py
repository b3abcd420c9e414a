"""Each model family answers what the engine asks (dpt/models/families): blocks, pipeline units,
a tensor-parallel plan, LoRA's default targets, FLOPs, the transformers model an export writes.
Asked of the model, never of its class elsewhere (tests/test_layout.py)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import torch
from torch import nn

from dpt.models.families import family_of
from dpt.models.gpt import GPT
from dpt.models.mlp import MLP

SMALL_HF = {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 2,
            "intermediate_size": 32, "vocab_size": 64}  # fmt: skip


def _hf(kind: str, auto: str = "AutoModelForCausalLM") -> nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(kind, **SMALL_HF)
    return getattr(transformers, auto).from_config(config)


class Own(nn.Module):
    """A model of a user's: dpt knows nothing of it but its parts."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _answers(model: nn.Module) -> dict[str, Any]:
    family = family_of(model)
    units = family.units(model)
    return {
        "blocks": len([b for b in family.blocks(model) if b is not None]),
        "units": None if units is None else [u.name for u in units],
        "plan": family.tensor_plan(model) is not None,
        "lora": family.lora_targets(model),
        "flops": family.flops_per_token(model) is not None,
    }


def test_dpts_own_models() -> None:
    gpt = GPT(num_outputs=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0, bias=True)
    assert _answers(gpt) == {"blocks": 2, "units": ["embed", "h.0", "h.1", "head"],
                             "plan": True, "lora": ("q_proj", "v_proj"), "flops": True}  # fmt: skip
    mlp = MLP((4,), 3, [8, 8])
    assert _answers(mlp) == {"blocks": 3, "units": ["0", "1", "2", "3", "4"], "plan": False,
                             "lora": (), "flops": False}  # fmt: skip
    assert family_of(gpt).as_transformers(gpt).__class__.__name__ == "GPT2LMHeadModel"
    assert family_of(mlp).as_transformers(mlp) is None


def test_torchvision_models() -> None:
    import torchvision

    resnet = torchvision.models.resnet18(num_classes=3)
    answers = _answers(resnet)
    assert answers["blocks"] == 8 and not answers["plan"] and answers["lora"] == ()
    assert answers["units"][:2] == ["stem", "layer1.0"] and answers["units"][-1] == "head"
    mobilenet = _answers(torchvision.models.mobilenet_v2(num_classes=3))
    assert mobilenet["blocks"] == 17 and mobilenet["units"] is None  # not a Sequential


def test_transformers_models_by_their_structure() -> None:
    llama = _hf("llama")
    assert _answers(llama) == {
        "blocks": 2, "units": ["model.layers.0", "model.layers.1"],
        "plan": True, "lora": ("q_proj", "v_proj"), "flops": True,
    }  # fmt: skip
    family = family_of(llama)
    assert family.as_transformers(llama) is llama
    assert json.loads(family.transformers_config(llama))["model_type"] == "llama"
    assert family.peft_task_type("language_model") == "CAUSAL_LM"
    # Fused attention projections: blocks, cuts and LoRA's targets; no plan.
    neox = _answers(_hf("gpt_neox"))
    assert (neox["blocks"], neox["units"], neox["plan"], neox["lora"]) == (
        2, ["gpt_neox.layers.0", "gpt_neox.layers.1"], False, ("query_key_value",))  # fmt: skip
    bert = _answers(_hf("bert", "AutoModelForSequenceClassification"))
    assert (bert["blocks"] >= 2, bert["lora"]) == (True, ("query", "value"))


@pytest.mark.parametrize("model", [Own(), nn.Sequential(nn.Linear(2, 2))])
def test_a_model_dpt_knows_only_by_its_parts(model: nn.Module) -> None:
    answers = _answers(model)
    assert (answers["blocks"], answers["plan"], answers["lora"]) == (0, False, ())
    assert answers["units"] == (["0"] if isinstance(model, nn.Sequential) else None)
    assert family_of(model).as_transformers(model) is None


DECODERS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "opt", "gpt2", "gpt_neox",
            "falcon"]  # fmt: skip


@pytest.mark.parametrize("kind", DECODERS)
def test_a_decoders_stages_in_turn_compute_its_forward(kind: str) -> None:
    """What the pipeline's stages compute, run in one process: the model's own logits (its own
    masks, positions and soft-capping), cut into 2 and 3 stages (3 layers). The model is built
    as dpt builds it (Gemma 2 with its own attention, not SDPA); no stage holds another's
    weights."""
    from dpt.models.hf import build_auto
    from dpt.models.stages import StageView, plan, stage_model
    from scripts.family_table import tiny_config

    torch.manual_seed(0)
    model = build_auto("AutoModelForCausalLM", tiny_config(kind, num_hidden_layers=3,
                                                           n_layer=3)).eval()  # fmt: skip
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
        for stages in (2, 3):
            x, held = ids, 0
            for kept in plan(model, stages, None):
                view = StageView(stage_model(model, kept), kept, contextlib.nullcontext)
                held += sum(p.numel() for p in view.parameters())
                x = view(x)
            assert (x - expected).abs().max() < 1e-5
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            whole = sum(p.numel() for p in model.parameters())
            assert held == whole + (model.get_input_embeddings().weight.numel() if tied else 0)
