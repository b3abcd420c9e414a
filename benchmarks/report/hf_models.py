"""Section 16 of the report, from the `hf` section (benchmarks/hf_models.py): a `model=hf` Llama
trained by dpt, by a hand-written loop and by transformers' `Trainer`, full and LoRA, at a short
step and a compute-bound one. It stands between two markers (`<!-- bench_hf -->`), so that
`--sections hf` replaces it alone (benchmarks/report/document.py)."""

from __future__ import annotations

from typing import Any

from benchmarks.report.common import (
    Results,
    TargetRow,
    md_table,
    measured_alone,
    quick_banner,
    target,
)
from benchmarks.runner import Stat, paired_ratios

TITLE = "## 16. Hugging Face models: dpt against a plain loop and transformers' Trainer"
TRAINER_TARGET = 1.1  # dpt's pace over Trainer's, at the short step
PLAIN_TARGET = 0.98  # dpt's pace over the plain loop's, at every size
MODE_NAMES = {"full": "full", "lora": "LoRA"}


def chapters(results: Results) -> list[str]:
    return [markdown(results["hf"])] if "hf" in results else []


def targets(results: Results) -> list[TargetRow]:
    return _targets(results["hf"]) if "hf" in results else []


def _paces(runs: list[dict[str, float]]) -> list[float]:
    return [run["steady"] for run in runs]


def ratio(r: dict[str, Any], folder: str, mode: str, peer: str) -> Stat:
    """dpt's pace over `peer`'s, each round's runs paired."""
    by_loop = r["runs"][folder][mode]
    return paired_ratios(_paces(by_loop["dpt"]), _paces(by_loop[peer]))


def _targets(r: dict[str, Any]) -> list[TargetRow]:
    rows = []
    short = r["short"]
    for mode in r["runs"][short]:
        rows.append(target(
            f"dpt/Trainer samples/s, `model=hf` {short}, {MODE_NAMES[mode]} >= {TRAINER_TARGET}",
            ratio(r, short, mode, "trainer"), lambda v: v >= TRAINER_TARGET,
        ))  # fmt: skip
    for folder, modes in r["runs"].items():
        for mode in modes:
            rows.append(target(
                f"dpt/plain samples/s, `model=hf` {folder}, {MODE_NAMES[mode]} >= {PLAIN_TARGET}",
                ratio(r, folder, mode, "plain"), lambda v: v >= PLAIN_TARGET,
            ))  # fmt: skip
    return rows


def command(r: dict[str, Any]) -> str:
    parts = ["python -m benchmarks --sections hf", f"--rounds {r['rounds']}"]
    if r["threads"] != 1:
        parts.append(f"--threads {r['threads']}")
    if r["smoke"] or r["quick"]:
        parts.append("--smoke" if r["smoke"] else "--quick")
    return " ".join(parts)


def _pace(runs: list[dict[str, float]]) -> str:
    """Samples/s, with a decimal where they are few (the compute-bound step)."""
    stat = Stat.of(_paces(runs))
    return stat.fmt(",.1f" if stat.median < 100 else ",.0f")


def _seconds(runs: list[dict[str, float]]) -> Stat:
    return Stat.of([run["first_step_s"] for run in runs])


def _table(r: dict[str, Any]) -> str:
    rows = []
    for folder, modes in r["runs"].items():
        size = r["folders"][folder]
        for mode, by_loop in modes.items():
            trains = size["parameters"] if mode == "full" else size["lora_parameters"]
            rows.append([
                folder, MODE_NAMES[mode], f"{trains:,}",
                *(_pace(by_loop[loop]) for loop in ("dpt", "plain", "trainer")),
                ratio(r, folder, mode, "plain").fmt(".3f"),
                ratio(r, folder, mode, "trainer").fmt(".3f"),
                *(_seconds(by_loop[loop]).fmt(".1f") for loop in ("dpt", "plain", "trainer")),
                f"{_loss_gap(by_loop):.1e}",
            ])  # fmt: skip
    return md_table(
        "model | training | parameters that train | dpt samples/s | plain samples/s | Trainer "
        "samples/s | dpt/plain (paired) | dpt/Trainer (paired) | dpt s to step 1 | plain s to "
        "step 1 | Trainer s to step 1 | loss gap",
        rows,
    )


def _loss_gap(by_loop: dict[str, list[dict[str, float]]]) -> float:
    """The largest gap, over the rounds, between the three loops' last-window loss."""
    gaps = []
    for runs in zip(*by_loop.values(), strict=True):
        losses = [run["loss"] for run in runs]
        gaps.append(max(losses) - min(losses))
    return max(gaps)


def _ms(runs: list[dict[str, float]], batch: int) -> float:
    """Milliseconds a step at the median pace."""
    return 1000 * batch / Stat.of(_paces(runs)).median


def _findings(r: dict[str, Any]) -> str:
    """What the table says, in words, from its own numbers."""
    short, batch = r["short"], r["batch"]
    lines = []
    for mode, by_loop in r["runs"][short].items():
        d, p, t = (_ms(by_loop[loop], batch) for loop in ("dpt", "plain", "trainer"))
        lines.append(
            f"- {short}, {MODE_NAMES[mode]}: a step took {d:.2f} ms in dpt, {p:.2f} ms in the "
            f"plain loop and {t:.2f} ms in Trainer (medians): Trainer {t - d:+.2f} ms a step "
            f"against dpt, the plain loop {p - d:+.2f} ms."
        )
    for folder, modes in r["runs"].items():
        if folder == short:
            continue
        for mode, by_loop in modes.items():
            d, p, t = (_ms(by_loop[loop], batch) for loop in ("dpt", "plain", "trainer"))
            gap = 100 * (max(d, p, t) / min(d, p, t) - 1)
            paces = [Stat.of(_paces(by_loop[loop])) for loop in ("dpt", "plain", "trainer")]
            spread = max(100 * (s.high - s.low) / s.median for s in paces)
            why = (f"within the spread of each loop's own runs ({spread:.1f} %): the model's "
                   "arithmetic sets the pace" if gap <= spread
                   else f"more than each loop's own runs spread ({spread:.1f} %)")  # fmt: skip
            lines.append(
                f"- {folder}, {MODE_NAMES[mode]}: {d:.0f} ms a step in dpt, {p:.0f} ms in the "
                f"plain loop, {t:.0f} ms in Trainer: the slowest {gap:.1f} % over the fastest, "
                f"{why}."
            )
    firsts = {loop: Stat.of([run["first_step_s"] for modes in r["runs"].values()
                             for by_loop in modes.values() for run in by_loop[loop]]).median
              for loop in ("dpt", "plain", "trainer")}  # fmt: skip
    lines.append(
        f"- Start-up (the median over every row and round): dpt's first optimizer step came "
        f"{firsts['dpt']:.1f} s after its launch, the plain loop's {firsts['plain']:.1f} s, "
        f"Trainer's {firsts['trainer']:.1f} s."
    )
    return "\n".join(lines)


def _method(r: dict[str, Any]) -> str:
    sizes = "; ".join(
        f"*{name}*: width {s['hidden']}, {s['layers']} layers, MLP width {s['intermediate']}, "
        f"windows of {s['block_size']} tokens, {s['parameters']:,} parameters "
        f"({s['lora_parameters']:,} train with LoRA), {r['steps'][name]} steps"
        for name, s in r["folders"].items()
    )
    v = r["versions"]
    targets_ = ", ".join(f"`{t}`" for t in r["lora_targets"])
    return (
        "**The models and data.** Llama folders written by the benchmark with transformers' "
        "`LlamaForCausalLM(config).save_pretrained` (4 heads, 2 of keys and values, an "
        f"embedding of 320 rows, untied head), nothing downloaded: {sizes}. The text: "
        f"{r['text_bytes'] / 1e3:,.0f} kB of seeded made-up words, {r['tokens']:,} tokens of a "
        "byte-level BPE of 300 ids learned on it (the folders' `tokenizer.json`), tokenized "
        "once before the rounds into dpt's token cache; the peers read that token file. No "
        "epoch ends within a run.\n\n"
        "**How.** dpt: `python train.py model=hf model.path=<folder> task=language_model "
        "dataset=text dataset.root=<text> dataset.val_fraction=0 optimizer=adamw "
        f"optimizer.weight_decay=0 trainer.batch_size={r['batch']} trainer.grad_clip_norm=1.0 "
        f"trainer.log_every_n_steps={r['log_every']} checkpoint.enabled=false ...` (through "
        "`benchmarks/stamped_train.py`, which stamps the first optimizer step), LoRA with "
        f"`finetune.lora.rank={r['lora_rank']}`. The plain loop (`benchmarks/plain_hf.py`): "
        "`AutoModelForCausalLM.from_pretrained`, peft's `get_peft_model` for LoRA, the token "
        "file through a memory map, a batch in one indexing op, `F.cross_entropy` on the "
        "logits, `clip_grad_norm_` at 1.0, a `for` loop. Trainer (`benchmarks/hf_trainer.py`): "
        "`Trainer` and "
        '`TrainingArguments` (on the CPU, no evaluation, no saving, `report_to="none"`, '
        f"logging every {r['log_every']} steps, loader workers 0; its own defaults otherwise, "
        "as its users run it: the fused AdamW, clipping at 1.0, its progress bar), peft for "
        "LoRA, the targets given as `shift_labels` (the loss over the same positions), and a "
        "sampler of dpt's order. All three: the same windows in the same order (dpt's seeded "
        f"shuffle), batch {r['batch']}, `torch.optim.AdamW` at lr {r['lr']:g} with no weight "
        "decay (dpt and Trainer on torch's fused kernel, their default; the plain loop on "
        "torch's, a loop per tensor on the CPU: the same arithmetic), a constant rate, the "
        "gradients' norm clipped at 1.0 (Trainer's default), "
        f"LoRA of rank {r['lora_rank']} and alpha "
        f"{r['lora_alpha']:g} on {targets_}, the model as it loads (float32, SDPA attention, "
        "no key/value cache); each run its own process, "
        f"{r['threads']} intra-op thread(s), dpt's heap settings (glibc's variables) for all "
        f"three; torch {v['torch']}, transformers {v['transformers']}, peft {v['peft']}, "
        f"accelerate {v['accelerate']}. The runs alternate (dpt, plain, Trainer, for every row, "
        "round after round) and each ratio pairs the runs of one round.\n\n"
        "**What is measured.** The pace: samples/s over the logging windows after the first "
        "(dpt's `steady_samples_per_s` in metrics.json; the peers' from the wall clock at their "
        "logging steps, Trainer's in a `TrainerCallback`'s `on_step_end`), start-up and the "
        "first window left out. *s to step 1*: from the process's launch to its first "
        "optimizer step's return (imports, the folder's load, the data, the first step). "
        "*loss gap*: the largest difference over the rounds between the three loops' mean loss "
        "of the last window: ~0 in full fine-tuning (the same arithmetic on the same batches); "
        "with LoRA each loop draws its adapters' first weights itself (dpt's draw and peft's "
        "differ), so the losses differ a little. Per "
        "step Trainer also counts the step's FLOPs and draws its progress bar; those are part "
        "of its pace."
    )


def markdown(r: dict[str, Any]) -> str:
    note = "`--sections hf` writes only this part of the report."
    verdicts = md_table("target | measured | verdict", _targets(r))
    return f"""{TITLE}{quick_banner(r)}

{measured_alone(r, command(r), note, cores=True)}

{_method(r)}

{_table(r)}

{_findings(r)}

{verdicts}"""
