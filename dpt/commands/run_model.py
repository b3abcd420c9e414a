"""A finished run's model and task, rebuilt from its run folder for `dpt-predict`.

`Predictor.from_run(run_dir)` reads `.hydra/config.yaml` and `data.json` (see
dpt/state/results.py), builds the run's model, task and validation transform and loads
`model_best.pt` (or `model.pt`), on the device a run's `trainer.device=auto` takes.

torch is imported inside the functions (or for type checking only): `dpt-predict --help` and
bad arguments answer before it loads.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpt.config.tasks import CLASSIFICATION
from dpt.errors import DptError, first_line, one_line, torch_load_reason
from dpt.state.results import (
    BEST_MODEL,
    DATA_FILE,
    HF_CONFIG_FILE,
    LAST_MODEL,
    RunData,
    read_run_data,
)
from dpt.state.sweep_folder import is_sweep, not_a_run

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpt.data.tokenizer import Tokenizer
    from dpt.tasks.task import Task

CONFIG_FILE = Path(".hydra") / "config.yaml"
# Models whose `weights` key names a pretrained file that only initialises them: the run's own
# state_dict replaces it, so prediction must not need that file (nor spend time reading it).
PRETRAINED_WEIGHTS_TARGETS = (
    "dpt.models.resnet.resnet",
    "dpt.models.classifiers.torchvision_classifier",
)


def weights_file(run_dir: Path, last: bool = False) -> tuple[Path, str | None]:
    """The weights to load and, where `model_best.pt` was asked for but is absent, a notice."""
    best, final = run_dir / BEST_MODEL, run_dir / LAST_MODEL
    if not last and best.is_file():
        return best, None
    if not final.is_file():
        raise DptError(
            f"{final} not found: the run has not finished (model.pt is written at its end)"
        )
    if last:
        return final, None
    return final, f"{best} not found: using {final} (the last epoch's weights)"


@dataclass
class Predictor:
    """A run's model (eval mode, on `device`), its task and validation transform.

    `Predictor.from_run(run_dir)`, then `predict(predictor.load(path))`-style use:
    `load` turns one image file into the model's input, `predict` a batch of inputs into what
    the run's task predicts (`Task.predict`: class probabilities, rows summing to 1, for
    classification), on the CPU, float32, one row per input."""

    model: nn.Module
    transform: Any  # a callable: uint8 (3, H, W) RGB tensor -> the model's input; None: none
    classes: list[str]  # the names of the model's outputs (data.json's `classes`)
    device: torch.device
    weights: Path  # the file the model's weights came from
    task: Task
    kind: str = CLASSIFICATION  # the task's kind, as data.json records it
    input_shape: tuple[int, ...] = ()  # one input's
    notice: str | None = None  # why `weights` is not the file asked for
    channels_last: bool = False
    # The run's trainer.precision, as validation ran it (bf16 autocast): the same predictions.
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    no_transform: str = ""  # why `load` cannot read images (the run gave no val_transform)
    input_dtype: Any = None  # float inputs are cast to it (the model's float type)

    @classmethod
    def from_run(
        cls, run_dir: str | os.PathLike[str], last: bool = False, device: str | None = None
    ) -> Predictor:
        run_dir = run_folder(Path(run_dir))
        data = read_run_data(run_dir)
        transform = None if data.val_transform is None else build_transform(run_dir, data)
        weights, notice = weights_file(run_dir, last)
        cfg = run_config(run_dir)
        lora = run_lora(cfg)  # before model_config, which forgets model.path
        model_cfg = model_config(run_dir, cfg)
        task = build_run_task(run_dir, data, cfg)
        model = build_run_model(model_cfg, data, lora)
        load_state(model, weights)
        target = pick_device(device)
        precision = _run_precision(cfg)
        return cls(
            model=model.to(target).eval(),
            transform=transform,
            classes=data.classes,
            device=target,
            weights=weights,
            task=task,
            kind=data.task,
            input_shape=tuple(data.input_shape),
            notice=notice,
            channels_last=bool(model_cfg.get("channels_last", False)),
            autocast=_autocast(precision, target),
            no_transform=no_transform_message(run_dir) if transform is None else "",
            input_dtype=_float_type(model),
        )

    def load(self, path: str | os.PathLike[str]) -> torch.Tensor:
        """One image file as the model's input; `ImageDecodeError` where it cannot be read."""
        from dpt.data.images import read_image_rgb

        if self.transform is None:
            raise DptError(self.no_transform)
        return self.transform(read_image_rgb(path))

    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """What the task predicts `(batch, n)` of a batch of the model's inputs (transformed
        images, or rows of a tensor file): `Task.predict` of the outputs, float32."""
        import torch

        inputs = inputs.to(self.device, non_blocking=True)
        if inputs.is_floating_point() and self.input_dtype is not None:
            inputs = inputs.to(self.input_dtype)  # a float64 array for a float32 model
        if self.channels_last and inputs.dim() == 4:  # as training fed it (dpt.data.loaders)
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        with torch.no_grad(), self.autocast():
            outputs = self.model(inputs).float()
        with torch.no_grad():
            return self.task.predict(outputs).float().cpu()


def run_folder(run_dir: Path) -> Path:
    if not run_dir.exists():
        raise DptError(f"{run_dir}: no such run folder")
    if not run_dir.is_dir():
        raise DptError(f"{run_dir} is not a folder: give the run folder (it holds data.json)")
    if is_sweep(run_dir):  # `dpt -m ...` prints the sweep's folder: its runs are inside
        raise DptError(not_a_run(run_dir))
    return run_dir


def no_transform_message(run_dir: Path) -> str:
    return (
        f"{run_dir / DATA_FILE} records no val_transform (the run's data set gave none): "
        "dpt-predict needs a data set with a `val_transform` (see dpt/contract.py)"
    )


def build_transform(run_dir: Path, data: RunData) -> Any:
    """The run's validation transform, built from its `_target_` node."""
    if data.val_transform is None:
        raise DptError(no_transform_message(run_dir))
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dpt.config.build import build

    try:
        return build(OmegaConf.create(data.val_transform))
    except (HydraException, OmegaConfBaseException) as error:
        raise DptError(f"cannot build the run's val_transform: {one_line(error)}") from error


def run_config(run_dir: Path) -> Any:
    """The run's composed config (its interpolations still resolvable)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from dpt.config.store import register_configs

    register_configs()  # the `${dpt.cores:N}` resolver, for nodes that refer to others
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise DptError(f"{path} not found: the run's config, which says how to build its model")
    try:
        return OmegaConf.load(path)
    except (OSError, ValueError, OmegaConfBaseException) as error:
        raise DptError(f"{path} is unreadable: {one_line(error)}") from error


def model_config(run_dir: Path, cfg: Any = None) -> Any:
    """The `model` node of the run's composed config (its interpolations still resolvable);
    `cfg`: that config, where already read."""
    from omegaconf.errors import OmegaConfBaseException

    cfg = run_config(run_dir) if cfg is None else cfg
    try:
        model = cfg.model
    except OmegaConfBaseException as error:
        raise DptError(f"{run_dir / CONFIG_FILE} is unreadable: {one_line(error)}") from error
    if model.get("_target_") in PRETRAINED_WEIGHTS_TARGETS and model.get("weights"):
        model.weights = None
    if (run_dir / HF_CONFIG_FILE).is_file():  # model=hf: its config as the run kept it
        model.path = None
        model.config = json.loads((run_dir / HF_CONFIG_FILE).read_text())
    return model


def task_config(run_dir: Path, data: RunData, cfg: Any = None) -> Any:
    """The `task` node of the run's config (`cfg`, where already read); classification's for a
    run of before tasks."""
    from omegaconf import DictConfig, OmegaConf

    node = (run_config(run_dir) if cfg is None else cfg).get("task")
    if isinstance(node, DictConfig) and "_target_" in node:
        return node
    if data.task != CLASSIFICATION:
        raise DptError(
            f"{run_dir / CONFIG_FILE} has no `task` node: {run_dir / DATA_FILE} says the run's "
            f"task is {data.task}, which dpt-predict needs the config of"
        )
    from dpt.config.tasks import BEFORE_TASKS

    return OmegaConf.create(BEFORE_TASKS)  # a run folder of before tasks


def build_run_task(run_dir: Path, data: RunData, cfg: Any = None) -> Task:
    """The run's Task object, for the targets and outputs data.json records (`cfg`: the run's
    config, where already read)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dpt.targets import Targets
    from dpt.tasks.task import build_task

    if data.task == CLASSIFICATION:
        targets = Targets.labels(len(data.classes))
    else:
        targets = Targets(integer=False, shape=tuple(data.target_shape))
    node = task_config(run_dir, data, cfg)
    try:
        return build_task(node, targets, len(data.classes), list(data.classes))
    except (HydraException, OmegaConfBaseException) as error:
        raise DptError(f"cannot build the run's task: {one_line(error)}") from error


def _run_precision(cfg: Any) -> str:
    from omegaconf import OmegaConf

    return str(OmegaConf.select(cfg, "trainer.precision") or "32")


def _autocast(precision: str, device: torch.device) -> Callable[[], Any]:
    """Validation's autocast on this device; fp32 where it has none (16-mixed off CUDA)."""
    from dpt.loop.precision import Precision

    try:
        return Precision(precision, device).autocast
    except DptError:
        return contextlib.nullcontext


def _float_type(model: nn.Module) -> Any:
    """The float type of the model's first float parameter or buffer (None: it has none)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype
    return None


@dataclass(frozen=True)
class RunLora:
    """A run's LoRA adapters (`finetune.lora`), and where its frozen base came from."""

    rank: int
    alpha: float
    dropout: float
    targets: list[str]
    base: str | None  # the run's model.init_from, else model.path (None: neither)
    modules_to_save: list[str] | None = None  # trained whole (None: the family's head)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def run_lora(cfg: Any) -> RunLora | None:
    """The run's LoRA settings; None for a run without (rank 0, or a run folder of before
    `finetune`). Read before `model_config`, which forgets `model.path`."""
    from omegaconf import OmegaConf

    lora = OmegaConf.select(cfg, "finetune.lora")
    if lora is None or not lora.get("rank"):
        return None
    base = OmegaConf.select(cfg, "model.init_from") or OmegaConf.select(cfg, "model.path")
    return RunLora(
        rank=int(lora.rank),
        alpha=float(lora.get("alpha", 16.0)),
        dropout=float(lora.get("dropout", 0.0)),
        targets=[str(t) for t in lora.get("targets", [])],
        base=None if base is None else str(base),
        modules_to_save=_modules_to_save(lora),
    )


def _modules_to_save(lora: Any) -> list[str] | None:
    """The run's `finetune.lora.modules_to_save`: a run of before it trained its adapters alone
    (an empty list)."""
    if "modules_to_save" not in lora:
        return []
    names = lora.modules_to_save
    return None if names is None else [str(n) for n in names]


def build_run_model(model_cfg: Any, data: RunData, lora: RunLora | None = None) -> nn.Module:
    """The run's model, with its LoRA adapters where it trained some (`lora`): its weights
    files hold them beside the base."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dpt.models import build_model

    try:
        model = build_model(model_cfg, tuple(data.input_shape), data.num_classes, task=data.task)
    except (HydraException, OmegaConfBaseException) as error:
        raise DptError(f"cannot build the run's model: {one_line(error)}") from error
    if lora is not None:
        from dpt.models.lora import add_lora

        add_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.modules_to_save)
    return model


def with_base(
    model: nn.Module, state: dict[str, torch.Tensor], lora: RunLora | None, num_outputs: int
) -> dict[str, torch.Tensor]:
    """`state`, and where it is a LoRA run's checkpoint (the adapters alone: the frozen base
    was never saved), the base's weights from the run's `model.init_from` / `model.path`."""
    from dpt.models.lora import is_lora_key

    base_keys = [k for k in model.state_dict() if not is_lora_key(k)]
    if lora is None or all(k in state for k in base_keys):
        return state
    if lora.base is None:
        raise DptError(
            "the weights hold the run's LoRA adapters alone, and its config names no base "
            "weights (model.init_from, model.path) to put them on: use model_best.pt or model.pt"
        )
    from dpt.models.weights import fitting, tied_twins
    from dpt.state.model_state import read_model_state

    key = f"the run's base weights ({lora.base})"
    whole = {**fitting(model, read_model_state(Path(lora.base), key), key, num_outputs), **state}
    for name, twin in tied_twins(model).items():  # a tied copy (GPT's head): its twin's tensor
        if name not in whole and twin in whole:
            whole[name] = whole[twin]
    return whole


def load_state(model: nn.Module, path: Path) -> None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise DptError(
            f"{path} is not a loadable state_dict: {torch_load_reason(error)}"
        ) from error
    load_into(model, state, path)


def load_into(model: nn.Module, state: Any, source: Path | str) -> None:
    """`state` (read from `source`) into the run's model, refused in one line where it does
    not fit."""
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as error:
        raise DptError(
            f"{source} does not fit the model of the run's config: {first_line(error)}"
        ) from error


def pick_device(name: str | None = None) -> torch.device:
    """`name`, or what a run's `trainer.device=auto` takes: CUDA, then MPS, then CPU."""
    import torch

    from dpt.distributed import available_accelerator

    return torch.device(name or available_accelerator())


def run_tokenizer(run_dir: Path, data: RunData) -> Tokenizer:
    """The tokenizer the run trained with: bytes, or its copy of the tokenizers file."""
    from dpt.data.tokenizer import BYTES, ByteTokenizer, FileTokenizer

    described = data.tokenizer or {}
    if described.get("kind", BYTES) == BYTES:
        return ByteTokenizer()
    return FileTokenizer(run_dir / described["file"], "{}")  # the run's own copy, by its path
