"""Checks of a composed config that its types cannot express (`trainer.batch_size=0`, a data
set's folder layout, a model name torchvision does not know), each a one-line ConfigError that
names the key. Run by the launching process before any rank starts: from a Hydra callback
before Hydra makes the run folder (dpt.launch.hydra_callbacks), and again per multirun job.
"""

from __future__ import annotations

import dataclasses
from importlib.resources import files
from pathlib import Path
from typing import Any

from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

from dpt.config.checks import check_of
from dpt.config.datasets import (
    ChatConfig,
    CustomDatasetConfig,
    ImageFolderConfig,
    RecordsConfig,
    ShardsConfig,
    TextConfig,
    declared_targets,
    no_validation,
)
from dpt.config.launchers import SlurmLauncherConfig
from dpt.config.models import HFModelConfig, TorchvisionModelConfig, check_model_folder
from dpt.config.store import SCHEMAS
from dpt.config.strategies import (
    INTERLEAVED,
    DDPConfig,
    FSDPConfig,
    PipelineConfig,
    TensorParallel,
    data_degree,
    is_distributed,
    pipeline_replicas,
)
from dpt.config.tasks import CLASSIFICATION, CUSTOM, task_higher_is_better, task_kind, val_metrics
from dpt.config.tensor_parallel import check_tensor_parallel
from dpt.config.trainer import objectives
from dpt.data.tokenizer import BYTES, RUN_FILE, tokenizer_file
from dpt.errors import ConfigError, options_with
from dpt.launch.logger_checks import check_loggers
from dpt.tasks import fit
from dpt.user_code import check_importable, check_moved


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
    """Reject out-of-range values with a one-line message that names the key: each key's own
    check (its schema's field says it: dpt.config.checks), then the keys that relate."""
    _validate_windows(cfg.dataset, cfg.model)  # first: its interpolation fails without a GPT
    _check_required(cfg)
    _check_known_keys(cfg)
    for group in ("trainer", "checkpoint", "monitor", "scheduler", "dataset", "finetune"):
        check_fields(cfg[group], group)
    _validate_checkpoint(cfg.checkpoint)
    _validate_monitor(cfg.monitor, cfg.checkpoint)
    if OmegaConf.get_type(cfg.model) is HFModelConfig and cfg.model.get("path"):
        check_model_folder(cfg.model.path)  # before the tokenizer that defaults to it
    _validate_dataset_paths(cfg.dataset)
    _validate_outage(cfg.dataset, cfg.trainer, cfg.strategy)
    _validate_task(cfg.task, cfg.dataset, cfg.model)
    _validate_early_stopping(cfg.trainer.early_stopping, cfg.dataset, cfg.task)
    _validate_objective(cfg.sweep.objective, cfg.dataset, cfg.task)
    _validate_optimizer(cfg.optimizer)
    _validate_model(cfg.model)
    _validate_user_targets(cfg)
    _validate_launcher(cfg)
    check_fields(cfg.strategy, "strategy")
    _validate_tensor_parallel(cfg)
    check_fields(cfg.logger, "logger")
    check_loggers(cfg)
    if OmegaConf.get_type(cfg.strategy) is FSDPConfig:
        _validate_fsdp(cfg.trainer)
    if OmegaConf.get_type(cfg.strategy) is PipelineConfig:
        _validate_pipeline(cfg.strategy, cfg.trainer, _world_size(cfg.launcher))
        # Its schedule takes each micro-batch's mean loss, and its stages token ids alone.
        _check(OmegaConf.get_type(cfg.dataset) is not ChatConfig, "strategy", "pipeline",
               "dataset=chat is not trained in pipeline stages yet (its loss weighs answer "
               "tokens across micro-batches, its packed windows carry positions); use ddp or "
               "fsdp")  # fmt: skip


def check_fields(node: Any, path: str) -> None:
    """Each key's own check, as its schema's field says it (`dpt.config.checks`), in the order
    of the fields, typed sub-nodes too (`trainer.early_stopping`); null always passes."""
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return
    for spec in dataclasses.fields(schema):
        if spec.name not in node:
            continue
        if isinstance(node._get_node(spec.name), DictConfig):
            check_fields(node[spec.name], f"{path}.{spec.name}")
            continue
        check, value = check_of(schema, spec.name), node[spec.name]
        if check is not None and value is not None and not check.ok(value):
            shown = f"[{','.join(map(str, value))}]" if isinstance(value, ListConfig) else value
            raise ConfigError(f"{path}.{spec.name}={shown}: {check.says}")


def _validate_launcher(cfg: DictConfig) -> None:
    if "nproc_per_node" in cfg.launcher:
        parse_nproc(cfg.launcher.nproc_per_node)
    check_fields(cfg.launcher, "launcher")
    _validate_slurm(cfg)


def _validate_windows(dataset: DictConfig, model: DictConfig) -> None:
    """A text's windows must fit the model's longest sequence (dataset=text, model=gpt)."""
    if OmegaConf.get_type(dataset) not in (TextConfig, ChatConfig):
        return
    if OmegaConf.select(dataset, "block_size", throw_on_resolution_failure=False) is None:
        raise ConfigError(
            "dataset.block_size: it reads model.block_size, which this model does not have; "
            "set dataset.block_size=N (tokens a sample trains on)"
        )
    _check(dataset.block_size >= 1, "dataset.block_size", dataset.block_size, "must be >= 1")
    longest = model.get("block_size")
    _check(longest is None or dataset.block_size <= longest, "dataset.block_size",
           dataset.block_size, f"longer than model.block_size={longest}")  # fmt: skip


def _validate_model(model: DictConfig) -> None:
    """What a builder would refuse once the ranks run, said before any process starts."""
    if model.get("n_embd") is not None and model.get("n_head"):
        _check(model.n_embd % model.n_head == 0, "model.n_embd", model.n_embd,
               f"must be a multiple of model.n_head={model.n_head}")  # fmt: skip
    for dim in model.get("hidden_dims", None) or []:
        _check(dim >= 1, "model.hidden_dims", list(model.hidden_dims), "every width must be >= 1")
    check_fields(model, "model")
    if OmegaConf.get_type(model) is TorchvisionModelConfig:
        from dpt.models.classifiers import check_name  # imports torchvision: only for this model

        check_name(model.name)
    if model.get("weights"):
        weights = Path(model.weights)
        _check(weights.is_file(), "model.weights", model.weights, "file not found")


# dpt's own targets and the libraries it names: found without importing them here.
OWN_TARGETS = ("dpt.", "torch.", "torchvision.", "hydra_plugins.")


def _validate_user_targets(cfg: DictConfig) -> None:
    """A `_target_` of dpt's earlier layout, or a user's whose module cannot be found: one line
    now, not a failed rank later."""
    for group in SCHEMAS:
        target = cfg[group].get("_target_")
        if not isinstance(target, str):
            continue
        check_moved(target, f"{group}._target_")
        if group in ("model", "dataset", "task") and not target.startswith(OWN_TARGETS):
            check_importable(target, f"{group}._target_")
    for key, target in _nested_targets(cfg):
        if not target.startswith(OWN_TARGETS):
            check_importable(target, key)


def _nested_targets(cfg: DictConfig) -> list[tuple[str, str]]:
    """The `_target_`s of yours inside dpt's options: dataset=custom's data sets, task=custom's
    loss and metrics."""
    nodes = {"dataset.train": cfg.dataset.get("train"), "dataset.val": cfg.dataset.get("val"),
             "task.loss": cfg.task.get("loss")}  # fmt: skip
    if isinstance(cfg.task.get("metrics"), DictConfig):
        nodes |= {f"task.metrics.{name}": node for name, node in cfg.task.metrics.items()}
    return [(f"{key}._target_", node._target_) for key, node in nodes.items()
            if isinstance(node, DictConfig) and isinstance(node.get("_target_"), str)]  # fmt: skip


def _validate_fsdp(trainer: DictConfig) -> None:
    # GradScaler's overflow check sees only this rank's gradient shards: ranks could disagree on
    # skipping a step, and their shards of the model would drift apart.
    _check(trainer.precision != "16-mixed", "trainer.precision", trainer.precision,
           "not supported with strategy=fsdp; use bf16-mixed")  # fmt: skip


def _validate_tensor_parallel(cfg: DictConfig) -> None:
    """The model's plan and widths, and the world's split, where strategy.tensor_parallel > 1."""
    degree = int(cfg.strategy.get("tensor_parallel", 1))
    if degree == 1:
        return
    check_tensor_parallel(cfg.model, degree)
    _check_ddp_keys_unset(cfg.strategy, degree)
    world = _world_size(cfg.launcher)
    if world is not None:
        data_degree(world, degree, int(cfg.strategy.get("stages", 1)))
    _check(not cfg.finetune.lora.rank, "finetune.lora.rank", cfg.finetune.lora.rank,
           "LoRA's adapters are not split over strategy.tensor_parallel ranks yet; use ddp or "
           "fsdp without it")  # fmt: skip
    # GradScaler's overflow check would see this rank's slices of the gradients alone.
    _check(cfg.trainer.precision != "16-mixed", "trainer.precision", cfg.trainer.precision,
           "not supported with strategy.tensor_parallel; use bf16-mixed")  # fmt: skip


def _check_ddp_keys_unset(strategy: DictConfig, degree: int) -> None:
    """DDP does not wrap a model split over tensor-parallel ranks (its replicas' gradients are
    averaged in dpt's own buckets, of `bucket_cap_mb`): any other DDP key set away from its
    default would be ignored."""
    if OmegaConf.get_type(strategy) is not DDPConfig:
        return
    defaults = OmegaConf.load(files("dpt.conf").joinpath("strategy", "ddp.yaml"))
    tensor_keys = {f.name for f in dataclasses.fields(TensorParallel)} | {"bucket_cap_mb"}
    for field in dataclasses.fields(DDPConfig):
        key = field.name
        if key.startswith("_") or key in tensor_keys or strategy[key] == defaults[key]:
            continue
        shown = OmegaConf.to_yaml({key: strategy[key]}).strip().split(": ", 1)[1]
        raise ConfigError(
            f"strategy.{key}={shown}: DDP does not wrap a model split over "
            f"strategy.tensor_parallel={degree} (its replicas' gradients are averaged in dpt's "
            "own buckets), so this would be ignored; remove it or use strategy.tensor_parallel=1"
        )


def _validate_pipeline(p: DictConfig, trainer: DictConfig, world: int | None) -> None:
    _check(trainer.batch_size % p.microbatches == 0, "strategy.microbatches", p.microbatches,
           f"does not divide trainer.batch_size={trainer.batch_size} (each replica's batch); "
           f"use a divisor of {trainer.batch_size}")  # fmt: skip
    _check(p.schedule == "gpipe" or p.microbatches >= p.stages, "strategy.microbatches",
           p.microbatches, f"strategy.schedule={p.schedule} needs at least one micro-batch per "
           f"stage (strategy.stages={p.stages})")  # fmt: skip
    interleaved = p.schedule == INTERLEAVED
    _check(p.stages_per_rank >= 2 if interleaved else p.stages_per_rank == 1,
           "strategy.stages_per_rank", p.stages_per_rank,
           "must be >= 2 with strategy.schedule=interleaved_1f1b" if interleaved else
           "more than one stage per rank needs strategy.schedule=interleaved_1f1b")  # fmt: skip
    if interleaved:
        _check(p.microbatches % p.stages == 0, "strategy.microbatches", p.microbatches,
               f"interleaved_1f1b runs rounds of strategy.stages={p.stages} micro-batches; "
               f"use a multiple of {p.stages}")  # fmt: skip
    if world is not None:
        pipeline_replicas(p.stages, world, int(p.tensor_parallel))
    # The loss scale's overflow check would need agreeing over the stages.
    _check(trainer.precision != "16-mixed", "trainer.precision", trainer.precision,
           "not supported with strategy=pipeline; use bf16-mixed")  # fmt: skip
    _check(not trainer.compile, "trainer.compile", trainer.compile,
           "not supported with strategy=pipeline yet (its stages run eagerly)")  # fmt: skip


def _world_size(launcher: DictConfig) -> int | None:
    """The world's size where the config alone says it: a number of local processes, or a
    SLURM job's nodes x tasks; None where it is known only at start (`auto`, torchrun)."""
    nproc = str(launcher.get("nproc_per_node", ""))
    if "nodes" in launcher and "tasks_per_node" in launcher:
        return int(launcher.nodes) * int(launcher.tasks_per_node)
    return int(nproc) if nproc.isdigit() else None


def _validate_early_stopping(es: DictConfig, dataset: DictConfig, task: DictConfig) -> None:
    """The metric must be one validation reports for this task, and there must be validation
    at all when early stopping is on (otherwise the first epoch end would fail)."""
    _check_choice("trainer.early_stopping.metric", es.metric, val_metrics(task))
    if es.patience is None:
        return  # off: the metric is never read
    no_val = no_validation(dataset)
    _check(no_val is None, "trainer.early_stopping.patience", es.patience,
           f"early stopping needs validation metrics, and {no_val} gives none")  # fmt: skip
    _check_top5_classes("trainer.early_stopping.metric", es.metric, dataset)


def _validate_objective(name: str, dataset: DictConfig, task: DictConfig) -> None:
    """A validation metric needs validation; `auto` falls back to the train loss by itself."""
    _check_choice("sweep.objective", name, objectives(task))
    if name.startswith("val/"):
        missing = no_validation(dataset)
        _check(missing is None, "sweep.objective", name,
               f"needs validation metrics, and {missing} gives none; use train/loss")  # fmt: skip
        _check_top5_classes("sweep.objective", name, dataset)


def _check_top5_classes(key: str, metric: str, dataset: DictConfig) -> None:
    """val/acc5 needs 5 classes or more (every class is in the top 5 otherwise)."""
    classes = dataset.get("num_classes")  # COCO's count is only known from its annotation file
    _check(metric != "val/acc5" or classes is None or classes >= 5, key, metric,
           f"needs dataset.num_classes >= 5 (it is {classes}); use val/acc1")  # fmt: skip


def _validate_task(task: DictConfig, dataset: DictConfig, model: DictConfig) -> None:
    """The task's own keys, and whether it fits what dpt's own data sets and models give (a
    data set or model of yours is built first: dpt.launch.preflight)."""
    kind = task_kind(task)
    check_fields(task, "task")
    _check_choice("task.watch", task.watch, val_metrics(task))
    _check_watch_mode(task)
    if "pos_weight" in task:
        _check_pos_weight(task.pos_weight)
    if kind == CUSTOM:
        _validate_custom_task(task)
    if kind == CLASSIFICATION and OmegaConf.get_type(dataset) is CustomDatasetConfig:
        _check(dataset.num_classes is not None, "dataset.num_classes", "null",
               "task=classification needs the number of classes (labels 0 .. N-1)")  # fmt: skip
    declared = declared_targets(dataset)
    if declared is not None and is_own_model(model) and kind != CUSTOM:
        fit.check(kind, declared, None, 0)  # dpt's model gives what the task needs


def _check_watch_mode(task: DictConfig) -> None:
    """A built-in metric watched the wrong way round would keep the worst epoch's weights."""
    if task_kind(task) == CUSTOM:
        return
    better = task_higher_is_better(task, task.watch)
    way, right = ("higher", "max") if better else ("lower", "min")
    _check(task.mode == right, "task.mode", task.mode,
           f"{task.watch} is better {way}; set task.mode={right}")  # fmt: skip


def _check_pos_weight(value: Any) -> None:
    weights = list(value) if isinstance(value, ListConfig) else [value]
    _check(value is None or all(isinstance(w, int | float) and w > 0 for w in weights),
           "task.pos_weight", value, "must be null, a number > 0, or a list of numbers > 0 "
           "(one per target column)")  # fmt: skip


def _validate_custom_task(task: DictConfig) -> None:
    for name, node in (task.metrics or {}).items():
        _check(isinstance(node, DictConfig) and isinstance(node.get("_target_"), str),
               f"task.metrics.{name}", node,
               "must be a node with a _target_ (a Metric class) and its keys")  # fmt: skip


def is_own_model(model: DictConfig) -> bool:
    """One of dpt's models: built to give the outputs the task asks for."""
    return str(model.get("_target_", "")).startswith("dpt.models.")


def _validate_optimizer(opt: DictConfig) -> None:
    """What torch's optimizers check in their constructors, reported before any rank starts."""
    check_fields(opt, "optimizer")
    for i, group in enumerate(opt.get("groups") or []):
        check_fields(group, f"optimizer.groups[{i}]")
    if "betas" in opt:
        betas = list(opt.betas)
        _check(len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas), "optimizer.betas", betas,
               "must be two numbers [beta1, beta2], each >= 0 and < 1")  # fmt: skip
    if opt.get("nesterov"):
        _check(opt.momentum > 0, "optimizer.nesterov", "true",
               f"needs optimizer.momentum > 0 (it is {opt.momentum:g})")  # fmt: skip


def _validate_checkpoint(ck: DictConfig) -> None:
    if ck.resume not in (None, "auto", "never"):  # fail before any worker starts
        path = Path(ck.resume)
        _check(path.exists(), "checkpoint.resume", ck.resume, "folder not found")
        _check(path.is_dir(), "checkpoint.resume", ck.resume,
               "not a checkpoint folder (<run>/checkpoints/step-<8 digits>)")  # fmt: skip


def _validate_monitor(monitor: DictConfig, checkpoint: DictConfig) -> None:
    for name in ("loss_spike", "grad_spike", "nonfinite", "slowdown"):
        node = monitor[name]
        if "window" in node:
            _check(node.warmup <= node.window, f"monitor.{name}.warmup", node.warmup,
                   f"must be <= monitor.{name}.window ({node.window})")  # fmt: skip
        if node.action == "rollback":
            _check(checkpoint.enabled, f"monitor.{name}.action", node.action,
                   "needs checkpoints to return to (checkpoint.enabled=true)")  # fmt: skip


def _validate_outage(dataset: DictConfig, trainer: DictConfig, strategy: DictConfig) -> None:
    """A rank waiting out a source's outage keeps the others waiting in the step's collective:
    they must not give up on it first (trainer.timeout_s)."""
    if OmegaConf.get_type(dataset) is not ShardsConfig:
        return
    fraction = dataset.max_skipped_fraction
    _check(fraction <= 1, "dataset.max_skipped_fraction", fraction,
           "must be <= 1 (a share of an epoch's samples)")  # fmt: skip
    longest = dataset.outage_s + dataset.timeout_s  # the last try may hang for timeout_s
    if is_distributed(strategy) and longest >= trainer.timeout_s:
        raise ConfigError(
            f"dataset.outage_s={dataset.outage_s:g}: with dataset.timeout_s={dataset.timeout_s:g} "
            f"it must stay below trainer.timeout_s={trainer.timeout_s:g}, how long the other "
            "ranks wait for a rank's data before they give up on it"
        )


def _validate_dataset_paths(dataset: DictConfig) -> None:
    if OmegaConf.get_type(dataset) is ShardsConfig:
        _validate_shards_root(dataset.root)
    elif OmegaConf.get_type(dataset) in (TextConfig, ChatConfig, RecordsConfig):  # file or folder
        _check(Path(dataset.root).exists(), "dataset.root", dataset.root, "no such file or folder")
        tokenizer = dataset.tokenizer
        found = tokenizer in (None, BYTES) or tokenizer_file(tokenizer).is_file()
        missing = f"file not found, nor a folder with {RUN_FILE} (or bytes: UTF-8 bytes, 256 ids)"
        _check(found, "dataset.tokenizer", tokenizer, missing)
    elif "root" in dataset:
        root = dataset.root
        _check(Path(root).is_dir(), "dataset.root", root, "folder not found")
    if OmegaConf.get_type(dataset) is ImageFolderConfig:
        from dpt.data.folder_layout import check_layout  # no torch: a bad layout answers fast

        check_layout(dataset.root, dataset.val_fraction)


def _validate_shards_root(root: str) -> None:
    """A local root must hold dpt-shards' index; a URL is only read by the ranks (one line
    there if it cannot be had: dpt.data.shards.read_index)."""
    from dpt.data.shard_fetch import is_local, local_path  # stdlib only: no torch here

    if not is_local(root):
        return
    folder = local_path(root)
    _check(folder.is_dir(), "dataset.root", root, "folder not found")
    _check((folder / "index.json").is_file(), "dataset.root", root,
           "no index.json here: write shards with dpt-shards --out <folder>")  # fmt: skip


def _validate_slurm(cfg: DictConfig) -> None:
    if OmegaConf.get_type(cfg.launcher) is not SlurmLauncherConfig:
        return
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
    groups = ("trainer", "checkpoint", "monitor", "sweep", *SCHEMAS)
    for name in groups:
        _check_node_keys(f"{name}.", cfg[name])
    _check_node_keys("", cfg, nested=False)


def _check_node_keys(path: str, node: Any, nested: bool = True) -> None:
    """The keys of a schema-typed node, and of its typed sub-nodes (monitor.loss_spike.typo)."""
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return
    allowed = [f.name for f in dataclasses.fields(schema)]
    for key in node:
        if key not in allowed and key != "hydra":
            names = ", ".join(a for a in allowed if not a.startswith("_"))
            hint = f"allowed keys: {names}" if names else "this option takes no keys"
            raise ConfigError(f"{path}{key}: unknown key; {hint}{options_with(f'{path}{key}')}")
        if nested:
            _check_node_keys(f"{path}{key}.", node._get_node(key))
