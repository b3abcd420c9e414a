"""Section 13 of the report, from the `pipeline_parallel` section (benchmarks/pipeline_parallel.py):
per-step time, each stage's measured bubble against (p - 1) / (m + p - 1), and the training state
per stage against one process. It stands between two markers (`<!-- bench_pipeline_parallel -->`),
so that `--sections pipeline_parallel` replaces it alone (benchmarks/report/document.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.report.common import Results, md_table, measured_alone, quick_banner
from benchmarks.runner import Stat, paired_ratios
from dpt.loop.pipeline import bubble

TITLE = "## 13. Pipeline parallelism: the bubble and the memory per stage"


def chapters(results: Results) -> list[str]:
    return [markdown(results["pipeline_parallel"])] if "pipeline_parallel" in results else []


def command(r: dict[str, Any]) -> str:
    quick = " --smoke" if r["smoke"] else " --quick" if r["quick"] else ""
    return f"python -m benchmarks --sections pipeline_parallel --rounds {r['rounds']}{quick}"


def markdown(r: dict[str, Any]) -> str:
    runs, p = r["runs"], r["stages"]
    single = runs["single"]
    rows, memory, ratios = [], [], []
    for key, measured in runs.items():
        if key == "single":
            continue
        schedule, m = key.split(" m=")
        stages = [[run["ranks"][s]["pipeline/bubble"] for run in measured] for s in range(p)]
        ratio = paired_ratios([run["step_s"] for run in measured],
                              [run["step_s"] for run in single])  # fmt: skip
        ratios.append((schedule, int(m), ratio.median, [Stat.of(b).median for b in stages]))
        rows.append([
            schedule, m, Stat.of([run["step_s"] * 1e3 for run in measured]).fmt(".1f"),
            ratio.fmt(".2f"),
            *(Stat.of(b).fmt(".2f") for b in stages), f"{bubble(p, int(m)):.2f}",
        ])  # fmt: skip
    whole = single[0]["ranks"][0]["state_mb"]
    stage_mb = [rank["state_mb"] for rank in next(iter(
        v for k, v in runs.items() if k != "single"))[0]["ranks"]]  # fmt: skip
    memory = [
        [f"stage {s + 1}", f"{mb:,.1f}", f"{mb / whole:.2f}"] for s, mb in enumerate(stage_mb)
    ]
    memory.append(["one process", f"{whole:,.1f}", "1.00"])
    shape = r["shape"]
    bubbles = " | ".join(f"bubble stage {s + 1}" for s in range(p))
    headers = (f"schedule | micro-batches | ms per step | step / one process | {bubbles} | "
               "(p-1)/(m+p-1)")  # fmt: skip
    note = "`--sections pipeline_parallel` writes only this part of the report."
    return f"""{TITLE}{quick_banner(r)}

{measured_alone(r, command(r), note, cores=True)}

A GPT of {shape["n_layer"]} blocks, width {shape["n_embd"]}, windows of {shape["block_size"]}
tokens, batch {r["batch"]}, SGD, cut by `strategy=pipeline` into {p} stages balanced by
parameter count (the embedding and the head share a matrix: each end holds a copy, their
gradients summed), on {p} CPU ranks over Gloo, one intra-op thread each, against the same model
in one process (one thread); {r["steps"]} timed steps per run, the schedules and the one process
alternated round by round. The bubble is each stage's idle share of the schedule's step as dpt
measures and logs it (`pipeline/bubble`: the step's time less the stage's own forward and
backward calls, over the step's time); the textbook's is (p - 1) / (m + p - 1) for p stages and
m micro-batches, which assumes equal stages and free sends.

{md_table(headers, rows)}

Training state per rank (parameters, gradients, SGD's momentum: `memory/*_mb`):

{md_table("holder | state MB | / one process", memory)}

{_reading(rows, ratios, p)}"""


def _reading(rows: list[Any], ratios: list[tuple[str, int, float, list[float]]], p: int) -> str:
    """What the numbers say, worded from them."""
    by_m: dict[int, list[tuple[float, list[float]]]] = {}
    for _, m, ratio, stages in ratios:
        by_m.setdefault(m, []).append((ratio, stages))
    steps = ", ".join(f"{sum(r for r, _ in v) / len(v):.2f} with m={m}"
                      for m, v in sorted(by_m.items()))  # fmt: skip
    mean = lambda v: sum(sum(b) / len(b) for _, b in v) / len(v)  # noqa: E731
    trend = ", ".join(f"m={m}: {mean(v):.2f} (formula {bubble(p, m):.2f})"
                      for m, v in sorted(by_m.items()))  # fmt: skip
    over = [f"{s} m={m}" for s, m, _, b in ratios if max(b) > bubble(p, m) + 0.005]
    excess = (f"A stage's bubble exceeds the formula's for {', '.join(over)}: the stages are "
              "not equal (the last computes the head and the loss) and sends are not free."
              if over else "No stage's bubble exceeds the formula's.")  # fmt: skip
    return (
        f"**Reading it.** A step on {p} stages took, against one process's: {steps} (the "
        f"ranks compute at once, on a core each, except while they wait for each other). The "
        f"bubble, the mean over the stages, by micro-batches: {trend}. {excess} Each stage "
        f"holds about 1/{p} of the training state: what a pipeline is for when a model does "
        "not fit one device, or when the links between machines are too slow for data "
        "parallelism's all-reduce of every gradient."
    )
