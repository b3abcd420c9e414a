"""The config reference (docs/reference/config.md): every config group, option and key, with its
type (from the schemas in dpt/config/), its default (the option composed as `dpt` composes it)
and what it does (the comment the key carries in the option's YAML, else in the schema).

    python scripts/config_reference.py --out docs/reference/config.md    # write it anew
    python scripts/config_reference.py --check docs/reference/config.md  # exit 1: not current

`dpt --help` is the short form: the same groups and options, its main keys and the composed
default config. A key without a comment in either place is an error here, not a blank cell.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import re
import sys
import tokenize
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

import dpt.conf
from dpt.config.store import LIST_GROUPS, SCHEMAS, Config

CONF = Path(dpt.conf.__file__).parent
# Sections of the config that are no group: always there, typed by `Config`'s fields.
ALWAYS = ("trainer", "checkpoint", "monitor", "sweep", "finetune")
# Keys Hydra reads, not the target: the same meaning wherever they appear.
HYDRA_KEYS = {
    "_target_": "what is built: the class or function, as an import path (Hydra's instantiate)",
    "_partial_": "built partially: dpt passes the rest (the model's parameters, the optimizer)",
    "_recursive_": "false: the nodes inside are built by the target itself, not by Hydra first",
}
SWEEPER = "hydra/sweeper"  # dpt's own Hydra plugin group (hydra_plugins/dpt_optuna_sweeper)


@dataclass(frozen=True)
class Key:
    """One row of the reference."""

    name: str  # dotted, as an override names it: trainer.epochs
    type: str
    default: str
    what: str


@dataclass(frozen=True)
class Section:
    """One table: an always-present section (`trainer`) or a group's option (`model=mlp`)."""

    title: str  # trainer | model=mlp | hydra/sweeper=optuna
    about: str
    keys: tuple[Key, ...]
    default_choice: bool = False


# --- comments: what a key does ---------------------------------------------------------------


@functools.cache  # asked once per field
def _field_comments(cls: type) -> dict[str, str]:
    """A dataclass's fields -> the comment they carry: the comment lines right above the field
    and the one at its line's end, joined."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    found, above = {}, []
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(comments[number])
            continue
        field = re.match(r"\s+(\w+): ", line)
        if field:
            parts = [*above, comments.get(number, "")]
            found[field.group(1)] = " ".join(p for p in parts if p)
        above = []
    return found


def _yaml_comments(text: str) -> tuple[str, dict[str, str]]:
    """An option's YAML -> (its header comment, each key's comment by dotted path). A key's
    comment: the comment lines right above it and the one at its line's end, with the comment
    lines that follow aligned under that one."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    header = []
    for line in lines[:start]:
        if "@package" in line:
            continue
        words = line.lstrip("#")  # an indented line is an example command: shown as code
        header.append(f"`{words.strip()}`" if words.startswith("   ") else words.strip())
    found: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing keys
    above: list[str] = []
    last: tuple[str, int] | None = None  # the key whose end-of-line comment may go on, its column
    for line in lines[start:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            column = line.index("#")
            if last and column == last[1]:
                found[last[0]] += " " + stripped.lstrip("#").strip()
            else:
                above.append(stripped.lstrip("#").strip())
                last = None
            continue
        key = re.match(r"(\s*)([\w.]+):(.*)$", line)
        if not key or stripped.startswith("-"):
            above, last = [], None
            continue
        indent = len(key.group(1))
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, key.group(2))]
        path_ = ".".join(k for _, k in stack)
        _, _, comment = key.group(3).partition(" #")
        found[path_] = " ".join(p for p in [*above, comment.strip()] if p)
        above = []
        last = (path_, line.index(" #") + 1) if comment else None
    return " ".join(header), found


# --- keys: types and defaults ----------------------------------------------------------------


def _type_name(hint: Any) -> str:
    """A field's type as a YAML user reads it: `int or null`, `list[int]`, `any`."""
    text = hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
    text = text.replace("typing.", "").replace("Any", "any").replace("None", "null")
    return text.replace(" | ", " or ")


def _fields(cls: type, prefix: str) -> Iterator[tuple[str, str, type]]:
    """(dotted name, type, the dataclass it is declared in) of every leaf field of `cls`; nested
    dataclasses (`monitor.loss_spike`) are walked into."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    for field in dataclasses.fields(cls):
        if field.name == "defaults":  # Hydra's defaults list inside a plugin's node
            continue
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from _fields(hint, f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", _type_name(field.type), _declared_in(cls, field.name)


def _declared_in(cls: type, name: str) -> type:
    """The class of `cls`'s MRO whose source declares the field `name` (its comment is there)."""
    return next(c for c in cls.__mro__ if name in vars(c).get("__annotations__", {}))


def _shown(value: Any) -> str:
    """A default as YAML writes it inline."""
    if value == "???":
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return str(value)


def _value(node: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        node = node[part]
    return node


def _section(title: str, schema: type, root: str, values: dict[str, Any], about: str,
             yaml_what: dict[str, str], default_choice: bool = False) -> Section:  # fmt: skip
    """The keys of `schema` under `root` (`model`), their defaults from `values` (the composed
    node) and their comments (the YAML's first, then the schema's)."""
    keys, missing = [], []
    for name, type_, declared in _fields(schema, ""):
        leaf = name.rsplit(".", 1)[-1]
        what = yaml_what.get(name) or _field_comments(declared).get(leaf) or HYDRA_KEYS.get(leaf)
        if not what:
            missing.append(f"{root}.{name}")
        keys.append(Key(f"{root}.{name}", type_, _shown(_value(values, name)), what))
    if missing:
        raise ValueError(f"{title}: no comment for {', '.join(missing)}")
    return Section(title, about, tuple(keys), default_choice)


def _composed(*overrides: str) -> dict[str, Any]:
    """The job's config as `dpt` composes it with `overrides`, interpolations kept."""
    from hydra.core.global_hydra import GlobalHydra

    from dpt.launch.cli import compose_from_argv

    GlobalHydra.instance().clear()
    try:
        cfg = compose_from_argv(list(overrides))
        return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]
    finally:
        GlobalHydra.instance().clear()


@functools.cache  # asked by every group's listing
def default_choices() -> dict[str, str | list[str]]:
    """Each group's option in the default job (dpt/conf/config.yaml's defaults list)."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml").defaults)
    return {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()  # type: ignore[union-attr]
            if not k.startswith("override") and v is not None}  # fmt: skip


def always_sections() -> list[Section]:
    values = _composed()
    hints = typing.get_type_hints(Config)
    return [
        _section(name, hints[name], name, values[name], _schema_about(hints[name]), {})
        for name in ALWAYS
    ]


def _schema_about(cls: type) -> str:
    doc = inspect.getdoc(cls)
    return " ".join(doc.split()) if doc and not doc.startswith(f"{cls.__name__}(") else ""


def group_sections(group: str) -> list[Section]:
    chosen = default_choices().get(group)
    sections = []
    for option, schema in sorted(SCHEMAS[group].items()):
        path = CONF / group / f"{option}.yaml"
        text = path.read_text()
        header, comments = _yaml_comments(text)
        if "@package _global_" in text:  # keys written under `<group>:` (launcher=slurm)
            comments = {k.removeprefix(f"{group}."): v for k, v in comments.items()}
        about = header or _schema_about(schema)
        if not about:
            raise ValueError(f"{group}={option}: {path.name} has no header comment")
        values, root = _composed(f"{group}={option}")[group], _root(group, option)
        if group in LIST_GROUPS:  # chosen as a list (logger=[...]): under logger.<option>
            values = values[option]
        listed = chosen if isinstance(chosen, list) else [chosen]
        sections.append(_section(f"{group}={option}", schema, root, values, about, comments,
                                 option in listed))  # fmt: skip
    return sections


def sweeper_sections() -> list[Section]:
    """`hydra/sweeper=optuna` and its samplers: dpt's own plugin's schemas."""
    from hydra_plugins.dpt_optuna_sweeper import config as optuna

    plugin = [("optuna", optuna.OptunaSweeperConf, "hydra.sweeper", False),
              ("tpe", optuna.TPESamplerConf, "hydra.sweeper.sampler", True),
              ("random", optuna.RandomSamplerConf, "hydra.sweeper.sampler", False)]  # fmt: skip
    sections = []
    for option, schema, root, default in plugin:
        group = SWEEPER if option == "optuna" else f"{SWEEPER}/sampler"
        values = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
        values = {k: ("???" if k == "sampler" else v) for k, v in values.items()}
        about = _schema_about(schema) or _module_about(optuna)
        sections.append(_section(f"{group}={option}", schema, root, values, about, {}, default))
    return sections


def _module_about(module: Any) -> str:
    return " ".join((module.__doc__ or "").split("\n\n")[0].split())


@dataclass(frozen=True)
class Experiment:
    name: str
    about: str
    sets: tuple[tuple[str, str], ...]  # (group or key, value)


def experiments() -> list[Experiment]:
    """Each experiment: its header comment and what it chooses and sets."""
    found = []
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        about, _ = _yaml_comments(path.read_text())
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        sets = []
        for entry in node.pop("defaults", []):  # type: ignore[union-attr]
            for key, value in entry.items():
                sets.append((key.removeprefix("override /"), str(value)))
        sets += [(k, _shown(v)) for k, v in _leaves(node, "")]
        found.append(Experiment(path.stem, about, tuple(sets)))
    return found


def _leaves(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of a YAML node's values; a search space (`params`) stays whole."""
    if isinstance(node, dict) and node and not prefix.endswith(".params."):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), node


# --- the page ----------------------------------------------------------------------------------

HEADER = """\
# Config reference

Every key of every config group, as `dpt` composes it: its type (the schema in
`dpt/config/`), its default (the option's YAML in `dpt/conf/<group>/<option>.yaml`) and what it
does (the comment the key carries there). Override any key with `key=value`, choose an option
with `group=option`; `dpt --help` lists the groups and the main keys, `dpt --cfg job ...` prints
the composed config. A wrong key, type or option is one line before anything starts
([errors](../errors.md)).

This page is generated (`python scripts/config_reference.py --out docs/reference/config.md`), and
`tests/test_config_reference.py` fails when it is not what the schemas say. Options of your own
(`--config-dir DIR`, [your own model and data](../guides/own-model-and-data.md)) have no schema:
their keys are your constructor's.
"""


def _md(text: str) -> str:
    """A comment as Markdown text: `<run>` is no HTML tag, `2**32` no emphasis and `a | b` no
    table cell, outside its code spans (which show every character as it is)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        for char, escaped in (("<", "&lt;"), ("*", "\\*"), ("|", "\\|")):
            parts[i] = parts[i].replace(char, escaped)
    return "`".join(parts)


def _table(keys: tuple[Key, ...]) -> list[str]:
    rows = ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    for key in keys:
        default = key.default.replace("|", "\\|")
        rows.append(f"| `{key.name}` | `{key.type}` | `{default}` | {_md(key.what)} |")
    return rows


def _section_lines(section: Section, level: str) -> list[str]:
    chosen = " (default)" if section.default_choice else ""
    about = [_md(section.about), ""] if section.about else []
    return [f"{level} `{section.title}`{chosen}", "", *about, *_table(section.keys), ""]


def _root(group: str, option: str) -> str:
    """Where an option's keys are: `model`, or `logger.mlflow` for a group chosen as a list."""
    return f"{group}.{option}" if group in LIST_GROUPS else group


def _choice(option: str | list[str]) -> str:
    """`mlp`, or a list's `[tensorboard]` (logger)."""
    return f"[{','.join(option)}]" if isinstance(option, list) else option


def page() -> str:
    lines = [HEADER]
    choices = " ".join(f"{g}={_choice(o)}" for g, o in default_choices().items()
                       if g != "experiment")  # fmt: skip
    lines += [f"The default job: `{choices}`.", ""]
    lines += ["## Always present", ""]
    for section in always_sections():
        lines += _section_lines(section, "###")
    for group in SCHEMAS:
        sections = group_sections(group)
        options = ", ".join(f"`{s.title.split('=')[1]}`" for s in sections)
        lines += [f"## `{group}`", "", f"Options: {options}.", ""]
        for section in sections:
            lines += _section_lines(section, "###")
    lines += ["## `experiment`", "",
              "A bundle of choices and values (`experiment=NAME`, applied after everything else); "
              "none by default.", ""]  # fmt: skip
    for experiment in experiments():
        lines += [f"### `experiment={experiment.name}`", "", _md(experiment.about), "",
                  "| sets | to |", "| --- | --- |"]  # fmt: skip
        lines += [f"| `{k}` | `{v}` |" for k, v in experiment.sets] + [""]
    lines += [f"## `{SWEEPER}`", "",
              "A search instead of a list of values (`dpt -m hydra/sweeper=optuna ...`; see "
              "[sweeps and search](../guides/sweeps.md)).", ""]  # fmt: skip
    for section in sweeper_sections():
        lines += _section_lines(section, "###")
    return "\n".join(lines).rstrip() + "\n"


# --- what the page names -----------------------------------------------------------------------


def schema_keys(schemas: dict[str, dict[str, type]] | None = None) -> set[tuple[str, str]]:
    """(section title, key) of every key the schemas have: the reference must list exactly these."""
    schemas = SCHEMAS if schemas is None else schemas
    hints = typing.get_type_hints(Config)
    found = {(name, f"{name}.{k}") for name in ALWAYS for k, _, _ in _fields(hints[name], "")}
    for group, options in schemas.items():
        for option, schema in options.items():
            root = _root(group, option)
            found |= {(f"{group}={option}", f"{root}.{k}") for k, _, _ in _fields(schema, "")}
    for section in sweeper_sections():
        found |= {(section.title, key.name) for key in section.keys}
    return found


def page_keys(text: str) -> set[tuple[str, str]]:
    """(section title, key) of every key row of the page's key tables."""
    found, title, in_keys = set(), "", False
    for line in text.splitlines():
        heading = re.match(r"#+ `([^`]+)`", line)
        if heading:
            title, in_keys = heading.group(1), False
        elif line.startswith("| key | type |"):
            in_keys = True
        elif in_keys and (row := re.match(r"\| `([^`]+)` \|", line)):
            found.add((title, row.group(1)))
        elif not line.startswith("|"):
            in_keys = False
    return found


def differences(text: str, schemas: dict[str, dict[str, type]] | None = None) -> list[str]:
    """What the page and the schemas disagree on, one line each (none: they agree)."""
    listed, declared = page_keys(text), schema_keys(schemas)
    return [f"missing from the page: {t}: {k}" for t, k in sorted(declared - listed)] + [
        f"on the page but in no schema: {t}: {k}" for t, k in sorted(listed - declared)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/config_reference.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="write the page here (default: print it)")
    parser.add_argument("--check", type=Path, help="exit 1 where this page is not current")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if args.check.read_text() != text:
            print(f"{args.check} is not current: python scripts/config_reference.py --out "
                  f"{args.check}", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
