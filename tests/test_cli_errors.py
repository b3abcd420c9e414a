"""Bad input stops before any worker starts, with one line that names the key.

Bad values and `--cfg job` are answered by the command's own process before any rank, fork
server or run folder exists: they run in this process, through the command's entry point
(tests.helpers.train_in_process: the exit code, stdout and stderr as that process would end
with them), which saves a Python start-up each. Two stay commands of their own:
`launcher=torchrun` outside torchrun is refused by the launcher, after Hydra made the run folder
(and its `.hydra/` files) and the process locked it; `HYDRA_FULL_ERROR=1` is about what the
interpreter prints for an exception that ends the process, a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import train, train_in_process

CASES = [
    ("trainer.batch_size=0", "Error: trainer.batch_size=0: must be >= 1"),
    ("trainer.epochs=-1", "Error: trainer.epochs=-1: must be >= 1"),
    (
        "launcher.nproc_per_node=0",
        "Error: launcher.nproc_per_node=0: expected 'auto' or a whole number >= 1",
    ),
    ("trainer.max_steps=0", "Error: trainer.max_steps=0: must be >= 1 or null (run all epochs)"),
    (
        "trainer.batch_size=abc",
        "Error: trainer.batch_size: Value 'abc' of type 'str' could not be converted to Integer",
    ),
    (
        "trainer.bogus=1",
        "Error: trainer.bogus: unknown key; allowed keys: epochs, max_steps, "
        "batch_size, seed, log_every_n_steps, val_every_n_steps, val_batches, device, timeout_s, "
        "stop_within, precision, grad_accum_steps, "
        "grad_clip_norm, compile, peak_tflops, on_nonfinite, early_stopping",
    ),
    (
        "+trainer.bogus=1",
        "Error: trainer.bogus: unknown key; allowed keys: epochs, max_steps, "
        "batch_size, seed, log_every_n_steps, val_every_n_steps, val_batches, device, timeout_s, "
        "stop_within, precision, grad_accum_steps, "
        "grad_clip_norm, compile, peak_tflops, on_nonfinite, early_stopping",
    ),
    (
        "strategy=foo",
        "Error: no config 'strategy/foo'; available options in 'strategy': ddp, dp, fsdp, "
        "pipeline, single",
    ),
    (
        "optimizer=lbfgs",
        "Error: no config 'optimizer/lbfgs'; available options in 'optimizer': "
        "adam, adamw, adamw_gpt, sgd",
    ),
    ("model.hidden_dims=[64,0]", "Error: model.hidden_dims=[64, 0]: every width must be >= 1"),
    ("dataset.num_classes=1", "Error: dataset.num_classes=1: must be >= 2"),
    ("trainer.device=tpu", "Error: trainer.device=tpu: must be one of auto, cuda, mps, cpu"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("override", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_value_fails_fast_naming_the_key(tmp_path: Path, override: str, message: str) -> None:
    run_dir = tmp_path / "run"
    result = train_in_process("strategy=ddp", override, f"hydra.run.dir={run_dir}")
    assert result.returncode == 1
    assert result.stderr.strip() == message  # exactly one line, no traceback
    assert "[rank" not in result.stdout  # no worker ever started
    assert not run_dir.exists()  # and no run folder was made


@pytest.mark.timeout(60)
def test_torchrun_launcher_outside_torchrun_says_what_is_missing(tmp_path: Path) -> None:
    result = train(tmp_path / "run", "launcher=torchrun", check=False, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: launcher=torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not "
        "set; start with `torchrun --nproc_per_node=N train.py launcher=torchrun ...`, or use "
        "launcher=local"
    )


@pytest.mark.timeout(60)
def test_hydra_full_error_keeps_the_traceback(tmp_path: Path) -> None:
    result = train(
        tmp_path / "run",
        "trainer.batch_size=abc",
        check=False,
        timeout=60,
        env={"HYDRA_FULL_ERROR": "1"},
    )
    assert result.returncode == 1
    assert "Traceback" in result.stderr


@pytest.mark.timeout(60)
def test_cfg_job_prints_the_config(tmp_path: Path) -> None:
    result = train_in_process("--cfg", "job", "strategy=ddp", "trainer.batch_size=16")
    assert result.returncode == 0, result.output
    assert "_target_: dpt.loop.strategy.DDP" in result.stdout
    assert "batch_size: 16" in result.stdout


def test_a_long_reason_is_cut_after_a_sentence_never_inside_a_link() -> None:
    from dpt.errors import clipped

    reason = ("Model registry functionality is unavailable; got unsupported URI 'htp://x' for "
              "model registry data storage. Supported URI schemes are: ['', 'file', "
              "'databricks', 'http', 'https', 'postgresql', 'mysql', 'sqlite', 'mssql']. See "
              "https://www.mlflow.org/docs/latest/tracking.html#where-runs-get")  # fmt: skip
    assert len(reason) > 250
    cut = clipped(reason, 250)  # the link starts at 228
    assert len(cut) <= 254 and cut.endswith("'mssql']. ...")
    assert clipped("short", 300) == "short"
    assert clipped("x" * 50 + " https://example.com/a/very/long/link", 60) == "x" * 50 + " ..."
