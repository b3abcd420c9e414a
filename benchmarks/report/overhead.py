"""Sections 6 and 7 of the report, which read several sections together: dpt's per-step overhead
(logging every step, from `startup`; dpt's own calls timed in place, from `sync`, as shares of the
step times of `loops`), and where dpt's time still goes (from all three)."""

from __future__ import annotations

from benchmarks.report.common import (
    LOGGING_TARGET_PCT,
    Results,
    TargetRow,
    fmt_ratio,
    logging_target,
    md_table,
)
from benchmarks.report.loops import step_times_ms
from benchmarks.runner import Stat


def targets(results: Results) -> list[TargetRow]:
    rows = []
    for r in results.get("logging", []):
        rows.append(logging_target(f"logging at log_every_n_steps=1 < {LOGGING_TARGET_PCT:.0f} % "
                                   f"of the step: mlp {r['strategy']} x{r['world']}", r["cost_pct"],
                                   ".1f"))  # fmt: skip
    steps = step_times_ms(results)
    for world, costs in sorted(results.get("per_step", {}).items()):
        for model, ms in steps.items():
            if model != "mlp" and world in ms:  # the MLP is measured end to end above
                cost = costs["per_step_us_every_1"]
                share = Stat(
                    *(100 * v / 1e3 / ms[world] for v in (cost.median, cost.low, cost.high)), cost.n
                )
                rows.append(logging_target(f"logging at log_every_n_steps=1 < "
                                           f"{LOGGING_TARGET_PCT:.0f} % of the step: {model} "
                                           f"x{world} (section 6 cost / section 2 step)", share,
                                           ".2f"))  # fmt: skip
    return rows


def chapters(results: Results) -> list[str]:
    return [_overhead(results), _findings(results)]


def _overhead(results: Results) -> str:
    parts = []
    if "logging" in results:
        rows = [
            (r["strategy"], r["world"], r["step_ms"].fmt(".3f"), r["cost_ms"].fmt(".3f"),
             r["cost_pct"].fmt(".1f"), fmt_ratio(r["ratio_at_1"]))
            for r in results["logging"]
        ]  # fmt: skip
        parts.append(
            "Logging every step: dpt at `trainer.log_every_n_steps=1` against the same run with "
            f"{1_000_000:,} (no logging inside the run), MLP, from `Trainer.fit`'s wall time "
            "(metrics.json). *dpt/plain at 1*: throughput ratio when both log every step.\n\n"
            + md_table(
                "strategy | world | step ms (no logging) | "
                "logging ms/step | logging % of step | dpt/plain at 1",
                rows,
            )
        )
    if "per_step" in results:
        parts.append(_per_step_table(results))
    if not parts:
        return ""
    return "## 6. Per-step overhead of dpt's loop\n\n" + "\n\n".join(parts)


PER_STEP_CALLS = {
    "each_step_us": "`MetricsLogger.record` (every step; no device op)",
    "agree_us": "`MetricsLogger.read_back` + `Agreement.agree` (one agreement for a window of "
    "10 steps: one read-back, the one `all_gather`)",
    "agreed_us": "`MetricsLogger.agreed` (that window written: TensorBoard scalars, a log line)",
    **{
        f"per_step_us_every_{n}": f"all of the above with `end_window`, per step, at "
        f"log_every_n_steps={n}, agreements at the loop's cadence (blocks of 100 windows, "
        "one agreement each)"
        for n in (1, 10, 50)
    },
    "fetch_dpt_us": "dpt's batch fetch, MLP batch of 64 (`InMemoryDataset.__getitems__`)",
    "fetch_plain_us": "the plain loop's batch fetch (`DataLoader(TensorDataset)`: a "
    "`__getitem__` per sample, `default_collate`)",
}


def _per_step_table(results: Results) -> str:
    steps = step_times_ms(results)
    headers = ["call", "world", "us"] + [f"% of {k} step" for k in steps]
    rows = []
    for world, costs in sorted(results["per_step"].items(), key=lambda kv: int(kv[0])):
        for key, label in PER_STEP_CALLS.items():
            if key not in costs:  # the batch fetch is timed in one process only
                continue
            stat = costs[key]
            shares = [
                f"{100 * stat.median / 1e3 / ms[int(world)]:.2f}" if int(world) in ms else "-"
                for ms in steps.values()
            ]
            rows.append((label, world, stat.fmt(".1f"), *shares))
    return (
        "dpt's own calls around the training, timed in place as `Trainer.train_step` makes "
        "them (in a 1-rank and a 2-rank Gloo world, both ranks making the same calls), and "
        "their share of the measured step time of each model (section 2, same world size). "
        "For comparison, the plain loop pays one `window_loss += loss.detach()` (a device op) "
        "per step and one `.item()` and a print per window.\n\n" + md_table(headers, rows)
    )


def _findings(results: Results) -> str:
    """Where the MLP step's time goes, dpt against the plain loop, from this run's numbers; and
    what start-up spends, from a profile."""
    costs = results.get("per_step", {}).get(1, {})
    rows = {(r["model"], r["world"], r["log_every"]): r for r in results.get("loops", [])}
    parts = []
    if "fetch_dpt_us" in costs and ("mlp", 1, 10) in rows:
        saving = costs["fetch_plain_us"].median - costs["fetch_dpt_us"].median
        lines = []
        for every in (10, 50):
            r = rows.get(("mlp", 1, every))
            if r is None:
                continue
            extra = costs[f"per_step_us_every_{every}"].median
            plain_ms, dpt_ms = (1e3 * r["batch"] / r[k].median for k in ("plain", "dpt"))
            # The plain loop's step if it fetched its batches as dpt does: what dpt's own
            # machinery costs against a loop with the same data path.
            same_fetch = (plain_ms - saving / 1e3) / dpt_ms
            lines.append(
                f"- log_every_n_steps={every}: dpt's bookkeeping costs {extra:.0f} us per step "
                f"({100 * extra / 1e3 / dpt_ms:.1f} % of its {dpt_ms:.2f} ms step), its batch "
                f"fetch saves {saving:.0f} us: dpt/plain measured {r['ratio'].median:.3f}; "
                f"against a plain loop with dpt's batch fetch it would be about {same_fetch:.3f}."
            )
        per_window = costs["agree_us"].median + costs["agreed_us"].median
        parts.append(
            "**MLP, one process.** The forward, backward and Adam step are the same calls in "
            "both loops. What differs, from section 6's in-place timings:\n\n"
            f"- every step, dpt keeps the loss and the counts "
            f"({costs['each_step_us'].median:.1f} us for `MetricsLogger.record`); the plain "
            "loop adds the loss into a device tensor (`window_loss += loss.detach()`, a couple "
            "of us): a wash;\n"
            f"- for a window with its own agreement, dpt spends {per_window:.0f} us: "
            f"{costs['agree_us'].median:.0f} us to read the window's losses back (one stack, "
            "one `.tolist()`; the non-finite check is done on those floats) and agree, and "
            f"{costs['agreed_us'].median:.0f} us in `MetricsLogger.agreed`. Windows shorter "
            "than `dpt.loop.agreement.SPACING_S` (50 ms of training) share one agreement, so the "
            "first part is paid once per 50 ms at most. A written window is one TensorBoard "
            "event for the rank's tags and one for the world's (held, then framed and written "
            "in bulk about once a second by dpt/observe/event_file.py with a compiled CRC-32C: "
            "~9 us an "
            "event in a tight loop; TensorBoard's own writer took 50-85 us, in a thread that "
            "held the interpreter for a pure-Python CRC), and a console line; the plain loop "
            "reads one number and prints a line;\n"
            f"- every step, the plain loop's `DataLoader(TensorDataset)` fetch costs "
            f"{costs['fetch_plain_us'].median:.0f} us (64 `__getitem__` calls, then "
            f"`default_collate`) against dpt's {costs['fetch_dpt_us'].median:.0f} us (one "
            "indexing op per batch, `InMemoryDataset.__getitems__`).\n\n"
            "So dpt's MLP ratio above 1 (where it is) is its data path, not its loop: "
            "per step its loop costs more than the plain loop's, by the window's cost divided "
            "by the cadence.\n\n" + "\n".join(lines) + "\n\n"
            "What the timed pieces leave of the gap to 1 is the Python around the training in "
            "`Trainer.train_step` and `forward_backward` (`agrees_now`, `ToDevice`, the "
            "`no_sync` and autocast contexts, `perf_counter` calls, sums over the micro-batches: "
            "tens of us per step under cProfile, less without it) and this run's noise (see "
            "the ranges)."
        )
    if any(m == "resnet18" for m, _, _ in rows):
        parts.append(
            "**ResNet-18.** Section 6 gives the same per-window costs as a share of its step, "
            "which is tens of times the MLP's. Two costs outside the loop had kept its ratios "
            "under 1 and spread: (1) the heap: on glibc's adaptive defaults a run settled at "
            "0.9 to 1.4 million page faults and ran up to 9 % faster or slower than the last "
            "one, dpt mostly at the slow end (the out-of-the-box table in section 1); with "
            "fixed thresholds (dpt/launch/allocator.py, given to both loops here) ~0.16 million "
            "faults, "
            "~10 % faster, runs within ~2 %. (2) torchvision's FakeData reseeds torch's global "
            "generator for every image, and on a torch built for CUDA that queues CUDA's "
            "seeding with a formatted copy of the call stack, ~5 us a frame: ~0.2 ms an image "
            "at the depth of dpt's loader (under Hydra and the launcher), half that at the "
            "plain loop's, 1-2 % of a step at batch 8. dpt's fake_images, and the plain loop "
            "alike, draw the same images from a generator of their own."
        )
    if "startup" in results:
        parts.append(
            "**Start-up** (timed in one process with `perf_counter` stamps and `python -X "
            "importtime`, on an idle machine; one run, so sizes only). Both loops pay for "
            "importing torch (~1.5 s) and, in the optimizer's constructor, torch._dynamo "
            "(~1.25 s). On top, dpt imports Hydra, OmegaConf and its CLI (~0.2 s) and composes "
            "the config once (~0.13 s): `@hydra.main` would compose it a second time first, "
            "only to read `hydra.mode` (`Hydra.get_mode`), which none of dpt's configs sets; "
            "dpt/launch/hydra_run.py skips that probe when nothing else can be in play. Its own "
            "modules, the parts and the run folder take ~0.1 s. TensorBoard, HPARAMS' protos, "
            "tqdm and the checkpoint machinery (DCP) are imported only when first used, after "
            "the first step. Under ddp the ranks fork from a server (dpt/launch/fork_server.py, "
            "Python's `forkserver`) that imports torch, torch._dynamo, dpt, DCP and, for "
            "dpt's own tasks, torchmetrics (without the optional packages of metrics they "
            "never use) once, started "
            "before the launcher imports torch, so the ranks' imports run beside the "
            "launcher's; the plain loop's `torch.multiprocessing.spawn` imports torch in the "
            "parent, then again in every rank."
        )
    if not parts:
        return ""
    return (
        "## 7. Where dpt's time still goes, and what would move it\n\n"
        + "\n\n".join(parts)
        + "\n\n**What would move the ratios next** (not made here):\n\n"
        "- Logging every step: measured with cold caches in a real run (an idle machine, "
        "1,000 MLP steps of ~0.9 ms), the window costs about 200 us: ~70 us for the two "
        "events, ~70 us for the console and log-file line (Python's logging, a flush per "
        "handler), ~70 us for the read-back, the agreement and the window's arithmetic; "
        "in a tight loop the same calls take a fifth of that. Under 5 % of a ~1 ms step "
        "leaves ~50 us: the events and lines would have to leave the training process (a "
        "writer process fed once a second), and the agreement's Python be halved.\n"
        "- Start-up, one process: torch's import and torch._dynamo's are both loops' floor; "
        "what is left to dpt is ~0.35 s of Hydra (its import, one compose, the run folder) "
        "and ~0.1 s of its own. Hydra's compose is about half Hydra's own config (~50 ms for "
        "an empty app) and half dpt's groups and schemas.\n"
    )
