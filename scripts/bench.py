#!/usr/bin/env python
"""The benchmark (benchmarks/bench.py), as `python scripts/bench.py ...`: the same as
`python -m benchmarks ...` from the repo root, from anywhere."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ and dpt from this checkout
    sys.path.insert(0, str(REPO))

from benchmarks.bench import main  # noqa: E402

if __name__ == "__main__":
    main(prog="python scripts/bench.py")
