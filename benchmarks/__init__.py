"""dpt's benchmarks: `python -m benchmarks [--quick] [--sections ...]` measures dpt against a
hand-written loop and writes docs/performance.md (benchmarks/README.md)."""
