"""Initial weights from a local state_dict file (`model.weights`), for any classifier.

Nothing is downloaded and nothing beyond tensors is unpickled. A classification head of another
size (e.g. ImageNet's 1000 classes for a data set of 7) stays freshly initialised: that is what
fine-tuning from a pretrained backbone needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpt.errors import DptError, some_of, torch_load_reason
from dpt.models.lora import is_lora_key


def load_weights(model: nn.Module, path: Path, label: str, num_classes: int) -> None:
    """Load `path` into `model`; `label` names the model in errors (`model={label}`)."""
    if not path.is_file():
        raise DptError(f"model.weights={path}: file not found")
    state = read_state_file(path, f"model.weights={path}")
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    heads = _head_keys(model, num_classes)
    missing = [
        k for k in own if k not in usable and not _is_fresh_head(k, own, state, heads, num_classes)
    ]
    if missing:
        raise DptError(
            f"model.weights={path}: does not fit model={label} ({len(missing)} tensors missing or "
            f"of another shape, e.g. {missing[0]})"
        )
    model.load_state_dict(usable, strict=False)


MODEL_PART = "model"  # the model's entry in a training state (and in a checkpoint)


def read_state_file(path: Path, key: str) -> dict[str, torch.Tensor]:
    """A torch file's state_dict (or a training state's, under `model`), tensors only;
    `key` names it in errors (`model.weights=PATH`, `model.init_from=PATH`)."""
    try:
        state: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        reason = torch_load_reason(error)
        raise DptError(f"{key}: not a loadable state_dict: {reason}") from error
    state = state.get(MODEL_PART, state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DptError(f"{key}: not a state_dict (a dict of tensors)")
    return state


def _is_fresh_head(
    key: str,
    own: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    heads: set[str],
    num_classes: int,
) -> bool:
    """A tensor left as initialised: one whose class dimension (the first) differs from the
    file's and nothing else (`fc.`, `classifier.N.`, `head.`, `heads.head.`, an auxiliary head
    too), or the classifier's own tensors where the file has no head at all."""
    if key not in state:
        return key in heads
    mine, theirs = own[key].shape, state[key].shape
    return len(mine) == len(theirs) >= 1 and mine[0] == num_classes and mine[1:] == theirs[1:]


def _head_keys(model: nn.Module, num_classes: int) -> set[str]:
    """The state-dict keys of the classifier: the last module holding parameters of its own,
    where its output dimension is `num_classes` (torchvision registers the head last)."""
    last = ""
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            last = name
    module = model.get_submodule(last)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape[:1] != (num_classes,):
        return set()
    prefix = f"{last}." if last else ""
    return {prefix + name for name, _ in module.named_parameters(recurse=False)}


def fit_state(
    model: nn.Module, state: dict[str, torch.Tensor], key: str, num_outputs: int
) -> set[str]:
    """Load `state` (from `key`, e.g. `model.init_from=PATH`) into `model`; the names loaded."""
    usable = fitting(model, state, key, num_outputs)
    model.load_state_dict(usable, strict=False)
    return set(usable)


def fitting(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    key: str,
    num_outputs: int,
    left_out: bool = False,
) -> dict[str, torch.Tensor]:
    """What of `state` loads into `model`, refused in one line unless every tensor of the
    model is there with its shape, but a classification head of another size (left fresh) and
    a tied copy (a head sharing the embedding's matrix, which transformers saves once), in the
    names the model's family reads (dpt's GPT: GPT-2's layout too, and its own fused `qkv` of
    before). Shapes only: `model` may be on the meta device."""
    from dpt.models.families import family_of

    state = family_of(model).weights_in(model, state)
    # LoRA's adapters are the run's own (dpt.models.lora): no source holds them.
    own = {k: v for k, v in model.state_dict().items() if not is_lora_key(k)}
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    heads, tied = _head_keys(model, num_outputs), tied_twins(model)
    missing = [k for k in own if k not in usable and tied.get(k) not in usable
               and not _is_fresh_head(k, own, state, heads, num_outputs)]  # fmt: skip
    # `left_out`: a pretrained folder's tensors the model lacks (a causal LM's head under a
    # classifier) are left out, as transformers' from_pretrained leaves them
    unexpected = [] if left_out else [k for k in state if k not in own]
    if missing or unexpected:
        both = "; " if missing and unexpected else ""
        raise DptError(f"{key}: its weights do not fit the model ({_first_few(missing, 'missing')}"
                       f"{both}{_first_few(unexpected, 'not in the model')})")  # fmt: skip
    return usable  # a tied copy is its twin's tensor: loaded with it


def tied_twins(model: nn.Module) -> dict[str, str]:
    """Each parameter name that is another's parameter (tied): the first name."""
    first: dict[int, str] = {}
    twins = {name: first.setdefault(id(p), name)
             for name, p in model.named_parameters(remove_duplicate=False)}  # fmt: skip
    return {name: twin for name, twin in twins.items() if twin != name}


def _first_few(keys: list[str], what: str, shown: int = 3) -> str:
    return f"{what}: {some_of(keys, shown)}" if keys else ""
