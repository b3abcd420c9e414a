"""docs/performance.md from what the benchmark measured: benchmarks/report/document.py assembles
it from the sections' reports (one module each: loops, pipeline, sync, startup, overhead, gpu,
memory)."""
