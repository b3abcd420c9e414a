"""Which Ray cluster `launcher=ray` runs on, and whether it answers: asked before any job starts,
without importing ray, so that a cluster that cannot be reached is one line, not a minute of
Ray's retries inside the first job.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dpt.config.launchers import RAY_AUTO, RAY_LOCAL, RayLauncherConfig
from dpt.errors import ConfigError
from dpt.launch.answers import why_silent


def head_address(address: str) -> str | None:
    """The cluster head's `host:port` that `launcher.address` names (`auto`: as Ray finds one,
    RAY_ADDRESS or the cluster `ray start --head` started on this machine); None: `local`, a
    cluster the job starts for itself."""
    if address == RAY_LOCAL:
        return None
    if address != RAY_AUTO:
        return address
    found = os.environ.get("RAY_ADDRESS") or _started_here()
    if not found:
        raise ConfigError(
            f"launcher.address={RAY_AUTO}: no Ray cluster found (RAY_ADDRESS is not set and none "
            "was started on this machine); start one (ray start --head), name its head "
            f"(launcher.address=host:port), or let the job start its own "
            f"(launcher.address={RAY_LOCAL})"
        )
    return found


def _started_here() -> str | None:
    """The address Ray's `ray start --head` recorded in its temporary folder (Ray's own `auto`)."""
    system = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    try:
        return (Path(system) / "ray" / "ray_current_cluster").read_text().strip() or None
    except OSError:
        return None


def check_reachable(address: str) -> None:
    """One line where the head at `address` (host:port) does not accept a connection."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"launcher.address={address}: expected auto, local or host:port")
    reason = why_silent(host, int(port))
    if reason is not None:
        raise ConfigError(
            f"launcher.address={address}: no Ray cluster answers there ({reason}); start one "
            f"(ray start --head --port={port}) or name a running cluster's head"
        )


def check(launcher: DictConfig) -> None:
    """Under `launcher=ray`: one line where its cluster is not found or does not answer."""
    if OmegaConf.get_type(launcher) is not RayLauncherConfig:
        return
    address = head_address(str(launcher.address))
    if address is not None:
        check_reachable(address)
