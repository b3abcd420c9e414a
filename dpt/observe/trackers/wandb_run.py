"""`logger=[...,wandb]`: a Weights & Biases run per dpt run, offline by default: it lies in
`<run>/wandb/offline-run-*` until `wandb sync` sends it. A sweep's jobs share a group (the
sweep folder's name); a run resumed from a checkpoint continues the same W&B run id."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from dpt.config.loggers import WANDB
from dpt.observe.trackers.tracker import Row, RunInfo


def quiet() -> Any:
    """W&B's settings for a run dpt opens: no console capture (dpt's logs are the run's), no
    system-stats thread, no git probing."""
    import wandb

    return wandb.Settings(silent=True, disable_git=True, console="off", x_disable_stats=True)


class WandbTracker:
    name = WANDB

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.run: Any = None

    def start(self, info: RunInfo, stored: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        resumed = bool(info.resumed and stored and stored.get("id"))
        run_id = (
            str(stored["id"]) if resumed and stored else secrets.token_hex(4)
        )  # W&B's ids: [a-z0-9]
        group = (
            None
            if info.sweep_dir is None
            else f"{info.sweep_dir.parent.name}/{info.sweep_dir.name}"
        )
        self.run = wandb.init(
            mode=str(self.cfg.mode), project=str(self.cfg.project), entity=self.cfg.entity,
            name=self.cfg.run_name or info.name, id=run_id, resume="allow" if resumed else None,
            dir=str(info.run_dir), config=info.params, group=group,
            tags=[f"{k}={v}" for k, v in info.tags.items()] + [str(t) for t in self.cfg.tags],
            reinit="create_new",
            settings=quiet(),
        )  # fmt: skip
        return {"id": run_id, "mode": str(self.cfg.mode)}

    def log_metrics(self, rows: list[Row]) -> None:
        for scalars, step, _ in rows:
            self.run.log(dict(scalars), step=step)

    def log_files(self, paths: list[Path]) -> None:
        """As one W&B artifact of the run (kept offline until `wandb sync`)."""
        kept = [p for p in paths if p.is_file() and (p.suffix != ".pt" or self.cfg.log_model)]
        log_artifact(self.run, kept, "run-files")

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def log_artifact(run: Any, paths: list[Path], kind: str) -> None:
    """`paths` as one artifact of `run`, named by the run's id and `kind`."""
    import wandb

    artifact = wandb.Artifact(f"{run.id}-{kind}", type=kind)
    for path in paths:
        artifact.add_file(str(path), name=path.name)
    run.log_artifact(artifact)
