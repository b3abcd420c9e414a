"""The `logger` list checked before any process starts: each tracker's package is there, and an
MLflow server named by the config answers (a run would otherwise train for nothing, or stop at
its first step)."""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

from omegaconf import DictConfig, OmegaConf

from dpt.config.loggers import EXTRAS, MLFLOW, MLFLOW_SCHEMES, chosen
from dpt.errors import ConfigError
from dpt.launch.answers import why_silent
from dpt.observe.trackers.opening import needs_package


def check_loggers(cfg: DictConfig) -> None:
    logger = OmegaConf.select(cfg, "logger")
    if logger is None:
        return
    for name in chosen(logger):
        if name in EXTRAS and importlib.util.find_spec(EXTRAS[name]) is None:
            raise needs_package(name)
    if OmegaConf.select(logger, MLFLOW) is not None:
        check_scheme(str(logger.mlflow.tracking_uri))
        check_reachable(str(logger.mlflow.tracking_uri))


def check_scheme(uri: str) -> None:
    """A scheme MLflow has a tracking store for (a typo, `htp://`, is found here, not once the
    model is built)."""
    scheme = urlsplit(uri).scheme
    if scheme.split("+")[0] not in MLFLOW_SCHEMES:
        raise ConfigError(
            f"logger.mlflow.tracking_uri={uri}: MLflow has no tracking store for {scheme}://; "
            "use http(s)://host:port (a server), sqlite:///file.db, a folder, or a database's "
            "URI (postgresql://, mysql://, mssql://)"
        )


def check_reachable(uri: str) -> None:
    """A server's URI (http, https): something must accept a connection at its host and port."""
    parts = urlsplit(uri)
    if not parts.scheme.startswith("http"):
        return  # a local store (sqlite:///, file:) or a named service (databricks)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    reason = why_silent(parts.hostname or "", port)
    if reason is None:
        return
    raise ConfigError(
        f"logger.mlflow.tracking_uri={uri}: no MLflow server answers there ({reason}); start "
        "one (mlflow server --backend-store-uri sqlite:///mlflow.db --port 5000), set "
        "logger.mlflow.tracking_uri, or leave mlflow out of logger=[...]"
    )
