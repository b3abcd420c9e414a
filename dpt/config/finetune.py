"""`finetune`: what of a (pretrained) model trains: LoRA adapters on a frozen base, frozen layers
(dpt/models/lora.py, freezing.py). The learning rate per group of parameters is the optimizer's
(`optimizer.groups`, `optimizer.layer_decay`: dpt/config/optim.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dpt.config.checks import above, at_least, between


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) beside the chosen linear layers; every other weight is frozen and
    checkpoints hold the adapters alone (the base is `model.path` / `model.init_from`)."""

    rank: int = at_least(0, 0)  # r: the adapters' rank; 0: no LoRA
    alpha: float = above(0, 16.0)  # the adapters' output is scaled by alpha / rank
    dropout: float = between(0, 1, 0.0)  # dropout on the adapters' input
    # Linear layers that get adapters, by name pattern (fnmatch) of the whole name or its last
    # parts; []: the attention's query and value projections, as the model's family names them
    # ([q_proj, v_proj] in dpt's GPT and Llama's shape, [query, value] in BERT's,
    # [query_key_value] in GPTNeoX's and Falcon's, [c_attn] in GPT-2's, a Conv1D).
    targets: list[str] = field(default_factory=list)
    # Modules that train whole beside the adapters (peft's modules_to_save), by name pattern;
    # null: a classifier's head where the model's family names it (transformers' classifier or
    # score: a head of the task's size, often fresh); []: none.
    modules_to_save: list[str] | None = None


@dataclass
class FinetuneConfig:
    # Parameters that do not train, by name pattern (fnmatch) of a parameter or a module, e.g.
    # [conv1, bn1, "layer[1-3]"] for a ResNet's backbone but its last stage.
    freeze: list[str] = field(default_factory=list)
    lora: LoraConfig = field(default_factory=LoraConfig)
