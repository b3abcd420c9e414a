"""The loop's own settings (`trainer`, `checkpoint`, `sweep`): the keys with no YAML of their
own, whose defaults are here."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from dpt.config.checks import Check, above, at_least, checked, one_of
from dpt.config.monitor import NONFINITE_ACTIONS
from dpt.config.tasks import WATCH_MODES, val_metrics

DEVICES = ("auto", "cuda", "mps", "cpu")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
# numpy's legacy seeding (np.random.seed in every worker) takes 0 .. 2**32 - 1.
MAX_SEED = 2**32 - 1
# `sweep.objective`: what a search optimizes (dpt/tasks/objective.py): auto, one of the task's
# validation metrics (`val/samples` is reported too, but it counts samples: not a metric to
# optimize or stop on), or the last logging window's training loss.
AUTO_OBJECTIVE, TRAIN_LOSS = "auto", "train/loss"


@dataclass
class EarlyStoppingConfig:
    # The task's watched metric by default (task.watch, in task.mode): val/loss (min) for
    # classification, binary and regression, val/map (max) for multilabel.
    metric: str = "${task.watch}"
    mode: str = one_of(WATCH_MODES, "${task.mode}")  # min or max: which way the metric is better
    # validations without improvement before the run stops (each epoch's end, and every
    # trainer.val_every_n_steps where set); null: off
    patience: int | None = at_least(1, None, null="off")
    min_delta: float = 0.0  # the least change of the metric that counts as an improvement


@dataclass
class TrainerConfig:
    """The loop: how long, how large a batch, on which device and in what precision."""

    epochs: int = at_least(1, 3)  # passes over the training set, where trainer.max_steps is not set
    # The run's length in optimizer steps, as many epochs as that takes (trainer.epochs is then
    # not used; the start line says which of the two ends the run); null: trainer.epochs.
    max_steps: int | None = at_least(1, None, null="run all epochs")
    # Per process for ddp and fsdp (per replica for pipeline); the whole batch for single and
    # dp. The global batch: batch_size x world size x grad_accum_steps.
    batch_size: int = at_least(1, 64)
    # data, shuffling, augmentation and initial weights (0 .. 2**32 - 1)
    seed: int = checked(Check(lambda v: 0 <= v <= MAX_SEED, f"must be >= 0 and <= {MAX_SEED} "
                              "(2**32 - 1, numpy's seed range)"), 0)  # fmt: skip
    # How often metrics are logged and printed: the ranks agree at those steps (or every 50 ms
    # where steps are faster), so a signal or a NaN is acted on within this many steps.
    log_every_n_steps: int = at_least(1, 10)
    # Validate every this many optimizer steps too, besides at each epoch's end: the curve of a
    # run whose epoch is long. The run's last step then validates only where it ends an epoch or
    # falls on the schedule, so a run stopped by max_steps and resumed validates where the
    # uninterrupted run does. null: at each epoch's end and at the run's end.
    val_every_n_steps: int | None = at_least(1, None, null="at epoch ends only")
    # Validate on at most this many batches of each process (the split's first ones, the same
    # every time); null: the whole validation split.
    val_batches: int | None = at_least(1, None, null="the whole split")
    device: str = one_of(DEVICES, "auto")  # auto (CUDA, then MPS, then CPU), cuda, mps or cpu
    # Seconds a rank waits in a collective before it fails; the run then names the rank that
    # stopped answering.
    timeout_s: float = above(0, 300.0)
    # The grace a preemption gives between its SIGTERM and its SIGKILL (Kubernetes' 30 s, SLURM's
    # --signal lead): the ranks agree often enough that a stop ends in a committed checkpoint
    # within it, or say in one line that a step and a checkpoint take longer. null: no deadline
    # (a stop waits for the next logging window).
    stop_within: float | None = above(0, None, null="no deadline")
    # 32, bf16-mixed (autocast on CPU and CUDA) or 16-mixed (CUDA, with a gradient scaler).
    precision: str = one_of(PRECISIONS, "32")
    # Micro-batches per optimizer step; ddp all-reduces (fsdp reduce-scatters) only on the last.
    grad_accum_steps: int = at_least(1, 1)
    # Clip the gradients to this global norm (the norm before clipping is logged as
    # optim/grad_norm); null: no clipping.
    grad_clip_norm: float | None = above(0, None, null="no clipping")
    compile: bool = False  # torch.compile the (wrapped) model
    # One device's peak TFLOP/s at the run's precision, for MFU (models that count their FLOPs:
    # model=gpt); null: dpt's table of A100, H100 and H200, else TFLOP/s achieved instead.
    peak_tflops: float | None = None
    # What a NaN or infinite loss (or gradient norm) does: error (stop at once, naming the step,
    # the rank and the first module whose output is not finite), skip (that step's update is not
    # applied; ranks then agree every step), rollback (as monitor.loss_spike's). The same value as
    # monitor.nonfinite.action, whose default it is.
    on_nonfinite: str = one_of(NONFINITE_ACTIONS, "error")
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)


@dataclass
class CheckpointConfig:
    """Checkpoints (`<run>/checkpoints/step-<8 digits>/`, written through DCP) and resuming."""

    # Write checkpoints at each epoch's end, every every_n_steps, and where a run is cut short
    # (SIGTERM, Ctrl-C, a monitor's stop).
    enabled: bool = True
    # also write one every this many optimizer steps
    every_n_steps: int | None = at_least(1, None, null="only at epoch ends")
    keep: int = at_least(1, 3)  # how many of this run's newest committed checkpoints are kept
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
class SweepConfig:
    """What each job of a sweep returns to its sweeper."""

    # What a search (`hydra/sweeper=optuna`) optimizes, the number dpt's job returns: auto (the
    # watched validation metric, trainer.early_stopping.metric in its mode, at its best epoch;
    # the final train loss where there is no validation), one of the task's validation metrics
    # (val/loss, val/acc1, ... at its best epoch) or train/loss (the last logging window's).
    objective: str = AUTO_OBJECTIVE


def objectives(task: DictConfig) -> tuple[str, ...]:
    """What `sweep.objective` may name for `task`: auto, its validation metrics, train/loss."""
    return (AUTO_OBJECTIVE, *val_metrics(task), TRAIN_LOSS)
