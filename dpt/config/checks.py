"""What a key may hold beyond its type, said beside the key in its schema.

A schema's field is made by one of these (`batch_size: int = at_least(1, default=64)`): its
default and its check in one place. `dpt.launch.validate` reads the checks of every field of
every composed node and refuses a value in one line that names the key, before any process
starts. Checks that relate keys (a pipeline's micro-batches and the batch) stay in code there.
A value of null always passes here: where null is not allowed, the key's type refused it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

CHECK = "dpt.check"  # the key of a field's metadata that holds its Check


@dataclass(frozen=True)
class Check:
    ok: Callable[[Any], bool]
    says: str  # the requirement, as the error line says it: `must be >= 1`


def checked(check: Check, default: Any = MISSING, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with `check` (its default: MISSING, as options' schemas leave it)."""
    if factory is not None:
        return field(default_factory=factory, metadata={CHECK: check})
    return field(default=default, metadata={CHECK: check})


def _or_null(text: str, null: str | None) -> str:
    return f"{text} or null ({null})" if null else text


def at_least(low: float, default: Any = MISSING, null: str | None = None) -> Any:
    """`must be >= low` (`null`: what null means, said in the line)."""
    return checked(Check(lambda v: v >= low, _or_null(f"must be >= {low:g}", null)), default)


def above(low: float, default: Any = MISSING, null: str | None = None) -> Any:
    """`must be > low`."""
    return checked(Check(lambda v: v > low, _or_null(f"must be > {low:g}", null)), default)


def between(low: float, high: float, default: Any = MISSING) -> Any:
    """`must be >= low and < high`."""
    return checked(Check(lambda v: low <= v < high, f"must be >= {low:g} and < {high:g}"), default)


def one_of(allowed: Sequence[str], default: Any = MISSING) -> Any:
    """`must be one of a, b, c`."""
    return checked(Check(lambda v: v in allowed, f"must be one of {', '.join(allowed)}"), default)


def check_of(schema: type, name: str) -> Check | None:
    """The check of `schema`'s field `name`, if it has one."""
    found = schema.__dataclass_fields__.get(name)
    return None if found is None else found.metadata.get(CHECK)
