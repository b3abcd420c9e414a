"""dpt installed from a wheel: the config groups ship in it, `dpt` works from any folder, under
torchrun (every rank, Hydra flags included), and finds its SLURM launcher plugin.

The wheel goes into a fresh virtual environment that sees this checkout's dependencies (torch,
Hydra, ...) through a .pth line, but not its editable dpt: setuptools' editable finder is itself
installed by a .pth file, which Python runs only in a site folder, and a folder named in a .pth
line is not one. So every `dpt` module, YAML file and plugin comes from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, Result, run_cmd

pytestmark = pytest.mark.slow

SMALL = ["dataset.num_samples=256", "dataset.num_val_samples=64", "trainer.max_steps=1"]
# Top-level folders of a checkout that are not sources (dpt/data is: only the top level counts).
NOT_SOURCES = {".git", ".venv", "outputs", "multirun", "data", "build", "dist", ".whl",
               ".pytest_cache", ".ruff_cache"}  # fmt: skip


def _not_sources(folder: str, names: list[str]) -> set[str]:
    skipped = {n for n in names if n == "__pycache__" or n.endswith(".egg-info")}
    return skipped | (NOT_SOURCES & set(names) if Path(folder) == REPO else set())


@dataclass
class Installed:
    wheel: Path
    python: Path
    dpt: Path
    elsewhere: Path  # a folder outside the checkout to run from

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> Result:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return run_cmd([*args], timeout=timeout, check=check, cwd=self.elsewhere, env=env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_not_sources)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist")]
    subprocess.run([*build, str(source)], check=True, timeout=180)
    (wheel,) = (root / "dist").glob("dpt-*.whl")
    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "checkout_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, timeout=180)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return Installed(wheel, python, env / "bin" / "dpt", elsewhere)


def test_the_wheel_ships_config_groups_plugin_and_entry_point(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = wheel.read(entry_points).decode()
    for shipped in (
        "dpt/conf/config.yaml",
        "dpt/conf/dataset/coco.yaml",
        "dpt/conf/experiment/coco_resnet18.yaml",
        "dpt/conf/hydra/help/dpt.yaml",
        "dpt/data/coco.py",
        "hydra_plugins/dpt_slurm_launcher/dpt_slurm_launcher.py",
    ):
        assert shipped in names, shipped
    assert "dpt = dpt.launch.cli:entry" in scripts


@pytest.mark.timeout(120)
def test_installed_dpt_is_the_wheel_not_the_checkout(installed: Installed) -> None:
    code = "import dpt, dpt.conf; print(dpt.__file__); print(dpt.conf.__file__)"
    result = installed.run(str(installed.python), "-c", code)
    for line in result.stdout.split():
        assert Path(line).is_relative_to(installed.python.parents[1]), line


@pytest.mark.timeout(120)
def test_installed_dpt_prints_its_config_and_finds_the_slurm_plugin(installed: Installed) -> None:
    job = installed.run(str(installed.dpt), "--cfg", "job", "strategy=ddp")
    assert "_target_: dpt.loop.strategy.DDP" in job.stdout
    plugins = installed.run(str(installed.dpt), "--info", "plugins")
    assert "DptSlurmLauncher" in plugins.stdout
    slurm = installed.run(str(installed.dpt), "launcher=slurm", "--cfg", "hydra")
    assert "dpt_slurm_launcher.DptSlurmLauncher" in slurm.stdout


@pytest.mark.timeout(180)
def test_installed_dpt_trains_one_step_from_another_folder(installed: Installed) -> None:
    installed.run(str(installed.dpt), *SMALL, "hydra.run.dir=one_step", timeout=150)
    metrics = json.loads((installed.elsewhere / "one_step" / "metrics.json").read_text())
    assert metrics["steps"] == 1


@pytest.mark.timeout(240)
def test_installed_dpt_under_torchrun_with_hydra_flags(installed: Installed) -> None:
    """Rank 1 composes from the same command line as rank 0: --config-dir, --config-name and a
    group option found only in that folder."""
    user_conf = installed.elsewhere / "my_conf"
    (user_conf / "model").mkdir(parents=True)
    (user_conf / "model" / "tiny.yaml").write_text("defaults:\n  - mlp\nhidden_dims: [8]\n")
    (user_conf / "my_job.yaml").write_text(
        "defaults:\n  - config\n  - _self_\nstrategy:\n  bucket_cap_mb: 1\n"
    )
    installed.run(
        str(installed.python),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(installed.dpt),
        "--config-dir",
        str(user_conf),
        "--config-name",
        "my_job",
        "strategy=ddp",
        "launcher=torchrun",
        "model=tiny",
        *SMALL,
        "hydra.run.dir=torchrun_run",
        timeout=200,
    )
    run = installed.elsewhere / "torchrun_run"
    assert json.loads((run / "metrics.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    config = (run / ".hydra" / "config.yaml").read_text()
    assert "- 8" in config and "bucket_cap_mb: 1" in config
