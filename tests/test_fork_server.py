"""The ranks of a local world fork from a server that imported torch and dpt while the launcher
went on (dpt/launch/fork_server.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dpt.launch import fork_server
from tests.helpers import REPO

# In a fresh interpreter: start the server (or keep it, if the environment and its imports are
# the same), then one process from it, as the elastic agent starts a rank. Returns what the rank
# put on its queue, its exit code, and whether this process had imported torch when the server
# had started.
LAUNCH_ONE = """
import json, multiprocessing, os, sys

def launch_one(rank, own_metrics=True):
    from dpt.launch import fork_server
    fork_server.start(own_metrics)
    launcher_torch = "torch" in sys.modules
    context = multiprocessing.get_context(fork_server.START_METHOD)
    queue = context.Queue()
    process = context.Process(target=rank, args=(queue,))
    process.start()
    found = queue.get(timeout=60)
    process.join()
    return found, process.exitcode, launcher_torch
"""

# What a rank found, and what the launcher had imported meanwhile.
PROBE = (
    LAUNCH_ONE
    + """
def rank(queue):
    queue.put({
        "preloaded": [
            m for m in ("torch", "torch._dynamo", "dpt.launch.worker",
                        "torch.distributed.checkpoint", "torchmetrics")
            if m in sys.modules
        ],
        # what torchmetrics is imported without for dpt's own metrics
        "hidden": [m for m in ("transformers", "scipy", "torchvision", "matplotlib")
                   if m in sys.modules],
        "gloo": os.environ.get("GLOO_SOCKET_IFNAME"),
        "parent": os.getppid(),
    })

if __name__ == "__main__":
    import dpt.launch.launchers
    found, exitcode, launcher_torch = launch_one(rank)
    found.update(launcher_torch=launcher_torch, launcher=os.getpid(),
                 launcher_gloo=os.environ.get("GLOO_SOCKET_IFNAME"), exitcode=exitcode)
    print(json.dumps(found))
"""
)


def _run_probe(tmp_path: Path, script: str, drop: Callable[[str], bool]) -> Any:
    """Run `script` in a fresh interpreter, without the variables `drop` names; its last line."""
    probe = tmp_path / "probe.py"  # a file: the rank's function must be found by name
    probe.write_text(script)
    env = {name: value for name, value in os.environ.items() if not drop(name)}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_forks_from_the_server_with_torch_and_dpt_imported(tmp_path: Path) -> None:
    found = _run_probe(tmp_path, PROBE, drop=lambda name: name.endswith("SOCKET_IFNAME"))
    preloaded = ["torch", "torch._dynamo", "dpt.launch.worker", "torch.distributed.checkpoint"]
    assert found["preloaded"] == [*preloaded, "torchmetrics"]
    assert found["hidden"] == []
    assert not found["launcher_torch"]  # the launcher's own torch import comes after the start
    assert found["parent"] != found["launcher"]  # forked by the server
    assert found["gloo"] == "lo"  # ranks' collectives on loopback ...
    assert found["launcher_gloo"] is None  # ... set for the server, not left in the launcher
    assert found["exitcode"] == 0


def test_a_chosen_interface_is_left_to_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert fork_server.collectives_on_loopback() == {"NCCL_SOCKET_IFNAME": "lo"}


# Launches from one process, as jobs of a sweep: the third sets a variable of its own, the fourth
# runs a task of the user's (its metrics may be any: the server imports no torchmetrics).
ENV_PROBE = (
    LAUNCH_ONE
    + """
from multiprocessing import forkserver

def rank(queue):
    queue.put([os.environ.get("DPT_PROBE_VARIABLE"), "torchmetrics" in sys.modules])

def launch(own_metrics=True):
    seen = launch_one(rank, own_metrics)[0]
    return forkserver._forkserver._forkserver_pid, seen

if __name__ == "__main__":
    first = launch()
    again = launch()
    os.environ["DPT_PROBE_VARIABLE"] = "job 2"
    changed = launch()
    custom = launch(own_metrics=False)
    print(json.dumps([first, again, changed, custom]))
"""
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_see_the_environment_of_their_launch(tmp_path: Path) -> None:
    probed = _run_probe(tmp_path, ENV_PROBE, drop="DPT_PROBE_VARIABLE".__eq__)
    first, again, changed, custom = probed
    assert first == again  # the same server, nothing changed
    assert first[1] == [None, True]
    assert changed[0] != first[0]  # a new server ...
    assert changed[1] == ["job 2", True]  # ... whose ranks see the variable
    assert custom[0] != changed[0]  # a new server, without torchmetrics
    assert custom[1] == ["job 2", False]
