"""torchmetrics, imported without the optional packages of metrics dpt's tasks never use, where
dpt's own metrics are all a run needs.

`import torchmetrics` imports every optional package it finds installed: transformers (dpt
depends on it for `model=hf`) for its text and multimodal metrics (BERTScore, InfoLM,
CLIPScore), scipy.signal for its audio metrics, torchvision for its image metrics and
matplotlib for its plots. Measured on an idle 2-core machine, torch imported: 4 to 6 s, 2.4 s
without transformers, 0.2 s without the four, paid by every process of a run at its first
validation. dpt's tasks (accuracy, F1, AUROC, average precision, MAE, MSE, R², means and sums)
use none of them, so for them torchmetrics is imported with those packages reported missing
(lightning_utilities' requirement checks, which torchmetrics asks, answer no for the import
only); a package the run imported already (torchvision for a ResNet) is not hidden: it costs
nothing more. A run whose task is the user's own (`task=custom`, whose metrics may be any)
imports torchmetrics as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

# What torchmetrics imports for metrics (text, multimodal, audio, image) and plots dpt's own
# tasks never use.
HIDDEN = ("transformers", "scipy", "torchvision", "matplotlib")


def import_torchmetrics(any_metric: bool) -> ModuleType:
    """torchmetrics; `any_metric`: the run may name any of its metrics (a task of yours)."""
    hidden = frozenset(name for name in HIDDEN if name not in sys.modules)
    if any_metric or "torchmetrics" in sys.modules or not hidden:
        import torchmetrics

        return torchmetrics
    with _requirements_missing(hidden):
        import torchmetrics
    return torchmetrics


@contextlib.contextmanager
def _requirements_missing(packages: frozenset[str]) -> Iterator[None]:
    try:
        import lightning_utilities.core.imports as checks
    except ImportError:  # another torchmetrics: nothing to hide it from
        yield
        return
    from packaging.requirements import Requirement

    check, available = checks.RequirementCache._check_available, checks.package_available

    def check_without(self: checks.RequirementCache) -> None:
        check(self)
        if self.requirement and Requirement(self.requirement).name in packages:
            self.available = False
            self.message = f"{self.requirement} is not imported for dpt's own metrics"

    def available_without(name: str) -> bool:
        return name not in packages and available(name)

    checks.RequirementCache._check_available = check_without  # type: ignore[method-assign]
    checks.package_available = available_without  # type: ignore[assignment]
    try:
        yield
    finally:
        checks.RequirementCache._check_available = check  # type: ignore[method-assign]
        checks.package_available = available
