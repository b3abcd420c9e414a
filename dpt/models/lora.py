"""LoRA (low-rank adapters, Hu et al. 2021) on any model's linear layers, dpt's own.

Each chosen linear layer (an `nn.Linear`, or transformers' `Conv1D`, GPT-2's, whose weight is
stored transposed: in x out) gets two submodules, `lora_A` (in -> rank) and `lora_B` (rank -> out),
and a forward hook that adds `lora_B(lora_A(dropout(x))) * alpha / rank` to its output. The base
layer is left as it is, so the model's state-dict keys are unchanged (`<name>.weight`, a base
file loads as before) and the adapters' are `<name>.lora_A.weight` and `<name>.lora_B.weight`:
peft's own layout, less its adapter name. Every other parameter is frozen.

The adapters' first values do not depend on the global RNG: `lora_A` is drawn (as peft does,
Kaiming-uniform) from a generator seeded by the layer's name, `lora_B` is zero. Every rank and
every strategy thus starts from the same adapters, and `init_lora` can draw them again on a model
whose parameters fsdp has sharded (DTensors): a meta model materialized by transformers' own
initialisation.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dpt.distributed import copy_whole, local_part
from dpt.errors import DptError

A, B, DROPOUT, SCALING = "lora_A", "lora_B", "lora_dropout", "lora_scaling"
SEED = 0x10A  # the adapters' init, with each layer's name: the same on every rank and run
SUFFIXES = (f".{A}.weight", f".{B}.weight")
LAYERS_SHOWN = 8  # linear layers' names shown where a pattern matches none


def add_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
    modules_to_save: Sequence[str] | None = (),
) -> list[str]:
    """Adapters of `rank` on every linear layer of `model` that a pattern of `targets` names
    (fnmatch of the whole name or of its last parts: `q_proj`, `h.*.attn.v_proj`; none: those
    the model's family names, its attention's query and value projections); every other
    parameter frozen but those of `modules_to_save` (`saved_whole`). The adapted layers' names;
    a pattern that matches none is refused."""
    linears = linear_layers(model)
    if not targets:
        from dpt.models.families import family_of

        targets = family_of(model).lora_targets(model)
    if not targets:
        raise DptError(
            f"finetune.lora.rank={rank}: dpt knows no attention projections of "
            f"{type(model).__name__} to adapt; name its layers in finetune.lora.targets "
            f"({_linear_names(linears)})"
        )
    chosen = _chosen(linears, targets)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    from dpt.models import bare_name  # dpt.models imports this module's users

    for name in chosen:
        layer = linears[name]
        _attach(layer, rank, alpha / rank, dropout)
        _init_adapter(bare_name(name), getattr(layer, A).weight, getattr(layer, B).weight)
    for name in saved_whole(model, modules_to_save):
        model.get_submodule(name).requires_grad_(True)
    return chosen


def saved_whole(model: nn.Module, patterns: Sequence[str] | None) -> list[str]:
    """The modules that train whole beside the adapters (peft's `modules_to_save`): those the
    patterns name (as `targets` match; the outermost), or where None those the model's family
    names (a classifier's head). A pattern that matches no module is refused."""
    if patterns is None:
        from dpt.models.families import family_of

        return list(family_of(model).lora_modules_to_save(model))
    names = [name for name, _ in model.named_modules() if name]
    for pattern in patterns:
        if not any(matches(name, pattern) for name in names):
            raise DptError(f"finetune.lora.modules_to_save: {pattern!r} names no module of "
                           f"{type(model).__name__}")  # fmt: skip
    named = [n for n in names if any(matches(n, p) for p in patterns)]
    return [n for n in named if not any(n.startswith(f"{m}.") for m in named)]


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's linear layers by name, adapters excluded (a second `add_lora` adds none)."""
    return {name: module for name, module in model.named_modules()
            if _features(module) and name.rpartition(".")[2] not in (A, B)}  # fmt: skip


def _features(layer: nn.Module) -> tuple[int, int] | None:
    """A linear layer's (in, out) features; None for any other module."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    from dpt.models.families.base import is_conv1d

    if is_conv1d(layer):
        rows, columns = layer.weight.shape
        return rows, columns
    return None


def transposed_layers(model: nn.Module) -> set[str]:
    """The names of `model`'s linear layers whose weight is stored in x out."""
    from dpt.models.families.base import is_conv1d

    return {name for name, layer in model.named_modules() if is_conv1d(layer)}


def _chosen(linears: dict[str, nn.Module], targets: Sequence[str]) -> list[str]:
    """The layers' names that a pattern matches, in the model's order; each pattern must match."""
    for pattern in targets:
        if not any(matches(name, pattern) for name in linears):
            raise DptError(
                f"finetune.lora.targets: {pattern!r} matches no linear layer of the model "
                f"({_linear_names(linears)})"
            )
    return [name for name in linears if any(matches(name, p) for p in targets)
            and not hasattr(linears[name], A)]  # fmt: skip


def matches(name: str, pattern: str) -> bool:
    """The whole dotted name, or its last parts (`self_attn.q_proj`, `q_proj`), matches."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def _linear_names(linears: Iterable[str]) -> str:
    ends = list(dict.fromkeys(name.rpartition(".")[2] for name in linears))
    if not ends:
        return "it has none"
    more = ", ..." if len(ends) > LAYERS_SHOWN else ""
    return f"its linear layers end in: {', '.join(ends[:LAYERS_SHOWN])}{more}"


def _attach(layer: nn.Module, rank: int, scaling: float, dropout: float) -> None:
    weight, features = layer.weight, _features(layer)
    assert isinstance(weight, torch.Tensor) and features is not None
    made = {"bias": False, "device": weight.device, "dtype": weight.dtype}
    layer.add_module(A, nn.Linear(features[0], rank, **made))
    layer.add_module(B, nn.Linear(rank, features[1], **made))
    layer.add_module(DROPOUT, nn.Dropout(dropout) if dropout > 0 else nn.Identity())
    setattr(layer, SCALING, scaling)  # a plain float: in no state dict
    layer.register_forward_hook(_add_adapter)


def _add_adapter(layer: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """The hook: the base layer's output plus the adapter's (a module-level function, so a
    model with adapters deep-copies and pickles)."""
    x = getattr(layer, DROPOUT)(args[0])
    return output + getattr(layer, B)(getattr(layer, A)(x)) * getattr(layer, SCALING)


def init_lora(model: nn.Module) -> None:
    """Every adapter of `model` (possibly wrapped, its parameters possibly fsdp's DTensors)
    drawn anew: `lora_A` from its layer's name, `lora_B` zero. Nothing on the meta device."""
    from dpt.models import bare_name, unwrap

    for name, layer in unwrap(model).named_modules():
        if isinstance(getattr(layer, A, None), nn.Module):
            _init_adapter(bare_name(name), getattr(layer, A).weight, getattr(layer, B).weight)


@torch.no_grad()
def _init_adapter(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.device.type == "meta":
        return
    generator = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
    full = torch.empty(a.shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)  # peft's lora_A
    copy_whole(a, full)
    local_part(b).zero_()


def is_lora_key(key: str) -> bool:
    """A state-dict key of an adapter (`...q_proj.lora_A.weight`)."""
    return key.endswith(SUFFIXES)


def adapter_state(state: dict[str, Any]) -> dict[str, Any]:
    """The adapters' tensors of a model's state dict."""
    return {k: v for k, v in state.items() if is_lora_key(k)}


def adapted_layers(state: dict[str, Any]) -> list[str]:
    """The names of the layers that carry adapters in `state`, in its order."""
    return [k.removesuffix(SUFFIXES[0]) for k in state if k.endswith(SUFFIXES[0])]


def merged_state(
    state: dict[str, torch.Tensor], scaling: float, transposed: set[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """A plain model's state dict: each adapted layer's weight `W + scaling * B @ A` (computed
    in float32, stored in W's type; transposed for the layers `transposed` names, whose weight
    is in x out), the adapters dropped."""
    merged = {k: v for k, v in state.items() if not is_lora_key(k)}
    for name in adapted_layers(state):
        weight = state[f"{name}.weight"]
        a, b = state[name + SUFFIXES[0]].float(), state[name + SUFFIXES[1]].float()
        delta = (b @ a).t() if name in transposed else b @ a
        merged[f"{name}.weight"] = (weight.float() + scaling * delta).to(weight.dtype)
    return merged


PEFT_PREFIX = "base_model.model."  # peft's saved keys: PeftModel -> LoraModel -> the model
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def peft_files(
    state: dict[str, torch.Tensor],
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str],
    base_path: str | None,
    task_type: str | None = None,
    fan_in_fan_out: bool = False,
    modules_to_save: Sequence[str] = (),
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The adapters of `state` in peft's layout: `adapter_config.json`'s content and
    `adapter_model.safetensors`' tensors, which `PeftModel.from_pretrained(base, folder)` loads.
    `task_type`: peft's (`CAUSAL_LM` for a transformers causal language model), None for
    another model (plain `PeftModel`); `fan_in_fan_out`: the adapted layers' weights are in x
    out (transformers' Conv1D); `modules_to_save`: modules trained whole, saved beside the
    adapters under their own names (as peft saves them)."""
    adapters = adapter_state(state)
    whole = {k: v for k, v in state.items() if not is_lora_key(k)
             and any(k.startswith(f"{m}.") for m in modules_to_save)}  # fmt: skip
    layers = adapted_layers(adapters)
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": _peft_targets(state, layers, targets),
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": list(modules_to_save) or None,
        "inference_mode": True,
    }
    tensors = {PEFT_PREFIX + k: v.detach().contiguous().clone()
               for k, v in {**adapters, **whole}.items()}  # fmt: skip
    return config, tensors


def _peft_targets(state: dict[str, Any], layers: list[str], targets: Sequence[str]) -> list[str]:
    """peft's `target_modules`: a list peft matches by whole name or last parts, without
    wildcards. The config's targets where they are plain names that match exactly the adapted
    layers (`[q_proj, v_proj]`; none named: the adapted layers' last names, where they do), else
    the layers' whole names."""
    targets = targets or list(dict.fromkeys(layer.rpartition(".")[2] for layer in layers))
    modules = {".".join(parts[:i]) for k in state if not is_lora_key(k)
               for parts in [k.split(".")] for i in range(1, len(parts))}  # fmt: skip
    plain = not any(c in t for t in targets for c in "*?[")
    if plain and {m for m in modules if any(matches(m, t) for t in targets)} == set(layers):
        return list(targets)
    return layers
