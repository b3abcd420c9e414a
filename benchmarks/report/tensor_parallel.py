"""Section 14 of the report, from the `tensor_parallel` section (benchmarks/tensor_parallel.py):
per-step time and tokens/s against one process and ddp, each rank's training state and logits
against one process's, the time each rank's step spends in the collectives, and each kind of
collective beside its floor. It stands between two markers (`<!-- bench_tensor_parallel -->`), so
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
    shape, tokens = r["shape"], r["batch"] * r["shape"]["block_size"]  # a step's, world-wide
    rate = lambda steps: Stat.of([tokens / s for s in steps]).fmt(",.0f")  # noqa: E731
    rows = [["one process", Stat.of([s * 1e3 for s in single_steps]).fmt(",.1f"), "1.00",
             rate(single_steps), *sizes, "1.000", f"{_logits_mb(r):,.2f}", "-", "-"]]  # fmt: skip
    for i in range(degree):
        ranks = [run["ranks"][i] for run in split]
        state = ranks[0]  # the same every round: the sizes are the model's
        rows.append([
            f"tp={degree}, rank {i + 1}",
            Stat.of([rank["step_s"] * 1e3 for rank in ranks]).fmt(",.1f"),
            paired_ratios([rank["step_s"] for rank in ranks], single_steps).fmt(".2f"),
            rate([run["step_s"] for run in split]),
            *(f"{state[f'{k}_mb']:,.1f}" for k in (*STATE, "state")),
            f"{state['state_mb'] / whole['state_mb']:.3f}",
            f"{state['logits_mb']:,.2f}",
            Stat.of([rank["collectives_s"] * 1e3 for rank in ranks]).fmt(",.1f"),
            _share(ranks).fmt(".2f"),
        ])  # fmt: skip
    ddp = [run["step_s"] for run in runs[f"ddp={degree}"]]
    rows.append([f"ddp={degree} (each rank half the batch)",
                 Stat.of([s * 1e3 for s in ddp]).fmt(",.1f"),
                 paired_ratios(ddp, single_steps).fmt(".2f"), rate(ddp),
                 *["-"] * 8])  # fmt: skip
    headers = ("run | ms per step | step / one process | tokens/s | params MB | grads MB | "
               "optimizer MB | state MB | state / one process | logits MB | collectives ms "
               "per step | collectives' share of the step")  # fmt: skip
    note = "`--sections tensor_parallel` writes only this part of the report."
    floors = md_table("collective | calls per step | MB per step | ms per step, alone | floor ms "
                      "per step (all-reduce of the same size) | alone / floor",
                      _floor_rows(split))  # fmt: skip
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
for) not at all. The share is that sum over the profiled step's time. The loss is computed on
each rank's slice of the logits (`loss_parallel`: the head's output split over the vocabulary,
as dpt's tensor-parallel runs of a language model have it); logits MB is what a rank's
forward gives, the one process's its whole logits. ddp={degree}: the same model wrapped by dpt's
ddp on {degree} ranks, each half of the batch; tokens/s are the world's ({tokens:,} tokens a
step over its time).

{md_table(headers, rows)}

Each kind of collective of a step, beside its floor (rank 1, medians of its rounds): the calls a
step made of each, by the profiler (its sizes from the calls' inputs, fp32), issued again alone
on the same group ({r["floor_repeats"]} times each, the median) after the profiled steps, and
the floor: an all-reduce of each call's whole tensor (the gathered output, the scattered
input), what the same bytes cost as the collective every data-parallel step makes.

{floors}

{_reading(r)}"""


def _logits_mb(r: dict[str, Any]) -> float:
    """One process's logits: the batch's windows, a float for every word of the vocabulary."""
    return r["batch"] * r["shape"]["block_size"] * r["vocab"] * 4 / 2**20


def _floor_rows(split: list[dict[str, Any]]) -> list[list[str]]:
    """Per kind of collective: rank 1's calls and bytes per step, its time alone and its floor
    (medians over the rounds), and their paired ratio."""
    firsts = [run["ranks"][0]["floors"] for run in split]
    rows = []
    for name in sorted(firsts[0]):
        each = [found[name] for found in firsts]
        alone, floor = [e["alone_ms"] for e in each], [e["floor_ms"] for e in each]
        rows.append([
            f"`{name.rpartition('::')[2]}`", f"{each[0]['calls']:.0f}", f"{each[0]['mb']:,.2f}",
            Stat.of(alone).fmt(",.1f"), Stat.of(floor).fmt(",.1f"),
            paired_ratios(alone, floor).fmt(".2f"),
        ])  # fmt: skip
    return rows


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
    against_ddp = paired_ratios([run["step_s"] for run in runs[f"ddp={degree}"]],
                                [run["step_s"] for run in split])  # fmt: skip
    logits = max(rank["logits_mb"] for rank in ranks) / _logits_mb(r)
    alone = _median(
        sum(f["alone_ms"] for f in run["ranks"][0]["floors"].values())
        / sum(f["floor_ms"] for f in run["ranks"][0]["floors"].values())
        for run in split
    )  # rank 1's, each round's: their median
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
        f"computes 1/{degree} of every block's weights. Against ddp on the same {degree} ranks "
        f"(each half the batch), tensor parallelism trains {against_ddp.median:.2f}x its "
        f"tokens/s; each rank's logits are {logits:.2f} of one process's (its slice of the "
        "vocabulary: the loss is computed on the split). Alone, a step's collectives took "
        f"{alone:.2f}x what all-reduces of the same sizes take (the floor; rank 1, the median "
        "of the rounds)."
    )
