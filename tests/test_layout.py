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
