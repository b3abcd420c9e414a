"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML files under `dpt/conf/` extend these schemas (`defaults: [/schema/<group>/<name>@_here_]`),
so OmegaConf rejects an unknown key or a value of the wrong type while Hydra composes the config.
Each default lives in one place: a group option's values in its YAML file (the schemas of groups
give types only, `???` until the YAML fills them), `trainer` and `checkpoint`, which have no YAML,
here. Builders take what the config gives them, without defaults of their own.
Ranges that a type cannot express (`trainer.batch_size=0`) are checked by `validate`, which runs
from a Hydra callback before Hydra makes the run folder.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf

from dpt.errors import ConfigError, DptError, one_line


@dataclass
class EarlyStoppingConfig:
    metric: str = "val/loss"
    mode: str = "min"
    patience: int | None = None  # null = off
    min_delta: float = 0.0


@dataclass
class TrainerConfig:
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 64
    seed: int = 0
    log_every_n_steps: int = 10
    device: str = "auto"
    timeout_s: float = 300.0
    precision: str = "32"
    grad_accum_steps: int = 1
    grad_clip_norm: float | None = None
    compile: bool = False
    on_nonfinite: str = "error"
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


@dataclass
class CheckpointConfig:
    enabled: bool = True
    every_n_steps: int | None = None
    keep: int = 3
    resume: str | None = "auto"
    # Keep `model_best.pt` beside `model.pt`: the weights of the epoch with the best watched
    # metric (trainer.early_stopping.metric and .mode); needs validation, else nothing is kept.
    save_best: bool = True
    # Refuse to resume a checkpoint written under another seed, data, model or optimizer kind
    # (dpt/resume_config.py); false: say so, and resume anyway.
    strict: bool = True


@dataclass
class MLPConfig:
    _target_: str = "dpt.models.mlp.MLP"
    hidden_dims: list[int] = MISSING
    # Recompute each block's activations in backward (not passed to `_target_`: see build_model).
    activation_checkpointing: bool = MISSING


# `model.arch` of model=resnet18/resnet50 (checked here, before any process starts).
RESNET_ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101")


@dataclass
class ResNetConfig:
    _target_: str = "dpt.models.resnet.resnet"
    arch: str = MISSING
    weights: str | None = MISSING  # a local state_dict file; nothing is ever downloaded
    channels_last: bool = MISSING
    activation_checkpointing: bool = MISSING


@dataclass
class TorchvisionModelConfig:
    """Any classification model of torchvision's registry, by name (dpt/models/classifiers.py)."""

    _target_: str = "dpt.models.classifiers.torchvision_classifier"
    name: str = MISSING  # torchvision.models.list_models(torchvision.models), e.g. efficientnet_b0
    weights: str | None = MISSING  # a local state_dict file; nothing is ever downloaded
    channels_last: bool = MISSING
    options: dict[str, Any] = MISSING  # more keyword arguments of the builder, e.g. {dropout: 0.3}
    activation_checkpointing: bool = MISSING


@dataclass
class SyntheticConfig:
    _target_: str = "dpt.data.synthetic.SyntheticData"
    num_samples: int = MISSING
    num_val_samples: int = MISSING
    input_dim: int = MISSING
    num_classes: int = MISSING
    num_workers: int = MISSING


@dataclass
class CocoConfig:
    _target_: str = "dpt.data.coco.CocoData"
    root: str = MISSING
    train_split: str = MISSING
    val_split: str | None = MISSING
    label_policy: str = MISSING
    image_size: int = MISSING
    # `${dpt.cores:4}` in the YAML: 4, or fewer on a machine with fewer cores (see `cores_at_most`)
    num_workers: int = MISSING
    on_bad_image: str = MISSING
    train_ann_file: str | None = MISSING
    train_image_dir: str | None = MISSING
    val_ann_file: str | None = MISSING
    val_image_dir: str | None = MISSING


@dataclass
class ImageFolderConfig:
    _target_: str = "dpt.data.image_folder.ImageFolderData"
    root: str = MISSING  # <root>/train/<class>/<images>, and <root>/val/<class>/<images> if any
    val_fraction: float = MISSING  # without <root>/val: this share of train, seeded; 0 = none
    image_size: int = MISSING
    num_workers: int = MISSING
    on_bad_image: str = MISSING


@dataclass
class FakeImagesConfig:
    _target_: str = "dpt.data.fake_images.FakeImages"
    num_samples: int = MISSING
    num_val_samples: int = MISSING
    image_size: int = MISSING
    num_classes: int = MISSING
    num_workers: int = MISSING


# `distributed`: one process per device, started by the launcher. A class variable, not a config
# key: the launcher reads it from the composed config's schema without importing torch.


@dataclass
class SingleConfig:
    _target_: str = "dpt.strategy.Single"
    distributed: ClassVar[bool] = False


@dataclass
class DPConfig:
    _target_: str = "dpt.strategy.DataParallel"
    distributed: ClassVar[bool] = False
    device_ids: list[int] | None = MISSING  # null = every visible GPU


@dataclass
class DDPConfig:
    _target_: str = "dpt.strategy.DDP"
    distributed: ClassVar[bool] = True
    bucket_cap_mb: float = MISSING
    gradient_as_bucket_view: bool = MISSING
    static_graph: bool = MISSING
    find_unused_parameters: bool = MISSING
    comm_hook: str | None = MISSING  # bf16 | fp16: compress gradients for the all-reduce
    sync_batchnorm: bool = MISSING  # BatchNorm statistics over the global batch, not the rank's


@dataclass
class FSDPConfig:
    _target_: str = "dpt.strategy.FSDP"
    distributed: ClassVar[bool] = True
    reshard_after_forward: bool = MISSING
    cpu_offload: bool = MISSING
    reduce_dtype: str = MISSING  # fp32 | bf16: the dtype of the gradient reduce-scatter
    sync_batchnorm: bool = MISSING  # BatchNorm statistics over the global batch, not the rank's


@dataclass
class LocalLauncherConfig:
    _target_: str = "dpt.launch.LocalLauncher"
    # A string so that both `auto` and a number fit; `validate` checks it.
    nproc_per_node: str = MISSING
    max_restarts: int = MISSING


@dataclass
class TorchrunLauncherConfig:
    _target_: str = "dpt.launch.TorchrunLauncher"


@dataclass
class SlurmLauncherConfig:
    """One SLURM job per multirun job, one task per rank (conf/launcher/slurm.yaml passes these
    to Hydra's submitit launcher). They size the allocation of the whole sweep: not sweepable."""

    _target_: str = "dpt.launch.SlurmLauncher"
    nodes: int = MISSING
    tasks_per_node: int = MISSING  # = ranks per node
    gpus_per_node: int | None = MISSING
    cpus_per_task: int | None = MISSING
    mem_gb: int | None = MISSING  # per node
    time: int = MISSING  # minutes
    partition: str | None = MISSING
    sbatch: dict[str, Any] = MISSING  # extra `#SBATCH --key=value` lines
    setup: list[str] = MISSING  # shell lines run before the tasks start
    max_num_timeout: int = MISSING  # times a job that reaches its time limit is requeued


@dataclass
class AdamConfig:
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = MISSING
    momentum: float = MISSING
    weight_decay: float = MISSING
    nesterov: bool = MISSING


@dataclass
class ConstantScheduleConfig:
    _target_: str = "dpt.schedulers.constant"
    _partial_: bool = True


@dataclass
class WarmupCosineConfig:
    _target_: str = "dpt.schedulers.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = MISSING
    min_lr: float = MISSING


@dataclass
class StepScheduleConfig:
    _target_: str = "dpt.schedulers.step"
    _partial_: bool = True
    step_size: int = MISSING
    gamma: float = MISSING


@dataclass
class Config:
    model: Any = MISSING
    dataset: Any = MISSING
    strategy: Any = MISSING
    launcher: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "mlp": MLPConfig,
        "resnet18": ResNetConfig,
        "resnet50": ResNetConfig,
        "torchvision": TorchvisionModelConfig,
    },
    "dataset": {
        "synthetic": SyntheticConfig,
        "coco": CocoConfig,
        "fake_images": FakeImagesConfig,
        "image_folder": ImageFolderConfig,
    },
    "strategy": {
        "single": SingleConfig,
        "dp": DPConfig,
        "ddp": DDPConfig,
        "fsdp": FSDPConfig,
    },
    "launcher": {
        "local": LocalLauncherConfig,
        "torchrun": TorchrunLauncherConfig,
        "slurm": SlurmLauncherConfig,
    },
    "optimizer": {"adam": AdamConfig, "adamw": AdamWConfig, "sgd": SGDConfig},
    "scheduler": {
        "constant": ConstantScheduleConfig,
        "warmup_cosine": WarmupCosineConfig,
        "step": StepScheduleConfig,
    },
}


def is_distributed(strategy: DictConfig) -> bool:
    """Whether the composed `strategy` runs one process per device (its schema says so)."""
    return bool(getattr(OmegaConf.get_type(strategy), "distributed", False))


def cpu_cores() -> int:
    """The cores this process may run on (what DataLoader compares its workers with)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cores_at_most(wanted: int) -> int:
    """`${dpt.cores:N}`: N, or the number of cores where there are fewer (loader workers beyond
    the cores only compete with the ranks, and DataLoader warns about each loader)."""
    return min(int(wanted), cpu_cores())


def register_configs() -> None:
    """Store the schemas under `schema/`, out of sight of the user-facing group listings."""
    OmegaConf.register_new_resolver("dpt.cores", cores_at_most, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def build(node: DictConfig, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate`, with its failures in one line: a DptError from the target
    surfaces as itself, anything else (a target that cannot be found, a constructor that
    rejects its arguments) as a DptError naming the config node, the target and the cause."""
    return build_as(node, node._get_full_key("") or "config", **kwargs)


def build_as(node: DictConfig, group: str, **kwargs: Any) -> Any:
    """`build` for a node made outside the config (its key is not known from it): `group`."""
    from dpt.user_code import locate

    key = f"{group}._target_"
    locate(node._target_, key)  # one line for a target that cannot be imported
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, DptError):
            raise cause from None
        if cause is None:
            raise
        raise DptError(
            f"{key}={node._target_}: {type(cause).__name__}: {one_line(cause)}"
        ) from cause


# --- range checks that types cannot express -------------------------------------------------------

DEVICES = ("auto", "cuda", "mps", "cpu")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
# `strategy.comm_hook`: gradients cast to 16 bits for the all-reduce and back (half the bytes on
# the wire), for worlds whose network, not compute, bounds the step. bf16 keeps fp32's exponent
# range (no overflow); fp16 has 3 more mantissa bits and overflows above 65504.
COMM_HOOK_NAMES = ("bf16", "fp16")
# `strategy.reduce_dtype` of fsdp: bf16 halves the reduce-scatter's bytes, fp32 sums exactly.
REDUCE_DTYPES = ("fp32", "bf16")
# What validation reports (dpt/evaluate.py); `val/acc5` needs 5 classes or more. `val/samples`
# is reported too, but it counts samples: not a metric to stop on.
VAL_METRICS = ("val/loss", "val/acc1", "val/acc5")
# numpy's legacy seeding (np.random.seed in every worker) takes 0 .. 2**32 - 1.
MAX_SEED = 2**32 - 1


def _check(ok: bool, key: str, value: Any, requirement: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {requirement}")


def _check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, value, f"must be one of {', '.join(allowed)}")


def parse_nproc(value: str) -> int | None:
    """`auto` -> None; a positive integer -> itself; anything else -> ConfigError."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"launcher.nproc_per_node={value}: expected 'auto' or a whole number >= 1"
        )
    return int(value)


def validate(cfg: DictConfig) -> None:
    """Reject out-of-range values with a one-line message that names the key."""
    _check_required(cfg)
    _check_known_keys(cfg)
    _validate_trainer(cfg.trainer)
    _validate_checkpoint(cfg.checkpoint)
    _validate_group(cfg.scheduler, "scheduler", SCHEDULER_MINIMUMS)
    _validate_group(cfg.dataset, "dataset", DATASET_MINIMUMS)
    _validate_dataset_choices(cfg.dataset)
    _validate_early_stopping(cfg.trainer.early_stopping, cfg.dataset)
    _validate_optimizer(cfg.optimizer)
    _validate_model(cfg.model)
    _validate_user_targets(cfg)
    if "nproc_per_node" in cfg.launcher:
        parse_nproc(cfg.launcher.nproc_per_node)
    _validate_group(cfg.launcher, "launcher", {"max_restarts": 0})
    _validate_slurm(cfg)
    _validate_group(cfg.strategy, "strategy", {"bucket_cap_mb": 1e-3})
    if cfg.strategy.get("comm_hook") is not None:
        _check_choice("strategy.comm_hook", cfg.strategy.comm_hook, COMM_HOOK_NAMES)
    if OmegaConf.get_type(cfg.strategy) is FSDPConfig:
        _validate_fsdp(cfg.strategy, cfg.trainer)


def _validate_model(model: DictConfig) -> None:
    """What a builder would refuse once the ranks run, said before any process starts."""
    for dim in model.get("hidden_dims", None) or []:
        _check(dim >= 1, "model.hidden_dims", list(model.hidden_dims), "every width must be >= 1")
    schema = OmegaConf.get_type(model)
    if schema is ResNetConfig:
        _check_choice("model.arch", model.arch, RESNET_ARCHS)
    elif schema is TorchvisionModelConfig:
        from dpt.models.classifiers import check_name  # imports torchvision: only for this model

        check_name(model.name)
    if model.get("weights"):
        weights = Path(model.weights)
        _check(weights.is_file(), "model.weights", model.weights, "file not found")


# dpt's own targets and the libraries it names: found without importing them here.
OWN_TARGETS = ("dpt.", "torch.", "torchvision.", "hydra_plugins.")


def _validate_user_targets(cfg: DictConfig) -> None:
    """A user's `_target_` whose module cannot be found: one line now, not a failed rank later."""
    from dpt.user_code import check_importable

    for group in ("model", "dataset"):
        target = cfg[group].get("_target_")
        if isinstance(target, str) and not target.startswith(OWN_TARGETS):
            check_importable(target, f"{group}._target_")


def _validate_fsdp(strategy: DictConfig, trainer: DictConfig) -> None:
    _check_choice("strategy.reduce_dtype", strategy.reduce_dtype, REDUCE_DTYPES)
    # GradScaler's overflow check sees only this rank's gradient shards: ranks could disagree on
    # skipping a step, and their shards of the model would drift apart.
    _check(trainer.precision != "16-mixed", "trainer.precision", trainer.precision,
           "not supported with strategy=fsdp; use bf16-mixed")  # fmt: skip


SCHEDULER_MINIMUMS = {"warmup_steps": 0, "min_lr": 0.0, "step_size": 1, "gamma": 0.0}
DATASET_MINIMUMS = {"num_samples": 1, "input_dim": 1, "num_classes": 2, "num_workers": 0,
                    "num_val_samples": 0, "image_size": 16}  # fmt: skip


def _validate_trainer(t: DictConfig) -> None:
    _check(t.epochs >= 1, "trainer.epochs", t.epochs, "must be >= 1")
    _check(t.max_steps is None or t.max_steps >= 1, "trainer.max_steps", t.max_steps,
           "must be >= 1 or null (run all epochs)")  # fmt: skip
    _check(t.batch_size >= 1, "trainer.batch_size", t.batch_size, "must be >= 1")
    _check(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps,
           "must be >= 1")  # fmt: skip
    _check(0 <= t.seed <= MAX_SEED, "trainer.seed", t.seed,
           f"must be >= 0 and <= {MAX_SEED} (2**32 - 1, numpy's seed range)")  # fmt: skip
    _check_choice("trainer.device", t.device, DEVICES)
    _check(t.timeout_s > 0, "trainer.timeout_s", t.timeout_s, "must be > 0")
    _check_choice("trainer.precision", t.precision, PRECISIONS)
    _check(t.grad_accum_steps >= 1, "trainer.grad_accum_steps", t.grad_accum_steps, "must be >= 1")
    _check(t.grad_clip_norm is None or t.grad_clip_norm > 0, "trainer.grad_clip_norm",
           t.grad_clip_norm, "must be > 0 or null (no clipping)")  # fmt: skip
    _check_choice("trainer.on_nonfinite", t.on_nonfinite, ("error", "skip"))
    es = t.early_stopping
    _check_choice("trainer.early_stopping.mode", es.mode, ("min", "max"))
    _check(es.patience is None or es.patience >= 1, "trainer.early_stopping.patience",
           es.patience, "must be >= 1 or null (off)")  # fmt: skip


def _validate_early_stopping(es: DictConfig, dataset: DictConfig) -> None:
    """The metric must be one validation reports for this dataset, and there must be validation
    at all when early stopping is on (otherwise the first epoch end would fail)."""
    _check_choice("trainer.early_stopping.metric", es.metric, VAL_METRICS)
    if es.patience is None:
        return  # off: the metric is never read
    no_val = _no_validation(dataset)
    _check(no_val is None, "trainer.early_stopping.patience", es.patience,
           f"early stopping needs validation metrics, and {no_val} gives none")  # fmt: skip
    classes = dataset.get("num_classes")  # COCO's count is only known from its annotation file
    _check(es.metric != "val/acc5" or classes is None or classes >= 5,
           "trainer.early_stopping.metric", es.metric,
           f"needs dataset.num_classes >= 5 (it is {classes}); use val/acc1")  # fmt: skip


def _no_validation(dataset: DictConfig) -> str | None:
    """The setting that leaves this dataset without a validation split, or None."""
    if dataset.get("num_val_samples", 1) == 0:
        return "dataset.num_val_samples=0"
    if dataset.get("val_fraction", None) == 0 and not (Path(dataset.root) / "val").is_dir():
        return "dataset.val_fraction=0 (with no <root>/val folder)"
    if "val_split" in dataset and dataset.val_split is None:
        return "dataset.val_split=null"
    return None


def _validate_optimizer(opt: DictConfig) -> None:
    """What torch's optimizers check in their constructors, reported before any rank starts."""
    _validate_group(opt, "optimizer", {"lr": 0.0, "weight_decay": 0.0, "momentum": 0.0})
    if "betas" in opt:
        betas = list(opt.betas)
        _check(len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas), "optimizer.betas", betas,
               "must be two numbers [beta1, beta2], each >= 0 and < 1")  # fmt: skip
    if opt.get("nesterov"):
        _check(opt.momentum > 0, "optimizer.nesterov", "true",
               f"needs optimizer.momentum > 0 (it is {opt.momentum:g})")  # fmt: skip


def _validate_checkpoint(ck: DictConfig) -> None:
    if ck.resume not in (None, "auto"):  # fail before any worker starts
        path = Path(ck.resume)
        _check(path.exists(), "checkpoint.resume", ck.resume, "folder not found")
        _check(path.is_dir(), "checkpoint.resume", ck.resume,
               "not a checkpoint folder (<run>/checkpoints/step-<8 digits>)")  # fmt: skip
    _check(ck.every_n_steps is None or ck.every_n_steps >= 1, "checkpoint.every_n_steps",
           ck.every_n_steps, "must be >= 1 or null (only at epoch ends)")  # fmt: skip
    _check(ck.keep >= 1, "checkpoint.keep", ck.keep, "must be >= 1")


def _validate_dataset_choices(dataset: DictConfig) -> None:
    for key, allowed in (
        ("label_policy", ("first", "largest")),
        ("on_bad_image", ("skip", "error")),
    ):
        if key in dataset:
            _check(
                dataset[key] in allowed,
                f"dataset.{key}",
                dataset[key],
                f"must be one of {', '.join(allowed)}",
            )
    if "root" in dataset:
        root = dataset.root
        _check(Path(root).is_dir(), "dataset.root", root, "folder not found")
    if OmegaConf.get_type(dataset) is ImageFolderConfig:
        from dpt.data.folder_layout import check_layout  # no torch: a bad layout answers fast

        check_layout(dataset.root, dataset.val_fraction)


def _validate_slurm(cfg: DictConfig) -> None:
    if OmegaConf.get_type(cfg.launcher) is not SlurmLauncherConfig:
        return
    _validate_group(
        cfg.launcher,
        "launcher",
        {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 1, "mem_gb": 1},
    )
    _validate_group(cfg.launcher, "launcher", {"time": 1, "max_num_timeout": 0})
    # `python train.py launcher=slurm` (no -m) would train right here, not on the cluster.
    if OmegaConf.select(cfg, "hydra.mode") == RunMode.RUN:
        raise ConfigError(
            "launcher=slurm submits jobs through Hydra's multirun: add -m "
            "(python train.py -m launcher=slurm ...)"
        )


def _check_required(cfg: DictConfig) -> None:
    """`???` values the user must set (e.g. dataset.root); Hydra's own node is not ours."""
    for group in cfg:
        node = cfg[group]
        if group == "hydra" or not isinstance(node, DictConfig):
            continue
        missing = sorted(OmegaConf.missing_keys(node))
        if missing:
            key = missing[0]  # already the full key
            raise ConfigError(f"{key}: required, set it with {key}=...")


def _check_known_keys(cfg: DictConfig) -> None:
    """`+trainer.typo=1` slips past the schema (`+` may add keys); an unused key is still a typo."""
    groups = ("trainer", "checkpoint", *SCHEMAS)
    for path, node in [("", cfg), *((f"{name}.", cfg[name]) for name in groups)]:
        schema = OmegaConf.get_type(node)
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            continue
        allowed = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in allowed and key != "hydra":
                names = ", ".join(a for a in allowed if not a.startswith("_"))
                raise ConfigError(f"{path}{key}: unknown key; allowed keys: {names}")


def _validate_group(node: DictConfig, group: str, minimums: dict[str, float]) -> None:
    for key, minimum in minimums.items():
        if key in node and node[key] is not None:
            _check(node[key] >= minimum, f"{group}.{key}", node[key], f"must be >= {minimum:g}")
