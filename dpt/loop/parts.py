"""The rank boundary: the resolved config becomes typed settings once, and the run's parts are
built from it here (data, model, strategy, optimizer, schedule, precision, metrics, agreement,
validation, early stopping). The trainer receives them built; defaults live in `dpt.config`."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpt.config.build import build, build_as
from dpt.config.finetune import FinetuneConfig
from dpt.config.models import INIT_KEY, HFModelConfig
from dpt.config.monitor import MonitorConfig
from dpt.config.optim import FUSED_KEY, GROUP_KEYS
from dpt.config.tasks import CLASSIFICATION, LANGUAGE_MODEL, task_kind
from dpt.config.trainer import CheckpointConfig, TrainerConfig
from dpt.contract import DataModule, input_dtype, output_names, targets_of, val_transform_node
from dpt.data.batch_memory import check_batch_fits
from dpt.data.loaders import Loaders, ToDevice, build_loaders
from dpt.distributed import DistEnv
from dpt.errors import DptError
from dpt.loggers import ONCE_LOGGER_NAME
from dpt.loop import finetuning
from dpt.loop.agreement import Agreement
from dpt.loop.early_stopping import EarlyStopping
from dpt.loop.evaluate import Validation
from dpt.loop.optimizers import fused_fits
from dpt.loop.param_groups import check_groups, param_groups
from dpt.loop.precision import Precision
from dpt.loop.strategy import Strategy
from dpt.models import bare_name, build_model, token_flops, unwrap
from dpt.models.families import family_of
from dpt.models.lora import init_lora, is_lora_key
from dpt.models.meta import output_shape
from dpt.models.weights import fit_state, fitting
from dpt.monitor.grad_diagnostics import GradDiagnostics
from dpt.monitor.monitor import Monitor
from dpt.observe.console import count
from dpt.observe.dashboard import TbPlace, one_run
from dpt.observe.flops import Throughput, peak_tflops
from dpt.observe.logs import setup_logging
from dpt.observe.memory import MemoryUse
from dpt.observe.metrics import MetricsLogger
from dpt.seeding import seed_everything
from dpt.state.best_model import BestModel
from dpt.state.checkpoint import Checkpoints
from dpt.state.model_state import model_shapes, read_model_state
from dpt.state.results import CHAT_FORMAT_FILE, HF_CONFIG_FILE, RunData
from dpt.state.sharded_load import load_shards, materialize, safetensors_folder
from dpt.tasks import fit
from dpt.tasks.task import Task, build_task

T = TypeVar("T")
HF_TARGET = HFModelConfig._target_
once = logging.getLogger(ONCE_LOGGER_NAME)  # what every rank says alike: rank 0 says it


@dataclass
class RunConfig:
    """The worker's config: typed settings, plus the group nodes that `build` instantiates."""

    trainer: TrainerConfig
    checkpoint: CheckpointConfig
    monitor: MonitorConfig
    finetune: FinetuneConfig
    groups: DictConfig  # model, dataset, strategy, optimizer, scheduler: `_target_` nodes
    yaml: str  # the whole resolved config, stored in checkpoints

    @classmethod
    def of(cls, cfg: DictConfig) -> RunConfig:
        return cls(_typed(TrainerConfig, cfg.trainer), _typed(CheckpointConfig, cfg.checkpoint),
                   _typed(MonitorConfig, cfg.monitor), finetuning.settings_of(cfg), cfg,
                   OmegaConf.to_yaml(cfg))  # fmt: skip


def _tensorboard_flush(cfg: DictConfig) -> float | None:
    """logger.tensorboard.flush_s; None where `logger=[...]` leaves tensorboard out."""
    return OmegaConf.select(cfg, "logger.tensorboard.flush_s")


def _typed(schema: type[T], node: DictConfig) -> T:
    # Resolved in place first: an interpolation (monitor.nonfinite.action) reads the whole config.
    values = OmegaConf.to_container(node, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))  # type: ignore[return-value]


@dataclass
class Parts:
    settings: TrainerConfig
    checkpoint_settings: CheckpointConfig  # `checkpoints` below is what writes them
    env: DistEnv
    run_dir: Path
    strategy: Strategy
    task: Task
    throughput: Throughput | None  # tokens/s and MFU: a task of tokens
    loaders: Loaders
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    to_device: ToDevice
    metrics: MetricsLogger
    agreement: Agreement
    monitor: Monitor
    diagnostics: GradDiagnostics
    validation: Validation
    early_stopping: EarlyStopping
    best_model: BestModel
    run_data: RunData  # what dpt-predict needs: class names, input shape, validation transform
    run_files: dict[str, bytes]  # kept beside data.json: a language model's tokenizers file
    total_steps: int
    global_batch: int
    checkpoints: Checkpoints
    trainable: str  # `2,048 of 96,512 parameters train (2.1 %)`: the start line's
    # A LoRA run: checkpoints hold the adapters (and their optimizer state) alone.
    adapter_only: bool = False
    # Targets that leave positions out (dataset=chat): the loss weighs micro-batches and ranks
    # by their scored positions (Trainer.scored_shares).
    masked_targets: bool = False
    # A data set's `max_skipped_fraction` of an epoch's samples (dataset=shards): more samples
    # skipped in one epoch stop the run. None: no bound.
    max_skipped: int | None = None

    @property
    def checkpoint_every(self) -> int:
        ck = self.checkpoint_settings
        return (ck.every_n_steps or 0) if ck.enabled else 0


def build_parts(
    cfg: RunConfig, env: DistEnv, run_dir: Path, log_file: Path, tb: TbPlace | None = None
) -> Parts:
    """`tb`: where TensorBoard's folders go (the launching process's `job_place.place`); a
    run of its own by default."""
    t, groups = cfg.trainer, cfg.groups
    seed_everything(t.seed)
    data, shuffle = build_data(groups.dataset, t.seed)
    check_batch_fits(data.input_shape, t.batch_size, groups.dataset)  # before anything allocates
    task = build_data_task(groups.task, data)
    strategy: Strategy = build(groups.strategy)
    worker_init = functools.partial(_init_loader_worker, env.rank, log_file)
    loaders = build_loaders(data, strategy.data_env(env), t.batch_size, t.seed, worker_init,
                            shuffle, task.targets, val_env=strategy.val_env(env))  # fmt: skip
    torch.manual_seed(t.seed)  # identical initial weights on every rank, every strategy
    shards_from = sharded_source(groups.model, strategy, env)  # no whole copy on any rank
    with torch.device("meta") if shards_from else contextlib.nullcontext():
        model = build_model(groups.model, data.input_shape, task.num_outputs, t.compile, task.kind)
    if shards_from is None:
        initial_weights(groups.model, model, task.num_outputs)
    _pad_as_the_data(model, data, task.kind)
    finetuning.adapt(model, cfg.finetune)  # before the strategy: DDP sees what trains
    trainable = finetuning.trainable_text(model)  # the whole model (a pipeline stage: a part)
    task.check(output_shape(model, data.input_shape, input_dtype(data)))  # before any step
    throughput = token_throughput(task, model, t, env)
    # What each tensor is read from: named by the model before the strategy wraps it (FSDP2's
    # class of its own is not the one transformers knows the saved names of).
    pretrained = groups.model.get(INIT_KEY) is None  # model.path's folder, not model.init_from
    reads = sharded_reads(model, shards_from, task.num_outputs, pretrained) if shards_from else {}
    strategy.split_logits = task.loss_on_split_logits  # under tensor parallelism: left split
    strategy.sample_input = (tuple(data.input_shape), input_dtype(data))
    model = strategy.wrap(model if shards_from else model.to(env.device), env, t.precision)
    if shards_from is not None:
        materialize(model, env.device)
        load_shards(model, shards_from, reads)
        _init_fresh(model, set(reads))  # as one process draws them
        init_lora(model)  # materialized by transformers' init: the adapters' own, anew
    if strategy.tensor_parallel > 1:  # the whole model's count, and the rank's own share
        trainable += finetuning.on_this_rank(model, strategy.tensor_parallel)
    if t.compile:
        model = torch.compile(model)
    optimizer = build_optimizer(groups.optimizer, model)
    total_steps = planned_steps(loaders, t, env.world_size)
    check_log_interval(t.log_every_n_steps, total_steps)
    scheduler = build(groups.scheduler)(optimizer, total_steps=total_steps)
    precision = Precision(t.precision, env.device, strategy.grad_norm)
    to_device = ToDevice(env.device, bool(groups.model.get("channels_last", False)))
    task = task.to(env.device)
    strategy.attach(task.loss, precision.autocast, to_device, t.grad_accum_steps)
    monitor = Monitor(cfg.monitor, run_dir, env.is_main, clipping=t.grad_clip_norm is not None,
                      sharded_norm=strategy.shards_gradients and env.distributed)  # fmt: skip
    return Parts(
        settings=t, checkpoint_settings=cfg.checkpoint, env=env, run_dir=run_dir, strategy=strategy,
        task=task, throughput=throughput, loaders=loaders, model=model,
        optimizer=optimizer, scheduler=scheduler, precision=precision, to_device=to_device,
        metrics=MetricsLogger(tb or one_run(run_dir), env, total_steps,
                              _rank_scalars(MemoryUse(model, optimizer), strategy), throughput,
                              copies=strategy.copies,
                              flush_s=_tensorboard_flush(cfg.groups)),
        agreement=Agreement(env, total_steps, cfg.monitor.nonfinite.action, t.log_every_n_steps,
                            every_step=monitor.every_step, stop_within=t.stop_within),
        monitor=monitor,
        diagnostics=GradDiagnostics(model, cfg.monitor.grad_diagnostics_every),
        validation=Validation(loaders.val, env, task, precision.autocast, to_device,
                              _lockstep_input(strategy, env, data),
                              counted=strategy.counts_validation(env),
                              max_batches=t.val_batches),
        early_stopping=EarlyStopping(t.early_stopping, verbose=env.is_main,
                                     per="validation" if t.val_every_n_steps else "epoch"),
        best_model=BestModel(t.early_stopping.metric, t.early_stopping.mode,
                             cfg.checkpoint.save_best, run_dir, env),
        run_data=run_data(data, task),
        run_files=run_files(data, unwrap(model)),  # DDP's or compile's wrapper: the model in it
        total_steps=total_steps,
        global_batch=loaders.global_batch(t.grad_accum_steps),
        checkpoints=Checkpoints(run_dir, env, cfg.checkpoint.keep, cfg.yaml),
        trainable=trainable,
        adapter_only=finetuning.uses_lora(cfg.finetune),
        masked_targets=bool(getattr(data, "masks_targets", False)),
        max_skipped=max_skipped(data),
    )  # fmt: skip


def build_optimizer(node: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer on the parameters that train, in `optimizer.groups`' groups (with
    `optimizer.layer_decay`'s learning rates), its other keys its target's."""
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    groups, layer_decay = (values.pop(key, None) for key in GROUP_KEYS)
    if values.get(FUSED_KEY):  # asked for: given where the parameters' device has the kernel
        values[FUSED_KEY] = fused_fits(model)
    chosen = [OmegaConf.create(g) for g in groups or []]
    return build(OmegaConf.create(values))(param_groups(model, chosen, layer_decay, values["lr"]))


def max_skipped(data: DataModule) -> int | None:
    fraction = getattr(data, "max_skipped_fraction", None)
    return None if fraction is None else int(fraction * len(data.train))


# A key of every data set's config that dpt applies itself (the loaders' order), not the target.
SHUFFLE_KEY = "shuffle"


def build_data(node: DictConfig, seed: int) -> tuple[DataModule, bool]:
    """The data set as dpt.contract says (its target gets its keys and `seed`, not `shuffle`),
    and whether its training order is shuffled (`dataset.shuffle`, true where not given)."""
    values = OmegaConf.to_container(node, resolve=True)  # dataset=text reads model.block_size
    assert isinstance(values, dict)
    shuffle = bool(values.pop(SHUFFLE_KEY, True))
    return build_as(OmegaConf.create(values), "dataset", seed=seed), shuffle


def build_data_task(node: DictConfig, data: DataModule) -> Task:
    """The run's task, fitted to what the data set's targets are (and its classes)."""
    kind, targets = task_kind(node), targets_of(data)
    outputs = fit.num_outputs(kind, targets, getattr(data, "num_classes", None))
    # A vocabulary's tokens are not listed (its tokenizer is kept instead: dpt-generate).
    names = [] if kind == LANGUAGE_MODEL else output_names(
        data, outputs, classification=kind == CLASSIFICATION)  # fmt: skip
    return build_task(node, targets, outputs, names)


def probe_fit(groups: DictConfig, seed: int) -> None:
    """The check `build_parts` makes of the task, made beforehand (dpt.launch.preflight): the
    data set built as a rank builds it, the model on the meta device. Only the task's refusals
    and the data set's and the model's own one-line errors are raised: whatever else fails here
    (a model that cannot be built) is left to the rank, which says it as always."""
    seed_everything(seed)
    data, _ = build_data(groups.dataset, seed)
    task = build_data_task(groups.task, data)
    model = _meta_model(groups.model, data, task)
    task.check(None if model is None else output_shape(model, data.input_shape, input_dtype(data)))
    if model is not None:  # do the initial weights fit it (shapes only)?
        initial_weights(groups.model, model, task.num_outputs, load=False)
        finetuning.adapt(model, finetuning.settings_of(groups))  # its patterns match?
        optimizer = groups.get("optimizer") or {}
        check_groups(model, [g.match for g in optimizer.get("groups") or []],
                     optimizer.get("layer_decay"))  # fmt: skip
    if model is not None and "strategy" in groups:  # does it cut into its stages (pipeline)?
        build(groups.strategy).check(model)


def initial_weights(
    node: DictConfig, model: nn.Module, num_outputs: int, load: bool = True
) -> None:
    """The model's weights from `model.init_from` where set (a run folder, a checkpoint, a
    weights file or a transformers folder); `load=False`: only whether they fit."""
    source = node.get(INIT_KEY)
    if source is None:
        return
    key = f"model.{INIT_KEY}={source}"
    if load:
        loaded = fit_state(model, read_model_state(Path(source), key), key, num_outputs)
        _init_fresh(model, loaded)  # as fsdp's ranks draw them
    else:  # the pre-run check: a safetensors source's headers alone
        fitting(model, model_shapes(Path(source), key), key, num_outputs)


def _pad_as_the_data(model: nn.Module, data: DataModule, kind: str) -> None:
    """A classifier of texts that names no pad token takes the data's (its tokenizer's)."""
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is None or kind == LANGUAGE_MODEL:
        return
    said = family_of(model).pads_with(model, tokenizer.pad_id())
    if said:
        once.warning(said)


def _init_fresh(model: nn.Module, given: set[str]) -> None:
    """The trainable parameters that the weights did not give (a head of the task's size)
    drawn by the model's family from their names: the same under every strategy. LoRA's
    adapters are drawn apart (init_lora)."""
    bare = unwrap(model)
    fresh = [name for name, _ in bare.named_parameters()
             if bare_name(name) not in given and not is_lora_key(name)]  # fmt: skip
    if fresh:
        family_of(bare).init_fresh(bare, fresh)


def sharded_source(node: DictConfig, strategy: Strategy, env: DistEnv) -> Path | None:
    """The transformers folder whose safetensors each rank reads only its shards of: a
    transformers model's weights (`model.init_from`, else `model.path`), under a strategy that
    shards parameters on more than one rank. None: the whole model is built on every rank."""
    if not (strategy.builds_on_meta and env.distributed) or node.get("_target_") != HF_TARGET:
        return None
    return safetensors_folder(node.get(INIT_KEY) or node.get("path"))


def sharded_reads(
    model: nn.Module, folder: Path, num_outputs: int, pretrained: bool = False
) -> dict[str, str]:
    """Each of the meta model's tensors that the folder holds, with its name in the files: what
    fits (a head of another size keeps its fresh initialisation), refused in one line else.
    `pretrained`: `model.path`'s folder, whose tensors the model lacks are left out (a causal
    LM's head under a classifier), as from_pretrained leaves them on one process."""
    shapes = model_shapes(folder, f"model weights in {folder}")
    usable = fitting(model, shapes, f"model weights in {folder}", num_outputs, pretrained)
    stored = {name: key for key, name in family_of(model).names_in(model, list(shapes)).items()}
    return {name: stored.get(name, name) for name in usable}


def _meta_model(node: DictConfig, data: DataModule, task: Task) -> nn.Module | None:
    """The model built on the meta device; None where it cannot be built there."""
    try:
        with torch.device("meta"):
            return build_model(node, data.input_shape, task.num_outputs, task=task.kind)
    except DptError:  # dpt's own one line (a model folder that is not one): said now
        raise
    except Exception:  # the rank builds it again, and reports what fails in its one line
        return None


def run_files(data: DataModule, model: nn.Module) -> dict[str, bytes]:
    """What the run keeps beside data.json: the data set's tokenizers file (and the special
    tokens and chat template of the folder it came from), a transformers
    model's config (dpt-generate and dpt-export rebuild the model from it, not from its folder),
    and how dataset=chat made text of its rows (dpt-generate renders a prompt so)."""
    tokenizer = getattr(data, "tokenizer", None)
    text = getattr(tokenizer, "text", None)
    files = {} if text is None else {tokenizer.describe()["file"]: text.encode()}
    files |= tokenizer.companions() if hasattr(tokenizer, "companions") else {}
    config = family_of(model).transformers_config(model)
    if config is not None:
        files[HF_CONFIG_FILE] = config.encode()
    chat = getattr(data, "chat_format", None)
    if chat is not None:
        files[CHAT_FORMAT_FILE] = json.dumps(chat.describe(), indent=2).encode()
    return files


def token_throughput(
    task: Task, model: nn.Module, settings: TrainerConfig, env: DistEnv
) -> Throughput | None:
    """For a task of tokens: its tokens per sample, the model's FLOPs per token where it counts
    them (`flops_per_token`), and the device's peak at the run's precision."""
    tokens = getattr(task, "tokens_per_sample", None)
    if tokens is None:
        return None
    count = token_flops(model)
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else ""
    peak = peak_tflops(name, settings.precision, settings.peak_tflops)
    return Throughput(tokens, count(tokens) if count else None, peak * 1e12 if peak else None)


def run_data(data: DataModule, task: Task) -> RunData:
    """The data set's side of the contract that outlives the run (dpt.contract), and what
    prediction needs of the task: its kind, the output names, one target's shape."""
    transform = val_transform_node(data)
    text = None if transform is None else repr(build(OmegaConf.create(transform)))
    tokenizer = getattr(data, "tokenizer", None)
    return RunData(task.names, list(data.input_shape), transform, text, task=task.kind,
                   target_shape=list(task.targets.shape), num_outputs=task.num_outputs,
                   tokenizer=tokenizer.describe() if tokenizer is not None else None)  # fmt: skip


def planned_steps(loaders: Loaders, settings: TrainerConfig, world_size: int) -> int:
    """Optimizer steps of the whole run: trainer.max_steps where set (as many epochs as that
    takes), else epochs x full steps per epoch."""
    per_epoch = loaders.steps_per_epoch(settings.grad_accum_steps)
    if per_epoch == 0:
        raise DptError(
            f"the training set gives no full optimizer step: {loaders.train_size} samples over "
            f"{world_size} rank(s) at trainer.batch_size={loaders.batch_size} x "
            f"trainer.grad_accum_steps={settings.grad_accum_steps}"
        )
    return settings.max_steps or per_epoch * settings.epochs


def check_log_interval(every: int, total_steps: int) -> None:
    """A logging interval as long as the run (an experiment's, made for a longer one) shows its
    progress only at the end: said once, with an interval that shows it."""
    if every >= total_steps > 1:
        once.warning(
            f"trainer.log_every_n_steps={every} is not shorter than the run ({total_steps} "
            f"steps): its progress shows only at the end; trainer.log_every_n_steps="
            f"{max(1, total_steps // 10)} shows it as it goes"
        )


def length_key(settings: TrainerConfig) -> str:
    """The key that sets the run's length."""
    return "trainer.max_steps" if settings.max_steps else "trainer.epochs"


def run_length(settings: TrainerConfig, total_steps: int, per_epoch: int) -> str:
    """What ends the run, for its first line: trainer.max_steps, when set, alone (the epochs
    then run on as long as it takes), else trainer.epochs."""
    steps, epoch = count(total_steps, "step"), count(per_epoch, "step")
    if settings.max_steps:
        return (f"{steps} (trainer.max_steps; {total_steps / per_epoch:.3g} epochs of {epoch}, "
                "trainer.epochs not used)")  # fmt: skip
    return f"{steps} ({count(settings.epochs, 'epoch')} of {epoch})"


def _lockstep_input(strategy: Strategy, env: DistEnv, data: DataModule) -> torch.Tensor | None:
    """One input of zeros, where validation must keep the ranks' forwards in step (fsdp): what a
    rank with fewer batches runs its missing forwards on (one, not none: not every model's
    forward takes an empty batch, transformers' attention does not)."""
    if not (strategy.lockstep_forward and env.distributed):
        return None
    return torch.zeros((1, *data.input_shape), dtype=input_dtype(data))


def _rank_scalars(memory: MemoryUse, strategy: Strategy) -> Callable[[], dict[str, float]]:
    """A rank's own numbers at each logging window: its memory, and its strategy's (a
    pipeline stage's compute and idle time)."""
    return lambda: memory.scalars() | strategy.rank_scalars()


def _init_loader_worker(rank: int, log_file: Path, worker_id: int) -> None:
    """DataLoader workers may be fresh processes: give them the rank's log prefix and file."""
    setup_logging(f"rank {rank} loader {worker_id}", log_file, speaks_once=False)
