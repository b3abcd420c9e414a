"""strategy.sync_batchnorm=true: ddp (and fsdp) with 2 ranks x batch B equal single with batch 2B
on a BatchNorm model, weights and running statistics; dpt's CPU SyncBatchNorm on its own."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from dpt.distributed import env_from_environment
from dpt.models import unwrap
from dpt.models.sync_batchnorm import GlooSyncBatchNorm, convert_sync_batchnorm
from dpt.state.stateful import full_state_dict
from tests.helpers import build_trainer, free_port, joined_world, max_abs_diff, spawn

STEPS = 4
# ResNet-18 (20 BatchNorm2d layers, in fsdp's blocks and in the root) on 32-pixel images. A
# small learning rate: its gradient norm is ~100 at the start, and at sgd's lr=0.1 the run is
# chaotic (single against single on another number of threads differs by 0.1 after 4 steps),
# which would hide what is compared here behind rounding.
IMAGES = ["model=resnet18", "dataset=fake_images", "dataset.image_size=32",
          "dataset.num_samples=64", "dataset.num_val_samples=0", "dataset.num_workers=0",
          "optimizer=sgd", "optimizer.lr=0.0003", f"trainer.max_steps={STEPS}", "trainer.seed=5",
          "checkpoint.enabled=false"]  # fmt: skip
RUNS = {
    "ddp-sync": ["strategy=ddp", "strategy.sync_batchnorm=true"],
    "ddp": ["strategy=ddp"],  # the control: each rank's own statistics
    "fsdp-sync": ["strategy=fsdp", "strategy.sync_batchnorm=true"],
}
CPU = torch.device("cpu")


# --- in one process: a world of one ---------------------------------------------------------------


def _tiny() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.BatchNorm1d(4 * 6 * 6, momentum=None), nn.Linear(4 * 6 * 6, 2, bias=False),
    )  # fmt: skip


def _train_steps(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    outputs = []
    for _ in range(steps):
        out = model(torch.randn(5, 3, 8, 8, generator=gen) * 2 + 1)
        outputs.append(out.detach())
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    outputs.append(model(torch.randn(5, 3, 8, 8, generator=gen)).detach())
    return outputs


def test_a_world_of_one_is_exactly_batchnorm() -> None:
    torch.manual_seed(0)
    plain = _tiny()
    synced = GlooSyncBatchNorm.convert(copy.deepcopy(plain))
    assert all(isinstance(m, GlooSyncBatchNorm) for m in (synced[1], synced[4]))
    for ours, theirs in zip(_train_steps(synced), _train_steps(plain), strict=True):
        assert torch.equal(ours, theirs)  # training and eval outputs
    for key, value in plain.state_dict().items():
        assert torch.equal(synced.state_dict()[key], value), key  # weights, running statistics


def test_conversion_keeps_the_tensors_and_the_state_dict_keys() -> None:
    plain = torchvision.models.resnet18(num_classes=10)
    before = plain.state_dict()
    synced = convert_sync_batchnorm(plain, CPU)
    after = synced.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)  # shared, not copied
    batchnorms = [m for m in synced.modules() if isinstance(m, _BatchNorm)]
    assert len(batchnorms) == 20 and all(isinstance(m, GlooSyncBatchNorm) for m in batchnorms)
    torchvision.models.resnet18(num_classes=10).load_state_dict(after)  # strict: model.pt loads
    assert GlooSyncBatchNorm.convert(synced) is synced  # converting twice changes nothing


def test_torch_syncbatchnorm_on_the_devices_that_support_it() -> None:
    synced = convert_sync_batchnorm(_tiny(), torch.device("cuda", 0))  # built, never run here
    types = [type(m) for m in synced.modules() if isinstance(m, _BatchNorm)]
    assert types == [nn.SyncBatchNorm, nn.SyncBatchNorm]


def test_bias_free_and_untracked_layers_convert() -> None:
    untracked = nn.BatchNorm3d(2, track_running_stats=False)
    layers = nn.Sequential(nn.BatchNorm2d(3, affine=False), untracked)
    synced = GlooSyncBatchNorm.convert(copy.deepcopy(layers))
    assert synced[0].weight is None and synced[1].running_mean is None
    x = torch.randn(4, 3, 2, 2)
    assert torch.equal(synced[0](x), layers[0](x))
    with pytest.raises(ValueError, match="at least 2D"):
        synced[0](torch.randn(3))


# --- a 2-rank world -------------------------------------------------------------------------------

# (layer, input shape, rank 0's share of the 6 samples): unequal shares, and a rank without any.
MODULE_CASES = {
    "2d-equal": (lambda: nn.BatchNorm2d(3), (6, 3, 4, 4), 3),
    "1d-cumulative-unequal": (lambda: nn.BatchNorm1d(5, momentum=None), (6, 5), 2),
    "3d-no-affine": (lambda: nn.BatchNorm3d(2, affine=False), (6, 2, 3, 2, 2), 4),
    "2d-rank1-empty": (lambda: nn.BatchNorm2d(3), (6, 3, 4, 4), 6),
    "2d-rank0-empty": (lambda: nn.BatchNorm2d(3), (6, 3, 4, 4), 0),
}


def _module_case(rank: int, case: str) -> float:
    """Largest difference between the synchronised layer on this rank's share and BatchNorm on
    all 6 samples, over 3 training steps: outputs, input and parameter gradients, running
    statistics."""
    make, shape, share = MODULE_CASES[case]
    torch.manual_seed(0)
    plain = make()
    if plain.affine:
        nn.init.uniform_(plain.weight, 0.5, 2.0)
        nn.init.uniform_(plain.bias, -1.0, 1.0)
    synced = GlooSyncBatchNorm.convert(copy.deepcopy(plain))
    mine = slice(0, share) if rank == 0 else slice(share, shape[0])
    worst = 0.0
    for _ in range(3):
        x, grad = torch.randn(shape) * 3 + 5, torch.randn(shape)
        ours, theirs = x[mine].clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = synced(ours), plain(theirs)
        (out * grad[mine]).sum().backward()  # collectives here too, on an empty rank as well
        (expected * grad).sum().backward()
        pairs = [(out, expected[mine]), (ours.grad, theirs.grad[mine])]
        for ours_p, theirs_p in zip(synced.parameters(), plain.parameters(), strict=True):
            dist.all_reduce(ours_p.grad)  # what ddp does: the ranks' shares summed
            pairs.append((ours_p.grad, theirs_p.grad))
        pairs += list(zip(synced.buffers(), plain.buffers(), strict=True))
        worst = max([worst] + [(a - b).abs().max().item() for a, b in pairs if b.numel()])
        synced.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    return worst


def _edge_counts(rank: int) -> dict[str, Any]:
    """No sample on any rank: an empty output, running statistics untouched (as BatchNorm on an
    empty batch). One sample in all: BatchNorm's error, on every rank (none left waiting)."""
    synced = GlooSyncBatchNorm.convert(nn.BatchNorm2d(3))
    before = [b.clone() for b in (synced.running_mean, synced.running_var)]
    out = synced(torch.randn(0, 3, 2, 2, requires_grad=True))
    out.sum().backward()
    after = [synced.running_mean, synced.running_var]
    result: dict[str, Any] = {
        "empty": out.shape == (0, 3, 2, 2)
        and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    }
    try:
        synced(torch.randn(1 - rank, 3, 1, 1))
    except ValueError as error:
        result["one"] = str(error)
    return result


def _warnings_without_batchnorm() -> list[str]:
    """Warnings of `strategy.sync_batchnorm=true` on a model without BatchNorm (an MLP)."""
    from dpt.loop.strategy import DDP
    from dpt.models.mlp import MLP

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("dpt").addHandler(handler)
    try:
        strategy = DDP(comm_hook=None, sync_batchnorm=True, bucket_cap_mb=25)
        strategy.wrap(MLP((8,), 2, [4]), env_from_environment("cpu"), "32")
    finally:
        logging.getLogger("dpt").removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def _world(rank: int, world: int, port: int, out: Path) -> None:
    """One 2-rank world for every check (one start-up): each run's full weights to
    `<run>.pt`, the BatchNorm layers' types to `<run>-types.pt`, the module checks to
    `checks-rank<rank>.pt`."""
    with joined_world(rank, world, port) as env:
        checks: dict[str, Any] = {case: _module_case(rank, case) for case in MODULE_CASES}
        checks.update(_edge_counts(rank))
        checks["warnings"] = _warnings_without_batchnorm()
        torch.save(checks, out / f"checks-rank{rank}.pt")
        for name, overrides in RUNS.items():
            trainer = build_trainer(out / name, env, *IMAGES, *overrides, "trainer.batch_size=4")
            trainer.fit()
            trainer.metrics.close()
            weights = full_state_dict(trainer.model)  # every rank: a collective under fsdp
            if env.is_main:
                torch.save(weights, out / f"{name}.pt")
                types = {type(m).__name__ for m in unwrap(trainer.model).modules()
                         if isinstance(m, _BatchNorm)}  # fmt: skip
                torch.save(sorted(types), out / f"{name}-types.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sync_batchnorm")
    spawn(_world, 2, free_port(), out, nprocs=2)
    return out


@pytest.fixture(scope="module")
def single(runs: Path) -> dict[str, torch.Tensor]:
    """The same model trained by one process on the global batch of 8."""
    trainer = build_trainer(runs / "single", env_from_environment("cpu"), *IMAGES,
                            "strategy=single", "trainer.batch_size=8")  # fmt: skip
    trainer.fit()
    trainer.metrics.close()
    return full_state_dict(trainer.model)


def _split(
    weights: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, BatchNorm running statistics)."""
    stats = {k: v for k, v in weights.items() if k.endswith(("running_mean", "running_var"))}
    params = {k: v for k, v in weights.items() if k not in stats and "num_batches" not in k}
    return params, stats


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["ddp-sync", "fsdp-sync"])
def test_two_ranks_with_sync_batchnorm_equal_single_with_the_global_batch(
    runs: Path, single: dict[str, torch.Tensor], run: str
) -> None:
    synced = torch.load(runs / f"{run}.pt", weights_only=True)
    assert torch.load(runs / f"{run}-types.pt") == ["GlooSyncBatchNorm"]
    (params, stats), (single_params, single_stats) = _split(synced), _split(single)
    assert max_abs_diff(single_params, params) < 1e-5  # measured: 1.2e-7
    assert max_abs_diff(single_stats, stats) < 1e-5  # measured: 9.5e-7 (variances of 1 to 10)
    assert {v.item() for k, v in synced.items() if "num_batches" in k} == {STEPS}
    init = build_trainer(runs / "init", env_from_environment("cpu"), *IMAGES).model.state_dict()
    assert max_abs_diff(_split(init)[0], params) > 1e-3  # it trained: measured 5.8e-3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_sync_batchnorm_two_ranks_differ_from_single(
    runs: Path, single: dict[str, torch.Tensor]
) -> None:
    """The control: each rank normalising by its own 4 samples is another computation."""
    plain = torch.load(runs / "ddp.pt", weights_only=True)
    assert torch.load(runs / "ddp-types.pt") == ["BatchNorm2d"]
    (params, stats), (single_params, single_stats) = _split(plain), _split(single)
    assert max_abs_diff(single_params, params) > 1e-4  # measured: 1.4e-2
    assert max_abs_diff(single_stats, stats) > 1e-4  # measured: 0.42


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_the_cpu_module_on_two_ranks_equals_batchnorm_on_all_samples(runs: Path, case: str) -> None:
    for rank in (0, 1):
        assert torch.load(runs / f"checks-rank{rank}.pt")[case] < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_samples_on_any_rank_and_one_sample_in_all(runs: Path) -> None:
    for rank in (0, 1):
        checks = torch.load(runs / f"checks-rank{rank}.pt")
        assert checks["empty"]
        assert checks["one"] == (
            "Expected more than 1 value per channel when training, got 1 over all ranks"
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_model_without_batchnorm_gets_one_warning_on_rank_0(runs: Path) -> None:
    warnings = [torch.load(runs / f"checks-rank{rank}.pt")["warnings"] for rank in (0, 1)]
    assert warnings == [
        ["strategy.sync_batchnorm=true: MLP has no BatchNorm layer; nothing to synchronise"],
        [],
    ]
