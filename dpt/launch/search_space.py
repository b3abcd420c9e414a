"""A search space from Hydra's override grammar, as hydra-optuna-sweeper reads it: `choice(a, b)`
(categorical), `range(start, stop[, step])` (integers, or floats on a step; `stop` left out, as
in Python), `interval(low, high)` (uniform floats), `tag(log, ...)` (log-uniform); any other
value is fixed for every trial."""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from dpt.errors import ConfigError


def parse(arguments: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str]]:
    """(the distributions to search, the values fixed for every trial), by key."""
    searched: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_sweep_override():
            searched[key] = distribution(override)
        else:
            fixed[key] = override.get_value_element_as_str()
    for key in searched.keys() & fixed.keys():
        del fixed[key]  # the search space's, as hydra-optuna-sweeper does
    return searched, fixed


def distribution(override: Override) -> BaseDistribution:
    value = override.value()
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        return CategoricalDistribution(list(override.sweep_iterator(Transformer.encode)))
    if isinstance(value, RangeSweep):
        return _range(override.get_key_element(), value)
    if isinstance(value, IntervalSweep):  # Hydra's interval is of floats (range: integers)
        return FloatDistribution(value.start, value.end, log="log" in value.tags)
    raise ConfigError(f"{override.input_line}: not a search space (choice, range, interval)")


def _range(key: str, value: RangeSweep) -> BaseDistribution:
    start, stop, step = value.start, value.stop, value.step
    if stop is None or (stop - start) / step < 1:
        raise ConfigError(f"{key}=range({start}, {stop}, {step}): no value in the range")
    count = int((stop - start) / step - 1e-9)  # values after the first; `stop` left out
    last = start + count * step
    if all(isinstance(x, int) for x in (start, stop, step)):
        return IntDistribution(int(start), int(last), step=int(step))
    return FloatDistribution(float(start), float(last), step=float(step))


def overrides(params: dict[str, Any], fixed: dict[str, str]) -> list[str]:
    """A trial's command line: its sampled values, then the fixed ones."""
    return [f"{key}={value}" for key, value in {**params, **fixed}.items()]
