"""Resuming under another config: which differences from the checkpoint's config take effect, and
which are refused because the run would no longer continue the checkpoint's run.

The rule is a table: the keys in `APPLIED` may change (the run's length, logging, checkpointing,
how processes and loader workers are laid out, the optimizer's numbers); every other key that
differs is refused, with the reason of the first `REFUSED` prefix it falls under. Both configs
are compared flat, as dotted keys of the resolved config (`optimizer.lr`, `model.hidden_dims`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from dpt.config.finetune import FinetuneConfig
from dpt.config.models import INIT_KEY
from dpt.config.tasks import BEFORE_TASKS
from dpt.user_code import current_target

# A key matches an entry equal to it, or one ending in "." that it starts with.
APPLIED = (
    "trainer.epochs",
    "trainer.max_steps",
    "trainer.log_every_n_steps",
    "trainer.timeout_s",
    "trainer.device",
    "trainer.batch_size",  # the data position is kept in samples of the epoch's global order
    "trainer.grad_accum_steps",
    "trainer.grad_clip_norm",
    "trainer.precision",  # the loss scaler starts afresh or is dropped; weights stay fp32
    "trainer.compile",
    "trainer.on_nonfinite",
    "trainer.early_stopping.patience",
    "trainer.early_stopping.min_delta",
    "checkpoint.",
    "monitor.",  # what is watched and done from now on; the data and the model stay
    "logger.",  # where the metrics go besides the run's own files
    "dataset.test",  # the test split: dpt-evaluate's alone, never read in training
    "launcher.",
    "strategy.",  # checkpoints are the same for every strategy and world size
    "dataset.num_workers",  # augmentation draws from (seed, epoch, sample), not worker RNG
    # dataset=shards: where and how shards are fetched and kept, not which samples they hold
    "dataset.cache_dir",
    "dataset.cache_limit_gb",
    "dataset.retries",
    "dataset.outage_s",
    "dataset.max_skipped_fraction",
    "dataset.timeout_s",
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.betas",
    "optimizer.momentum",
    "optimizer.nesterov",
    "optimizer.fused",  # the same state and arithmetic, in one kernel call
    "scheduler.warmup_steps",
    "scheduler.min_lr",
    "scheduler.step_size",
    "scheduler.gamma",
)
REFUSED = (
    ("trainer.seed", "that changes the data and the initial weights"),
    ("finetune.", "that changes what trains, and what the checkpoint holds"),
    ("dataset.", "that changes the data"),
    ("model.", "that changes the model"),
    ("task.", "that changes what is learned and how it is measured"),
    ("optimizer.", "the checkpoint's optimizer state does not fit another optimizer"),
    ("scheduler.", "the checkpoint's schedule state does not fit another schedule"),
    ("trainer.early_stopping.", "the best value so far was measured by another rule"),
)
OTHER_REASON = "the checkpoint's state may not fit it"
# Where a checkpoint comes from is not a setting of the run it continues.
IGNORED = ("checkpoint.resume",)
ABSENT = "(absent)"


@dataclass(frozen=True)
class Change:
    key: str
    old: Any  # the checkpoint's value, or ABSENT
    new: Any  # this run's value, or ABSENT

    def __str__(self) -> str:
        return f"{self.key} {show(self.old)} -> {show(self.new)}"


@dataclass(frozen=True)
class Comparison:
    applied: tuple[Change, ...]
    refused: tuple[Change, ...]  # most telling first: seed, data, model, optimizer, ...


def flat(config_yaml: str) -> dict[str, Any]:
    """The resolved config as dotted keys; lists are values of their own (`model.hidden_dims`).
    A config of before tasks reads as task=classification's."""
    container = OmegaConf.to_container(OmegaConf.create(config_yaml), resolve=True)
    out: dict[str, Any] = {}
    _flatten(container if isinstance(container, dict) else {}, "", out)
    if not any(key.startswith("task.") for key in out):
        out.update({f"task.{key}": value for key, value in BEFORE_TASKS.items()})
    for key, value in _added_later().items():  # a config of before them: their defaults
        out.setdefault(key, value)
    return out


def _added_later() -> dict[str, Any]:
    """Keys added after checkpoints were written, with the values that mean what those runs
    did (no initial weights, one group of parameters, everything trains)."""
    added: dict[str, Any] = {f"model.{INIT_KEY}": None, "optimizer.groups": [],
                             "optimizer.layer_decay": None}  # fmt: skip
    defaults = OmegaConf.to_container(OmegaConf.structured(FinetuneConfig))
    _flatten({"finetune": defaults}, "", added)
    return added


def _flatten(node: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        if isinstance(value, dict) and value:
            _flatten(value, f"{prefix}{key}.", out)
        elif key == "_target_" and isinstance(value, str):
            out[f"{prefix}{key}"] = current_target(value)  # as named before dpt's modules moved
        else:
            out[f"{prefix}{key}"] = value


def compare(stored: dict[str, Any], current: dict[str, Any]) -> Comparison:
    """Every key whose value differs, split into applied and refused."""
    changes = [
        Change(key, stored.get(key, ABSENT), current.get(key, ABSENT))
        for key in sorted(stored.keys() | current.keys())
        if key not in IGNORED and stored.get(key, ABSENT) != current.get(key, ABSENT)
    ]
    applied = tuple(c for c in changes if _matches(c.key, APPLIED))
    refused = sorted((c for c in changes if c not in applied), key=_telling)
    return Comparison(applied, tuple(refused))


def reason(key: str) -> str:
    """Why a change of `key` is refused."""
    return next((why for prefix, why in REFUSED if _matches(key, (prefix,))), OTHER_REASON)


def _matches(key: str, entries: tuple[str, ...]) -> bool:
    return any(key == e or (e.endswith(".") and key.startswith(e)) for e in entries)


def _telling(change: Change) -> tuple[int, bool, str]:
    """Order of refusals: by the REFUSED table, a group's kind (`_target_`) before its values."""
    rank = next((i for i, (p, _) in enumerate(REFUSED) if _matches(change.key, (p,))), len(REFUSED))
    return rank, not change.key.endswith("._target_"), change.key


def refusal(checkpoint: str, refused: tuple[Change, ...]) -> str:
    """One line: the most telling refused key with both values, the others by name."""
    first, rest = refused[0], refused[1:]
    also = f" (also differs: {', '.join(c.key for c in rest)})" if rest else ""
    return (
        f"checkpoint {checkpoint} was written with {first.key}={show(first.old)}, this run has "
        f"{first.key}={show(first.new)}: {reason(first.key)}{also}; set checkpoint.strict=false "
        "to resume anyway"
    )


def forced(checkpoint: str, refused: tuple[Change, ...]) -> str:
    listed = ", ".join(f"{c} ({reason(c.key)})" for c in refused)
    return f"checkpoint.strict=false: resuming from {checkpoint} despite {listed}"


def applied_line(applied: tuple[Change, ...]) -> str:
    return f"resuming with changed settings: {', '.join(str(c) for c in applied)}"


def show(value: Any) -> str:
    """As on the command line: null, true, [64, 64]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
