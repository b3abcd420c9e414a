"""Test-only: put on PYTHONPATH of a Ray cluster's processes by tests/test_ray.py, so that a
documented command runs as printed while one of its workers is lost.

Where DPT_TEST_KILL_RANK is set, dpt's MLP gets tests.faults' kill once it is imported: rank
$DPT_TEST_KILL_RANK SIGKILLs itself at its $DPT_TEST_KILL_CALL-th training forward, once per
cluster ($DPT_TEST_KILL_MARKER). Nothing is imported before dpt's MLP is: Ray's own processes
start as they would.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

TARGET = "dpt.models.mlp"


class _PatchAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds dpt's MLP module as Python would, and gives it the kill after it executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            self.loader = spec.loader
            spec.loader = self
        return spec

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        from tests.faults import kill_once_in

        kill_once_in(module.MLP)


if os.environ.get("DPT_TEST_KILL_RANK"):
    sys.meta_path.insert(0, _PatchAfterImport())
