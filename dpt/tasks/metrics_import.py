"""torchmetrics, imported without transformers where dpt's own metrics are all a run needs.

Where transformers is installed (dpt depends on it for `model=hf`), `import torchmetrics`
imports it too, for its text and multimodal metrics (BERTScore, InfoLM, CLIPScore): 0.6 to 2.8 s
for every run at its first validation. dpt's tasks use none of those, so for them torchmetrics
is imported with transformers reported missing (lightning_utilities' requirement check, which
torchmetrics asks, answers no for the import only). A run that imported transformers already
(`model=hf`) or whose task is the user's own (`task=custom`, whose metrics may be any) imports
torchmetrics as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

HIDDEN = "transformers"  # the requirement torchmetrics checks for its text and multimodal metrics


def import_torchmetrics(any_metric: bool) -> ModuleType:
    """torchmetrics; `any_metric`: the run may name any of its metrics (a task of yours)."""
    if any_metric or "torchmetrics" in sys.modules or HIDDEN in sys.modules:
        import torchmetrics

        return torchmetrics
    with _requirement_missing(HIDDEN):
        import torchmetrics
    return torchmetrics


@contextlib.contextmanager
def _requirement_missing(package: str) -> Iterator[None]:
    try:
        from lightning_utilities.core.imports import RequirementCache
    except ImportError:  # another torchmetrics: nothing to hide it from
        yield
        return
    from packaging.requirements import Requirement

    check = RequirementCache._check_available

    def check_without(self: RequirementCache) -> None:
        check(self)
        if self.requirement and Requirement(self.requirement).name == package:
            self.available = False
            self.message = f"{package} is not imported for dpt's own metrics"

    RequirementCache._check_available = check_without  # type: ignore[method-assign]
    try:
        yield
    finally:
        RequirementCache._check_available = check  # type: ignore[method-assign]
