"""Run `train.py` the way a user does, in its own process group, with a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"

# Small and quick: 20 steps of batch 64 on the synthetic task.
FAST = ["dataset.num_samples=2048", "dataset.num_val_samples=256", "trainer.log_every_n_steps=5"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def run_cmd(
    cmd: list[str],
    timeout: float = 120,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: Path = REPO,
) -> Result:
    """Run a command; on timeout kill its whole process group (workers included) and fail."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd}\n{stdout}\n{stderr}") from None
    result = Result(proc.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{result.output}")
    return result


def train(
    run_dir: Path | None,
    *overrides: str,
    timeout: float = 120,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> Result:
    cmd = [sys.executable, str(TRAIN), *overrides]
    if run_dir is not None:
        cmd.append(f"hydra.run.dir={run_dir}")
    return run_cmd(cmd, timeout=timeout, env=env, check=check)


def load_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
