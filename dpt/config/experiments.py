"""Experiments (`experiment=<name>`, dpt/conf/experiment/): named bundles of group options and
keys. Each chooses some groups' options (its defaults list) and sets keys of them; an option
chosen on the command line instead may not have those keys. Hydra then says
`In 'experiment/gpt_tiny': ConfigKeyError ... Key 'betas' not in 'SGDConfig'`: `explain` says it
in dpt's words, naming the experiment, the key and both options."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from dpt.errors import ConfigError

# Hydra's composition error for a key an experiment sets that the chosen option's schema lacks.
_MISSING_KEY = re.compile(
    r"In 'experiment/(?P<name>[\w.-]+)': ConfigKeyError raised while composing config:\s*"
    r"Key '(?P<key>\w+)' not in '\w+'\s*full_key: (?P<full>[\w.]+)"
)


def experiment_file(name: str) -> Path:
    import dpt.conf

    return Path(dpt.conf.__file__).parent / "experiment" / f"{name}.yaml"


def chosen_options(name: str) -> dict[str, str]:
    """The group options experiment `name` chooses (`override /optimizer: adamw_gpt`)."""
    path = experiment_file(name)
    if not path.is_file():
        return {}
    defaults = OmegaConf.load(path).get("defaults") or []
    found = {}
    for entry in defaults:
        for key, option in entry.items() if hasattr(entry, "items") else ():
            group = str(key).removeprefix("override").strip().lstrip("/")
            found[group] = str(option)
    return found


def explain(error: BaseException, overrides: list[str]) -> ConfigError | None:
    """Hydra's composition error where an experiment sets a key the option chosen on the
    command line lacks, as one line of dpt's; None for any other error."""
    found = _MISSING_KEY.search(str(error))
    if found is None:
        return None
    name, key = found.group("name"), found.group("full")
    group = key.split(".")[0]
    chosen = next((o.partition("=")[2] for o in overrides if o.startswith(f"{group}=")), None)
    own = chosen_options(name).get(group)
    if chosen is None or own is None:
        return None
    return ConfigError(
        f"experiment={name} sets {key}, a key of its own {group}={own}, which {group}={chosen} "
        f"does not have: drop {group}={chosen} (the experiment chooses the {group}), or run "
        f"{group}={chosen} without experiment={name} (dpt/conf/experiment/{name}.yaml says "
        "what it sets)"
    )
