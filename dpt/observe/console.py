"""Console lines that summarise the world (written by rank 0 only)."""

from __future__ import annotations

import logging

log = logging.getLogger("dpt")


def log_epoch(epoch: int, step: int, loss: float | None, val: dict[str, float], bad: int) -> None:
    """`epoch 2 done | step 40 | train loss 0.6931 | val loss 0.7012 | val acc1 51.20% | ...`"""
    parts = [f"epoch {epoch + 1} done", f"step {step}"]
    if loss is not None:
        parts.append(f"train loss {loss:.4f}")
    parts += [format_val(k, v) for k, v in sorted(val.items(), key=_val_order)]
    if bad:
        parts.append(f"{bad} unreadable samples skipped")
    log.info(" | ".join(parts))


def count(number: int, noun: str) -> str:
    """`1 step`, `2 steps`, `1,024 steps`."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def log_validation(step: int, val: dict[str, float]) -> None:
    """`step 200 validation | val loss 0.7012 | val acc1 51.20% | ...` (trainer.val_every_n_steps);
    nothing where it had no metrics to report (a shard that could not be had)."""
    if val:
        metrics = [format_val(k, v) for k, v in sorted(val.items(), key=_val_order)]
        log.info(" | ".join([f"step {step} validation", *metrics]))


def _val_order(item: tuple[str, float]) -> tuple[bool, str]:
    return (item[0] != "val/loss", item[0])  # loss first, then accuracies


def format_val(key: str, value: float) -> str:
    name = key.replace("/", " ")
    if key.endswith("samples"):
        return f"{name} {value:,.0f}"
    return f"{name} {value:.2%}" if "acc" in key else f"{name} {value:.4f}"
