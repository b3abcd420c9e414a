"""What a checkpoint holds, as parts: the model, the step count, the data position, the RNGs.

Each part has `state_dict()` / `load_state_dict()` (torch.distributed.checkpoint's `Stateful`), so
a checkpoint is the dict of every part's state and nothing else needs to know their insides. DCP
writes tensors as tensors (each rank its own; replicated ones once) and flattens dicts by their
keys, so a part whose keys are only known once it is filled (best metrics, a scheduler's state) is
stored as one JSON string (`PlainState`).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from dpt.errors import DptError
from dpt.models import bare_name, unwrap


@dataclass
class Progress:
    """Optimizer steps done, and unreadable samples skipped world-wide (plain numbers only): in
    all, and by the start of the epoch in progress (its epoch line, max_skipped_fraction)."""

    step: int = 0
    bad_samples: int = 0
    bad_at_epoch_start: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.bad_samples = int(state["step"]), int(state["bad_samples"])
        # Checkpoints written before it was kept: the epoch's count from the run's start.
        self.bad_at_epoch_start = int(state.get("bad_at_epoch_start", 0))

    def bad_in_epoch(self) -> int:
        return self.bad_samples - self.bad_at_epoch_start


def _state_dicts() -> ModuleType:
    """DCP's state-dict functions, imported at the first save or load: DCP and DTensor cost
    start-up time that a run spends before its first step otherwise."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


class ModelState:
    """The model's weights without its wrappers (DDP, DataParallel, torch.compile), so one
    checkpoint loads under every strategy. DCP's state-dict functions work on the unwrapped module
    in one process too, and are where sharded models (FSDP) will plug in. `trainable_only`: the
    parameters that train alone (a LoRA run's adapters: its base is rebuilt from the config)."""

    def __init__(self, model: nn.Module, trainable_only: bool = False) -> None:
        self.model, self.trainable_only = model, trainable_only

    def expect(self, stored: set[str]) -> None:
        """One line where the model's family cannot resume from a checkpoint of these tensors
        (DCP loads by the model's names: a GPT checkpoint of before, with one fused `qkv`)."""
        from dpt.models.families import family_of

        model = unwrap(self.model)
        refused = family_of(model).refused_checkpoint(model, stored)
        if refused is not None:
            raise DptError(refused)

    def _options(self) -> Any:
        only = self.trainable_only
        return _state_dicts().StateDictOptions(ignore_frozen_params=only, strict=not only)

    def state_dict(self) -> dict[str, Any]:
        state = _state_dicts().get_model_state_dict(unwrap(self.model), options=self._options())
        if self.trainable_only:  # a frozen parameter's second name too (a GPT's tied head)
            frozen = _frozen_names(unwrap(self.model))
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _state_dicts().set_model_state_dict(unwrap(self.model), state, options=self._options())


def _frozen_names(model: nn.Module) -> set[str]:
    """The names, every one of a shared parameter, of the parameters that do not train (as
    state dicts name them: without the wrappers' parts)."""
    return {bare_name(name) for name, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad}  # fmt: skip


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The whole model's weights as plain CPU tensors, on rank 0 ({} on the others), under every
    strategy: fsdp's shards are gathered (all ranks must call this). Loads into the bare model
    with `torch.load(weights_only=True)` and `load_state_dict`."""
    dicts = _state_dicts()
    options = dicts.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dicts.get_model_state_dict(unwrap(model), options=options)


class OptimizerState:
    """The optimizer's state keyed by parameter names (not positions), through DCP.

    Flattened (torchtitan's choice): each parameter's settings under its own name
    (`param_groups.<name>.lr`), not one list of every group's names, so a rank that holds only
    some of the parameters (a pipeline stage) saves and loads only theirs, and a checkpoint
    loads under any number of stages. Checkpoints written before (a list of groups, each with
    its parameters' names) still load, as they were written."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.flat = True

    def expect(self, stored: set[str]) -> None:
        """Told the checkpoint's keys under this part before loading: which layout it has."""
        # Before: `param_groups.<i>.params` lists every group's parameter names.
        self.flat = not any(k.startswith("param_groups.") and k.endswith(".params") for k in stored)

    def _options(self) -> Any:
        return _state_dicts().StateDictOptions(flatten_optimizer_state_dict=self.flat)

    def state_dict(self) -> dict[str, Any]:
        return _state_dicts().get_optimizer_state_dict(
            unwrap(self.model), self.optimizer, options=self._options()
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _state_dicts().set_optimizer_state_dict(
            unwrap(self.model), self.optimizer, state, options=self._options()
        )
        self.flat = True  # what this run saves from now on


class PlainState:
    """A part of plain numbers and strings (scheduler, scaler, progress, ...) as one JSON string:
    DCP loads into the keys the part has now, and e.g. the best metrics have none before a run."""

    def __init__(self, part: Any) -> None:
        self.part = part
        # A part added after checkpoints were written loads fresh from them (dpt.state.checkpoint).
        self.optional = bool(getattr(part, "optional", False))

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.part.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(json.loads(state["json"]))


class RNGState:
    """This rank's generators (Python's, NumPy's, torch's, CUDA's) under `rank<k>`: they differ per
    rank (dropout, loader workers), so each rank stores and restores its own. Tensors and numbers
    only: the stored objects load with `weights_only=True` (no NumPy objects, no pickled code).

    A checkpoint of another world size has streams for other ranks: then none is restored and
    `stored_world` says so (the trainer re-derives them); data order and augmentation do not
    depend on these streams."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.key, self.world_size = f"rank{rank}", world_size
        self.stored_world: int | None = None  # set while loading a checkpoint (see `expect`)

    def expect(self, stored: set[str]) -> None:
        """Told the checkpoint's keys under this part (`rank0.torch`, ...) before loading."""
        self.stored_world = len({key.split(".", 1)[0] for key in stored})

    @property
    def other_world(self) -> bool:
        return self.stored_world is not None and self.stored_world != self.world_size

    def state_dict(self) -> dict[str, Any]:
        return {} if self.other_world else {self.key: self._generators()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.key in state:
            self._restore(state[self.key])

    @staticmethod
    def _generators() -> dict[str, Any]:
        np_state = np.random.get_state()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": _lists(random.getstate()),
            "numpy": {
                "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                "pos": int(np_state[2]),
                "has_gauss": int(np_state[3]),
                "gauss": float(np_state[4]),
            },
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def _restore(state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(_tuples(state["python"]))
        keys = state["numpy"]
        np.random.set_state(
            (
                "MT19937",
                keys["keys"].numpy().astype(np.uint32),
                keys["pos"],
                keys["has_gauss"],
                keys["gauss"],
            )
        )
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def _lists(value: Any) -> Any:
    return [_lists(v) for v in value] if isinstance(value, tuple | list) else value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
