"""strategy=fsdp against single, activation checkpointing, and memory per rank."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.distributed import env_from_environment
from dpt.state.stateful import full_state_dict
from tests.helpers import FAST, build_trainer, free_port, joined_world, max_abs_diff, spawn

STEPS = 20
# 65 validation samples: 33 on rank 0, 32 on rank 1, so 2 batches against 1. fsdp's forwards
# are collectives, so this also proves that validation keeps the ranks in step.
COMMON = [*FAST, "dataset.num_val_samples=65", f"trainer.max_steps={STEPS}", "trainer.seed=3",
          "checkpoint.enabled=false", "trainer.log_every_n_steps=1"]  # fmt: skip
VARIANTS = {
    f"{name}-{opt}": [f"optimizer={opt}", *extra]
    for opt in ("sgd", "adam")
    for name, extra in {
        "plain": [],
        "accum": ["trainer.grad_accum_steps=2"],
        "clip": ["trainer.grad_clip_norm=0.5"],
        "recompute": ["model.activation_checkpointing=true"],
    }.items()
}


def _train_fsdp(rank: int, world: int, port: int, out: Path) -> None:
    """Every variant in one 2-rank world (one start-up for all): weights to `<variant>.pt`."""
    with joined_world(rank, world, port) as env:
        for name, overrides in VARIANTS.items():
            trainer = build_trainer(
                out / f"fsdp-{name}", env, *COMMON, *overrides, "strategy=fsdp",
                "trainer.batch_size=32",
            )  # fmt: skip
            trainer.fit()
            trainer.metrics.close()
            weights = full_state_dict(trainer.model)  # every rank: a collective
            if env.is_main:
                torch.save(weights, out / f"fsdp-{name}.pt")
                torch.save(trainer.parts.validation.last, out / f"fsdp-{name}-val.pt")


@functools.cache  # one run per variant, whichever test asks first
def _train_single(out: Path, name: str) -> dict[str, torch.Tensor]:
    trainer = build_trainer(
        out / f"single-{name}", env_from_environment("cpu"), *COMMON, *VARIANTS[name],
        "trainer.batch_size=64",
    )  # fmt: skip
    trainer.fit()
    trainer.metrics.close()
    return full_state_dict(trainer.model)


def _scalars(folder: Path, tag: str) -> list[float]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.value for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    spawn(_train_fsdp, 2, free_port(), out, nprocs=2)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_fsdp_on_two_ranks_equals_single_with_the_global_batch(runs: Path, name: str) -> None:
    single = _train_single(runs, name)
    fsdp = torch.load(runs / f"fsdp-{name}.pt", weights_only=True)
    assert max_abs_diff(single, fsdp) < 1e-5
    torch.manual_seed(3)
    init = build_trainer(runs / "init", env_from_environment("cpu"), *COMMON).model.state_dict()
    assert max_abs_diff(init, fsdp) > 1e-3  # it trained: not two initialisations compared
    assert torch.load(runs / f"fsdp-{name}-val.pt", weights_only=True)["val/samples"] == 65


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_fsdp_logs_the_global_grad_norm_and_clips_by_it(runs: Path, opt: str) -> None:
    _train_single(runs, f"clip-{opt}")
    single = _scalars(runs / f"single-clip-{opt}" / "tb" / "rank0", "optim/grad_norm")
    assert max(single) > 0.5  # the bound was hit: clipping changed the updates
    for rank in (0, 1):  # each rank logs the norm of the whole model's gradients, not its shard's
        fsdp = _scalars(runs / f"fsdp-clip-{opt}" / "tb" / f"rank{rank}", "optim/grad_norm")
        assert fsdp == pytest.approx(single, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_memory_per_rank_is_a_shard_of_single(runs: Path) -> None:
    _train_single(runs, "plain-adam")
    tags = ("memory/params_mb", "memory/grads_mb", "memory/optimizer_mb")
    single = {tag: _scalars(runs / "single-plain-adam" / "tb" / "rank0", tag)[-1] for tag in tags}
    assert single["memory/optimizer_mb"] > 1.9 * single["memory/params_mb"]  # Adam: 2 moments
    ranks = [
        {tag: _scalars(runs / "fsdp-plain-adam" / "tb" / f"rank{r}", tag)[-1] for tag in tags}
        for r in (0, 1)
    ]
    for tag in tags:
        assert sum(r[tag] for r in ranks) == pytest.approx(single[tag], rel=0.01)
        assert all(r[tag] < 0.6 * single[tag] for r in ranks)


# --- activation checkpointing, in one process ----------------------------------------------------

MODELS = {
    "mlp": [*FAST],
    "resnet18": [
        "model=resnet18",
        "dataset=fake_images",
        "dataset.image_size=32",
        "dataset.num_samples=64",
        "dataset.num_val_samples=0",
        "dataset.num_workers=0",
        "trainer.batch_size=8",
    ],
}


def _trained(tmp_path: Path, model: str, recompute: bool, steps: int = 3) -> torch.nn.Module:
    trainer = build_trainer(
        tmp_path / f"{model}-{recompute}", env_from_environment("cpu"), *MODELS[model],
        f"model.activation_checkpointing={str(recompute).lower()}", f"trainer.max_steps={steps}",
        "optimizer=sgd", "checkpoint.enabled=false", "trainer.seed=1",
    )  # fmt: skip
    trainer.fit()
    trainer.metrics.close()
    return trainer.model


@pytest.mark.slow  # two training runs each
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", list(MODELS))
def test_activation_checkpointing_gives_the_same_weights(tmp_path: Path, model: str) -> None:
    plain = _trained(tmp_path, model, recompute=False)
    recomputed = _trained(tmp_path, model, recompute=True)
    assert max_abs_diff(plain.state_dict(), recomputed.state_dict()) < 1e-6


def _saved_and_forwards(model: torch.nn.Module, inputs: torch.Tensor) -> tuple[int, int]:
    """Bytes autograd keeps for backward during the forward, and forward calls of the first
    block's first convolution over a forward and backward."""
    from dpt.models.blocks import blocks

    calls = []
    first = next(m for m in blocks(model)[0].modules() if isinstance(m, torch.nn.Conv2d))
    handle = first.register_forward_hook(lambda *_: calls.append(1))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs).sum()
    forward_saved = sum(saved)
    loss.backward()
    handle.remove()
    return forward_saved, len(calls)


@pytest.mark.slow  # two ResNet training runs
@pytest.mark.timeout(300)
def test_activation_checkpointing_recomputes_blocks_and_keeps_less(tmp_path: Path) -> None:
    inputs = torch.randn(8, 3, 32, 32)
    plain_saved, plain_calls = _saved_and_forwards(
        _trained(tmp_path, "resnet18", recompute=False, steps=1), inputs
    )
    recompute_saved, recompute_calls = _saved_and_forwards(
        _trained(tmp_path, "resnet18", recompute=True, steps=1), inputs
    )
    assert (plain_calls, recompute_calls) == (1, 2)  # each block's forward runs again in backward
    assert recompute_saved < 0.5 * plain_saved


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fsdp_trains_resnet18_in_bf16_with_recomputation(tmp_path: Path) -> None:
    """Blocks sharded, bf16 weights gathered (BatchNorm kept fp32), recomputed in backward."""
    import torchvision

    from tests.helpers import load_weights, train

    train(
        tmp_path, "strategy=fsdp", "trainer.precision=bf16-mixed", *MODELS["resnet18"],
        "model.activation_checkpointing=true", "trainer.max_steps=3", "trainer.batch_size=4",
        timeout=380,
    )  # fmt: skip
    weights = load_weights(tmp_path)
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}
    torchvision.models.resnet18(num_classes=10).load_state_dict(weights)
