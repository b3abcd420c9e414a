"""docs/reference/config.md: generated from the schemas (scripts/config_reference.py), every key of
every group listed with its type, default and comment, and saying what `dpt --help` says."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from dpt.config.datasets import ShardsConfig
from dpt.config.store import SCHEMAS
from dpt.launch.cli import show_help
from scripts import config_reference as reference
from tests.helpers import REPO

PAGE = REPO / "docs" / "reference" / "config.md"


@pytest.fixture(scope="module")
def generated() -> str:
    return reference.page()


@pytest.mark.slow  # the page generated: every option of every group composed
def test_the_page_is_what_the_schemas_and_options_say(generated: str) -> None:
    assert PAGE.read_text() == generated, (
        "docs/reference/config.md is not current: python scripts/config_reference.py "
        "--out docs/reference/config.md"
    )


@pytest.mark.slow  # the page generated: every option of every group composed
def test_every_key_of_every_group_is_listed_and_no_other(generated: str) -> None:
    assert reference.differences(PAGE.read_text()) == []
    titles = {title for title, _ in reference.page_keys(PAGE.read_text())}
    options = {f"{g}={o}" for g, opts in SCHEMAS.items() for o in opts}
    assert options | set(reference.ALWAYS) <= titles
    assert ("trainer", "trainer.early_stopping.patience") in reference.page_keys(generated)


def _without(schema: type, name: str) -> type:
    """A copy of `schema` without its field `name`."""
    kept = [(f.name, f.type, f) for f in dataclasses.fields(schema) if f.name != name]
    return dataclasses.make_dataclass(schema.__name__, kept)


def test_a_key_dropped_from_a_schema_fails_the_check() -> None:
    schemas = {group: dict(options) for group, options in SCHEMAS.items()}
    schemas["dataset"]["shards"] = _without(ShardsConfig, "outage_s")
    assert reference.differences(PAGE.read_text(), schemas) == [
        "on the page but in no schema: dataset=shards: dataset.outage_s"
    ]


def test_a_key_missing_from_the_page_fails_the_check() -> None:
    lines = PAGE.read_text().splitlines()
    text = "\n".join(line for line in lines if not line.startswith("| `monitor.max_rollbacks`"))
    assert reference.differences(text) == ["missing from the page: monitor: monitor.max_rollbacks"]


def test_a_key_without_a_comment_is_refused() -> None:
    @dataclasses.dataclass
    class Uncommented:
        width: int = 3

    with pytest.raises(ValueError, match=r"^model=x: no comment for model\.width$"):
        reference._section("model=x", Uncommented, "model", {"width": 3}, "", {})


@pytest.mark.slow  # the page generated: every option of every group composed
def test_comments_come_from_the_yaml_then_the_schema(generated: str) -> None:
    assert (  # the YAML's two lines, the one at the key's end and the one aligned under it
        "| `dataset.outage_s` | `float` | `120.0` | seconds a source that does not answer "
        "(refused, timed out, 5xx) is retried (the same backoff, at most 8 s): past it the run "
        "stops with a checkpoint; the same command resumes |"
    ) in generated
    assert (  # the schema's comment lines above the field
        "| `trainer.on_nonfinite` | `str` | `error` | What a NaN or infinite loss"
    ) in generated
    assert "| `strategy.comm_hook` | `str or null` | `null` |" in generated


@pytest.fixture(scope="module")
def help_text() -> str:
    import contextlib
    import io

    out = io.StringIO()
    hydra_cfg = HydraConfig.instance().cfg  # Hydra's help sets it: the next run here reads it
    GlobalHydra.instance().clear()
    try:
        with contextlib.redirect_stdout(out):
            show_help(["--help"])
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = hydra_cfg
    return out.getvalue()


def test_help_and_reference_name_the_same_groups_and_options(help_text: str) -> None:
    listed = dict(re.findall(r"^(\w+): (\w+(?:, \w+)*)$", help_text, re.M))
    for group in (*SCHEMAS, "experiment"):
        on_page = re.search(r"^Options: (.*)\.$", _group_part(group), re.M)
        options = on_page.group(1).replace("`", "") if on_page else _experiments()
        assert listed[group] == options, group


def _group_part(group: str) -> str:
    return PAGE.read_text().split(f"## `{group}`\n", 1)[1].split("\n## ", 1)[0]


def _experiments() -> str:
    return ", ".join(re.findall(r"^### `experiment=(\w+)`", PAGE.read_text(), re.M))


@pytest.mark.slow  # the page generated: every option of every group composed
def test_help_main_keys_have_the_reference_defaults(help_text: str, generated: str) -> None:
    defaults = dict(re.findall(r"^\| `([\w.]+)` \| `[^`]+` \| `([^`]*)` \|", generated, re.M))
    main = help_text.split("== Main keys ==\n", 1)[1].split("\n\n", 1)[0]
    checked = 0
    for key, value in re.findall(r"^([\w./]+)=(\S+)", main, re.M):
        if key.startswith(("hydra", "task.loss")) or value == "...":
            continue  # Hydra's own keys; a key whose default differs by option
        assert key in defaults, f"dpt --help names {key}, the reference does not"
        same = yaml.safe_load(defaults[key]) == yaml.safe_load(value)  # 20 and 20.0 alike
        assert same, f"{key}: --help says {value}, the reference {defaults[key]}"
        checked += 1
    assert checked >= 15


def test_help_composed_config_keys_are_the_reference_keys_of_the_default_job(
    help_text: str,
) -> None:
    shown = help_text.split("== The composed config", 1)[1].split("\n", 1)[1]
    composed = OmegaConf.to_container(OmegaConf.create(shown.split("\n--help", 1)[0]))
    keys = {key for key, _ in reference._leaves(composed, "")}
    choices = reference.default_choices().items()  # logger: a list
    chosen = {f"{g}={o}" for g, found in choices
              for o in (found if isinstance(found, list) else [found])}  # fmt: skip
    chosen |= set(reference.ALWAYS)
    listed = {key for title, key in reference.page_keys(PAGE.read_text()) if title in chosen}
    assert keys == listed
