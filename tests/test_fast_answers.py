"""`--help`, `--cfg job` and every config error answer at once: they import the config machinery
(Hydra and its own packages) and dpt's checks, never torch, numpy or a tracker. What is imported
is checked, not how long it took: a timed bound fails on a busy machine (the seconds to an answer
belong in the benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf

from dpt.launch.cli import launcher_prefix
from tests.helpers import REPO

# Runs dpt's entry point in a fresh interpreter and reports, after it exits, the top-level
# packages outside the standard library it ever imported (sys.modules keeps every one).
PROBE = """
import sys
from dpt.launch.cli import main
sys.argv = ["dpt", *sys.argv[1:]]
try:
    main()
    code = 0
except SystemExit as stop:
    code = stop.code or 0
top = {name.partition(".")[0] for name in sys.modules}
found = sorted(n for n in top - set(sys.stdlib_module_names) if not n.startswith("_"))
print(f"PROBE imported={','.join(found)} exit={code}", file=sys.stderr)
"""
# Hydra, its parser and configs (antlr4, omegaconf, yaml, attr, packaging) and dpt itself;
# cython_runtime is the compiled YAML reader's.
CONFIG_MACHINERY = {"antlr4", "attr", "cython_runtime", "dpt", "hydra", "hydra_plugins",
                    "omegaconf", "packaging", "yaml"}  # fmt: skip

CASES = {
    "help": (["--help"], 0),
    "cfg job": (["--cfg", "job", "strategy=ddp", "dataset=coco"], 0),
    "unknown key": (["trainer.lr=0.1"], 1),
    "unknown option": (["strategy=zero3"], 1),
    "wrong type": (["trainer.batch_size=abc"], 1),
    "out of range": (["trainer.batch_size=0"], 1),
    "optimizer betas": (["optimizer.betas=[0.9,1.5]"], 1),
    "seed range": (["trainer.seed=4294967296"], 1),
    "comm hook": (["strategy=ddp", "strategy.comm_hook=int8"], 1),
    "fsdp precision": (["strategy=fsdp", "trainer.precision=16-mixed"], 1),
    "early stopping": (["trainer.early_stopping.patience=2", "dataset.num_val_samples=0"], 1),
}


def _probe(args: list[str], cwd: Path) -> tuple[set[str], int, str]:
    """The packages the answer imported, its exit code and what it wrote to stderr."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args, f"hydra.run.dir={cwd}/run"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = result.stderr.rstrip().rpartition("\n")[2]
    assert line.startswith("PROBE imported="), result.stderr
    imported, _, code = line.removeprefix("PROBE imported=").partition(" exit=")
    return set(imported.split(",")), int(code), result.stderr


@pytest.mark.slow  # a fresh interpreter each
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "code"), CASES.values(), ids=CASES.keys())
def test_answers_import_only_the_config_machinery(
    tmp_path: Path, args: list[str], code: int
) -> None:
    imported, exit_code, stderr = _probe(args, tmp_path)
    assert exit_code == code, stderr
    assert imported - CONFIG_MACHINERY == set(), stderr
    if code:
        assert stderr.startswith("Error: "), stderr
        assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.timeout(60)
def test_help_says_what_dpt_is_with_the_user_groups_and_main_keys() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--help", "model=resnet18"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    text = result.stdout
    assert text.startswith("dpt: data-parallel training for PyTorch")
    conf = REPO / "dpt" / "conf"
    # The config groups: the folders of options (not Python's __pycache__ of dpt.conf)
    groups = (p for p in conf.iterdir() if p.is_dir() and any(p.glob("*.yaml")))
    for group in sorted(p for p in groups if p.name != "hydra"):
        options = ", ".join(sorted(f.stem for f in group.glob("*.yaml")))
        assert f"\n{group.name}: {options}\n" in text, group.name
    assert "schema" not in text  # the internal schema/* groups stay out of sight
    assert "model=resnet18 dataset=synthetic strategy=single" in text  # this command's choices
    for key in ("trainer.max_steps", "trainer.batch_size", "dataset.num_samples", "hydra.run.dir"):
        assert f"\n{key}=" in text, key


def test_launcher_lines_carry_the_job_number_in_a_sweep() -> None:
    run = OmegaConf.create({"mode": RunMode.RUN, "job": {"num": 0}})
    sweep = OmegaConf.create({"mode": RunMode.MULTIRUN, "job": {"num": 3}})
    assert launcher_prefix(run) == "launcher"
    assert launcher_prefix(sweep) == "launcher job 3"
