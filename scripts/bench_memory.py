"""Memory per rank of the training state under ddp and fsdp, and their throughput.

An MLP of about 105 M parameters (1024 -> 7 x 4096 -> 10) trained with Adam on N CPU ranks over
Gloo, wrapped by dpt's own strategies with their YAML defaults. Per rank: the bytes of parameters,
gradients and optimizer state that the rank holds (`dpt.observe.memory.MemoryUse`, what the
metrics log as `memory/*_mb`), and the process's peak resident memory; per world: samples/s
over timed steps, ddp and fsdp alternated round by round. Its section of docs/performance.md
sits between two markers and is replaced alone, so `--sections memory` leaves the rest of the
report as it was.

    python scripts/bench.py --sections memory --world-sizes 2,4
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from bench_common import Stat, md_table, paired_ratios

from dpt.config import build
from dpt.distributed import destroy_process_group as dpt_destroy
from dpt.distributed import env_from_environment, init_process_group
from dpt.launch.cli import compose_from_argv
from dpt.launch.launchers import restored_environ
from dpt.models.mlp import MLP
from dpt.observe.memory import MemoryUse
from dpt.rendezvous import loopback_store

INPUT_DIM, HIDDEN, CLASSES = 1024, [4096] * 7, 10
BATCH = 16  # per rank
START, END = "<!-- bench_memory -->", "<!-- /bench_memory -->"
STRATEGIES = ("ddp", "fsdp")


def parameters() -> int:
    dims = [INPUT_DIM, *HIDDEN, CLASSES]
    return sum(a * b + b for a, b in itertools.pairwise(dims))


def measure(
    strategy: str, world: int, warmup: int, steps: int, threads: int
) -> list[dict[str, float]]:
    """One run of `world` CPU ranks; every rank's numbers, in rank order."""
    with tempfile.TemporaryDirectory(prefix="dpt-bench-memory-") as tmp:
        out = Path(tmp) / "memory.json"
        store = loopback_store(0, True, timedelta(seconds=600))  # this process serves it
        with restored_environ():
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
            os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the ranks are its clients
            mp.spawn(_rank, args=(strategy, warmup, steps, threads, out), nprocs=world)
        return json.loads(out.read_text())


def _rank(rank: int, strategy: str, warmup: int, steps: int, threads: int, out: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    env = env_from_environment("cpu")
    init_process_group(env, timeout_s=600)
    try:
        row = _train(strategy, env, warmup, steps)
        rows: list[Any] = [None] * env.world_size
        dist.all_gather_object(rows, row)
        if rank == 0:
            out.write_text(json.dumps(rows))
    finally:
        dpt_destroy()


def _train(strategy: str, env: Any, warmup: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = MLP((INPUT_DIM,), CLASSES, HIDDEN)
    model = build(compose_from_argv([f"strategy={strategy}"]).strategy).wrap(model, env, "32")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs, labels = torch.randn(BATCH, INPUT_DIM), torch.randint(0, CLASSES, (BATCH,))

    def step() -> None:
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):  # Adam's moments exist from the first step on
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    # ru_maxrss: KiB on Linux.
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**MemoryUse(model, optimizer).scalars(), "peak_rss_mb": peak_rss_mb,
            "samples_per_s": BATCH * env.world_size * steps / elapsed}  # fmt: skip


def run(worlds: list[int], rounds: int, quick: bool, threads: int, say: Any) -> dict[str, Any]:
    """Every world size, ddp and fsdp alternated `rounds` times."""
    warmup, steps = (1, 1) if quick else (1, 3)
    results: dict[str, Any] = {"worlds": {}, "parameters": parameters(), "steps": steps}
    for world in worlds:
        runs: dict[str, list[list[dict[str, float]]]] = {s: [] for s in STRATEGIES}
        for round_ in range(rounds):
            for strategy in STRATEGIES:
                runs[strategy].append(measure(strategy, world, warmup, steps, threads))
                say(f"  {strategy} on {world} ranks, round {round_ + 1}/{rounds} done")
        results["worlds"][world] = runs
    return results


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


def write_section(report: Path, results: dict[str, Any]) -> Path:
    """Replace this section of `report` (between its markers), or append it."""
    return put_section(report, f"{START}\n{markdown(results)}\n{END}")


def read_section(report: Path) -> str | None:
    """This section of `report` as it stands, markers included; None if it has none."""
    text = report.read_text() if report.exists() else ""
    if START not in text or END not in text:
        return None
    return START + text.split(START, 1)[1].split(END, 1)[0] + END


def put_section(report: Path, section: str) -> Path:
    """`section` (markers included) in place of this section of `report`, or appended."""
    text = report.read_text() if report.exists() else "# Performance\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    report.write_text(text)
    return report
