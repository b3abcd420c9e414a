"""The machine's pip settings as `uv pip install` options, one per line (scripts/setup.sh).

uv reads no pip.conf and no PIP_* variable; a machine that points pip at a mirror, local
indexes, a folder of wheels or a constraints file would install other packages through uv
without them. `pip config list` gives them all, files and environment alike.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's setting -> uv's option; a setting may hold several values, separated by spaces
OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def uv_args(pip_config: str) -> list[str]:
    """`pip config list`'s lines (`scope.key='value'`) as uv's options; the environment's
    value of a key (`:env:`) over the files' (what pip does)."""
    settings: dict[str, str] = {}
    for line in pip_config.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if key in OPTIONS and (key not in settings or scope == ":env:"):
            settings[key] = shlex.split(value)[0] if value else ""
    args = []
    for key, value in settings.items():
        for one in value.split():
            args += [OPTIONS[key], one]
    if "extra-index-url" in settings or "find-links" in settings:
        args += ["--index-strategy", "unsafe-best-match"]  # pip's: the best version of any index
    return args


def main() -> None:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    print("\n".join(uv_args(listed)))


if __name__ == "__main__":
    main()
