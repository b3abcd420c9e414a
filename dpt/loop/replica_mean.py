"""The replicas' mean of the gradients under tensor parallelism (a world of data x tensor
ranks), what DistributedDataParallel does for plain tensors and cannot for DTensors: each
gradient, once the last micro-batch's backward has made it, joins a bucket (`bucket_cap_mb`,
the parameters taken in reverse, about the order backward makes their gradients); a full
bucket's all-reduce starts at once, asynchronously, while backward goes on; after backward the
step waits for the buckets and writes the means back. Buffers that can differ between replicas
(BatchNorm's statistics, updated from each replica's batches) are made the group's first rank's;
the others never change in training and are not sent."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpt.distributed import local_part
from dpt.observe.memory import MB


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    ready: int = 0  # of its parameters, whose gradient this backward has made
    flat: torch.Tensor | None = None  # their gradients end to end, being all-reduced
    work: Any = None  # the all-reduce's handle


class ReplicaMean:
    """The gradients' mean over the replicas in `group` (`size` ranks), overlapped with the
    last backward of each step (`overlap`; else all taken by `finish`); `finish` after it."""

    def __init__(
        self, model: nn.Module, group: Any, size: int, bucket_cap_mb: float, overlap: bool = True
    ) -> None:
        self.group, self.size, self.syncing = group, size, True
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.buckets = _buckets(list(reversed(trainable)), bucket_cap_mb * MB)
        for bucket in self.buckets if overlap else ():
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(
                    lambda _, bucket=bucket: self._made(bucket)
                )
        self.buffers = differing_buffers(model)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A backward whose gradients stay on this rank (all but an accumulated step's last)."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def _made(self, bucket: _Bucket) -> None:
        if self.syncing:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        for param in bucket.params:
            if param.grad is None:  # unused this step: zeros, as DDP reduces them
                param.grad = torch.zeros_like(param)
        bucket.flat = torch.cat([local_part(p.grad).reshape(-1) for p in bucket.params])
        bucket.work = torch.distributed.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """After the step's backwards: every bucket's mean in its gradients (a bucket some of
        whose parameters got no gradient starts now); the differing buffers made rank 0's."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._start(bucket)
            bucket.work.wait()
            assert bucket.flat is not None
            bucket.flat /= self.size
            grads = [local_part(p.grad) for p in bucket.params]
            for grad, mean in zip(
                grads, bucket.flat.split([g.numel() for g in grads]), strict=True
            ):
                grad.copy_(mean.view_as(grad))
            bucket.ready, bucket.flat, bucket.work = 0, None, None
        broadcast_buffers(self.buffers, self.group)


def _buckets(params: list[nn.Parameter], cap_bytes: float) -> list[_Bucket]:
    """`params` in order, in buckets of at most `cap_bytes` of this rank's gradients (at least
    one parameter each), one dtype a bucket."""
    buckets: list[_Bucket] = []
    size, dtype = 0.0, None
    for param in params:
        nbytes = local_part(param).numel() * param.element_size()
        if not buckets or size + nbytes > cap_bytes or param.dtype != dtype:
            buckets.append(_Bucket([]))
            size, dtype = 0.0, param.dtype
        buckets[-1].params.append(param)
        size += nbytes
    return buckets


def differing_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers replicas update from their own batches (BatchNorm's running statistics)."""
    return [local_part(buffer) for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            for buffer in module.buffers(recurse=False)]  # fmt: skip


def broadcast_buffers(buffers: list[torch.Tensor], group: Any) -> None:
    """`buffers` made the group's first rank's, as DDP broadcasts them."""
    for buffer in buffers:
        torch.distributed.broadcast(buffer, group=group, group_src=0)
