"""What of the model trains (`finetune`): frozen parameters, LoRA adapters on a frozen base.
Applied to the bare model before the strategy wraps it (DDP registers only the parameters that
train; fsdp shards frozen and trained alike), and to the meta model before any rank starts, where
a pattern that matches nothing is said in one line."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpt.config.finetune import FinetuneConfig
from dpt.distributed import local_part
from dpt.models.freezing import freeze, trainable_count
from dpt.models.lora import add_lora


def settings_of(cfg: DictConfig) -> FinetuneConfig:
    """The typed `finetune` node (a run folder written before it existed: its defaults)."""
    node = cfg.get("finetune")
    values: Any = {} if node is None else OmegaConf.to_container(node, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FinetuneConfig), values))  # type: ignore[return-value]


def adapt(model: nn.Module, settings: FinetuneConfig) -> None:
    """Freeze `finetune.freeze`'s parameters, then put LoRA adapters on `finetune.lora.targets`
    (which freezes every other parameter but `finetune.lora.modules_to_save`'s)."""
    if settings.freeze:
        freeze(model, settings.freeze)
    lora = settings.lora
    if lora.rank:
        add_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.modules_to_save)


def uses_lora(settings: FinetuneConfig) -> bool:
    """A LoRA run's checkpoints hold the adapters alone (the base is rebuilt from the config)."""
    return settings.lora.rank > 0


def on_this_rank(model: nn.Module, degree: int) -> str:
    """`; 19,205 of them on this rank (strategy.tensor_parallel=2)`: the trainable parameters'
    elements a rank holds, its slices of the split layers and its copy of the others."""
    held = sum(local_part(p).numel() for p in model.parameters() if p.requires_grad)
    return f"; {held:,} of them on this rank (strategy.tensor_parallel={degree})"


def trainable_text(model: nn.Module) -> str:
    """`2,048 of 96,512 parameters train (2.1 %)`: for the start line."""
    trained, total = trainable_count(model)
    share = f" ({100 * trained / total:.3g} %)" if trained < total and total else ""
    return f"{trained:,} of {total:,} parameters train{share}"
