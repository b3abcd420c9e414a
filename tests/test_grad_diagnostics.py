"""Gradient diagnostics (dpt.monitor.grad_diagnostics): per-group gradient norms and update
ratios against values computed here by hand, names through wrappers, training left unchanged,
and under fsdp (2 ranks, sharded DTensors) the same numbers as the unsharded model."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpt.distributed import is_dtensor
from dpt.monitor.grad_diagnostics import GradDiagnostics
from tests.helpers import free_port, joined_world, spawn

LR = 0.1


class _Scaled(nn.Module):
    """A Sequential with a parameter of the root module's own: groups "net.0", "net.2", "root"."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
        self.scale = nn.Parameter(torch.tensor([1.5, 0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def _norm(tensors: list[torch.Tensor]) -> float:
    """The norm of several tensors together, in float64 on the host."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def _set_grads(model: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Known gradients on every parameter but those named in `skip` (left None)."""
    generator = torch.Generator().manual_seed(1)
    grads = {}
    for name, param in model.named_parameters():
        if name not in skip:
            param.grad = torch.randn(param.shape, generator=generator)
            grads[name] = param.grad.clone()
    return grads


def _sgd_step(model: nn.Module, diagnostics: GradDiagnostics) -> dict[str, float]:
    diagnostics.before_update()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return diagnostics.after_update()


def test_due_every_n_steps_and_never_when_off() -> None:
    model = nn.Linear(2, 2)
    assert not any(GradDiagnostics(model, None).due(step) for step in range(1, 50))
    every_3 = GradDiagnostics(model, 3)
    assert [step for step in range(1, 10) if every_3.due(step)] == [3, 6, 9]
    with pytest.raises(ValueError, match="every_n_steps"):
        GradDiagnostics(model, 0)


def test_norms_and_update_ratios_of_a_known_sgd_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    grads = _set_grads(model)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    scalars = _sgd_step(model, GradDiagnostics(model, 1))
    assert set(scalars) == {f"grads/{g}/{k}" for g in ("0", "2") for k in ("norm", "update_ratio")}
    for group in ("0", "2"):
        names = [f"{group}.weight", f"{group}.bias"]
        grad_norm = _norm([grads[n] for n in names])
        assert scalars[f"grads/{group}/norm"] == pytest.approx(grad_norm, rel=1e-5)
        # SGD: w_after - w_before = -lr * g
        ratio = LR * grad_norm / _norm([weights[n] for n in names])
        assert scalars[f"grads/{group}/update_ratio"] == pytest.approx(ratio, rel=1e-5)
    assert all(isinstance(value, float) for value in scalars.values())


def test_a_root_parameter_is_group_root_and_a_param_without_grad_is_left_out() -> None:
    torch.manual_seed(0)
    model = _Scaled()
    # net.0 loses its bias's gradient; net.2 has none at all: no scalars for it.
    grads = _set_grads(model, skip=("net.0.bias", "net.2.weight", "net.2.bias"))
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    scalars = _sgd_step(model, GradDiagnostics(model, 1))
    assert set(scalars) == {f"grads/{g}/{k}" for g in ("net.0", "root")
                            for k in ("norm", "update_ratio")}  # fmt: skip
    for group, name in (("net.0", "net.0.weight"), ("root", "scale")):
        grad_norm = _norm([grads[name]])
        assert scalars[f"grads/{group}/norm"] == pytest.approx(grad_norm, rel=1e-5)
        # The ratio is over what the step updates: the parameters with a gradient.
        ratio = LR * grad_norm / _norm([weights[name]])
        assert scalars[f"grads/{group}/update_ratio"] == pytest.approx(ratio, rel=1e-5)


def test_ddp_wrapped_names_have_no_module_prefix() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(_Scaled())
        model(torch.randn(4, 5)).sum().backward()
        scalars = _sgd_step(model, GradDiagnostics(model, 1))
    finally:
        dist.destroy_process_group()
    assert {tag.split("/")[1] for tag in scalars} == {"net.0", "net.2", "root"}


def test_after_update_frees_what_it_kept_and_reports_nothing_without_before() -> None:
    model = nn.Linear(2, 2)
    diagnostics = GradDiagnostics(model, 1)
    assert diagnostics.after_update() == {}
    _set_grads(model)
    assert _sgd_step(model, diagnostics)
    assert diagnostics.after_update() == {}  # the clones went with the first after_update


def test_a_non_finite_gradient_is_reported_not_raised() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    _set_grads(model)
    model[0].weight.grad[0, 0] = math.inf
    scalars = _sgd_step(model, GradDiagnostics(model, 1))
    assert scalars["grads/0/norm"] == math.inf
    assert math.isfinite(scalars["grads/1/norm"])


def _train(with_diagnostics: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _Scaled()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    diagnostics = GradDiagnostics(model, 2 if with_diagnostics else None)
    for step in range(1, 7):
        nn.functional.cross_entropy(model(torch.randn(8, 5)), torch.randint(3, (8,))).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if diagnostics.due(step):
            diagnostics.before_update()
        optimizer.step()
        if diagnostics.due(step):
            assert diagnostics.after_update()
        optimizer.zero_grad(set_to_none=True)
    return {**model.state_dict(), **{f"opt{k}": v for k, v in _adam_state(optimizer).items()}}


def _adam_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{key}": value for i, state in optimizer.state_dict()["state"].items()
            for key, value in state.items()}  # fmt: skip


def test_training_with_diagnostics_is_bit_identical_to_training_without() -> None:
    plain, watched = _train(False), _train(True)
    assert plain.keys() == watched.keys()
    assert all(torch.equal(plain[key], watched[key]) for key in plain)


# --- fsdp: 2 ranks of gloo on the CPU -------------------------------------------------------------


def _one_step(model: nn.Module) -> dict[str, float]:
    """Every rank the same batch: fsdp's averaged gradient is then the unsharded model's."""
    inputs = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    model(inputs).square().mean().backward()
    return _sgd_step(model, GradDiagnostics(model, 1))


def _fsdp_rank(rank: int, world: int, port: int, out: Path) -> None:
    with joined_world(rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = _Scaled()
        whole = _one_step(copy.deepcopy(model))  # no DTensors: no collective, every rank alone
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.net[0], model.net[2]):  # 7 and 3 rows: uneven shards
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root keeps `scale`, 3 elements: 2 + 1
        assert all(is_dtensor(p) for p in model.parameters())
        sharded = _one_step(model)
        torch.save({"whole": whole, "sharded": sharded}, out / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp_norms_equal_those_of_the_unsharded_model(tmp_path: Path) -> None:
    spawn(_fsdp_rank, 2, free_port(), tmp_path, nprocs=2)
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        whole, sharded = result["whole"], result["sharded"]
        assert {tag.split("/")[1] for tag in whole} == {"net.0", "net.2", "root"}
        assert sharded.keys() == whole.keys()
        for tag, value in whole.items():
            assert sharded[tag] == pytest.approx(value, rel=1e-5), tag
