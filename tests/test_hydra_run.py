"""A plain run skips Hydra's mode probe (dpt/launch/hydra_run.py) and is the same run as under
`hydra.main`: same Hydra config and job config; anything that could set `hydra.mode` still goes
through the probe."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from dpt.config.store import register_configs
from dpt.launch import hydra_run
from dpt.launch.hydra_run import CONFIG_NAME, CONFIG_PATH, hydra_app, hydra_args

CONF = Path(__file__).resolve().parents[1] / "dpt" / "conf"


@pytest.fixture(autouse=True)
def _clear_hydra() -> Any:
    register_configs()  # the schemas dpt's config extends, as dpt.launch.cli registers them
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@pytest.mark.parametrize(
    ("overrides", "plain"),
    [
        ([], True),
        (["trainer.max_steps=3", "strategy=ddp", "hydra.run.dir=/tmp/x"], True),
        (["hydra.job.chdir=false", "hydra.verbose=true", "hydra.output_subdir=null"], True),
        (["hydra.mode=MULTIRUN"], False),
        (["++hydra.mode=MULTIRUN"], False),
        (["hydra/launcher=basic"], False),
        (["hydra.searchpath=[file:///tmp/mine]"], False),
        (["+hydra.searchpath=[file:///tmp/mine]"], False),
        (["hydra=something"], False),
    ],
)
def test_the_probe_is_skipped_only_for_overrides_that_cannot_set_the_mode(
    overrides: list[str], plain: bool
) -> None:
    assert hydra_run.plain_run(hydra_args(overrides)) is plain


@pytest.mark.parametrize(
    "flags",
    [
        ["-m"],
        ["--cfg", "job"],
        ["--info", "config"],
        ["--config-dir", "/tmp"],
        ["--config-name", "x"],
    ],
)
def test_other_commands_go_through_hydra_main(flags: list[str]) -> None:
    assert not hydra_run.plain_run(hydra_args([*flags, "trainer.max_steps=3"]))


def test_a_search_path_beyond_dpt_configs_goes_through_the_probe(tmp_path: Path) -> None:
    assert hydra_run.only_dpt_configs(hydra_app(hydra_args([])))
    GlobalHydra.instance().clear()
    extra = hydra_app(hydra_args(["--config-dir", str(tmp_path)]))
    assert not hydra_run.only_dpt_configs(extra)


def _options() -> list[str]:
    groups = [g for g in CONF.iterdir() if g.is_dir() and g.name not in ("hydra", "__pycache__")]
    return [f"{g.name}={f.stem}" for g in sorted(groups) for f in sorted(g.glob("*.yaml"))]


@pytest.mark.parametrize("option", _options())
def test_no_dpt_config_sets_the_run_mode(option: str) -> None:
    """The premise of the skipped probe: composed as `Hydra.get_mode` composes (MULTIRUN, no
    sweep check), every option of every shipped group leaves `hydra.mode` unset."""
    app = hydra_app(hydra_args([]))
    cfg = app.compose_config(
        CONFIG_NAME,
        [option],
        run_mode=RunMode.MULTIRUN,
        with_log_configuration=False,
        validate_sweep_overrides=False,
    )
    assert cfg.hydra.mode is None, option


def _job_probe() -> Any:
    """A Hydra main like dpt's, whose job records the Hydra config and job config it got."""
    seen: dict[str, Any] = {}

    @hydra.main(config_path=CONFIG_PATH, config_name=CONFIG_NAME, version_base="1.3")
    def job(cfg: DictConfig) -> None:
        hydra_cfg = OmegaConf.to_container(HydraConfig.get(), resolve=False)
        assert isinstance(hydra_cfg, dict)
        hydra_cfg.pop("runtime")  # the output folder and working directory of each run
        hydra_cfg["run"].pop("dir")
        seen.update(mode=HydraConfig.get().mode, hydra=hydra_cfg, job=OmegaConf.to_yaml(cfg))

    return job, seen


def _run(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], through_probe: bool = False
) -> dict[str, Any]:
    job, seen = _job_probe()
    monkeypatch.setattr(sys, "argv", ["dpt", *argv])
    if through_probe:
        job()  # hydra.main itself
    else:
        hydra_run.run_hydra_main(job, hydra_args(argv))
    GlobalHydra.instance().clear()
    return seen


def test_a_plain_run_is_the_run_hydra_main_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    composes: list[RunMode] = []  # Hydra's mode probe composes as MULTIRUN, the run as RUN
    from hydra._internal.hydra import Hydra

    compose = Hydra.compose_config

    def counted(self: Hydra, *args: Any, **kwargs: Any) -> Any:
        composes.append(kwargs["run_mode"])
        return compose(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counted)
    argv = ["trainer.max_steps=7", "strategy=ddp", "hydra.run.dir=run"]  # in each cwd below
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    fast = _run(monkeypatch, argv)
    assert composes == [RunMode.RUN]  # one compose, no probe
    monkeypatch.chdir(tmp_path / "b")
    slow = _run(monkeypatch, argv, through_probe=True)
    assert composes == [RunMode.RUN, RunMode.MULTIRUN, RunMode.RUN]
    assert fast["mode"] == slow["mode"] == RunMode.RUN
    assert fast["job"] == slow["job"]
    assert fast["hydra"] == slow["hydra"]  # overrides (hydra.mode=RUN too), callbacks, job, ...
    for saved in ("config.yaml", "overrides.yaml"):
        fast_file, slow_file = (tmp_path / d / "run" / ".hydra" / saved for d in "ab")
        assert fast_file.read_text() == slow_file.read_text()


def test_a_config_that_sets_the_mode_still_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's config (here dpt's, with `hydra.mode: MULTIRUN`) makes a plain command a sweep,
    as under `hydra.main`."""
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - config\n  - _self_\nhydra:\n  mode: MULTIRUN\n"
    )
    argv = ["--config-dir", str(tmp_path), "--config-name", "mine"]
    seen = _run(monkeypatch, [*argv, f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert seen["mode"] == RunMode.MULTIRUN
    assert (tmp_path / "sweep" / "0" / ".hydra" / "config.yaml").exists()
