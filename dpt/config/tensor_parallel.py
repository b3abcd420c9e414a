"""Whether dpt's own model splits over `strategy.tensor_parallel` ranks, known from its config
alone (a GPT's keys): checked before any rank starts. A transformers model's family says it on
the model built on the meta device (dpt.models.tensor_plans.check_splits), before any rank too.
The plans themselves, which import torch, are dpt/models/tensor_plans.py."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from dpt.config.models import GPTConfig, HFModelConfig
from dpt.errors import ConfigError


def split_widths(model: DictConfig) -> dict[str, int] | None:
    """Each width dpt's GPT's plan splits, by the key that sets it; None: no plan."""
    if OmegaConf.get_type(model) is GPTConfig:
        return {"model.n_head": int(model.n_head), "model.n_embd x 4 (the MLP's width)":
                4 * int(model.n_embd)}  # fmt: skip
    return None


# The models dpt has tensor-parallel plans for, as a refusal names them.
WHO_SPLITS = "it has plans for model=gpt and model=hf decoder-only language models"


def check_tensor_parallel(model: DictConfig, degree: int) -> None:
    """One line where `model` has no plan, or a width it splits does not divide by `degree`. A
    transformers model's plan, and its widths, are its family's to say on the model built on
    the meta device (dpt.models.tensor_plans.check_splits, before any rank starts too)."""
    if degree == 1 or OmegaConf.get_type(model) is HFModelConfig:
        return
    widths = split_widths(model)
    if widths is None:
        raise ConfigError(
            f"strategy.tensor_parallel={degree}: dpt has no tensor-parallel plan for "
            f"{model.get('_target_', 'this model')}; {WHO_SPLITS}"
        )
    for key, width in widths.items():
        if width % degree:
            raise ConfigError(indivisible(degree, key, width))


def indivisible(degree: int, key: str, width: int) -> str:
    return (f"strategy.tensor_parallel={degree} does not divide {key}={width}: each rank holds "
            f"whole heads and an equal slice of the MLP; use a divisor of {width}")  # fmt: skip
