"""The package's layout: imports only run downward between its parts, as each part's
`__init__.py` says ("May import: ..."), and no module imports itself back through others."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "dpt"
PARTS = ("commands", "launch", "loop", "monitor", "state", "tasks", "data", "models", "observe")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if "conf" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def part_of(module: str) -> str:
    """`dpt.loop.trainer` -> loop; `dpt.config` (beside dpt/__init__.py) -> base."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[1] in PARTS else "base"


def imports(module: str) -> set[str]:
    """The dpt modules `module` imports, at its top or inside functions alike."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from dpt.launch import run_lock`: the submodule
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in MODULES and name not in ("dpt", module)}


def allowed() -> dict[str, set[str]]:
    """Each part's "May import:" line; the base modules may import only each other."""
    rules = {"base": set()}
    for part in PARTS:
        text = (PACKAGE / part / "__init__.py").read_text()
        line = re.search(r"May import: (.*?)\.\n", text, re.S)
        assert line, f"dpt/{part}/__init__.py says nothing of what it may import"
        rules[part] = {name.strip().removeprefix("dpt.") for name in line.group(1).split(",")}
    return rules


def test_each_part_imports_only_the_parts_its_init_names() -> None:
    rules = allowed()
    wrong = [
        f"{module} ({part_of(module)}) imports {target} ({part_of(target)})"
        for module in sorted(MODULES)
        for target in sorted(imports(module))
        if part_of(target) != part_of(module) and part_of(target) not in rules[part_of(module)]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_parts_are_layered_downward() -> None:
    """No part may import one that may import it, directly or through others."""
    rules = allowed()

    def below(part: str, seen: frozenset[str] = frozenset()) -> set[str]:
        assert part not in seen, f"parts import each other in a circle: {' -> '.join(seen)}"
        found = set(rules[part])
        for lower in rules[part]:
            found |= below(lower, seen | {part})
        return found

    for part in rules:
        assert part not in below(part), part


def test_no_module_imports_itself_back() -> None:
    graph = {module: imports(module) for module in MODULES}
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The checks above can fail: an observe module importing the loop is named."""
    source = "from dpt.loop.trainer import Trainer\n"
    module = "dpt.observe.upward_probe"
    MODULES[module] = tmp_path / "upward_probe.py"
    MODULES[module].write_text(source)
    try:
        assert imports(module) == {"dpt.loop.trainer"}
        assert "loop" not in allowed()[part_of(module)]
    finally:
        del MODULES[module]


def test_targets_of_the_flat_layout_compare_as_their_new_paths_on_resume() -> None:
    """A checkpoint written before the move stores `dpt.schedulers.constant`: the same schedule,
    so resuming it is not refused as another schedule."""
    from dpt.state.resume_config import compare, flat
    from dpt.user_code import moved_to

    old = flat("scheduler: {_target_: dpt.schedulers.constant}")
    new = flat("scheduler: {_target_: dpt.loop.schedulers.constant}")
    assert compare(old, new).refused == () and compare(old, new).applied == ()
    assert moved_to("dpt.launch.LocalLauncher") == "dpt.launch.launchers.LocalLauncher"
    assert moved_to("dpt.launch.launchers.LocalLauncher") is None  # the new path stays
    for new_path in (moved_to(f"{m}.x") for m in ("dpt.strategy", "dpt.launch", "dpt.sweep")):
        assert new_path is not None and new_path.rpartition(".")[0] in MODULES


# --- one place for each fact ----------------------------------------------------------------------

MAX_LINES = 600  # a source file of dpt/ past this holds more than one job
WORD = re.compile(r"[\w./-]+")  # what an allowed value or a name of dpt's looks like


def _strings(node: ast.AST) -> frozenset[str] | None:
    """The set of strings a literal spells: a tuple, list or set of 2 or more strings, or a dict's
    2 or more string keys; None for anything else (prose, mixed values)."""
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
    if not isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict) or not items:
        return None
    values = [item.value for item in items if isinstance(item, ast.Constant)]
    if len(values) < 2 or len(values) != len(items) or not all(isinstance(v, str) for v in values):
        return None
    return frozenset(values) if all(WORD.fullmatch(v) for v in values) else None


def _definitions(tree: ast.Module) -> list[ast.AST]:
    """The module's and its classes' assignments: where a set of values is given a name."""
    found: list[ast.AST] = []
    for node in [
        *tree.body,
        *(n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body),
    ]:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            found.append(node.value)
    return found


def value_sets(sources: dict[str, str]) -> tuple[list[str], list[str]]:
    """(sets of values spelled twice where one of them is named, UPPER_CASE names defined in
    two modules) among `sources` (module name -> its text)."""
    spelled: dict[frozenset[str], list[str]] = {}
    named: set[frozenset[str]] = set()
    constants: dict[str, list[str]] = {}
    for module, text in sources.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            found = _strings(node)
            if found is not None:
                spelled.setdefault(found, []).append(f"{module}:{node.lineno}")
        named |= {s for value in _definitions(tree) for s in map(_strings, ast.walk(value)) if s}
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])  # fmt: skip
            for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                if name.isupper():
                    constants.setdefault(name, []).append(module)
    twice = [f"{sorted(values)}: {', '.join(places)}" for values, places in spelled.items()
             if len(places) > 1 and values in named]  # fmt: skip
    names = [f"{name}: {', '.join(places)}" for name, places in constants.items()
             if len(places) > 1]  # fmt: skip
    return twice, names


def test_each_allowed_value_set_and_name_is_defined_once() -> None:
    """An allowed value set, a task's reported metrics, a constant's name: one definition,
    imported wherever it is checked, built, documented or printed; a second spelling of a
    named set (a tuple or a dict's keys) or a second constant of the same name fails here."""
    twice, names = value_sets({name: path.read_text() for name, path in MODULES.items()})
    assert not twice, "sets of values spelled again:\n" + "\n".join(twice)
    assert not names, "constants defined in two modules:\n" + "\n".join(names)


def test_the_rule_catches_a_set_spelled_again_and_a_name_defined_twice() -> None:
    sources = {
        "dpt.config.x": 'MODES = ("min", "max")\n',
        "dpt.launch.y": 'def f(m):\n    return m in ("max", "min")\n',
        "dpt.loop.z": 'MODES = {"min": 0, "max": 1}\n',
        "dpt.loop.w": 'PAIR = ("a", "b")\n',  # named once, spelled once: fine
    }
    twice, names = value_sets(sources)
    assert twice == ["['max', 'min']: dpt.config.x:1, dpt.launch.y:2, dpt.loop.z:1"]
    assert names == ["MODES: dpt.config.x, dpt.loop.z"]


def test_no_source_file_holds_more_than_one_job() -> None:
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"over {MAX_LINES} lines: {long}"


# A model's family asked by its class: what dpt/models/families answers.
_FAMILY_LOOKUP = re.compile(r"isinstance\([^)]*\b(GPT|MLP|PreTrainedModel|ResNet)\b")


def family_lookups(sources: dict[str, str]) -> list[str]:
    """`isinstance` on a family's model class outside the families' own files."""
    return [f"{name}:{number}" for name, text in sources.items()
            if not name.startswith("dpt.models.families")
            for number, line in enumerate(text.splitlines(), 1)
            if _FAMILY_LOOKUP.search(line)]  # fmt: skip


def test_a_models_family_is_asked_of_its_family_object() -> None:
    """What the engine knows of a kind of model (blocks, pipeline cuts, tensor-parallel plan,
    LoRA's targets, weight names, FLOPs, export) is one family file's answer, never an
    isinstance chain elsewhere (the next family would break it)."""
    found = family_lookups({name: path.read_text() for name, path in MODULES.items()})
    assert not found, "family lookups outside dpt/models/families: " + ", ".join(found)


def test_the_rule_catches_a_family_lookup() -> None:
    sources = {
        "dpt.loop.x": "if isinstance(model, GPT):\n    pass\n",
        "dpt.models.families.gpt": "return isinstance(model, GPT)\n",
        "dpt.models.y": "hf = isinstance(m, modeling.PreTrainedModel)\n",
    }
    assert family_lookups(sources) == ["dpt.loop.x:1", "dpt.models.y:1"]
