"""`model=hf`: a Hugging Face transformers model as a dpt model, from a local folder
(`model.path`: config.json, safetensors weights, the tokenizer) or from a config alone
(`model.config`, fresh weights). Nothing is downloaded.

The Auto class follows the task: a language model is a causal LM; the other tasks a sequence
classifier (token inputs) or an image classifier (image inputs) with the data's number of
outputs, a head of another size left fresh (transformers' `ignore_mismatched_sizes`). The model
is transformers' own module, so its weights keep transformers' names (`dpt-export` writes them as
they are); a forward hook hands the task its `.logits`. What the engine asks of such a model
(its blocks, pipeline units, tensor-parallel plan, FLOPs) its family answers:
dpt/models/families/transformers.py.

transformers is imported only here, by runs of `model=hf`.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpt.config.models import HF_CONFIG, check_model_folder
from dpt.config.tasks import CUSTOM, LANGUAGE_MODEL, TASKS
from dpt.errors import DptError, some_of, torch_load_reason
from dpt.loggers import ONCE_LOGGER_NAME
from dpt.models import packed

once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it

SHOWN = 4  # tensors named in a line of what did not load as it is
EXAMPLE_TYPES = "e.g. llama, gpt2, bert, vit"  # transformers' model types, for a hint
REMOTE_CODE_KEY = "auto_map"  # a config.json key naming the folder's own Python classes
# transformers' refusal of SDPA for a model whose attention it cannot express (soft-capping)
NO_SDPA = "does not support an attention implementation through torch.nn.functional"
CAUSAL_LM, SEQUENCE, IMAGE = (
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "AutoModelForImageClassification",
)


def pretrained(
    task: str,
    num_outputs: int,
    input_shape: tuple[int, ...],
    path: str | None = None,
    config: dict[str, Any] | None = None,
    block_size: int | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The transformers model for `task` (a dpt task kind), its outputs `num_outputs` (a
    classifier's labels; a language model's vocabulary, at most its embedding's)."""
    hf_config = model_config(path, config, trust_remote_code)
    auto = auto_class(task, input_shape)
    if task == LANGUAGE_MODEL:
        if path is None and "vocab_size" not in _plain(config):  # fresh: the data's, as model=gpt
            hf_config.vocab_size = num_outputs  # (not transformers' default, 32,000 for Llama)
        _check_vocabulary(num_outputs, hf_config, path)
    else:
        hf_config.num_labels = num_outputs
    hf_config.use_cache = False  # training: no key/value cache to build at every forward
    model = _build(auto, hf_config, path, trust_remote_code)
    model.register_forward_hook(_logits)
    model.register_forward_pre_hook(_packed_inputs, with_kwargs=True)
    if auto == SEQUENCE:  # where its config names a pad id (a run's data may give it one)
        model.register_forward_pre_hook(_padding_left_out, with_kwargs=True)
    model.block_size = block_size  # dpt-generate's context
    return model


def model_config(path: str | None, config: Any, trust_remote_code: bool) -> Any:
    """transformers' config of the folder, or of the `model.config` keys (`model_type` names
    the architecture)."""
    from transformers import AutoConfig

    if path is not None:
        folder = _folder(path, trust_remote_code)
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if not config:
        raise DptError("model=hf: set model.path (a local model folder) or model.config "
                       "(a transformers config with model_type, for fresh weights)")  # fmt: skip
    values = _plain(config)
    if not isinstance(values, dict):
        raise DptError(f"model.config={config}: a transformers config is its keys, e.g. "
                       "model.config={model_type: llama, hidden_size: 64}")  # fmt: skip
    kind = values.pop("model_type", None)
    if kind is None:
        raise DptError(f"model.config: needs model_type ({EXAMPLE_TYPES})")
    try:
        return AutoConfig.for_model(kind, **values)
    except ValueError as error:
        if "Unrecognized model identifier" in str(error):  # it lists every type there is
            raise DptError(f"model.config.model_type={kind}: transformers has no such model "
                           f"type ({EXAMPLE_TYPES})") from error  # fmt: skip
        raise DptError(f"model.config.model_type={kind}: {_first_line(error)}") from error


def _folder(path: str, trust_remote_code: bool) -> Path:
    """The model folder, refused in one line where it is not one, or where it would run its
    own code without the user's leave."""
    folder = check_model_folder(path)
    config_file = folder / HF_CONFIG
    if REMOTE_CODE_KEY in json.loads(config_file.read_text()) and not trust_remote_code:
        raise DptError(
            f"model.path={path}: its {HF_CONFIG} runs the folder's own Python code "
            f"({REMOTE_CODE_KEY}); set model.trust_remote_code=true only if you trust it"
        )
    return folder


def auto_class(task: str, input_shape: tuple[int, ...]) -> str:
    """The Auto class serving `task` on inputs of `input_shape` (token ids: one dimension)."""
    if task == LANGUAGE_MODEL:
        return CAUSAL_LM
    if task == CUSTOM or task not in TASKS:
        served = ", ".join(kind for kind in TASKS if kind != CUSTOM)
        raise DptError(f"model=hf: task={task} has no transformers Auto class (it serves {served})")
    return SEQUENCE if len(input_shape) == 1 else IMAGE


def _check_vocabulary(tokens: int, hf_config: Any, path: str | None) -> None:
    size = getattr(hf_config, "vocab_size", None)
    if size is not None and tokens > size:
        where = f"model.path={path}" if path else "model.config"
        raise DptError(
            f"the data set's tokenizer has {tokens} tokens, more than the embedding of {where} "
            f"({size}): use the model's own tokenizer (dataset.tokenizer=<its folder>)"
        )


def build_auto(auto: str, hf_config: Any) -> nn.Module:
    """A fresh model of transformers' Auto class `auto` for `hf_config`, as dpt builds it."""
    return _build(auto, hf_config, None, trust_remote_code=False)


def _build(auto: str, hf_config: Any, path: str | None, trust_remote_code: bool) -> nn.Module:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per rank per load: noise in logs
    cls = getattr(transformers, auto)
    options = {"trust_remote_code": trust_remote_code, "attn_implementation": "sdpa"}
    try:
        return _built(cls, hf_config, path, options)
    except ValueError as error:
        if NO_SDPA not in str(error):
            raise
    # Its own attention (Gemma 2's soft-capped one), named: the failed try left SDPA in the config
    return _built(cls, hf_config, path, options | {"attn_implementation": "eager"})


def _built(cls: Any, hf_config: Any, path: str | None, options: dict[str, Any]) -> nn.Module:
    auto = cls.__name__
    try:
        if path is None or _on_meta():  # the pre-run check's shapes: no weights read
            return cls.from_config(hf_config, **options)
        return _loaded(cls, path, hf_config, options)
    except pickle.UnpicklingError as error:  # a pickled weights file holding code, or damaged
        raise DptError(
            f"model.path={path}: its pickled weights file cannot be read as tensors alone "
            f"({torch_load_reason(error)}); dpt runs no code from a weights file: save the "
            "weights as safetensors (save_pretrained(folder) writes model.safetensors)"
        ) from error
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        raise DptError(
            f"model=hf: transformers has no {auto} for model_type={hf_config.model_type} "
            "(the task needs it)"
        ) from error


def _loaded(cls: Any, path: str, hf_config: Any, options: dict[str, Any]) -> nn.Module:
    """The folder's model; what did not load as it is (a head of another size, tensors the
    folder lacks or the model does not hold) said in dpt's lines, in place of transformers' load
    report (a table, from every rank)."""
    from transformers.modeling_utils import logger

    quiet = _NoLoadReport()
    logger.addFilter(quiet)
    try:
        model, info = cls.from_pretrained(path, config=hf_config, dtype=torch.float32,
                                          ignore_mismatched_sizes=True, output_loading_info=True,
                                          **options)  # fmt: skip
    finally:
        logger.removeFilter(quiet)
    for line in loading_lines(path, info):
        once.warning(line)
    from dpt.models.families import family_of

    own = dict(model.named_parameters())
    fresh = [name for name, *_ in info.get("mismatched_keys", ())]
    fresh += list(info.get("missing_keys", ()))
    family_of(model).init_fresh(model, [name for name in fresh if name in own])
    return model


class _NoLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def loading_lines(path: str, info: dict[str, Any]) -> list[str]:
    """What `from_pretrained` reported (its `output_loading_info`), a line each: the tensors
    that start fresh (of another shape in the folder, or not in it) and those left out."""
    lines = []
    reshaped = [f"{name} {list(stored)} -> {list(own)}" for name, stored, own in
                sorted(info.get("mismatched_keys", ()))]  # fmt: skip
    if reshaped:
        lines.append(f"model.path={path}: {_count(reshaped)} start fresh, of another shape in "
                     f"the folder than the task's model: {some_of(reshaped, SHOWN)}")  # fmt: skip
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        lines.append(f"model.path={path}: {_count(missing)} start fresh, not in the folder: "
                     f"{some_of(missing, SHOWN)}")  # fmt: skip
    unused = sorted(info.get("unexpected_keys", ()))
    if unused:
        lines.append(f"model.path={path}: {_count(unused)} of the folder not in the model, "
                     f"left out: {some_of(unused, SHOWN)}")  # fmt: skip
    return lines


def _count(names: list[str]) -> str:
    return "1 tensor" if len(names) == 1 else f"{len(names)} tensors"


def _on_meta() -> bool:
    return torch.empty(()).device.type == "meta"


def _packed_inputs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Packed examples (B, 2, T: dataset=chat): the ids, and their positions, from which
    transformers keeps each example's attention within itself (masking_utils'
    find_packed_sequence_indices: a position that does not follow the one before starts one)."""
    if not (args and isinstance(args[0], torch.Tensor) and args[0].dim() == packed.PACKED_DIMS):
        return None
    ids, positions = packed.split(args[0])
    return (ids, *args[1:]), {**kwargs, "position_ids": positions}


def _padding_left_out(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A classifier's texts padded to one length (dataset=records): the padding (the model's
    pad id) left out of its attention, as transformers' tokenizers' attention_mask does."""
    pad = getattr(module.config, "pad_token_id", None)
    if pad is None or not (args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2):
        return None
    if "attention_mask" in kwargs:
        return None
    mask = (args[0] != pad).long()
    return args, {**kwargs, "attention_mask": mask}


def _logits(module: nn.Module, args: Any, output: Any) -> Any:
    """The task's input: the model's logits, not transformers' output object."""
    return getattr(output, "logits", output)


def _plain(config: Any) -> Any:
    """`model.config` as plain Python values (a dict, where it is one)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return dict(config) if isinstance(config, dict) else config


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
