"""Two "hosts" on one machine: network namespaces with their own addresses (root only).

A thin wrapper over scripts/netns_two_hosts.sh, which says how the hosts are wired.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from tests.helpers import REPO

NETNS_SCRIPT = REPO / "scripts" / "netns_two_hosts.sh"


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def prefix(self, *env: str) -> list[str]:
        """Run a command on this host, with extra environment variables (`NAME=value`)."""
        return ["ip", "netns", "exec", self.namespace, "env", *env]


@dataclass(frozen=True)
class TwoHosts:
    name: str
    hosts: tuple[Host, Host]

    def unplug(self, index: int) -> None:
        """Pull host `index`'s cable: its packets are dropped silently, nothing is reset."""
        _script("unplug", self.name, str(index))


def unavailable() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


def up(name: str) -> TwoHosts:
    out = _script("up", name).stdout
    lines = [line.split() for line in out.splitlines()]
    first, second = (Host(namespace, address) for namespace, address, _ in lines)
    return TwoHosts(name, (first, second))


def down(name: str) -> None:
    _script("down", name)


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(NETNS_SCRIPT), *args], capture_output=True, text=True, timeout=30, check=True
    )
