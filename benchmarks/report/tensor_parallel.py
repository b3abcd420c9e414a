"""Section 14 of the report, from the `tensor_parallel` section (benchmarks/tensor_parallel.py):
per-step time, each rank's training state against one process's, and the time each rank's step
spends in the collectives. It stands between two markers (`<!-- bench_tensor_parallel -->`), so
that `--sections tensor_parallel` replaces it alone (benchmarks/report/document.py)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.report.common import Results, md_table, measured_alone, quick_banner
from benchmarks.runner import Stat, paired_ratios

TITLE = "## 14. Tensor parallelism: memory per rank and the collectives' time"
STATE = ("params", "grads", "optimizer")
# The profiler's names, as the reading words them (the rest by their own name).
WORDS = {
    "_c10d_functional::all_gather_into_tensor": "all-gathers",
    "_c10d_functional::reduce_scatter_tensor": "reduce-scatters",
    "_c10d_functional::all_reduce": "all-reduces",
}
WAIT = "_c10d_functional::wait_tensor"


def chapters(results: Results) -> list[str]:
    return [markdown(results["tensor_parallel"])] if "tensor_parallel" in results else []


def command(r: dict[str, Any]) -> str:
    quick = " --smoke" if r["smoke"] else " --quick" if r["quick"] else ""
    return f"python -m benchmarks --sections tensor_parallel --rounds {r['rounds']}{quick}"


def markdown(r: dict[str, Any]) -> str:
    runs, degree = r["runs"], r["degree"]
    single = runs["single"]
    split = runs[f"tp={degree}"]
    whole = single[0]["ranks"][0]
    single_steps = [run["step_s"] for run in single]
    sizes = [f"{whole[f'{k}_mb']:,.1f}" for k in (*STATE, "state")]
    rows = [["one process", Stat.of([s * 1e3 for s in single_steps]).fmt(",.1f"), "1.00", *sizes,
             "1.000", "-", "-"]]  # fmt: skip
    for i in range(degree):
        ranks = [run["ranks"][i] for run in split]
        state = ranks[0]  # the same every round: the sizes are the model's
        rows.append([
            f"tp={degree}, rank {i + 1}",
            Stat.of([rank["step_s"] * 1e3 for rank in ranks]).fmt(",.1f"),
            paired_ratios([rank["step_s"] for rank in ranks], single_steps).fmt(".2f"),
            *(f"{state[f'{k}_mb']:,.1f}" for k in (*STATE, "state")),
            f"{state['state_mb'] / whole['state_mb']:.3f}",
            Stat.of([rank["collectives_s"] * 1e3 for rank in ranks]).fmt(",.1f"),
            _share(ranks).fmt(".2f"),
        ])  # fmt: skip
    shape = r["shape"]
    headers = ("run | ms per step | step / one process | params MB | grads MB | optimizer MB | "
               "state MB | state / one process | collectives ms per step | collectives' share "
               "of the step")  # fmt: skip
    note = "`--sections tensor_parallel` writes only this part of the report."
    profiled = _median(rank["profiled_step_s"] * 1e3 for run in split for rank in run["ranks"])
    timed = _median(rank["step_s"] * 1e3 for run in split for rank in run["ranks"])
    return f"""{TITLE}{quick_banner(r)}

{measured_alone(r, command(r), note, cores=True)}

A GPT of {shape["n_layer"]} blocks, width {shape["n_embd"]}, {shape["n_head"]} heads, windows
of {shape["block_size"]} tokens, batch {r["batch"]}, SGD with momentum, on {degree} CPU ranks
over Gloo with `strategy.tensor_parallel={degree}` (dpt's own `DDP.wrap`: a world of {degree} is
tp {degree}, dp 1; each block's attention and MLP split by columns then rows, sequence
parallelism between them, dpt/models/tensor_plans.py), one intra-op thread each, against the
same model in one process (one thread); {r["steps"]} timed steps per run, the two alternated
round by round. The state is `memory/*_mb` (each rank's local parts of its DTensors). The
collectives' time is torch.profiler's (CPU) over {r["steps"]} more steps on each rank, after the
timed ones (the profiled steps took {profiled:,.1f} ms, the timed {timed:,.1f} ms: medians over
ranks and rounds): the sum of the outermost collective calls inside each step on the step's
thread, `_c10d_functional::all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce` and
`wait_tensor` (the wait for their results); the `c10d::` ops they call are counted through
them, and Gloo's own threads' events (`gloo:all_gather`, ...: the transfers the step waits
for) not at all. The share is that sum over the profiled step's time.

{md_table(headers, rows)}

{_reading(r)}"""


def _share(ranks: list[dict[str, Any]]) -> Stat:
    return Stat.of([rank["collectives_s"] / rank["profiled_step_s"] for rank in ranks])


def _median(values: Any) -> float:
    return statistics.median(list(values))


def _reading(r: dict[str, Any]) -> str:
    """What the numbers say, worded from them."""
    runs, degree = r["runs"], r["degree"]
    split = runs[f"tp={degree}"]
    ranks = split[0]["ranks"]
    whole = runs["single"][0]["ranks"][0]["state_mb"]
    state = max(rank["state_mb"] for rank in ranks) / whole
    replicated = max(rank["replicated_mb"] for rank in ranks)
    ratio = paired_ratios([run["step_s"] for run in split],
                          [run["step_s"] for run in runs["single"]])  # fmt: skip
    share = _share([rank for run in split for rank in run["ranks"]])  # every rank, every round
    calls = ranks[0]["calls"]
    counts = ", ".join(f"{calls[name]:.0f} {word}" for name, word in WORDS.items()
                       if name in calls)  # fmt: skip
    others = [f"{n:.0f} {name}" for name, n in calls.items() if name not in WORDS and name != WAIT]
    waits = f" and {calls[WAIT]:.0f} waits for their results" if WAIT in calls else ""
    slower = ratio.median > 1
    verdict = "slower than one process" if slower else "no slower than one process"
    buys = "memory, not speed" if slower else "memory, and here no loss of speed"
    over = "a little over" if state > 1 / degree else "about"
    every = [rank for run in split for rank in run["ranks"]]
    rest = _median((rank["profiled_step_s"] - rank["collectives_s"]) * 1e3 for rank in every)
    half = _median(run["step_s"] * 1e3 / degree for run in runs["single"])
    return (
        f"**Reading it.** Each rank holds {state:.3f} of one process's training state: the "
        f"layer norms, the position embedding and the row-split projections' biases "
        f"({replicated:,.2f} MB of parameters) stay whole on every rank, the rest is split in "
        f"{degree}, so the state is {over} 1/{degree}. Every block's forward waits on 4 "
        "collectives of activations (the sequence all-gathered before the attention and the "
        "MLP, their output projections' partial sums reduce-scattered over it) and its backward "
        f"on 4 more; per step each rank made {', '.join([counts, *others])}{waits} (the "
        "all-reduces sum the replicated parameters' gradients after backward). A step took "
        f"{ratio.median:.2f}x one process's ({verdict}), the collectives {share.median:.2f} "
        f"of it, and the rest of a rank's (profiled) step {rest:,.1f} ms against half of one "
        f"process's step, {half:,.1f} ms (medians over ranks and rounds): on Gloo over "
        f"loopback, with {degree} ranks sharing {r['cores']} CPU cores, tensor parallelism "
        f"buys {buys}. On GPUs joined by NVLink the same collectives are a small part of a "
        "step, and it is what lets a layer too wide for one device train: each rank holds and "
        f"computes 1/{degree} of every block's weights."
    )
