"""The local SLURM cluster (scripts/slurm_local.sh) as a pytest fixture, shared by the SLURM tests.

Needs root and apt (Debian): the fixture installs slurm-wlm + munge if missing and starts the
daemons once per test session (tests/conftest.py registers `slurm_cluster`). Where that is
impossible the tests FAIL (so CI can never silently skip them) unless DPT_SKIP_SLURM=1 is set,
which skips them. A cluster that was already up before the session is left running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "slurm_local.sh"
STATE_DIR = os.environ.get("DPT_SLURM_STATE_DIR", "/tmp/dpt-slurm")
_EXPORT = re.compile(r"^export (\w+)=(.*)$")


def _unavailable_reason() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "scripts/slurm_local.sh needs root to install and run the SLURM daemons"
    binaries = ("slurmctld", "slurmd", "sbatch", "munged")
    if not all(shutil.which(b) for b in binaries) and shutil.which("apt-get") is None:
        return "SLURM is not installed and apt-get is unavailable to install it"
    return None


def _run_script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args, STATE_DIR],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    """Start the local cluster (unless already up) and export SLURM_CONF + the sacct shim."""
    if os.environ.get("DPT_SKIP_SLURM") == "1":
        pytest.skip("DPT_SKIP_SLURM=1")
    reason = _unavailable_reason()
    if reason is not None:
        pytest.fail(f"{reason} (set DPT_SKIP_SLURM=1 to skip the slurm tests)")
    already_up = _run_script("status", timeout=30).returncode == 0
    proc = _run_script("start", timeout=110)
    if proc.returncode != 0:
        pytest.fail(f"slurm_local.sh start failed:\n{proc.stdout}\n{proc.stderr}")
    env = {}
    for line in proc.stdout.splitlines():
        match = _EXPORT.match(line.strip())
        if match:
            env[match.group(1)] = match.group(2).replace("$PATH", os.environ.get("PATH", ""))
    assert "SLURM_CONF" in env and "PATH" in env, proc.stdout
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        yield env
    if not already_up:
        stop = _run_script("stop", timeout=60)
        assert stop.returncode == 0, stop.stderr
