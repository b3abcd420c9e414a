"""Every command in README.md runs as written, from a fresh folder.

The commands come out of the README's ```bash blocks, in order, and run in one temporary folder
(with `scripts/` and `train.py` of this checkout linked in, and a COCO fixture made by the
README's own command). A run that does not set it gets `trainer.max_steps=2`, as the README says
to keep CPU runs short, and its own `hydra.run.dir` (`hydra.sweep.dir` for `-m`) in that folder.
The console transcripts (```` ``` ```` blocks of `$ command` lines) must print what they show.

Where a command runs: `python train.py ...` lines that run no rank beside the command's own
process (no ddp/fsdp world, no torchrun, no sweep, no loader worker processes: dataset
num_workers=0) and need no GPU on this machine, and the config-only answers (`--cfg job`, the
transcripts' one-line errors), run in this process, through the command's entry point
(`dpt.launch.cli.main`; tests.helpers.train_in_process: `sys.argv`, the current folder, stdout,
stderr, logging and warnings as that command's process has them), which saves a Python and
torch start-up per line. That proves what the line's own words decide, the whole run of its
overrides, with the same exit code and output, and that it leaves nothing behind (no child
process, thread or run-folder lock; what it changed in this process is put back).
What it leaves out, the process around the run (`train.py` itself, `cli.entry`, the exit), is the
same for every `python train.py` line and is proven by the lines that run as subprocesses: the
ddp, fsdp, torchrun, sweep and image-model lines, each of which starts processes (ranks, a fork
server, loader workers) that are not to be forked from the test process. `dpt` and `dpt-shards`
lines run their installed commands. On a machine with a GPU every training line runs as a
subprocess: `trainer.device=auto` would put CUDA into the test process, which forks later.
"""

from __future__ import annotations

import itertools
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, Result, run_cmd, runs_in_process, train_in_process

pytestmark = pytest.mark.slow

README = REPO / "README.md"
BIN = Path(sys.executable).parent

# Commands not run, by what they start with, and why.
SKIPPED = {
    "bash scripts/setup.sh": "sets up the environment this test runs in",
    "source .venv/bin/activate": "shell setup; the test calls the environment's binaries directly",
    "tensorboard": "a server that runs until stopped",
    "python -m benchmarks": "benchmarks of minutes; tests/test_bench.py covers them",
    "torchrun --nnodes=2": "needs two machines ($HEAD); tests/test_multinode.py runs two nodes",
    "python train.py -m launcher=slurm": "needs a SLURM cluster; tests/test_slurm.py starts one",
    "python train.py -m hydra/launcher=joblib hydra.launcher.n_jobs=2 strategy=ddp": (
        "this very sweep (trainer.seed=1,2) runs in tests/test_sweeps.py::"
        "test_joblib_runs_two_ddp_jobs_at_once, which also checks that the two jobs overlap"
    ),
}
# Runs whose meaning depends on their length: run as written, never shortened.
AS_WRITTEN = ("scheduler=warmup_cosine",)
SHORT = "trainer.max_steps=2"


def _blocks(language: str) -> list[str]:
    """The text of each fenced block opened with ```<language>, in order."""
    blocks, lines, fence = [], [], None
    for line in README.read_text().splitlines():
        if not line.startswith("```"):
            lines.append(line)
        elif fence is None:  # an opening fence
            fence, lines = line[3:].strip(), []
        else:  # its closing fence
            if fence == language:
                blocks.append("\n".join(lines))
            fence = None
    return blocks


def _bash_commands() -> list[str]:
    """Each command line of the ```bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.split(r"\s#\s", line, maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    return commands


def _transcripts() -> list[tuple[str, str]]:
    """(`$ command`, the line it prints) from the plain ``` blocks."""
    pairs = []
    for block in _blocks(""):
        lines = block.splitlines()
        pairs += [(a[2:], b) for a, b in itertools.pairwise(lines) if a.startswith("$ ")]
    return pairs


COMMANDS = _bash_commands()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder laid out like a checkout's root, without its outputs or data."""
    root = tmp_path_factory.mktemp("readme")
    (root / "scripts").symlink_to(REPO / "scripts")
    (root / "train.py").symlink_to(REPO / "train.py")
    return root


def _argv(command: str, index: int, folder: Path) -> list[str]:
    args = shlex.split(command)
    sweep = "-m" in args
    program = {
        "python": [sys.executable],
        "dpt": [str(BIN / "dpt")],
        "dpt-shards": [str(BIN / "dpt-shards")],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }[args[0]]
    args = program + args[1:]
    if "train.py" not in command and not command.startswith("dpt "):
        return args  # a helper script, not a run
    overrides = " ".join(args)
    if "--cfg" in args or "--help" in args:
        return args
    if "trainer.max_steps=" not in overrides and not any(a in overrides for a in AS_WRITTEN):
        args.append(SHORT)
    if sweep:
        args.append(f"hydra.sweep.dir={folder}/sweep{index:02d}")
    elif "hydra.run.dir=" not in overrides:
        args.append(f"hydra.run.dir={folder}/run{index:02d}")
    return args


def _run(args: list[str], folder: Path, timeout: float, check: bool = True) -> Result:
    """`args` (from `_argv`) run from `folder`: in this process where `runs_in_process` says so,
    else as a command; fails on a non-zero exit where `check`."""
    if args[:2] != [sys.executable, "train.py"] or not runs_in_process(args[2:], folder):
        return run_cmd(args, timeout=timeout, cwd=folder, check=check)
    result = train_in_process(*args[2:], cwd=folder, script="train.py")
    assert not check or result.returncode == 0, f"exit {result.returncode}\n{result.output}"
    return result


def _skip_reason(command: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if command.startswith(start)), None)


def test_the_readme_leads_with_setup_and_run_then_setup_and_test() -> None:
    assert COMMANDS[0] == "bash scripts/setup.sh && .venv/bin/python train.py"
    assert COMMANDS[1] == "bash scripts/setup.sh && .venv/bin/python -m pytest"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("index", "command"), list(enumerate(COMMANDS)), ids=[c[:60] for c in COMMANDS]
)
def test_readme_command_runs(folder: Path, index: int, command: str) -> None:
    reason = _skip_reason(command)
    if reason:
        pytest.skip(reason)
    result = _run(_argv(command, index, folder), folder, timeout=280)
    # What a first run must not meet: DataLoader's "N worker processes" warnings, a silent
    # warmup longer than the run.
    assert "worker processes in total" not in result.output
    assert "never leaves the warmup" not in result.output


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("command", "shown"), _transcripts())
def test_readme_transcript(folder: Path, command: str, shown: str) -> None:
    args = [sys.executable, *shlex.split(command)[1:], f"hydra.run.dir={folder}/transcript"]
    result = _run(args, folder, timeout=60, check=False)
    assert result.stderr.strip() == shown
