"""What the suite costs, per test file, from pytest's JUnit XML (`pytest --junitxml=PATH`: each
test's time with its set-up and tear-down, module worlds included).

    python scripts/test_costs.py table PATH [--top 15]   # the slowest files, seconds and share
    python scripts/test_costs.py order PATH              # tests/durations.json, for the next runs

`.ci/run` prints the table after every run. `order` writes the measured seconds per file that
tests/conftest.py starts the longest first by (the xdist workers take whole files in
collection order: a long file left for last keeps one worker busy alone); run it after a suite
run when files were added or changed their cost, and commit the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def file_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test file (`test_x.py`), summed over its tests."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is `tests.test_x` or `tests.test_x.TestClass`
        name = next((part for part in module if part.startswith("test_")), None)
        if name is not None:
            seconds[f"{name}.py"] += float(case.get("time", 0.0))
    return dict(seconds)


def table(seconds: dict[str, float], top: int) -> str:
    total = sum(seconds.values())
    rows = sorted(seconds.items(), key=lambda row: -row[1])[:top]
    lines = [f"the {len(rows)} slowest test files of {len(seconds)}, "
             f"{total:.0f} s in all (the workers' time summed):"]  # fmt: skip
    lines += [f"{s:8.1f} s {100 * s / total:5.1f} %  {name}" for name, s in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("table", "order"))
    parser.add_argument("junit", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    if not args.junit.exists():
        print(f"no JUnit XML at {args.junit}: pytest ended before writing it", file=sys.stderr)
        return 1
    seconds = file_seconds(args.junit)
    if args.what == "table":
        print(table(seconds, args.top))
    else:
        ordered = dict(sorted(((k, round(v, 1)) for k, v in seconds.items()), key=lambda r: -r[1]))
        DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")
        print(f"{len(ordered)} files' seconds written to {DURATIONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
