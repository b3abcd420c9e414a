"""Every command on every page of the docs (README.md and docs/**/*.md) runs as written, from a
fresh folder, or is named in the skip list below with the reason.

Each page's ```bash blocks run in order, in one temporary folder of that page (with `scripts/`,
`examples/` and `train.py` of this checkout linked in): a page's commands may build on its earlier
ones (a fixture made, then trained on), never on another page's. Every line runs exactly as
written: nothing is added to it (no length, no run or sweep folder), so its runs go where a
user's go, `outputs/<date>/<time>` and `multirun/<date>/<time>` under that folder; a line that
would take too long says its own length (`trainer.max_steps=N`), as a user would type it. A line
the same as one on an earlier page runs there, once. Blocks tagged ```bash <tag> are a guide's
walk-through, run word for word by the test that checks what they make (`TAGGED`). The console
transcripts (```` ``` ```` blocks of `$ command` lines) must print what they show.

Where a command runs: `python train.py ...` and `dpt ...` lines that run no rank beside the
command's own process (no ddp/fsdp world, no torchrun, no sweep, no loader worker processes:
dataset num_workers=0) and need no GPU on this machine, and the config-only answers (`--cfg job`,
the transcripts' one-line errors), run in this process, through the command's entry point
(`dpt.launch.cli.main`; tests.helpers.train_in_process: `sys.argv`, the current folder, stdout,
stderr, logging and warnings as that command's process has them), which saves a Python and
torch start-up per line. So do the helper scripts (`python scripts/make_*.py`, `python -c`,
run as `__main__`: tests.helpers.python_in_process) and, in tagged blocks, the commands that
train nothing (`dpt-predict`, `dpt-generate`, `dpt-export`, `dpt-evaluate`, `dpt-tokenizer`,
through their installed entry points). That proves what the line's own words decide, the
whole run of its overrides, with the same exit code and output, and that it leaves nothing
behind (no child process, thread or run-folder lock; what it changed in this process is put
back).
What it leaves out, the process around the run (`train.py` itself, `cli.entry`, the exit), is the
same for every such line and is proven by the lines that run as subprocesses: the ddp, fsdp,
torchrun, sweep and image-model lines, each of which starts processes (ranks, a fork server,
loader workers) that are not to be forked from the test process. `dpt-shards` lines run their
installed command. On a machine with a GPU every training line runs as a subprocess:
`trainer.device=auto` would put CUDA into the test process, which forks later.
"""

from __future__ import annotations

import itertools
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    DOC_PAGES,
    REPO,
    Result,
    python_in_process,
    run_cmd,
    runs_in_process,
    train_in_process,
)

pytestmark = pytest.mark.slow

README = REPO / "README.md"
BIN = Path(sys.executable).parent

# Commands not run, by what they start with, and why.
SKIPPED = {
    "mlflow ui": "a server that runs until stopped; tests/test_trackers.py starts this very line",
    "bash scripts/setup.sh": "sets up the environment this test runs in",
    "source .venv/bin/activate": "shell setup; the test calls the environment's binaries directly",
    "tensorboard": "a server that runs until stopped",
    ".venv/bin/mkdocs": "tests/test_docs_site.py builds the site (--strict), reads what it made",
    "python -m benchmarks": "benchmarks of minutes; tests/test_bench.py covers them",
    "torchrun --nnodes=2": "needs two machines ($HEAD); tests/test_multinode.py runs two nodes",
    "python train.py -m launcher=slurm": "needs a SLURM cluster; tests/test_slurm.py starts one",
    "python train.py -m hydra/launcher=joblib hydra.launcher.n_jobs=2 strategy=ddp": (
        "this very line runs, as written, in tests/test_sweeps.py::"
        "test_the_guides_joblib_sweep_runs_two_ddp_jobs_at_once, which also checks that the two "
        "jobs overlap"
    ),
}
# ```bash <tag> blocks: a guide's walk-through, run word for word (tests.helpers.run_docs_block)
# by the test that checks what its lines made.
TAGGED = {
    "own-model": "tests/test_own_model.py",
    "tasks": "tests/test_task_readme.py",
    "lm": "tests/test_task_readme.py",
    "hf": "tests/test_hf_models.py",
    "finetune": "tests/test_lora_runs.py",
    "pipeline": "tests/test_pipeline_runs.py",
    "tracking": "tests/test_trackers.py",
    "ray": "tests/test_ray.py",
}
PROGRAMS = {
    "python": [sys.executable],
    "dpt": [str(BIN / "dpt")],
    "dpt-shards": [str(BIN / "dpt-shards")],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _fences(page: Path) -> list[tuple[str, str]]:
    """(info string, text) of each fenced block of `page`, in order."""
    blocks, lines, fence = [], [], None
    for line in page.read_text().splitlines():
        if not line.startswith("```"):
            lines.append(line)
        elif fence is None:  # an opening fence
            fence, lines = line[3:].strip(), []
        else:  # its closing fence
            blocks.append((fence, "\n".join(lines)))
            fence = None
    return blocks


def _bash_commands(page: Path) -> list[str]:
    """Each command line of the page's untagged ```bash blocks, continuation lines joined,
    comments dropped."""
    commands = []
    for _, block in (b for b in _fences(page) if b[0] == "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.split(r"\s#\s", line, maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    return commands


def _transcripts(page: Path) -> list[tuple[str, str]]:
    """(`$ command`, the line it prints) from the page's plain ``` blocks."""
    pairs = []
    for _, block in (b for b in _fences(page) if b[0] == ""):
        lines = block.splitlines()
        pairs += [(a[2:], b) for a, b in itertools.pairwise(lines) if a.startswith("$ ")]
    return pairs


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _cases() -> list[tuple[str, int, str, str | None]]:
    """(page, index, command, why it is not run here) of every command of every page."""
    cases, first = [], {}
    for page in DOC_PAGES:
        for index, command in enumerate(_bash_commands(page)):
            reason = next((w for s, w in SKIPPED.items() if command.startswith(s)), None)
            if reason is None and command in first and _is_a_run_of_its_own(command):
                reason = f"the same line runs on {first[command]}"
            first.setdefault(command, f"{_name(page)} (command {index})")
            cases.append((_name(page), index, command, reason))
    return cases


def _is_a_run_of_its_own(command: str) -> bool:
    """A training line whose folder the test picks: nothing later on its page reads what it
    made (a helper script's files, or a run folder the page names, are read by later lines)."""
    runs = command.startswith(("dpt ", "python train.py"))
    return runs and "hydra.run.dir=" not in command and "hydra.sweep.dir=" not in command


CASES = _cases()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each page's fresh folder, laid out like a checkout's root, without outputs or data."""
    made: dict[str, Path] = {}
    for page in DOC_PAGES:
        root = tmp_path_factory.mktemp(page.stem)
        for name in ("scripts", "examples", "train.py"):
            (root / name).symlink_to(REPO / name)
        made[_name(page)] = root
    return made


def _split_env(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """`NAME=value ... program args` -> ({NAME: value}, [program, args])."""
    env = {}
    while args and re.fullmatch(r"[A-Z_]+=.*", args[0]):
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    return env, args


def _argv(args: list[str]) -> list[str]:
    """The command's words with its program resolved, and nothing else changed."""
    return PROGRAMS[args[0]] + args[1:]


def _run(args: list[str], folder: Path, timeout: float, env: dict[str, str] | None = None,
         check: bool = True) -> Result:  # fmt: skip
    """`args` (from `_argv`) run from `folder`: in this process where `runs_in_process` says so
    (a PYTHONPATH of the line becomes the import path it gives), else as a command; fails on a
    non-zero exit where `check`."""
    env = env or {}
    helper = args[0] == sys.executable and (args[1] == "-c" or args[1].endswith(".py"))
    if helper and args[1] != "train.py" and not env:  # a helper script: it trains nothing
        result = python_in_process(*args[1:], cwd=folder)
        assert not check or result.returncode == 0, f"exit {result.returncode}\n{result.output}"
        return result
    if args[:2] == [sys.executable, "train.py"]:
        script, overrides = "train.py", args[2:]
    elif args[0] == PROGRAMS["dpt"][0]:
        script, overrides = "dpt", args[1:]
    else:  # a helper script, torchrun, dpt-shards: their own process
        script, overrides = None, []
    in_process = script and set(env) <= {"PYTHONPATH"} and runs_in_process(overrides, folder)
    if not in_process:
        return run_cmd(args, timeout=timeout, cwd=folder, env=env, check=check)
    paths = tuple(folder / p for p in env.get("PYTHONPATH", "").split(":") if p)
    result = train_in_process(*overrides, cwd=folder, import_from=paths, script=script)
    assert not check or result.returncode == 0, f"exit {result.returncode}\n{result.output}"
    return result


def test_the_readme_leads_with_setup_and_run_then_setup_and_test() -> None:
    commands = _bash_commands(README)
    assert commands[0] == "bash scripts/setup.sh && .venv/bin/python train.py"
    assert commands[1] == "bash scripts/setup.sh && .venv/bin/python -m pytest"
    assert len(README.read_text().splitlines()) < 150


def test_every_command_block_is_run_here_or_by_the_test_its_tag_names() -> None:
    tags_used = set()
    for page in DOC_PAGES:
        for info, _ in _fences(page):
            words = info.split()
            if words[:1] != ["bash"] or len(words) == 1:
                continue
            assert len(words) == 2 and words[1] in TAGGED, f"{_name(page)}: ```{info} runs nowhere"
            tags_used.add(words[1])
    for tag, test in TAGGED.items():
        assert f'run_docs_block("{tag}"' in (REPO / test).read_text(), (tag, test)
    assert tags_used == set(TAGGED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("page", "index", "command", "reason"), CASES, ids=[f"{p}:{i}:{c[:50]}" for p, i, c, _ in CASES]
)
def test_docs_command_runs(
    folders: dict[str, Path], page: str, index: int, command: str, reason: str | None
) -> None:
    if reason:
        pytest.skip(reason)
    env, args = _split_env(shlex.split(command))
    folder = folders[page]
    result = _run(_argv(args), folder, timeout=280, env=env)
    # What a first run must not meet: DataLoader's "N worker processes" warnings, a silent
    # warmup longer than the run.
    assert "worker processes in total" not in result.output
    assert "never leaves the warmup" not in result.output


TRANSCRIPTS = [(_name(page), *pair) for page in DOC_PAGES for pair in _transcripts(page)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("page", "command", "shown"), TRANSCRIPTS)
def test_docs_transcript(folders: dict[str, Path], page: str, command: str, shown: str) -> None:
    folder = folders[page]
    result = _run(_argv(shlex.split(command)), folder, timeout=60, check=False)
    assert result.stderr.strip() == shown
