"""Section 5 of the report, from the `startup` section (benchmarks/startup.py): launch to the
first optimizer step, and the whole process's cost per extra step. (The same section's cost of
logging every step is in section 6: benchmarks/report/overhead.py.)"""

from __future__ import annotations

from benchmarks.report.common import (
    STARTUP_TARGET,
    THROUGHPUT_TARGET,
    Results,
    TargetRow,
    fmt_ratio,
    md_table,
    target,
)


def targets(results: Results) -> list[TargetRow]:
    rows = []
    for r in results.get("marginal", []):
        limit = 1 / THROUGHPUT_TARGET
        name = (f"whole-process cost per extra step, dpt/plain <= {limit:.3f} (the same target as "
                f"the user feels it): mlp {r['strategy']} x{r['world']}")  # fmt: skip
        if min(r["plain_ms"].low, r["dpt_ms"].low) <= 0:
            # A longer run that ended sooner: start-up's swings exceeded the extra steps' cost.
            verdict = "**inconclusive**: a longer run finished sooner in some round (load)"
            rows.append((name, fmt_ratio(r["ratio"]), verdict))
            continue
        rows.append(target(name, r["ratio"], lambda v: v <= 1 / THROUGHPUT_TARGET))
    for r in results.get("startup", []):
        name = (f"launch to first optimizer step, dpt/plain <= {STARTUP_TARGET}: "
                f"mlp {r['strategy']} x{r['world']}")  # fmt: skip
        rows.append(target(name, r["ratio"], lambda v: v <= STARTUP_TARGET))
    return rows


def chapters(results: Results) -> list[str]:
    return [_startup(results)]


def _startup(results: Results) -> str:
    if "startup" not in results:
        return ""
    rows = [
        (r["strategy"], r["world"], r["plain"].fmt(".2f"), r["dpt"].fmt(".2f"),
         r["extra_s"].fmt("+.2f"), fmt_ratio(r["ratio"]))
        for r in results["startup"]
    ]  # fmt: skip
    marginal = [
        (r["strategy"], r["world"], *(f"{s.fmt('.2f')}" for s in r["plain_wall_s"]),
         *(f"{s.fmt('.2f')}" for s in r["dpt_wall_s"]), r["plain_ms"].fmt(".3f"),
         r["dpt_ms"].fmt(".3f"), fmt_ratio(r["ratio"]))
        for r in results["marginal"]
    ]  # fmt: skip
    n1, n2 = results["marginal"][0]["steps"]
    return (
        "## 5. Start-up and the whole process, as the user feels them\n\n"
        "MLP on the synthetic task, both loops at log_every_n_steps=10, dpt with "
        "`checkpoint.enabled=false dataset.num_val_samples=0` as in section 1; every round runs "
        f"plain and dpt for {n1} steps, then for {n2} steps.\n\n"
        "*Launch to the first optimizer step*: seconds from starting the command (`python "
        "train.py ...` / `python benchmarks/plain_loop.py ...`) to the moment rank 0's first "
        "`optimizer.step()` returns, over the runs of both lengths (paired). The plain loop "
        "stamps it after its `optimizer.step()`; dpt runs as `benchmarks/stamped_train.py`, "
        "which is `train.py` plus a global optimizer hook that stamps the first step and removes "
        "itself. Neither stamp waits for a logging step, so neither loop is billed for its first "
        "metrics write. dpt's extra time is importing and composing more (Hydra, its config "
        "schemas) and, for ddp, the elastic launcher against `torch.multiprocessing.spawn`; "
        "dpt's ranks fork from a server that imported torch while the launcher did (section "
        "7).\n\n"
        + md_table("strategy | world | plain s | dpt s | dpt extra s | dpt/plain", rows)
        + "\n\n*Cost per extra step*: whole-process wall time (from starting the command to "
        f"its exit) of the {n2}-step run minus the {n1}-step run, over {n2 - n1} steps: what "
        "one more step costs the user, epoch boundaries, logging and everything else included; "
        "start-up and teardown cancel out. The ratio pairs the two loops round by round.\n\n"
        + md_table(
            f"strategy | world | plain s, {n1} steps | plain s, {n2} steps | dpt s, {n1} steps | "
            f"dpt s, {n2} steps | plain ms/step | dpt ms/step | dpt/plain cost",
            marginal,
        )
    )
