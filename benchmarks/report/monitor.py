"""Section 9 of the report, from the `monitor` section (benchmarks/monitor.py): what the monitor
costs per step (its detectors timed in place, the agreement's extra floats), end to end, and its
optional parts (gradient diagnostics, the norm for grad_spike's reactions). It stands between two
markers (`<!-- bench_monitor -->`), so that `--sections monitor` replaces it alone
(benchmarks/report/document.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.monitor import BLOCK_STEPS, DIAGNOSED_EVERY, MONITOR_OFF, STEP_S
from benchmarks.report.common import Results, TargetRow, fmt_ratio, md_table, target
from dpt.config.monitor import SlowdownConfig

TARGET_PCT = 1.0  # issue #28: the detectors at their defaults, per step, under 1 % of the MLP step

CADENCE_LABELS = {
    "window_10": "an agreement per window of 10 steps",
    "every_1": "log_every_n_steps=1, the loop's cadence (100 windows an agreement)",
    "every_10": "log_every_n_steps=10, the loop's cadence (100 windows an agreement)",
}


def targets(results: Results) -> list[TargetRow]:
    """Per world, the cadence where the detectors cost the largest share of the step."""
    if "monitor" not in results:
        return []
    rows = []
    for world, measured in sorted(results["monitor"]["detectors"].items()):
        cadences = measured["cadences"]
        name = max(cadences, key=lambda n: cadences[n]["pct"].median)
        rows.append(target(
            f"the monitor's detectors at their defaults < {TARGET_PCT:.0f} % of the MLP step: "
            f"x{world} (the costliest cadence: {CADENCE_LABELS[name]})",
            cadences[name]["pct"], lambda v: v < TARGET_PCT, ".2f", " %",
        ))  # fmt: skip
    return rows


def chapters(results: Results) -> list[str]:
    return [markdown(results)] if "monitor" in results else []


def markdown(results: Results) -> str:
    m = results["monitor"]
    quick = (
        "\n\n**A `--quick` run: few blocks and steps. Its numbers are not a measurement.**"
        if m["quick"]
        else ""
    )
    verdicts = "\n".join(f"- {name}: {measured}, {verdict}" for name, measured, verdict in
                         targets(results))  # fmt: skip
    parts = [
        "## 9. The monitor's cost" + quick,
        _detectors(m) + "\n\n**Against the target** (the median decides):\n\n" + verdicts,
        _gather(m),
        _end_to_end(m["end_to_end"]),
    ]
    if m["step_costs"]:
        parts += [_diagnostics(m["step_costs"]), _norm(m["step_costs"])]
    return "\n\n".join(parts)


def _detectors(m: dict[str, Any]) -> str:
    rows = []
    for world, measured in sorted(m["detectors"].items()):
        step = measured["step_ms"]
        for name, c in measured["cadences"].items():
            steps = c["log_every"] * c["windows"]
            rows.append((CADENCE_LABELS[name], world, steps, c["us"].fmt(".2f"),
                         f"{c['us'].median * steps:,.0f}", step.fmt(".3f"), c["pct"].fmt(".2f"),
                         c["events"]))  # fmt: skip
    return (
        "**The detectors at their defaults, timed in place.** What `Trainer.agree` and "
        "`Trainer.after_agreement` add for the monitor at an agreement: `Monitor.payload` (the "
        "rank's losses joined to the metrics' payload), the rows cut at the monitor's part, "
        "`Monitor.step_values` (each step's mean loss over the ranks), `Monitor.judge` on the "
        "steps (loss_spike; grad_spike has no norm to judge without clipping, its action at "
        "the default `warn` computes none) and `Monitor.judge` on the ended logging windows "
        f"(slowdown: the windows summed into spans of {SlowdownConfig().span_s:.0f} s of "
        "training, a span "
        "judged). The agreement itself (`Agreement.agree`, its `all_gather` included) runs "
        "between them, untimed; the next table times the monitor's share of its bytes. Every "
        "rank judges the rows of all ranks (the 2-rank world: both ranks make the same calls). "
        "The loss is a decaying curve with 5 % noise, different on each rank, so that the "
        "detectors take their normal path: no alarm (*alarms*), the running level taken again "
        "every 10 values (window 100 // 10). The windows hand the slowdown steps of about "
        f"{STEP_S * 1e3:.0f} ms. Each block holds agreements over {BLOCK_STEPS:,} steps, timed "
        "with `perf_counter` around the monitor's calls and divided by the steps; the blocks "
        "alternate with blocks of 100 MLP steps (32 -> [256, 256] -> 10, batch 64, Adam, 1 "
        "thread: the default job's step, the model alone on each rank) in the same processes, "
        "and *% of the MLP step* pairs each block with the step block before it (median over "
        "the blocks, range min-max). *us per agreement*: the median per step times the steps. "
        f"In 2 ranks a training step also all-reduces its gradients: dpt's ddp step, timed in "
        f"the same rounds, took {m['detectors'][2]['ddp_step_ms'].fmt('.3f')} ms, so the "
        "share of a 2-rank run's own step is smaller than the one shown.\n\n"
        + md_table(
            "cadence | world | steps an agreement | us per step | us per agreement | "
            "MLP step ms | % of the MLP step | alarms",
            rows,
        )
    )


def _gather(m: dict[str, Any]) -> str:
    step = m["detectors"][2]["step_ms"].median
    rows = []
    for name, g in m["gather"].items():
        extra = g["extra_us_per_step"]
        rows.append((CADENCE_LABELS[name], f"{g['floats'][0]:,} / {g['floats'][1]:,}",
                     g["without_us"].fmt(".1f"), g["with_us"].fmt(".1f"), extra.fmt(".3f"),
                     f"{100 * extra.median / 1e3 / step:.3f}"))  # fmt: skip
    return (
        "**The monitor's floats in the agreement's `all_gather`** (2 ranks, Gloo): the monitor "
        "does no collective of its own; its payload, one loss per step since the last agreement "
        "(and one norm per step where grad_spike watches one), rides on the agreement's one "
        "`all_gather` (`dpt.distributed.all_gather_floats`, float64). Timed here alone, with "
        "the floats an agreement sends without the monitor (its header and the metrics' "
        "windows) and with the monitor's losses added, alternated; each block's median of 20 "
        "calls. *extra us per step*: the difference per step, paired block by block. One rank "
        "has no collective (the rows are its own).\n\n"
        + md_table(
            "cadence | floats without / with | all_gather us without | with | "
            "extra us per step | % of the MLP step",
            rows,
        )
    )


def _end_to_end(e: dict[str, Any]) -> str:
    rows = [
        ("at its defaults", e["fit_on"].fmt(",.0f"), e["windows_on"].fmt(",.0f")),
        ("off", e["fit_off"].fmt(",.0f"), e["windows_off"].fmt(",.0f")),
        ("on / off (paired)", fmt_ratio(e["fit_ratio"]), fmt_ratio(e["windows_ratio"])),
    ]
    off = " ".join(f"`{o}`" for o in MONITOR_OFF)
    return (
        f"**End to end.** `python train.py` on the MLP (batch 64, {e['steps']:,} steps, "
        "log_every_n_steps=10, 200 batches an epoch, `checkpoint.enabled=false "
        "dataset.num_val_samples=0`, one process, the heap settings of section 1) with the "
        f"monitor at its defaults against the monitor off ({off}), alternated run by run. "
        "*Trainer.fit*: metrics.json's `samples_per_s` (the run's samples over `Trainer.fit`'s "
        "wall time, first steps and epoch ends included); *windows*: the median over its "
        f"logging windows from step {e['warmup']} on (section 1's measure). A difference of "
        "a fraction of a percent is below what runs of a few seconds on a shared machine can "
        "show: the ratios carry the machine's noise (see their ranges); the in-place timings "
        "above are the precise numbers.\n\n"
        + md_table("monitor | samples/s (Trainer.fit) | samples/s (windows)", rows)
    )


def _diagnostics(models: list[dict[str, Any]]) -> str:
    rows = [
        (r["model"], r["batch"], r["step_ms"].fmt(".2f"), r["diagnostics_us"].fmt(",.0f"),
         *(r[f"diagnostics_pct_every_{n}"].fmt(".2f") for n in DIAGNOSED_EVERY))
        for r in models
    ]  # fmt: skip
    shares = " | ".join(f"% of the steps at every {n}" for n in DIAGNOSED_EVERY)
    return (
        "**Gradient diagnostics** (`monitor.grad_diagnostics_every`, off by default), one "
        "process with the heap settings of dpt's ranks (dpt/launch/allocator.py): "
        "`GradDiagnostics.before_update` (each module's gradient and weight norms, "
        "the weights cloned) and `after_update` (the update's norm, one read-back) around a "
        "real Adam step, timed around the two calls; against the training step (forward, "
        "backward, Adam, one thread), the two alternated block by block and paired (MLP: "
        "blocks of 50 steps, ResNet-18: torchvision's resnet18 with 10 classes on 32 px "
        "images, blocks of 3). The share at every N: the call over N steps.\n\n"
        + md_table(f"model | batch | step ms | us per diagnostics call | {shares}", rows)
    )


def _norm(models: list[dict[str, Any]]) -> str:
    rows = [
        (r["model"], r["batch"], r["step_ms"].fmt(".2f"), r["norm_us"].fmt(",.0f"),
         r["norm_pct"].fmt(".2f"))
        for r in models
    ]  # fmt: skip
    return (
        "**The gradient norm for grad_spike's reactions without clipping.** grad_spike judges "
        "the global gradient norm; under `trainer.grad_clip_norm` clipping computes it anyway, "
        "and without clipping it is computed only when `monitor.grad_spike.action` is skip, "
        "rollback or stop (`Precision.norm`: `torch.nn.utils.get_total_norm` over the "
        "gradients, no collective), every step, timed as above. That is its price, besides "
        "one more float per step in the agreement (the table above) and a second detector "
        "per step (about the loss_spike's share of the first table). `skip` costs more than "
        "the norm: the update waits for the verdict, so ranks agree every step (section 6's "
        "agreement, per step).\n\n"
        + md_table("model | batch | step ms | us per step | % of the step", rows)
    )
