"""BatchNorm statistics over the whole world's batch (`strategy.sync_batchnorm=true`).

PyTorch's `nn.SyncBatchNorm` only runs on accelerators (its kernels have no CPU version and it
refuses CPU inputs), so on the CPU (Gloo) dpt converts to `GlooSyncBatchNorm`: the same maths
from all-reduced sums. Either way, ddp with N ranks x batch B then normalises like single with
batch N x B, running statistics included.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def torch_sync_devices() -> tuple[str, ...]:
    """The device types whose inputs `nn.SyncBatchNorm` accepts (its own list)."""
    return ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm layer of `model` made to normalise over all ranks' samples: PyTorch's
    SyncBatchNorm where it runs, dpt's elsewhere. Parameters and buffers are the same tensors,
    under the same state_dict keys."""
    if device.type in torch_sync_devices():
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return GlooSyncBatchNorm.convert(model)


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


class _AllReduceSum(torch.autograd.Function):
    """A differentiable all-reduce (sum): every rank's input feeds every rank's output, so the
    backward sums the ranks' gradients. `torch.distributed.nn.functional.all_reduce` does the
    same, but it is deprecated (a FutureWarning per call) and raises under torch.compile."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GlooSyncBatchNorm(_BatchNorm):
    """`nn.SyncBatchNorm` for CPU tensors: in training, with more than one rank, the per-channel
    mean and biased variance are those of all ranks' samples together, and gradients flow
    through them to every rank's inputs; otherwise exactly `F.batch_norm`."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        # (N, C, ...) of any rank, as nn.SyncBatchNorm takes (it replaces 1d, 2d and 3d).
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self.process_group or dist.group.WORLD
        if not (self.training and _world_size(group) > 1):
            return super().forward(input)  # eval, or a world of one: plain BatchNorm
        self._check_input_dim(input)
        factor = self._update_factor()
        out, mean, var, count = _sync_batch_norm(input, self.weight, self.bias, self.eps, group)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count, factor)
        return out

    def _update_factor(self) -> float:
        """BatchNorm's: counts the batch, then momentum, or 1 / batches for momentum=None
        (a cumulative average)."""
        if not self.track_running_stats:
            return 0.0
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    @torch.no_grad()
    def _update_running_stats(
        self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor, factor: float
    ) -> None:
        """As BatchNorm and SyncBatchNorm: the running variance is the unbiased one, of all
        ranks' samples. A step without samples on any rank leaves them as they are, as
        BatchNorm does an empty batch."""
        assert self.running_mean is not None and self.running_var is not None
        unbiased = var * (count / (count - 1).clamp(min=1))
        for running, batch in ((self.running_mean, mean), (self.running_var, unbiased)):
            updated = running * (1 - factor) + batch * factor
            running.copy_(torch.where(count > 0, updated, running))

    @classmethod
    def convert(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """`nn.SyncBatchNorm.convert_sync_batchnorm` with this class: each BatchNorm replaced
        by one holding the same parameter and buffer tensors (layers already synchronised are
        kept)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls | nn.SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group)  # fmt: skip
            # Assigned, not copied: the same tensors (and a bias=False layer's None).
            out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert(child, process_group))
        return out


def _world_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _sync_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchNorm's training forward with the per-channel mean and biased variance of all ranks'
    samples; returns (output in x's dtype, mean, variance, number of samples per channel).
    Float64, two passes (the mean, then squared deviations from it): the one-pass
    E[x^2] - E[x]^2 loses digits to cancellation."""
    dims = [0, *range(2, x.dim())]
    mean, count = _global_mean(x, dims, group)
    centred = x.to(torch.float64) - _per_channel(mean, x)
    var = _AllReduceSum.apply((centred * centred).sum(dims), group) / count.clamp(min=1)
    scale = torch.rsqrt(var + eps)
    if weight is not None:
        scale = scale * weight
    out = centred * _per_channel(scale, x)
    if bias is not None:
        out = out + _per_channel(bias, x)
    return out.to(x.dtype), mean, var, count


def _global_mean(x: torch.Tensor, dims: list[int], group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean over all ranks' samples and their number, from one all-reduce of the
    sums and counts. A rank without samples takes part with zeros, as in SyncBatchNorm."""
    local_count = torch.tensor([x.numel() // x.size(1)], dtype=torch.float64, device=x.device)
    summed = _AllReduceSum.apply(torch.cat([x.sum(dims, dtype=torch.float64), local_count]), group)
    count = summed[-1].detach()
    # Reading the count is free on the CPU, but would split a compiled graph.
    if not torch.compiler.is_compiling() and count.item() == 1:
        # Every rank sees the same count: all raise, none is left waiting.
        raise ValueError(
            "Expected more than 1 value per channel when training, got 1 over all ranks"
        )
    return summed[:-1] / count.clamp(min=1), count


def _per_channel(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(C,) shaped to broadcast over x's (N, C, ...)."""
    return values.view(1, -1, *([1] * (x.dim() - 2)))
