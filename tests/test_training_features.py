"""Precision, accumulation, clipping, schedules, non-finite losses, early stopping, compile."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dpt.loop.precision import Precision
from dpt.loop.schedulers import warmup_cosine
from dpt.models.mlp import MLP
from tests.helpers import (
    FAST,
    build_trainer,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    run_here,
    run_train,
    spawn,
    train,
)

# One-process runs whose weights, curves or console lines are checked train in this process
# (`run_here`: what `train.py strategy=single` runs), so do the one-process runs that end with an
# error line (`run_train`: as `train.py` would end); the worlds' runs and the compiled run
# (torch.compile's worker processes) start train.py.


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_accumulating_two_batches_of_16_equals_one_batch_of_32(tmp_path: Path) -> None:
    common = [*FAST, "optimizer=sgd", "trainer.max_steps=20", "trainer.seed=5"]
    run_here(tmp_path / "accum", *common, "trainer.batch_size=16", "trainer.grad_accum_steps=2")
    run_here(tmp_path / "big", *common, "trainer.batch_size=32")
    accum, big = load_weights(tmp_path / "accum"), load_weights(tmp_path / "big")
    assert max_abs_diff(accum, big) < 1e-6
    torch.manual_seed(5)
    assert max_abs_diff(MLP((32,), 10, [256, 256]).state_dict(), big) > 1e-3  # it trained


SMALL_DDP = ["strategy=ddp", "dataset.num_samples=512", "dataset.num_val_samples=0",
             "dataset.input_dim=8", "dataset.num_classes=3", "model.hidden_dims=[16]",
             "optimizer=sgd", "trainer.batch_size=8", "checkpoint.enabled=false"]  # fmt: skip


ACCUMS, ACCUM_STEPS = (1, 2, 4), 3


def _count_allreduces(rank: int, world: int, port: int, out: Path) -> None:
    """Every accumulation count's run, one after the other in one world (one start-up)."""
    with joined_world(rank, world, port) as env:
        for accum in ACCUMS:
            trainer = build_trainer(
                out / f"run{accum}", env, *SMALL_DDP, f"trainer.max_steps={ACCUM_STEPS}",
                f"trainer.grad_accum_steps={accum}", "trainer.log_every_n_steps=100",
            )  # fmt: skip
            calls: list[int] = []

            # No annotations: DDP compares them with dist.GradBucket, and here they are strings.
            def counting_hook(state, bucket, calls=calls):  # type: ignore[no-untyped-def]
                calls.append(bucket.index())
                return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

            trainer.model.register_comm_hook(None, counting_hook)
            trainer.fit()
            trainer.metrics.close()
            (out / f"calls-accum{accum}-rank{rank}.json").write_text(json.dumps(calls))


@pytest.fixture(scope="module")
def allreduces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("allreduces")
    spawn(_count_allreduces, 2, free_port(), out, nprocs=2)
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("accum", ACCUMS)
def test_ddp_all_reduces_once_per_optimizer_step_with_accumulation(
    allreduces: Path, accum: int
) -> None:
    for rank in (0, 1):
        calls = json.loads((allreduces / f"calls-accum{accum}-rank{rank}.json").read_text())
        assert calls == [0] * ACCUM_STEPS  # one bucket, one all-reduce per optimizer step


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bf16_mixed_trains_on_cpu(tmp_path: Path) -> None:
    _, result = run_here(tmp_path, *FAST, "trainer.precision=bf16-mixed", "trainer.epochs=2")
    assert "precision bf16-mixed" in result
    losses = [v for _, v in _scalars(tmp_path / "tb" / "world", "train/loss")]
    assert losses[-1] < 0.6 * losses[0]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["val"]["val/acc1"] > 0.6


@pytest.mark.timeout(60)
def test_fp16_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: 16-mixed is allowed")
    from dpt.errors import DptError

    with pytest.raises(DptError, match=r"trainer\.precision=16-mixed needs CUDA"):
        Precision("16-mixed", torch.device("cpu"))


def test_clipping_returns_the_pre_clip_norm_and_leaves_the_bound() -> None:
    torch.manual_seed(0)
    model = nn.Linear(10, 10)
    model(torch.randn(4, 10)).pow(2).sum().mul(100).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    assert expected > 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norm = Precision("32", torch.device("cpu")).clip_and_norm(model, optimizer, max_norm=1.0)
    assert norm is not None and norm.item() == pytest.approx(expected.item(), rel=1e-6)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert after.item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_grad_norm_and_lr_curves_are_logged(tmp_path: Path) -> None:
    run_here(
        tmp_path,
        *FAST,
        "trainer.max_steps=20",
        "trainer.log_every_n_steps=1",
        "trainer.grad_clip_norm=0.5",
        "scheduler=warmup_cosine",
        "scheduler.warmup_steps=5",
        "scheduler.min_lr=1e-4",
        "optimizer.lr=1e-3",
    )
    norms = _scalars(tmp_path / "tb" / "rank0", "optim/grad_norm")
    assert [s for s, _ in norms] == list(range(1, 21)) and all(v > 0 for _, v in norms)
    lrs = dict(_scalars(tmp_path / "tb" / "rank0", "optim/lr"))
    # After step s, the next update uses the lr for step index s: warmup (s+1)/5, then cosine.
    for step, lr in lrs.items():
        if step < 5:
            expected = 1e-3 * (step + 1) / 5
        else:
            progress = min(1.0, (step - 5) / (20 - 5 - 1))
            expected = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lr == pytest.approx(expected, rel=1e-5), step
    assert lrs[19] == pytest.approx(1e-4, rel=1e-5)  # the floor at the last step


def test_warmup_cosine_curve() -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = warmup_cosine(optimizer, total_steps=11, warmup_steps=2, min_lr=0.1)
    lrs = [schedule.get_last_lr()[0]]
    for _ in range(11):
        optimizer.step()
        schedule.step()
        lrs.append(schedule.get_last_lr()[0])
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])  # linear warmup, then the peak
    assert lrs[10] == pytest.approx(0.1)  # the floor at the last step (index total - 1)
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:11]))  # monotone decay


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_non_finite_loss_stops_naming_step_and_rank(tmp_path: Path, strategy: str) -> None:
    result = run_train(
        tmp_path, *FAST, f"strategy={strategy}", "optimizer=sgd", "optimizer.lr=1e30",
        "trainer.max_steps=10",
    )  # fmt: skip
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert "non-finite loss" in line and "at step 2 on rank 0" in line, line
    assert "set trainer.on_nonfinite=skip" in line


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_non_finite_loss_is_caught_before_anything_is_saved(tmp_path: Path) -> None:
    # The loss is inf from step 2; ranks agree on it at step 3, a checkpoint step, before saving.
    result = run_train(
        tmp_path, *FAST, "optimizer=sgd", "optimizer.lr=1e30", "trainer.log_every_n_steps=10",
        "checkpoint.every_n_steps=3", "trainer.max_steps=10",
    )  # fmt: skip
    assert result.returncode == 1
    assert "at step 2 on rank 0" in result.stderr.strip().splitlines()[-1], result.stderr
    assert not list((tmp_path / "checkpoints").glob("*.pt"))  # step 3's would hold inf weights
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.filterwarnings("ignore:Encountered `nan` values")  # torchmetrics, of the skipped step
def test_non_finite_loss_can_be_skipped(tmp_path: Path) -> None:
    _, result = run_here(
        tmp_path,
        *FAST,
        "optimizer=sgd",
        "optimizer.lr=1e30",
        "trainer.max_steps=6",
        "trainer.on_nonfinite=skip",
    )
    # The step's forward replayed on its batch: the second Linear's output is the first infinite.
    assert (
        "monitor: nonfinite at step 2: nan on rank 0, first non-finite output: 2 (Linear); "
        "update skipped, 64 samples skipped"
    ) in result
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 6


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_early_stopping_ends_the_run_when_the_metric_stalls(tmp_path: Path) -> None:
    # lr=0: the weights never change, so val/acc1 never improves after the first epoch.
    _, result = run_here(
        tmp_path,
        *FAST,
        "optimizer.lr=0",
        "trainer.epochs=5",
        "trainer.early_stopping.patience=1",
        "trainer.early_stopping.metric=val/acc1",
        "trainer.early_stopping.mode=max",
    )
    assert "early stopping: val/acc1 did not improve for 1 epoch(s)" in result
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["stopped_early"] is True
    assert metrics["steps"] == 2 * (2048 // 64)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compile_trains(tmp_path: Path) -> None:
    train(tmp_path / "compiled", *FAST, "trainer.compile=true", "trainer.max_steps=4", timeout=380)
    run_here(tmp_path / "eager", *FAST, "trainer.max_steps=4")
    diff = max_abs_diff(load_weights(tmp_path / "compiled"), load_weights(tmp_path / "eager"))
    assert diff < 1e-4  # same training, up to kernel-fusion rounding
