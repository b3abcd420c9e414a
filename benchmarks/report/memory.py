"""Section 8 of the report, from the `memory` section (benchmarks/memory.py): memory per rank and
throughput, ddp against fsdp. It stands between two markers (`<!-- bench_memory -->`), so that
`--sections memory` replaces it alone (benchmarks/report/document.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.memory import BATCH, STRATEGIES
from benchmarks.report.common import Results, md_table
from benchmarks.runner import Stat, paired_ratios


def chapters(results: Results) -> list[str]:
    return [markdown(results["memory"])] if "memory" in results else []


def _state_mb(rank: dict[str, float]) -> float:
    return rank["memory/params_mb"] + rank["memory/grads_mb"] + rank["memory/optimizer_mb"]


def markdown(results: dict[str, Any]) -> str:
    rows, ratios = [], []
    for world, runs in results["worlds"].items():
        for strategy in STRATEGIES:
            ranks = runs[strategy][0]  # sizes are the same in every round
            rows.append([
                strategy, world,
                *(f"{max(r[f'memory/{k}_mb'] for r in ranks):,.0f}"
                  for k in ("params", "grads", "optimizer")),
                f"{max(_state_mb(r) for r in ranks):,.0f}",
                f"{max(r['peak_rss_mb'] for r in ranks):,.0f}",
                Stat.of([run[0]["samples_per_s"] for run in runs[strategy]]).fmt(",.1f"),
            ])  # fmt: skip
        ddp, fsdp = runs["ddp"], runs["fsdp"]
        ratios.append([
            world,
            f"{max(_state_mb(r) for r in fsdp[0]) / max(_state_mb(r) for r in ddp[0]):.3f}",
            f"{1 / world:.3f}",
            paired_ratios([r[0]["samples_per_s"] for r in fsdp],
                          [r[0]["samples_per_s"] for r in ddp]).fmt(".2f"),
        ])  # fmt: skip
    table = md_table(
        "strategy | ranks | params MB | grads MB | Adam state MB | state MB | peak RSS MB "
        "| samples/s (world)",
        rows,
    )
    ratio_table = md_table("ranks | fsdp/ddp state per rank | 1/ranks | fsdp/ddp samples/s", ratios)
    return f"""## 8. Sharded training: memory per rank, ddp against fsdp

An MLP of {results["parameters"] / 1e6:.0f} M parameters (1024 -> 7 x 4096 -> 10), Adam, batch
{BATCH} per rank, on CPU ranks over Gloo (1 intra-op thread each), wrapped by dpt's strategies
with their defaults; {results["steps"]} timed steps after the warmup. Per rank, the largest over
the ranks: parameters, gradients and Adam's two moments as the rank holds them (what the metrics
log as `memory/params_mb`, `memory/grads_mb`, `memory/optimizer_mb`), their sum, and the
process's peak resident memory (Python, torch, activations and communication buffers included).

{table}

{ratio_table}

fsdp keeps about 1/ranks of the training state per rank; the peak resident memory falls less,
since every rank also holds the interpreter, torch and each block's gathered weights while it
computes. Throughput is the price: each step all-gathers the weights (twice, with
`reshard_after_forward=true`) and reduce-scatters the gradients, where ddp only all-reduces the
gradients."""
