"""Section 11 of the report, from the `gpt` section (benchmarks/gpt.py): dpt's tiny GPT against a
hand-written loop of the same model and data (benchmarks/plain_gpt.py), single and ddp, and dpt's
tokens/s and memory per rank under ddp and fsdp. It stands between two markers
(`<!-- bench_gpt -->`), so that `--sections gpt` replaces it alone (benchmarks/report/document.py).
"""

from __future__ import annotations

from typing import Any

from benchmarks.report.common import (
    THROUGHPUT_TARGET,
    Results,
    TargetRow,
    fmt_ratio,
    md_table,
    measured_alone,
    quick_banner,
)
from benchmarks.report.common import target as target_row
from benchmarks.runner import Stat, paired_ratios
from dpt.launch import allocator

TITLE = "## 12. A tiny GPT: dpt against a hand-written loop"


def _name(row: dict[str, Any], log_every: int) -> str:
    world = f" x{row['world']}" if row["world"] > 1 else ""
    return (f"dpt/plain per-step throughput, tiny GPT: {row['strategy']}{world}, "
            f"log_every_n_steps={log_every}")  # fmt: skip


def targets(results: Results) -> list[TargetRow]:
    if "gpt" not in results:
        return []
    g = results["gpt"]
    return [
        target_row(_name(r, r["log_every"]), r["ratio"], lambda v: v >= THROUGHPUT_TARGET)
        for r in g["rows"]
    ]


def chapters(results: Results) -> list[str]:
    return [markdown(results)] if "gpt" in results else []


def command(g: dict[str, Any]) -> str:
    """The command that measures this section again."""
    parts = ["python -m benchmarks --sections gpt", f"--rounds {g['rounds']}"]
    if g["worlds"] and g["worlds"] != [2]:
        parts.append(f"--world-sizes {','.join(map(str, g['worlds']))}")
    if g["threads"] != 1:
        parts.append(f"--threads {g['threads']}")
    if g["smoke"] or g["quick"]:
        parts.append("--smoke" if g["smoke"] else "--quick")
    return " ".join(parts)


def markdown(results: Results) -> str:
    g = results["gpt"]
    quick = quick_banner(g)
    measured = measured_alone(g, command(g), "`--sections gpt` writes only this part of the "
                              "report.", cores=True)  # fmt: skip
    verdicts = "\n".join(f"- {name}: {ratio}, {verdict}" for name, ratio, verdict in
                         targets(results))  # fmt: skip
    parts = [
        TITLE + quick,
        measured,
        _method(g),
        _table(g),
        f"**Against the target** (dpt/plain >= {THROUGHPUT_TARGET}, the paired ratio's median "
        "decides):\n\n" + verdicts + _spread(g),
    ]
    if g["memory"]:
        parts += [_memory(g)]
    return "\n\n".join(parts)


def _method(g: dict[str, Any]) -> str:
    m, w = g["model"], g["work"]
    tokens = w.batch_size * m["block_size"]
    heap = ", ".join(f"`{k}={v}`" for k, v in allocator.HEAP_ENV.items())
    return (
        f"**The model and data.** `experiment={m['experiment']}`: a GPT of {m['n_layer']} "
        f"blocks, width {m['n_embd']}, {m['n_head']} heads, windows of {m['block_size']} tokens, "
        f"a vocabulary of {m['vocab_size']} (byte tokens), {m['parameters'] / 1e6:.2f} M "
        f"parameters (the head tied to the embedding), {m['flops_per_token'] / 1e6:.1f} MFLOP "
        f"per token trained (`GPT.flops_per_token`); AdamW, a warmup and a cosine, clipping at "
        f"1.0, as the experiment configures them (the plain loop gets them as flags: "
        f"`{' '.join(m['flags'])}`). Batch {w.batch_size} windows per process: {tokens:,} tokens "
        f"per process and step. The text: {m['text_bytes'] / 1e3:,.0f} kB of made-up words "
        f"(seeded), {m['tokens']:,} byte tokens, {m['windows']:,} windows, tokenized once "
        "before the rounds into the token cache that dpt's runs get (`dataset.cache_dir`), whose "
        "token file the plain loop reads; no validation (`dataset.val_fraction=0`, one `.txt` "
        "file), no checkpoints (`checkpoint.enabled=false`), and no epoch ends within a run.\n\n"
        "**How.** dpt: `python train.py experiment=gpt_tiny dataset.root=<text> "
        "dataset.val_fraction=0 checkpoint.enabled=false strategy=... trainer.max_steps=...`, "
        "its stamps: the wall-clock times of rank 0's `train/loss` events. The plain loop "
        "(`benchmarks/plain_gpt.py`): dpt's `GPT` class and nothing else of "
        "dpt; the token file through a memory map, the same windows (`block_size + 1` tokens at "
        "non-overlapping offsets), the epoch's order from a `DistributedSampler` (dpt draws the "
        "same permutation and gives each rank the same share), a batch in one indexing op, DDP "
        "with its defaults (dpt's ddp: `gradient_as_bucket_view=true`), `torch.optim.AdamW` "
        "over the two groups of `optimizer=adamw_gpt` (no decay on biases and gains), "
        "the schedule as a `LambdaLR`, `clip_grad_norm_`, the loss read back every "
        f"`--log-every` steps and the wall clock stamped there. Both: {w.steps} steps, logging "
        f"every {w.log_every}; throughput is the median over the logging windows from step "
        f"{w.warmup_steps} to {w.steps} (start-up and the first window left out), *all steps* "
        f"over that whole span; {g['threads']} intra-op thread(s) per process, Gloo between "
        f"processes, both with dpt's heap settings ({heap}). The runs alternate (plain, dpt, "
        "plain, dpt, ...) and each ratio is taken between the two runs of one round. *loss "
        "gap*: the largest difference over the rounds between the two runs' mean loss of the "
        "last window (rank 0): ~0, since both do the same arithmetic on the same batches."
    )


def _table(g: dict[str, Any]) -> str:
    rows = [
        (r["strategy"], r["world"], r["batch"], f"{r['tokens_per_step']:,}", r["log_every"],
         r["plain_tokens"].fmt(), r["dpt_tokens"].fmt(), fmt_ratio(r["ratio"]),
         fmt_ratio(r["ratio_all_steps"]), f"{r['loss_gap']:.1e}")
        for r in g["rows"]
    ]  # fmt: skip
    return md_table(
        "strategy | processes | batch/process | tokens/step (world) | log every | plain tokens/s "
        "(world) | dpt tokens/s (world) | dpt/plain (paired) | dpt/plain, all steps | loss gap",
        rows,
    )


def _spread(g: dict[str, Any]) -> str:
    ratios = [r["ratio"] for r in g["rows"]]
    if not ratios or all(r.n < 2 for r in ratios):
        return ""
    widest = max(r.high - r.low for r in ratios)
    return (
        f"\n\nThe paired ratios ran from {min(r.low for r in ratios):.3f} to "
        f"{max(r.high for r in ratios):.3f} (the widest row {widest:.3f} wide): on a shared "
        "machine a difference of a percent between the loops is below what single runs of a "
        "minute show, and a verdict on a 1 % target is only as good as that spread allows."
    )


def _state_mb(rank: dict[str, float]) -> float:
    return rank["memory/params_mb"] + rank["memory/grads_mb"] + rank["memory/optimizer_mb"]


def _memory(g: dict[str, Any]) -> str:
    w = g["memory_work"]
    rows, ratios = [], []
    for world, runs in g["memory"].items():
        for strategy, measured in runs.items():
            ranks = measured[0].ranks  # the sizes are the same in every round
            peak = [max(r["peak_rss_mb"] for r in run.ranks) for run in measured]
            tflops = [run.tflops for run in measured if run.tflops is not None]
            rows.append([
                strategy, world,
                *(f"{max(r[f'memory/{k}_mb'] for r in ranks):,.2f}"
                  for k in ("params", "grads", "optimizer")),
                f"{max(_state_mb(r) for r in ranks):,.2f}",
                Stat.of(peak).fmt(",.0f"),
                Stat.of([run.tokens_per_s for run in measured]).fmt(",.0f"),
                Stat.of(tflops).fmt(".4f") if tflops else "-",
            ])  # fmt: skip
        if {"ddp", "fsdp"} <= runs.keys():
            ddp, fsdp = runs["ddp"], runs["fsdp"]
            state = max(_state_mb(r) for r in fsdp[0].ranks) / max(
                _state_mb(r) for r in ddp[0].ranks
            )
            ratios.append([
                world, f"{state:.3f}", f"{1 / world:.3f}",
                paired_ratios([r.tokens_per_s for r in fsdp],
                              [r.tokens_per_s for r in ddp]).fmt(".2f"),
            ])  # fmt: skip
    table = md_table(
        "strategy | ranks | params MB | grads MB | AdamW state MB | state MB | peak RSS MB | "
        "tokens/s (world) | TFLOP/s (world)",
        rows,
    )
    ratio_table = md_table(
        "ranks | fsdp/ddp state per rank | 1/ranks | fsdp/ddp tokens/s (paired)", ratios
    )
    return (
        "### Under ddp and fsdp: tokens/s and memory per rank\n\n"
        f"dpt alone, the same experiment and text, {w.steps} steps (logging every "
        f"{w.log_every}), run through `benchmarks/stamped_train.py`, which "
        "is `train.py` plus a global optimizer hook that stamps each rank's peak resident memory "
        "(`ru_maxrss`, as section 8 reads it, over the training steps); ddp and fsdp alternated "
        "round by round with the runs above. Per rank, the largest over the ranks: parameters, "
        "gradients and AdamW's two moments as the rank holds them (each rank's TensorBoard "
        "`memory/params_mb`, `memory/grads_mb`, `memory/optimizer_mb`), their sum, and the peak "
        "resident memory (median over the rounds, with the range: Python, torch, the token map, "
        "activations and communication buffers included); tokens/s and TFLOP/s: the world's, "
        "over the whole run, from metrics.json (`tokens_per_s`, `tflops`).\n\n"
        f"{table}\n\n{ratio_table}\n\n"
        "At this size the training state is a few MB per rank: sharding it saves little next "
        "to what every process holds anyway (the interpreter and torch), so the peak RSS hardly "
        "moves, while fsdp's all-gathers and reduce-scatters per block cost time on every step. "
        "fsdp pays off for models whose state, not the runtime, fills the memory (section 8)."
    )
