"""A config node turned into its object: Hydra's `instantiate`, with failures in one line."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from dpt.errors import DptError, one_line


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
