"""What the engine asks of a model family, and the parts the families share.

A family answers for the models it owns (`owns`): its blocks (fsdp's and recomputation's
units), its pipeline units (where a cut may go), its tensor-parallel plan, LoRA's default targets,
how weights written in another layout are named in its own, its FLOPs per token, and the
transformers model `dpt-export --to hf` writes. The defaults answer "dpt knows none": a family
states only what it knows. The engine asks `dpt.models.families.family_of(model)`, never the
model's class.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpt.config.tensor_parallel import WHO_SPLITS


@dataclass(frozen=True)
class Unit:
    """A pipeline unit. `name`: what `strategy.split_points` names; `modules`: the modules it
    runs (their names in the model); `run(model, x)`: its forward, on the model that holds
    them (None where its family runs a stage as a whole: `Family.run_stage`)."""

    name: str
    modules: tuple[str, ...]
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None


# A tensor-parallel plan: splits the model over a 1-D tensor mesh, in place; True: its logits
# stay split over the vocabulary in training (the task's loss computes on the split).
Plan = Callable[[nn.Module, Any, bool], None]


class Family:
    """A model family: what dpt knows of the models it owns. The defaults: nothing."""

    def owns(self, model: nn.Module) -> bool:
        return False

    def blocks(self, model: nn.Module) -> list[nn.Module | None]:
        """The blocks in forward order (a pipeline stage's copy holds None for the others')."""
        return []

    def units(self, model: nn.Module) -> list[Unit] | None:
        """The pipeline units in forward order; None: dpt does not know where to cut it."""
        return None

    def run_stage(self, model: nn.Module, kept: Sequence[Unit], x: torch.Tensor) -> torch.Tensor:
        """A pipeline stage's forward: its units in turn, on the stage's copy of the model."""
        for unit in kept:
            assert unit.run is not None
            x = unit.run(model, x)
        return x

    def absent(self, module: nn.Module) -> nn.Module | None:
        """What a stage's copy holds in place of `module`, another stage's (None: nothing)."""
        return None

    def tensor_plan(self, model: nn.Module) -> Plan | None:
        return None

    def no_plan_reason(self, model: nn.Module) -> str:
        """Why `model` has no tensor-parallel plan (tensor_plan is None), what to do instead."""
        return f"dpt has no tensor-parallel plan for {type(model).__name__}; {WHO_SPLITS}"

    def split_widths(self, model: nn.Module) -> dict[str, int]:
        """Each width the plan splits (it must divide by the degree), by the name that sets it."""
        return {}

    def lora_targets(self, model: nn.Module) -> tuple[str, ...]:
        """The layers LoRA adapts when `finetune.lora.targets` names none."""
        return ()

    def lora_modules_to_save(self, model: nn.Module) -> tuple[str, ...]:
        """The modules that train whole beside LoRA's adapters when
        `finetune.lora.modules_to_save` names none (a classifier's head)."""
        return ()

    def weights_in(self, model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """`state` (a weights source's tensors) named as `model` names them."""
        names = self.names_in(model, list(state))
        return {names.get(key, key): value for key, value in state.items()}

    def names_in(self, model: nn.Module, stored: list[str]) -> dict[str, str]:
        """The stored names whose tensor `model` names otherwise, each with the model's name
        (a rename only: the tensor as stored); {}: the same names."""
        return {}

    def pads_with(self, model: nn.Module, pad_id: int) -> str | None:
        """Tell a model of texts' token ids the id that pads them (the data's tokenizer's),
        where it must know it and its config names none; what to say of it, or None."""
        return None

    def init_fresh(self, model: nn.Module, names: list[str]) -> None:
        """Draw anew the parameters `names` that the weights did not give (a head of the task's
        size), each from its own name, the same under every strategy (fsdp's model is built on
        the meta device and drawn in another order); nothing where the family's models are
        built alike under every strategy."""

    def refused_checkpoint(self, model: nn.Module, stored: set[str]) -> str | None:
        """Why a checkpoint holding the tensors `stored` cannot resume `model`; None: it can."""
        return None

    def flops_per_token(self, model: nn.Module) -> Callable[[int], float] | None:
        """Training FLOPs per token of a sequence of so many tokens; None: not counted."""
        return getattr(model, "flops_per_token", None)

    def as_transformers(self, model: nn.Module) -> nn.Module | None:
        """The transformers model `dpt-export --to hf` saves; None: transformers has no class."""
        return None

    def peft_task_type(self, task: str) -> str | None:
        """peft's task type for an adapter of this family's model trained for `task` (a dpt
        task kind); None: a plain PeftModel."""
        return None

    def name_outputs(self, model: nn.Module, task: str, names: list[str]) -> None:
        """Write into the model's exported config what its outputs are (the run's `names` of
        them, for a task of dpt's kinds); nothing where the family's export has no place."""

    def transformers_config(self, model: nn.Module) -> str | None:
        """The transformers config (JSON) a run keeps to rebuild the model without its folder."""
        return None


def is_conv1d(layer: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2's projections): a linear layer whose weight is stored in x
    out (peft's `fan_in_fan_out`)."""
    return loaded_instance(layer, "transformers.pytorch_utils", "Conv1D")


def loaded_instance(model: nn.Module, module: str, cls: str) -> bool:
    """Whether `model` is a `module.cls`, where `module` is imported already: a library is
    imported only where a model of it was built, never to find out that a model is not one."""
    found = sys.modules.get(module)
    return found is not None and isinstance(model, getattr(found, cls))


def child(name: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """A unit's forward that runs the submodule `name`."""
    return lambda model, x: model.get_submodule(name)(x)


def outermost(module: nn.Module, is_block: Callable[[type], bool]) -> Iterator[nn.Module]:
    """The outermost blocks under `module` (a class or one of its bases `is_block`), each as
    the model holds it (inside activation checkpointing's wrapper: the wrapper). The bases
    too: FSDP2 subclasses a module's class when it shards it."""
    for sub in module.children():
        inner = getattr(sub, "_checkpoint_wrapped_module", sub)
        if any(is_block(c) for c in type(inner).__mro__):
            yield sub
        else:
            yield from outermost(sub, is_block)


def inner(block: nn.Module) -> nn.Module:
    """The block inside activation checkpointing's wrapper: a plan's names are its own."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def sequential_units(model: nn.Sequential) -> list[Unit]:
    """An `nn.Sequential`'s units: its children."""
    return [Unit(name, (name,), child(name)) for name, _ in model.named_children()]
