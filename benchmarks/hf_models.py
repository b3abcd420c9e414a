"""Section `hf` (not run by default): a `model=hf` Llama-shaped folder trained by dpt, by a
hand-written loop and by transformers' `Trainer`, full fine-tuning and LoRA, side by side.

Two folders written here with transformers' own `save_pretrained` (nothing is downloaded): a
tiny Llama (a step of a few ms: what each loop adds per step shows) and one of a few million
parameters (a compute-bound step), with a byte-level BPE tokenizer learned on the section's text
(seeded made-up words, benchmarks/gpt.py's `write_text`). The text is tokenized once, before the
rounds, into dpt's token cache (`dpt.data.text.cached_tokens`), whose token file the two peers
read. For each folder, full and LoRA (rank 8 on `q_proj` and `v_proj`):

- dpt: `python benchmarks/stamped_train.py model=hf model.path=<folder> task=language_model
  dataset=text ...` (train.py, stamping its first optimizer step);
- the plain loop: benchmarks/plain_hf.py (`from_pretrained`, peft's LoRA, a `for` loop);
- Trainer: benchmarks/hf_trainer.py (`Trainer`, `TrainingArguments`, peft's LoRA).

All three train the same windows in the same order (dpt's seeded shuffle), at the same batch,
with AdamW at the same learning rate (no weight decay, a constant rate, the gradients' norm
clipped at 1.0: Trainer's default, which it runs with as its users do), logging
every LOG_EVERY steps, for the same steps, each run in a process of its own with `--threads`
intra-op threads and dpt's heap settings, alternated round by round. Per run: the steady pace
(samples/s over the logging windows after the first: dpt's `steady_samples_per_s`, the peers'
from their stamps at the logging steps), the seconds from the process's launch to its first
optimizer step, and the last window's mean loss (the three agree: the same arithmetic). Its
section of docs/performance.md sits between two markers (benchmarks/report/hf_models.py).

    python -m benchmarks --sections hf --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpt import write_text
from benchmarks.jobs import child_env
from benchmarks.plain_hf import CLIP_NORM
from benchmarks.report.common import stamp
from benchmarks.runner import REPO, RunError, Say, alternate, run_process
from benchmarks.stamped_train import FIRST_STEP_ENV
from dpt.launch import allocator

LOOPS = ("dpt", "plain", "trainer")
MODES = ("full", "lora")
BATCH, LOG_EVERY, LR = 8, 10, 1e-3
LORA_RANK, LORA_ALPHA, LORA_TARGETS = 8, 16.0, ("q_proj", "v_proj")  # dpt's defaults for Llama
VOCAB_ROWS = 320  # the embedding's rows: the tokenizer's 300 ids and padding, as real models pad
TEXT_BYTES, SMOKE_TEXT_BYTES = 600_000, 60_000  # ~2.4 bytes a token: 250,000 tokens
TIMEOUT_S = 600.0  # one run: a loaded machine stretches a run of seconds a lot


@dataclass(frozen=True)
class Shape:
    """A Llama folder's size, its windows and how long each loop trains it."""

    name: str
    hidden: int
    layers: int
    intermediate: int
    block_size: int
    steps: int
    quick_steps: int


SHAPES = (
    # A step of a few ms on one thread: what each loop adds to a step shows.
    Shape("tiny", hidden=64, layers=2, intermediate=128, block_size=64, steps=250,
          quick_steps=60),
    # ~3 M parameters, windows of 128: a step of about 0.2 s on one thread, the arithmetic.
    Shape("3M", hidden=256, layers=4, intermediate=688, block_size=128, steps=30,
          quick_steps=20),
)  # fmt: skip
SMOKE_STEPS = 20  # the tiny folder with LoRA only (peft in both peers): two logging windows


@dataclass(frozen=True)
class Data:
    """The section's text and its token file in dpt's cache (the same for both folders: one
    tokenizer)."""

    text: Path
    cache: Path  # dpt's dataset.cache_dir: its token file is there already
    tokens: Path
    count: int
    dtype: str


def write_folder(folder: Path, shape: Shape, tokenizer: Any) -> dict[str, Any]:
    """A Llama of `shape` (grouped-query attention: 4 heads, 2 of keys and values) saved with
    transformers' `save_pretrained`, with `tokenizer`; its size, full and with LoRA."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    # As dpt's own loads (dpt.models.hf): one small shard's bar is noise, and the first bar
    # would start tqdm's monitor thread in the process that writes the folder.
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_ROWS, hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=shape.block_size,
                         tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS))
    adapted = get_peft_model(model, lora)
    trained = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    return {"hidden": shape.hidden, "layers": shape.layers, "intermediate": shape.intermediate,
            "block_size": shape.block_size, "parameters": parameters,
            "lora_parameters": trained}  # fmt: skip


def prepare(
    folder: Path, shapes: tuple[Shape, ...], text_bytes: int
) -> tuple[Data, dict[str, Any]]:
    """The text, its tokenizer, the folders and the token file (in the cache dpt's runs get);
    each folder's size, by name."""
    from dpt.data.text import cached_tokens
    from dpt.data.tokenizer import load_tokenizer
    from scripts.make_hf_fixture import tokenizer as bpe

    folder.mkdir(parents=True, exist_ok=True)
    text = write_text(folder / "text.txt", text_bytes)
    learned = bpe(text.read_text())  # byte-level BPE of 300 ids, learned on this text
    sizes = {shape.name: write_folder(folder / shape.name, shape, learned) for shape in shapes}
    cache = folder / "tokens"
    # As dpt's runs tokenize (the folder's tokenizer.json, no validation), so they find it made.
    found = cached_tokens([text], [], load_tokenizer(str(folder / shapes[0].name)), cache, 0.0)
    train = found["train"]
    data = Data(text, cache, Path(train["path"]), int(train["count"]), train["dtype"])
    return data, sizes


def _steps(shape: Shape, args: argparse.Namespace) -> int:
    if args.smoke:
        return SMOKE_STEPS
    return shape.quick_steps if args.quick else shape.steps


def _check_epoch(shape: Shape, steps: int, data: Data) -> None:
    """No epoch ends within a run: dpt logs at an epoch's end too (a window cut there would not
    be the peers'), and Trainer's order is one epoch's."""
    windows = (data.count - 1) // shape.block_size
    if steps * BATCH > windows:
        raise RunError(f"hf {shape.name}: {steps} steps of {BATCH} cross an epoch of {windows} "
                       "windows; make the text longer (TEXT_BYTES)")  # fmt: skip


def _command(loop: str, mode: str, shape: Shape, folder: Path, steps: int, data: Data,
             run_dir: Path) -> list[str]:  # fmt: skip
    """The run's command line: the same run, three ways."""
    if loop == "dpt":
        cmd = [sys.executable, str(REPO / "benchmarks" / "stamped_train.py"), "model=hf",
               f"model.path={folder}", f"model.block_size={shape.block_size}",
               "task=language_model", "dataset=text", f"dataset.root={data.text}",
               "dataset.val_fraction=0", f"dataset.cache_dir={data.cache}", "optimizer=adamw",
               f"optimizer.lr={LR}", "optimizer.weight_decay=0", f"trainer.batch_size={BATCH}",
               f"trainer.grad_clip_norm={CLIP_NORM}",
               f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={LOG_EVERY}",
               "checkpoint.enabled=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
        return cmd + ([f"finetune.lora.rank={LORA_RANK}"] if mode == "lora" else [])
    script = "plain_hf.py" if loop == "plain" else "hf_trainer.py"
    cmd = [sys.executable, str(REPO / "benchmarks" / script), f"--model={folder}",
           f"--tokens={data.tokens}", f"--count={data.count}", f"--dtype={data.dtype}",
           f"--block-size={shape.block_size}", f"--batch-size={BATCH}", f"--steps={steps}",
           f"--log-every={LOG_EVERY}", f"--lr={LR}",
           f"--out={run_dir / 'stamps.json'}"]  # fmt: skip
    if mode == "lora":
        cmd += [f"--lora-rank={LORA_RANK}", f"--lora-alpha={LORA_ALPHA}", "--lora-targets",
                *LORA_TARGETS]  # fmt: skip
    return cmd


def _run(
    loop: str, mode: str, shape: Shape, folder: Path, steps: int, data: Data, tmp: Path,
    env: dict[str, str], numbers: itertools.count[int],
) -> dict[str, float]:  # fmt: skip
    """One run: its steady samples/s, seconds from launch to its first optimizer step, and the
    mean loss of its last logging window."""
    run_dir = tmp / f"{next(numbers):03d}-{shape.name}-{mode}-{loop}"
    run_dir.mkdir(parents=True)
    first_file = run_dir / "first_step.txt"
    what = f"hf {shape.name} {mode} {loop}"
    launched, _ = run_process(_command(loop, mode, shape, folder, steps, data, run_dir),
                              tmp / f"{run_dir.name}.txt", env | {FIRST_STEP_ENV: str(first_file)},
                              TIMEOUT_S, what, cwd=tmp)  # fmt: skip
    if loop == "dpt":
        summary = json.loads((run_dir / "metrics.json").read_text())
        losses = {row["step"]: row["train/loss"] for row in summary["history"]
                  if "train/loss" in row}  # fmt: skip
        steady, first = summary["steady_samples_per_s"], float(first_file.read_text())
    else:
        record = json.loads((run_dir / "stamps.json").read_text())
        stamps = {int(k): v for k, v in record["stamps"].items()}
        losses = {int(k): v for k, v in record["losses"].items()}
        # The windows after the first, as dpt's steady pace counts them.
        steady = (steps - LOG_EVERY) * BATCH / (stamps[steps] - stamps[LOG_EVERY])
        first = record["first_step"]
    return {"steady": steady, "first_step_s": first - launched, "loss": losses[steps]}


def run(args: argparse.Namespace, tmp: Path, say: Say) -> dict[str, Any]:
    """Every folder x {full, LoRA} x {dpt, plain, Trainer}, alternated round by round."""
    started, load_before = time.time(), os.getloadavg()
    shapes, modes = (SHAPES[:1], ("lora",)) if args.smoke else (SHAPES, MODES)
    data, sizes = prepare(tmp / "hf-data", shapes, SMOKE_TEXT_BYTES if args.smoke else TEXT_BYTES)
    steps = {shape.name: _steps(shape, args) for shape in shapes}
    for shape in shapes:
        _check_epoch(shape, steps[shape.name], data)
    say(f"  {data.count:,} tokens; batch {BATCH}, steps {steps}, logging every {LOG_EVERY}")
    # dpt's heap settings for all three, through glibc's variables (dpt then leaves glibc as
    # it is): the ratios measure the loops, not where each process's heap settled.
    env = child_env(args, "cpu") | allocator.HEAP_ENV | {"HF_HUB_OFFLINE": "1"}
    numbers, runs_dir = itertools.count(), tmp / "hf-runs"
    contenders = {
        (shape.name, mode, loop): functools.partial(
            _run, loop, mode, shape, tmp / "hf-data" / shape.name, steps[shape.name], data,
            runs_dir, env, numbers,
        )
        for shape in shapes for mode in modes for loop in LOOPS
    }  # fmt: skip

    def done(key: tuple[str, str, str], r: int, seconds: float) -> None:
        say(f"  round {r + 1}/{args.rounds}  {' '.join(key):18s} ({seconds:5.1f} s)")

    measured = alternate(contenders, args.rounds, done=done)
    runs = {shape.name: {mode: {loop: measured[shape.name, mode, loop] for loop in LOOPS}
                         for mode in modes} for shape in shapes}  # fmt: skip
    found = {"runs": runs, "folders": sizes, "short": shapes[0].name, "steps": steps,
             "batch": BATCH,
             "log_every": LOG_EVERY, "lr": LR, "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA,
             "lora_targets": LORA_TARGETS, "tokens": data.count,
             "text_bytes": data.text.stat().st_size,
             "threads": args.threads, "versions": _versions()}  # fmt: skip
    found |= stamp(args, started) | {"load": (load_before, os.getloadavg())}
    return {"hf": found}


def _versions() -> dict[str, str]:
    """The peers' packages, as the report names them."""
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "peft", "accelerate")}
