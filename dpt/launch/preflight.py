"""Does the task fit the data set and the model? Asked in the launching process before Hydra
makes the run folder, so that a task that cannot train on them is one line and leaves nothing.

What dpt's own data sets and models give is known from the config (`dpt.launch.validate` checks
it without torch). A data set of yours (its targets are known once it is built), a model of
yours (its output shape), and a loss of yours (tried on those shapes) are built here first, as a
rank builds them (dpt.loop.parts.probe_fit): that costs the data set's building time once more,
and is only done for them; and a text (dataset=text), whose tokens this makes once for the
ranks (they read them from the cache) and whose vocabulary must fit the model's. Every rank
checks again on its built parts (a multirun's jobs, whose folders Hydra makes before their own
overrides are known, are refused there, at start).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from dpt.config.datasets import ChatConfig, ShardsConfig, TextConfig, declared_targets
from dpt.config.models import INIT_KEY, HFModelConfig
from dpt.config.strategies import PipelineConfig
from dpt.config.tasks import CUSTOM, task_kind
from dpt.launch.validate import is_own_model


def needs_building(cfg: DictConfig) -> bool:
    """Whether the fit depends on code of yours: a data set, a model or a custom task. Shards
    are not read here (their index, over HTTP perhaps, is the ranks' to fetch): they are
    checked at start."""
    schema = OmegaConf.get_type(cfg.dataset)
    if schema is ShardsConfig:
        return False
    return (
        OmegaConf.get_type(cfg.strategy) is PipelineConfig  # the model's cut into its stages
        or task_kind(cfg.task) == CUSTOM
        or declared_targets(cfg.dataset) is None
        or not is_own_model(cfg.model)
        or schema in (TextConfig, ChatConfig)  # its tokens; the model's vocabulary
        or OmegaConf.get_type(cfg.model) is HFModelConfig  # its folder, its Auto class
        or cfg.model.get(INIT_KEY) is not None  # do its initial weights fit it?
        or _names_parameters(cfg)  # do its patterns match the model's parameters?
    )


def _names_parameters(cfg: DictConfig) -> bool:
    """`finetune` or `optimizer.groups` / `layer_decay` set: patterns of the model's names."""
    finetune, optimizer = cfg.get("finetune") or {}, cfg.get("optimizer") or {}
    lora = finetune.get("lora") or {}
    return bool(finetune.get("freeze") or lora.get("rank") or optimizer.get("groups")
                or optimizer.get("layer_decay") is not None)  # fmt: skip


def check(cfg: DictConfig) -> None:
    """Raise the one-line DptError a rank would raise at start for this task's fit."""
    if not needs_building(cfg):
        return
    from dpt.loop.parts import probe_fit  # imports torch: only where something is built

    # Resolved, as a rank gets them (dataset=text's block size reads the model's).
    groups = OmegaConf.create({group: OmegaConf.to_container(cfg[group], resolve=True)
                               for group in ("dataset", "model", "task", "strategy",
                                             "optimizer", "finetune") if group in cfg})  # fmt: skip
    probe_fit(groups, cfg.trainer.seed)
