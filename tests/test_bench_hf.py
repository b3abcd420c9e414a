"""The benchmark's `hf` section (benchmarks/hf_models.py): its report from made-up numbers, its
command lines, and a `--smoke` run of its three loops end to end (dpt, benchmarks/plain_hf.py,
benchmarks/hf_trainer.py on a tiny Llama with LoRA). No timing is asserted: a smoke run's
numbers on a shared machine mean nothing."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, python_in_process


def _runs(paces: list[float], firsts: list[float], loss: float = 3.0) -> list[dict[str, float]]:
    return [{"steady": pace, "first_step_s": first, "loss": loss}
            for pace, first in zip(paces, firsts, strict=True)]  # fmt: skip


def _measured() -> dict[str, Any]:
    """Two rounds of every row, numbers made up."""
    folder = {"hidden": 64, "layers": 2, "intermediate": 128, "block_size": 64,
              "parameters": 115_008, "lora_parameters": 3_584}  # fmt: skip
    big = {"hidden": 256, "layers": 4, "intermediate": 688, "block_size": 128,
           "parameters": 3_066_112, "lora_parameters": 28_672}  # fmt: skip
    runs = {
        "tiny": {
            "full": {"dpt": _runs([1000, 900], [4.0, 5.0]), "plain": _runs([1000, 1000], [3, 3]),
                     "trainer": _runs([800, 900], [5.0, 6.0], loss=3.0 + 1e-6)},
            "lora": {"dpt": _runs([1200, 1200], [4, 4]), "plain": _runs([1000, 1200], [3, 3]),
                     "trainer": _runs([1000, 1000], [5, 5])},
        },
        "3M": {
            "full": {loop: _runs([40, 40], [5, 5]) for loop in ("dpt", "plain", "trainer")},
            "lora": {"dpt": _runs([50, 48], [5, 5]), "plain": _runs([50, 50], [4, 4]),
                     "trainer": _runs([45, 55], [6, 6], loss=3.02)},
        },
    }  # fmt: skip
    return {"hf": {
        "runs": runs, "folders": {"tiny": folder, "3M": big}, "short": "tiny",
        "steps": {"tiny": 300, "3M": 30}, "batch": 8, "log_every": 10, "lr": 1e-3,
        "lora_rank": 8, "lora_alpha": 16.0, "lora_targets": ("q_proj", "v_proj"),
        "tokens": 250_000, "text_bytes": 600_000, "threads": 1,
        "versions": {"torch": "2", "transformers": "5", "peft": "0.1", "accelerate": "1"},
        "quick": False, "smoke": False, "rounds": 2, "date": "today", "duration_s": 300.0,
        "load": ((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)), "cores": 2,
    }}  # fmt: skip


def test_hf_is_a_marked_section_of_its_own() -> None:
    from benchmarks import bench
    from benchmarks.report import document

    assert "hf" in bench.RUNNERS and "hf" not in bench.DEFAULT_SECTIONS
    assert "hf" in document.MARKED
    report = (REPO / "docs" / document.REPORT).read_text()
    assert report.index("<!-- /bench_trackers -->") < report.index("<!-- bench_hf -->")
    assert report.index("<!-- bench_hf -->") < report.index("<!-- /bench_hf -->")


def test_hf_report_pairs_each_rounds_paces_and_judges_the_targets(tmp_path: Path) -> None:
    """What `--sections hf` measures (numbers made up): each row's paces, their paired ratios,
    the seconds to the first step, the loss gap and the verdicts."""
    from benchmarks.report import document

    path = tmp_path / document.REPORT
    path.write_text("# Performance\n\nthe rest, as it was\n")
    document.write_marked(tmp_path, _measured())
    section = path.read_text().split("the rest, as it was\n\n", 1)[1]
    assert section.startswith("<!-- bench_hf -->\n## 16. Hugging Face models")
    assert section.endswith("<!-- /bench_hf -->\n")
    assert "`python -m benchmarks --sections hf --rounds 2`" in section
    # dpt/plain pairs 1000/1000 and 900/1000; dpt/Trainer 1000/800 and 900/900
    assert ("| tiny | full | 115,008 | 950 (900-1,000) | 1,000 (1,000-1,000) | 850 (800-900) "
            "| 0.950 (0.900-1.000) | 1.125 (1.000-1.250) | 4.5 (4.0-5.0) | 3.0 (3.0-3.0) "
            "| 5.5 (5.0-6.0) | 1.0e-06 |") in section  # fmt: skip
    assert ("| tiny | LoRA | 3,584 | 1,200 (1,200-1,200) | 1,100 (1,000-1,200) | 1,000 "
            "(1,000-1,000) | 1.100 (1.000-1.200) | 1.200 (1.200-1.200) |") in section  # fmt: skip
    assert ("| 3M | LoRA | 28,672 | 49.0 (48.0-50.0) | 50.0 (50.0-50.0) | 50.0 (45.0-55.0) "
            "| 0.980 (0.960-1.000) | 0.992 (0.873-1.111) |") in section  # fmt: skip
    # the words come from the numbers: 8,000 / 950 samples/s is 8.42 ms a step
    assert ("- tiny, full: a step took 8.42 ms in dpt, 8.00 ms in the plain loop and 9.41 ms in "
            "Trainer (medians): Trainer +0.99 ms a step against dpt, the plain loop -0.42 ms."
            ) in section  # fmt: skip
    assert ("- 3M, LoRA: 163 ms a step in dpt, 160 ms in the plain loop, 160 ms in Trainer: the "
            "slowest 2.0 % over the fastest, within the spread of each loop's own runs (20.0 %)"
            ) in section  # fmt: skip
    assert "dpt's first optimizer step came 5.0 s after its launch, the plain loop's 3.5 s" \
        in section  # fmt: skip
    verdicts = [
        "| dpt/Trainer samples/s, `model=hf` tiny, full >= 1.1 | 1.125 (1.000-1.250) | met (not "
        "in every round) |",
        "| dpt/Trainer samples/s, `model=hf` tiny, LoRA >= 1.1 | 1.200 (1.200-1.200) | met |",
        "| dpt/plain samples/s, `model=hf` tiny, full >= 0.98 | 0.950 (0.900-1.000) | **not met** "
        "(met in some rounds) |",
        "| dpt/plain samples/s, `model=hf` 3M, full >= 0.98 | 1.000 (1.000-1.000) | met |",
        "| dpt/plain samples/s, `model=hf` 3M, LoRA >= 0.98 | 0.980 (0.960-1.000) | met (not in "
        "every round) |",
    ]
    for row in verdicts:
        assert row in section
    # a whole report's targets table has the same rows
    from benchmarks.report import hf_models

    assert len(hf_models.targets(_measured())) == 6


def test_hf_commands_are_one_run_three_ways(tmp_path: Path) -> None:
    from benchmarks import hf_models

    shape, folder = hf_models.SHAPES[0], tmp_path / "tiny"
    data = hf_models.Data(tmp_path / "text.txt", tmp_path / "tokens", tmp_path / "t.bin", 999,
                          "uint16")  # fmt: skip
    dpt = hf_models._command("dpt", "lora", shape, folder, 20, data, tmp_path / "run")
    assert dpt[1].endswith("benchmarks/stamped_train.py")
    assert {"model=hf", f"model.path={folder}", "optimizer=adamw", "optimizer.weight_decay=0",
            "trainer.batch_size=8", "trainer.max_steps=20", "finetune.lora.rank=8",
            f"dataset.cache_dir={data.cache}", "checkpoint.enabled=false"} <= set(dpt)  # fmt: skip
    for loop, script in (("plain", "plain_hf.py"), ("trainer", "hf_trainer.py")):
        full = hf_models._command(loop, "full", shape, folder, 20, data, tmp_path / "run")
        assert full[1].endswith(f"benchmarks/{script}")
        assert {f"--model={folder}", f"--tokens={data.tokens}", "--count=999", "--batch-size=8",
                "--steps=20", "--log-every=10", "--lr=0.001"} <= set(full)  # fmt: skip
        assert not any(arg.startswith("--lora") for arg in full)
        lora = hf_models._command(loop, "lora", shape, folder, 20, data, tmp_path / "run")
        assert lora[-4:] == ["--lora-alpha=16.0", "--lora-targets", "q_proj", "v_proj"]


def test_a_run_that_would_cross_an_epoch_is_refused(tmp_path: Path) -> None:
    from benchmarks import hf_models
    from benchmarks.runner import RunError

    data = hf_models.Data(tmp_path, tmp_path, tmp_path, 64 * 100 + 1, "uint16")
    hf_models._check_epoch(hf_models.SHAPES[0], 12, data)  # 96 of 100 windows
    with pytest.raises(RunError, match="cross an epoch of 100 windows"):
        hf_models._check_epoch(hf_models.SHAPES[0], 13, data)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_smoke_runs_dpt_the_plain_loop_and_trainer_on_one_folder(tmp_path: Path) -> None:
    """A tiny Llama folder with LoRA (peft in both peers), 20 steps of each loop, one process
    each (about 17 s on 2 idle cores): the folder, the token file, the three command lines, the
    stamps each loop leaves and the report's row from them. The benchmark's own process is
    this one (`python scripts/bench.py`, the same command, run in process): its start-up
    measures nothing; the three loops' are the smoke."""
    result = python_in_process("scripts/bench.py", "--smoke", "--sections", "hf", "--out",
                               str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.output
    report = (tmp_path / "performance.md").read_text()
    assert "<!-- bench_hf -->\n## 16. Hugging Face models" in report
    assert "`python -m benchmarks --sections hf --rounds 1 --smoke`" in report
    number = r"[\d,]+(?:\.\d)?"
    row = (rf"\| tiny \| LoRA \| 3,584 \| {number} \| {number} \| {number} \| \d\.\d{{3}} "
           rf"\| \d\.\d{{3}} \| \d+\.\d \| \d+\.\d \| \d+\.\d \| \d\.\de[-+]\d\d \|")  # fmt: skip
    assert re.search(row, report), report
    assert "| dpt/Trainer samples/s, `model=hf` tiny, LoRA >= 1.1 |" in report


def test_the_peers_parse_the_same_options() -> None:
    """benchmarks/plain_hf.py and benchmarks/hf_trainer.py take one set of options (the
    section starts both with the same run)."""
    from benchmarks import hf_trainer, plain_hf

    argv = ["--model=m", "--tokens=t", "--count=10", "--lora-rank=8"]
    plain, trainer = plain_hf.parse_args(argv), hf_trainer.parse_args(argv)
    assert isinstance(plain, argparse.Namespace) and vars(plain) == vars(trainer)
    assert plain.lora_targets == ["q_proj", "v_proj"] and plain.lora_alpha == 16.0
