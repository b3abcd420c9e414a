"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The YAML files under `dpt/conf/` extend these schemas (`defaults: [/schema/<group>/<name>@_here_]`),
so OmegaConf rejects an unknown key or a value of the wrong type while Hydra composes the config.
Each default lives in one place: a group option's values in its YAML file (the schemas of groups
give types only, `???` until the YAML fills them), `trainer` and `checkpoint`, which have no YAML,
here. Builders take what the config gives them, without defaults of their own.
Ranges that a type cannot express (`trainer.batch_size=0`) are checked by
`dpt.launch.validate`, which runs from a Hydra callback before Hydra makes the run folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf

from dpt.errors import DptError, one_line
from dpt.targets import Targets


@dataclass
class EarlyStoppingConfig:
    # The task's watched metric by default (task.watch, in task.mode): val/loss (min) for
    # classification, binary and regression, val/map (max) for multilabel.
    metric: str = "${task.watch}"
    mode: str = "${task.mode}"  # min or max: which way the metric is better
    patience: int | None = None  # epochs without improvement before the run stops; null: off
    min_delta: float = 0.0  # the least change of the metric that counts as an improvement


@dataclass
class TrainerConfig:
    """The loop: how long, how large a batch, on which device and in what precision."""

    epochs: int = 3  # passes over the training set, where trainer.max_steps is not set
    # The run's length in optimizer steps, as many epochs as that takes (trainer.epochs is then
    # not used; the start line says which of the two ends the run); null: trainer.epochs.
    max_steps: int | None = None
    # Per process for ddp and fsdp (per replica for pipeline); the whole batch for single and
    # dp. The global batch: batch_size x world size x grad_accum_steps.
    batch_size: int = 64
    seed: int = 0  # data, shuffling, augmentation and initial weights (0 .. 2**32 - 1)
    # How often metrics are logged and printed: the ranks agree at those steps (or every 50 ms
    # where steps are faster), so a signal or a NaN is acted on within this many steps.
    log_every_n_steps: int = 10
    device: str = "auto"  # auto (CUDA, then MPS, then CPU), cuda, mps or cpu
    # Seconds a rank waits in a collective before it fails; the run then names the rank that
    # stopped answering.
    timeout_s: float = 300.0
    # 32, bf16-mixed (autocast on CPU and CUDA) or 16-mixed (CUDA, with a gradient scaler).
    precision: str = "32"
    # Micro-batches per optimizer step; ddp all-reduces (fsdp reduce-scatters) only on the last.
    grad_accum_steps: int = 1
    # Clip the gradients to this global norm (the norm before clipping is logged as
    # optim/grad_norm); null: no clipping.
    grad_clip_norm: float | None = None
    compile: bool = False  # torch.compile the (wrapped) model
    # One device's peak TFLOP/s at the run's precision, for MFU (models that count their FLOPs:
    # model=gpt); null: dpt's table of A100, H100 and H200, else TFLOP/s achieved instead.
    peak_tflops: float | None = None
    # What a NaN or infinite loss (or gradient norm) does: error (stop at once, naming the step,
    # the rank and the first module whose output is not finite), skip (that step's update is not
    # applied; ranks then agree every step), rollback (as monitor.loss_spike's). The same value as
    # monitor.nonfinite.action, whose default it is.
    on_nonfinite: str = "error"
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


@dataclass
class CheckpointConfig:
    """Checkpoints (`<run>/checkpoints/step-<8 digits>/`, written through DCP) and resuming."""

    # Write checkpoints at each epoch's end, every every_n_steps, and where a run is cut short
    # (SIGTERM, Ctrl-C, a monitor's stop).
    enabled: bool = True
    every_n_steps: int | None = None  # also write one every this many optimizer steps
    keep: int = 3  # how many of this run's newest committed checkpoints are kept
    # auto: the newest good checkpoint of the run folder (a damaged one is skipped, said so); a
    # folder with an earlier run's work but none to resume is refused. never (or null): start
    # over, the folder's step folders moved aside. A checkpoint folder: start from that one.
    resume: str | None = "auto"
    # Keep `model_best.pt` beside `model.pt`: the weights of the epoch with the best watched
    # metric (trainer.early_stopping.metric and .mode); needs validation, else nothing is kept.
    save_best: bool = True
    # Refuse to resume a checkpoint written under another seed, data, model or optimizer kind
    # (dpt/state/resume_config.py); false: say so, and resume anyway.
    strict: bool = True


@dataclass
class SpikeConfig:
    """A spike detector (dpt/monitor/detectors.py): a value more than `threshold` robust units
    above the median of the last `window` values it accepted."""

    # warn: one line and an event; skip: the step's update is not applied (ranks then agree every
    # step, as the update waits for the verdict); rollback: back to the newest checkpoint before
    # the step, past the data since it (at most monitor.max_rollbacks times); stop: checkpoint and
    # end with exit code 1; off: not watched.
    action: str = "warn"
    # Robust units: 1.4826 x the median absolute deviation (a normal noise's standard deviation),
    # at least 1 % of the level. 10 passes no clean run of dpt's own tests and benchmarks.
    threshold: float = 10.0
    window: int = 100  # the values the running median and deviation are taken over
    warmup: int = 20  # values accepted before the first judgement


@dataclass
class NonFiniteConfig:
    # error, skip or rollback (see trainer.on_nonfinite, its default).
    action: str = "${trainer.on_nonfinite}"


@dataclass
class SlowdownConfig:
    """The world's time per step (the slowest rank's data wait and compute, checkpoints and
    validation left out) and the straggler ratio (slowest rank's compute / the median rank's),
    each judged per logging window against its running median."""

    action: str = "warn"  # warn, stop or off (a slow machine is not the data's fault: no rollback)
    threshold: float = 3.0  # times the running median
    # Seconds of training one judged value spans (the logging windows in it together): a moment
    # of stall (another process, a collection) is not a slowdown.
    span_s: float = 10.0
    window: int = 30  # spans the running median is taken over
    warmup: int = 3  # spans accepted before the first judgement
    patience: int = 3  # spans in a row over the threshold before it is an event


@dataclass
class MonitorConfig:
    """Training that watches itself (dpt/monitor): detectors judged at the ranks' agreement (no
    collective of their own), reactions every rank takes at the same step, events in
    <run>/events.jsonl, on the console and in TensorBoard."""

    loss_spike: SpikeConfig = field(default_factory=SpikeConfig)  # the world-mean loss of a step
    # The global gradient norm before clipping: computed anyway under trainer.grad_clip_norm;
    # otherwise computed for this detector only when its action is skip, rollback or stop.
    grad_spike: SpikeConfig = field(default_factory=SpikeConfig)
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    slowdown: SlowdownConfig = field(default_factory=SlowdownConfig)
    max_rollbacks: int = 3  # rollbacks in one run; one more event that asks for one stops it
    # Every N steps: each module's gradient norm and update/weight ratio to TensorBoard
    # (grads/<module>/...); null: off.
    grad_diagnostics_every: int | None = None


@dataclass
class SweepConfig:
    """What each job of a sweep returns to its sweeper."""

    # What a search (`hydra/sweeper=optuna`) optimizes, the number dpt's job returns: auto (the
    # watched validation metric, trainer.early_stopping.metric in its mode, at its best epoch;
    # the final train loss where there is no validation), one of the task's validation metrics
    # (val/loss, val/acc1, ... at its best epoch) or train/loss (the last logging window's).
    objective: str = "auto"


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
class GPTConfig:
    """A decoder-only transformer in the GPT-2 shape (dpt/models/gpt.py)."""

    _target_: str = "dpt.models.gpt.GPT"
    block_size: int = MISSING  # the longest sequence; dataset=text's windows read it
    n_layer: int = MISSING
    n_head: int = MISSING
    n_embd: int = MISSING
    dropout: float = MISSING
    bias: bool = MISSING  # biases in the linear layers and LayerNorms
    vocab_size: int | None = MISSING  # null: the data's; larger pads the embedding (e.g. to 64s)
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
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


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
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING
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
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING
    on_bad_image: str = MISSING


@dataclass
class ShardsConfig:
    _target_: str = "dpt.data.shards.ShardsData"
    root: str = (
        MISSING  # a folder, an http(s):// URL or an fsspec URL (s3://...) of dpt-shards' output
    )
    image_size: int = MISSING
    num_workers: int = MISSING
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING
    on_bad_image: str = MISSING
    shuffle_window: int = MISSING  # samples shuffled together, after the shards' seeded order
    cache_dir: str | None = MISSING  # null: $XDG_CACHE_HOME/dpt/shards (~/.cache/dpt/shards)
    cache_limit_gb: float = MISSING
    retries: int = MISSING  # tries after the first for a transfer that comes damaged
    # seconds a source that does not answer (refused, timed out, 5xx) is retried before the
    # run stops with a checkpoint (the same command resumes)
    outage_s: float = MISSING
    # share of an epoch's samples that damaged shards may take before the run stops
    max_skipped_fraction: float = MISSING
    timeout_s: float = MISSING


@dataclass
class FakeImagesConfig:
    _target_: str = "dpt.data.fake_images.FakeImages"
    num_samples: int = MISSING
    num_val_samples: int = MISSING
    image_size: int = MISSING
    num_classes: int = MISSING
    num_workers: int = MISSING
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


# --- tasks: what is learned (dpt/tasks) ---------------------------------------------------------
# Each schema names, as class variables (known without torch, before any process starts), the
# task's kind for the fit rules (dpt/tasks/fit.py) and the validation metrics it reports
# (`reports`: their names without `val/`; `higher`: those that are better when higher).


@dataclass
class ClassificationTaskConfig:
    """One class per sample: logits (B, K), integer labels; cross-entropy."""

    _target_: str = "dpt.tasks.classification.Classification"
    kind: ClassVar[str] = "classification"
    reports: ClassVar[tuple[str, ...]] = ("loss", "acc1", "acc5")  # acc5 with 5 classes or more
    higher: ClassVar[tuple[str, ...]] = ("acc1", "acc5")
    label_smoothing: float = MISSING  # training's cross-entropy only (val/loss is plain)
    watch: str = MISSING  # the metric model_best.pt, early stopping and sweep.objective=auto watch
    mode: str = MISSING  # min or max: which way the watched metric is better


@dataclass
class BinaryTaskConfig:
    """One logit per target column, 0/1 targets; binary cross-entropy on the logits."""

    _target_: str = "dpt.tasks.binary.Binary"
    kind: ClassVar[str] = "binary"
    reports: ClassVar[tuple[str, ...]] = ("loss", "acc", "auroc", "f1")
    higher: ClassVar[tuple[str, ...]] = ("acc", "auroc", "f1")
    pos_weight: Any = MISSING  # null, a number, or one per target column: weight of positives
    threshold: float = MISSING  # a probability above it predicts 1 (acc, f1, dpt-predict)
    watch: str = MISSING
    mode: str = MISSING


@dataclass
class MultilabelTaskConfig:
    """K labels per sample, any number of them present: logits (B, K), K-hot targets."""

    _target_: str = "dpt.tasks.multilabel.Multilabel"
    kind: ClassVar[str] = "multilabel"
    reports: ClassVar[tuple[str, ...]] = ("loss", "map", "f1")  # macro over the labels
    higher: ClassVar[tuple[str, ...]] = ("map", "f1")
    pos_weight: Any = MISSING
    threshold: float = MISSING
    watch: str = MISSING
    mode: str = MISSING


@dataclass
class RegressionTaskConfig:
    """Float targets of any shape; the output has as many numbers per sample."""

    _target_: str = "dpt.tasks.regression.Regression"
    kind: ClassVar[str] = "regression"
    reports: ClassVar[tuple[str, ...]] = ("loss", "mse", "mae", "r2")
    higher: ClassVar[tuple[str, ...]] = ("r2",)
    loss: str = MISSING  # mse, l1 or huber
    huber_delta: float = MISSING  # task.loss=huber: where it turns from squared to linear
    watch: str = MISSING
    mode: str = MISSING


@dataclass
class LanguageModelTaskConfig:
    """Next-token prediction: logits (B, T, V) for windows of token ids (B, T)."""

    _target_: str = "dpt.tasks.language_model.LanguageModel"
    kind: ClassVar[str] = "language_model"
    reports: ClassVar[tuple[str, ...]] = ("loss", "perplexity")
    higher: ClassVar[tuple[str, ...]] = ()
    watch: str = MISSING
    mode: str = MISSING


@dataclass
class CustomTaskConfig:
    """Your own loss and metrics, each a `_target_` node."""

    _target_: str = "dpt.tasks.custom.Custom"
    # The nodes below are built by the task (a loss function is not called at build time).
    _recursive_: bool = False
    kind: ClassVar[str] = "custom"
    # An nn.Module class (built with the node's other keys) or a function
    # (outputs, targets) -> scalar (its other keys bound as keyword arguments).
    loss: Any = MISSING
    # name -> a torchmetrics Metric `_target_` node: val/<name>, updated with (outputs, targets).
    metrics: dict[str, Any] = MISSING
    # What dpt-predict writes of an output: values (as the model gives them), sigmoid
    # (probabilities per output) or softmax (class probabilities).
    predict: str = MISSING
    watch: str = MISSING
    mode: str = MISSING


# The task a run made before the `task` group existed trained: task=classification's node, as
# its YAML sets it (a checkpoint's config and a run folder of then have no `task`).
BEFORE_TASKS: dict[str, Any] = {
    "_target_": "dpt.tasks.classification.Classification",
    "label_smoothing": 0.0,
    "watch": "val/loss",
    "mode": "min",
}
TASK_KINDS = ("classification", "binary", "multilabel", "regression", "language_model", "custom")
PREDICT_OUTPUTS = ("values", "sigmoid", "softmax")
REGRESSION_LOSSES = ("mse", "l1", "huber")
WATCH_MODES = ("min", "max")


def task_schema(task: DictConfig) -> type | None:
    """The composed `task`'s schema: its own type, or (in a rank, whose config was rebuilt from
    plain values) the built-in schema of its `_target_`; None for a task class of yours."""
    schema = OmegaConf.get_type(task)
    if schema in SCHEMAS["task"].values():
        return schema
    target = task.get("_target_")
    return next((s for s in SCHEMAS["task"].values() if s._target_ == target), None)


def task_kind(task: DictConfig) -> str:
    """The composed `task`'s kind; a task class of yours counts as custom."""
    return str(getattr(task_schema(task), "kind", "custom"))


def val_metrics(task: DictConfig) -> tuple[str, ...]:
    """The validation metrics `task` reports (`val/<name>`; `val/samples` is a count, left out)."""
    if task_kind(task) == "custom":
        return ("val/loss", *(f"val/{name}" for name in task.get("metrics") or {}))
    return tuple(f"val/{name}" for name in getattr(task_schema(task), "reports", ()))


def higher_is_better(task: DictConfig, metric: str) -> bool | None:
    """Whether `metric` (val/<name>) is better higher; None where only its class could say (a
    custom metric that is not the watched one)."""
    name = metric.removeprefix("val/")
    if name == "loss":
        return False
    if task_kind(task) != "custom":
        return name in getattr(task_schema(task), "higher", ())
    if metric == task.get("watch"):
        return task.mode == "max"
    return None


@dataclass
class TextConfig:
    """Text files as windows of token ids (dpt/data/text.py), for task=language_model."""

    _target_: str = "dpt.data.text.TextData"
    root: str = MISSING  # a text file, or a folder of them (val.txt or val/ for validation)
    extensions: list[str] = MISSING  # a folder's files that are read, by extension (.txt)
    tokenizer: str | None = MISSING  # bytes (or null): UTF-8 bytes; or a tokenizers JSON file
    block_size: int = MISSING  # tokens a sample trains on (windows of block_size + 1)
    val_fraction: float = MISSING  # without val.txt or val/: this share of the tokens, the last
    cache_dir: str | None = MISSING  # null: $XDG_CACHE_HOME/dpt/tokens (~/.cache/dpt/tokens)
    num_workers: int = MISSING
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


@dataclass
class CustomDatasetConfig:
    """Plain `torch.utils.data.Dataset` classes of yours (dpt/data/custom.py): each item an
    (input, target) pair; the input shape is read from the first training sample."""

    _target_: str = "dpt.data.custom.CustomData"
    _recursive_: bool = False  # the nodes below are built by CustomData, each with its own keys
    train: Any = MISSING  # `_target_`: your Dataset class (or function), and its keys
    val: Any = MISSING  # the same for validation, or null: no validation
    # task=classification: how many classes (labels 0 .. N-1); other tasks read the targets.
    num_classes: int | None = MISSING
    classes: list[str] | None = MISSING  # names of the classes or outputs in order; null: 0, 1..
    num_workers: int = MISSING
    # false: every epoch in index order (dpt applies it: the target never sees it)
    shuffle: bool = MISSING


def declared_targets(dataset: DictConfig) -> Targets | None:
    """What the samples' targets are, as a config of dpt's own data sets says (None: a data set
    of yours, known only once built; shards, whose index says: images or tokens)."""
    schema = OmegaConf.get_type(dataset)
    if schema is CocoConfig and dataset.label_policy == "all":
        return Targets(integer=False, shape=(-1,))  # K-hot over the categories
    if schema in (SyntheticConfig, FakeImagesConfig):
        return Targets.labels(dataset.num_classes)
    if schema in (CocoConfig, ImageFolderConfig):
        return Targets.labels()
    if schema is TextConfig:
        return Targets(integer=True, shape=(dataset.block_size,))  # token ids, one token later
    return None


# `distributed`: one process per device, started by the launcher. A class variable, not a config
# key: the launcher reads it from the composed config's schema without importing torch.


@dataclass
class SingleConfig:
    _target_: str = "dpt.loop.strategy.Single"
    distributed: ClassVar[bool] = False


@dataclass
class DPConfig:
    _target_: str = "dpt.loop.strategy.DataParallel"
    distributed: ClassVar[bool] = False
    device_ids: list[int] | None = MISSING  # null = every visible GPU


@dataclass
class DDPConfig:
    _target_: str = "dpt.loop.strategy.DDP"
    distributed: ClassVar[bool] = True
    bucket_cap_mb: float = MISSING
    gradient_as_bucket_view: bool = MISSING
    static_graph: bool = MISSING
    find_unused_parameters: bool = MISSING
    comm_hook: str | None = MISSING  # bf16 | fp16: compress gradients for the all-reduce
    sync_batchnorm: bool = MISSING  # BatchNorm statistics over the global batch, not the rank's


@dataclass
class FSDPConfig:
    _target_: str = "dpt.loop.strategy.FSDP"
    distributed: ClassVar[bool] = True
    reshard_after_forward: bool = MISSING
    cpu_offload: bool = MISSING
    reduce_dtype: str = MISSING  # fp32 | bf16: the dtype of the gradient reduce-scatter
    sync_batchnorm: bool = MISSING  # BatchNorm statistics over the global batch, not the rank's


@dataclass
class PipelineConfig:
    _target_: str = "dpt.loop.pipeline.Pipeline"
    distributed: ClassVar[bool] = True
    stages: int = MISSING  # ranks one copy of the model is cut over
    schedule: str = MISSING  # gpipe | 1f1b | interleaved_1f1b
    microbatches: int = MISSING  # per step and replica; divides trainer.batch_size
    stages_per_rank: int = MISSING  # interleaved_1f1b: stages each rank holds (virtual stages)
    split_points: list[str] | None = MISSING  # names of the blocks where stages begin
    data_parallel: str = (
        MISSING  # none | ddp | fsdp: how copies of the pipeline (world > stages) train
    )


@dataclass
class LocalLauncherConfig:
    _target_: str = "dpt.launch.launchers.LocalLauncher"
    # A string so that both `auto` and a number fit; `validate` checks it.
    nproc_per_node: str = MISSING
    max_restarts: int = MISSING


@dataclass
class TorchrunLauncherConfig:
    _target_: str = "dpt.launch.launchers.TorchrunLauncher"


@dataclass
class SlurmLauncherConfig:
    """One SLURM job per multirun job, one task per rank (conf/launcher/slurm.yaml passes these
    to Hydra's submitit launcher). They size the allocation of the whole sweep: not sweepable."""

    _target_: str = "dpt.launch.launchers.SlurmLauncher"
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
class AdamWGPTConfig(AdamWConfig):
    """AdamW with weight decay on matrices only (dpt/loop/optimizers.py)."""

    _target_: str = "dpt.loop.optimizers.adamw_gpt"


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
    _target_: str = "dpt.loop.schedulers.constant"
    _partial_: bool = True


@dataclass
class WarmupCosineConfig:
    _target_: str = "dpt.loop.schedulers.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = MISSING
    min_lr: float = MISSING


@dataclass
class StepScheduleConfig:
    _target_: str = "dpt.loop.schedulers.step"
    _partial_: bool = True
    step_size: int = MISSING
    gamma: float = MISSING


@dataclass
class Config:
    model: Any = MISSING
    dataset: Any = MISSING
    task: Any = MISSING
    strategy: Any = MISSING
    launcher: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "mlp": MLPConfig,
        "resnet18": ResNetConfig,
        "resnet50": ResNetConfig,
        "torchvision": TorchvisionModelConfig,
        "gpt": GPTConfig,
    },
    "dataset": {
        "synthetic": SyntheticConfig,
        "coco": CocoConfig,
        "fake_images": FakeImagesConfig,
        "image_folder": ImageFolderConfig,
        "shards": ShardsConfig,
        "custom": CustomDatasetConfig,
        "text": TextConfig,
    },
    "task": {
        "classification": ClassificationTaskConfig,
        "binary": BinaryTaskConfig,
        "multilabel": MultilabelTaskConfig,
        "regression": RegressionTaskConfig,
        "language_model": LanguageModelTaskConfig,
        "custom": CustomTaskConfig,
    },
    "strategy": {
        "single": SingleConfig,
        "dp": DPConfig,
        "ddp": DDPConfig,
        "fsdp": FSDPConfig,
        "pipeline": PipelineConfig,
    },
    "launcher": {
        "local": LocalLauncherConfig,
        "torchrun": TorchrunLauncherConfig,
        "slurm": SlurmLauncherConfig,
    },
    "optimizer": {
        "adam": AdamConfig,
        "adamw": AdamWConfig,
        "adamw_gpt": AdamWGPTConfig,
        "sgd": SGDConfig,
    },
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
# `sweep.objective`: what a search optimizes (dpt/launch/objective.py): auto, one of the task's
# validation metrics (`val_metrics`; `val/samples` is reported too, but it counts samples: not a
# metric to optimize or stop on), or the last logging window's training loss.
AUTO_OBJECTIVE, TRAIN_LOSS = "auto", "train/loss"


def objectives(task: DictConfig) -> tuple[str, ...]:
    return (AUTO_OBJECTIVE, *val_metrics(task), TRAIN_LOSS)


# What each detector may do (dpt/monitor). A non-finite update cannot be applied and go on (warn),
# nor be checkpointed (stop); a slowdown is no reason to undo or skip updates.
SPIKE_ACTIONS = ("warn", "skip", "rollback", "stop", "off")
NONFINITE_ACTIONS = ("error", "skip", "rollback")
SLOWDOWN_ACTIONS = ("warn", "stop", "off")
# numpy's legacy seeding (np.random.seed in every worker) takes 0 .. 2**32 - 1.
MAX_SEED = 2**32 - 1
