"""The world a cloud launcher's variables describe, as torchrun's own (`PET_*`).

torchrun takes each of its options from a `PET_<OPTION>` variable where the command line leaves
it out; Kubeflow's operators set those (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT). SkyPilot and dstack describe the cluster in variables of their
own; `dpt-torchrun` maps them onto torchrun's before it reads its options, so that a task file's
command is `dpt-torchrun train.py launcher=torchrun ...` on every engine. What the command line
or a PET_ variable already says wins.
"""

from __future__ import annotations

from collections.abc import Mapping


def _skypilot(env: Mapping[str, str]) -> dict[str, str]:
    """SkyPilot: SKYPILOT_NODE_IPS (one per line, the head first), SKYPILOT_NODE_RANK,
    SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE."""
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    if not ips or "SKYPILOT_NODE_RANK" not in env:
        return {}
    return {"NNODES": env.get("SKYPILOT_NUM_NODES", str(len(ips))),
            "NODE_RANK": env["SKYPILOT_NODE_RANK"], "MASTER_ADDR": ips[0],
            **_processes(env.get("SKYPILOT_NUM_GPUS_PER_NODE"))}  # fmt: skip


def _dstack(env: Mapping[str, str]) -> dict[str, str]:
    """dstack: DSTACK_MASTER_NODE_IP, DSTACK_NODE_RANK, DSTACK_NODES_NUM, DSTACK_GPUS_PER_NODE."""
    if "DSTACK_MASTER_NODE_IP" not in env or "DSTACK_NODE_RANK" not in env:
        return {}
    return {"NNODES": env.get("DSTACK_NODES_NUM", "1"), "NODE_RANK": env["DSTACK_NODE_RANK"],
            "MASTER_ADDR": env["DSTACK_MASTER_NODE_IP"],
            **_processes(env.get("DSTACK_GPUS_PER_NODE"))}  # fmt: skip


def _processes(gpus: str | None) -> dict[str, str]:
    """A rank per GPU; a node without GPUs: torchrun's own count (its option, or 1)."""
    return {"NPROC_PER_NODE": gpus} if gpus and gpus.isdigit() and int(gpus) > 0 else {}


ENGINES = (_skypilot, _dstack)


def torchrun_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The PET_ variables the first engine found in `env` describes, but those `env` sets."""
    for engine in ENGINES:
        found = engine(env)
        if found:
            return {f"PET_{key}": value for key, value in found.items()
                    if f"PET_{key}" not in env}  # fmt: skip
    return {}
