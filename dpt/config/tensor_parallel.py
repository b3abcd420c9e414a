"""Whether a model splits over `strategy.tensor_parallel` ranks, known from its config alone
(a GPT's keys, a transformers folder's config.json): checked before any rank starts. The plans
themselves, which import torch, are dpt/models/tensor_plans.py; these are the widths they split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dpt.config.models import GPTConfig, HFModelConfig
from dpt.errors import ConfigError

# transformers' architectures whose modules the Llama plan names (model.layers' self_attn with
# q/k/v/o_proj, mlp with gate/up/down_proj, model.norm, lm_head).
LLAMA_SHAPED = ("llama", "mistral", "qwen2", "qwen3")


def split_widths(model: DictConfig) -> dict[str, int] | None:
    """Each width a plan splits, by the key that sets it; None where dpt has no plan."""
    schema = OmegaConf.get_type(model)
    if schema is GPTConfig:
        return {"model.n_head": int(model.n_head), "model.n_embd x 4 (the MLP's width)":
                4 * int(model.n_embd)}  # fmt: skip
    if schema is HFModelConfig:
        config = _hf_config(model)
        if config.get("model_type") not in LLAMA_SHAPED:
            return None
        heads = int(config["num_attention_heads"])
        return {"num_attention_heads": heads,
                "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
                "intermediate_size": int(config["intermediate_size"])}  # fmt: skip
    return None


def check_tensor_parallel(model: DictConfig, degree: int) -> None:
    """One line where `model` has no plan, or a width it splits does not divide by `degree`."""
    if degree == 1:
        return
    widths = split_widths(model)
    if widths is None:
        raise ConfigError(
            f"strategy.tensor_parallel={degree}: dpt has no tensor-parallel plan for "
            f"{_named(model)}; it has plans for model=gpt and Llama-shaped model=hf "
            f"({', '.join(LLAMA_SHAPED)})"
        )
    for key, width in widths.items():
        if width % degree:
            raise ConfigError(
                f"strategy.tensor_parallel={degree} does not divide {key}={width}: each rank "
                f"holds whole heads and an equal slice of the MLP; use a divisor of {width}"
            )


def _hf_config(model: DictConfig) -> dict[str, Any]:
    """A folder's config.json, or the `model.config` keys ({} where neither can be read: the
    rank's own build then says what is wrong)."""
    if model.get("path"):
        file = Path(str(model.path)) / "config.json"
        return json.loads(file.read_text()) if file.is_file() else {}
    config = model.get("config")
    return dict(OmegaConf.to_container(config, resolve=True)) if config else {}  # type: ignore[arg-type]


def _named(model: DictConfig) -> str:
    if OmegaConf.get_type(model) is HFModelConfig:
        return f"model=hf of model_type={_hf_config(model).get('model_type')}"
    return str(model.get("_target_", "this model"))
