"""`python -m benchmarks ...`: benchmarks/bench.py."""

from __future__ import annotations

from benchmarks.bench import main

if __name__ == "__main__":
    main()
