"""scripts/bench.py end to end in its --quick mode: it runs and writes its report. No timing is
asserted: the numbers of a smoke run on a shared machine mean nothing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_cmd

SECTIONS = (
    "## Targets",
    "## 1. dpt against a hand-written loop",
    "## 2. Strategies and scaling",
    "## 3. Input pipeline",
    "## 4. Gradient synchronisation",
    "## 5. Start-up",
    "## 6. Per-step overhead",
    "## GPU path",
)
PLOTS = ("perf_throughput.png", "perf_pipeline.png", "perf_sync.png")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_benchmark_writes_its_report(tmp_path: Path) -> None:
    bench = REPO / "scripts" / "bench.py"
    run_cmd([sys.executable, str(bench), "--quick", "--out", str(tmp_path)], timeout=570)

    report = (tmp_path / "performance.md").read_text()
    for heading in SECTIONS:
        assert heading in report
    # The dpt/plain row of the MLP on one process, logging every 10 steps (the quick run's one
    # cadence): two rates and their ratio.
    row = r"\| mlp \| single \| 1 \| 64 \| 10 \| [\d,]+ \| [\d,]+ \| \d+\.\d{3} \|"
    assert re.search(row, report)
    assert "`python scripts/bench.py --quick --out" in report  # the exact command
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in report
    if not torch.cuda.is_available():
        assert "Not measured in this run: no CUDA device" in report
