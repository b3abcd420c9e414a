"""How the model is spread over devices: single, DataParallel, DistributedDataParallel, FSDP."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dpt.config.strategies import COMM_HOOK_NAMES, REDUCE_DTYPES
from dpt.distributed import DistEnv, is_dtensor
from dpt.errors import DptError, some_of
from dpt.loop.mesh import Degrees
from dpt.loop.replica_mean import ReplicaMean
from dpt.models.blocks import blocks
from dpt.models.meta import unused_parameters
from dpt.models.sync_batchnorm import convert_sync_batchnorm, has_batchnorm

log = logging.getLogger("dpt")

# `strategy.comm_hook`: each name (dpt.config.strategies) is torch's `<name>_compress_hook`.
COMM_HOOKS: dict[str, Callable[..., Any]] = {
    name: getattr(default_hooks, f"{name}_compress_hook") for name in COMM_HOOK_NAMES
}


def skip_gradient_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """A backward that keeps its gradients on this rank (all but the last micro-batch of an
    accumulated step): DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)` (both reached
    through torch.compile's wrapper too); nothing to skip for an unsynchronised model."""
    no_sync = getattr(model, "no_sync", None)
    if no_sync is not None:
        return no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Iterator[None]:
    """Gradients accumulate unsharded on each rank until the last micro-batch, whose backward
    reduce-scatters their sum once."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class Strategy:
    """Wraps the model. Which strategies run one process per device is a property of their config
    schema (`dpt.config.is_distributed`), known without importing torch."""

    name: ClassVar[str] = "single"
    # Every forward is a collective (fsdp gathers each block's weights): all ranks must run the
    # same number of them, also in validation, whose shards may differ by a batch.
    lockstep_forward: ClassVar[bool] = False
    # Each rank holds only its shards of the gradients (fsdp): a norm of its own is partial.
    shards_gradients: ClassVar[bool] = False
    # It shards a model built on the meta device, each rank then allocating only its shards
    # (fsdp): a transformers folder's weights are read slice by slice (dpt.state.sharded_load).
    builds_on_meta: ClassVar[bool] = False

    # How many ranks train each sample (a pipeline's stages): world sums count it once.
    copies: int = 1
    # The step's forwards and backwards, where the strategy runs them itself (a pipeline's
    # schedule); None: the trainer's loop over the micro-batches.
    forward_backward: Callable[[list[Any], float], tuple[torch.Tensor, float]] | None = None
    # The gradients' global norm, where the strategy computes it itself (None: dpt.loop.precision).
    grad_norm: Callable[[nn.Module], torch.Tensor] | None = None
    # Ranks each layer is split over (`strategy.tensor_parallel`): the mesh's innermost dimension.
    tensor_parallel: int = 1
    split_layout = ""  # where this rank stands in a tensor-parallel mesh, for its start line
    # The task's loss computes on logits split over the vocabulary (cross-entropy, under torch's
    # `loss_parallel`): under tensor parallelism the head leaves them split (set before `wrap`).
    split_logits = False
    # One input's shape and dtype (set before `wrap`): a strategy may probe the model with it.
    sample_input: tuple[tuple[int, ...], torch.dtype | None] | None = None

    def check(self, model: nn.Module) -> None:
        """One line where the model (built on the meta device, beforehand) cannot be wrapped:
        under tensor parallelism, a model without a plan or with a width that does not split."""
        if self.tensor_parallel > 1:
            from dpt.models.tensor_plans import check_splits

            check_splits(model, self.tensor_parallel)

    def data_env(self, env: DistEnv) -> DistEnv:
        """Where this rank's batches come from: its own share of each step, by default; under
        tensor parallelism its replica's, which every rank of the replica reads."""
        if self.tensor_parallel == 1:
            return env
        return Degrees.of(env.world_size, self.tensor_parallel).data_env(env)

    def val_env(self, env: DistEnv) -> DistEnv:
        """Where this rank's validation batches come from: all ranks split the split, unless a
        forward takes several ranks (tensor parallelism: its replica's, as in training)."""
        return env if self.tensor_parallel == 1 else self.data_env(env)

    def counts_validation(self, env: DistEnv) -> bool:
        """Whether this rank's validation batches count in the world's metrics: the ranks of a
        tensor-parallel group run the same batches, one of them counts them."""
        return env.rank % self.tensor_parallel == 0

    def loss_context(self) -> contextlib.AbstractContextManager[Any]:
        """Where a micro-batch's forward, loss and backward run: under tensor parallelism with
        split logits, torch's `loss_parallel` (cross-entropy on each rank's slice of the
        vocabulary, and its backward)."""
        if self.tensor_parallel > 1 and self.split_logits:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A backward whose gradients stay on this rank (an accumulated step's but the last)."""
        return skip_gradient_sync(model)

    def sync_gradients(self, model: nn.Module) -> None:
        """After the step's backwards: what the wrapper does not do itself."""
        if self.tensor_parallel > 1:
            grads_as_params(model)

    def wrap(self, model: nn.Module, env: DistEnv, precision: str) -> nn.Module:
        return model

    def attach(
        self,
        loss: Callable[..., torch.Tensor],
        autocast: Callable[[], Any],
        to_device: Callable[[torch.Tensor], torch.Tensor],
        grad_accum_steps: int,
    ) -> None:
        """Told the task's loss and the run's precision (a strategy that runs the step)."""

    def whole_model(self, model: nn.Module) -> nn.Module:
        """The whole model (validation, the saved weights): the wrapped one, unless it is cut."""
        return model

    def layout(self) -> str:
        """What this rank holds, for its start line (` | stage 1 of 2 ...`); "" by default."""
        return self.split_layout

    def rank_scalars(self) -> dict[str, float]:
        """This rank's own numbers for TensorBoard at each logging window (a stage's times)."""
        return {}


class Single(Strategy):
    name = "single"


class DataParallel(Strategy):
    """One process; `batch_size` is the whole batch, which DataParallel splits over the GPUs."""

    name = "dp"

    def __init__(self, device_ids: list[int] | None) -> None:
        self.device_ids = None if device_ids is None else list(device_ids)

    def wrap(self, model: nn.Module, env: DistEnv, precision: str) -> nn.Module:
        gpus = torch.cuda.device_count() if env.device.type == "cuda" else 0
        if self.device_ids is not None:
            if max(self.device_ids, default=0) >= gpus:
                raise DptError(
                    f"strategy.device_ids={self.device_ids}: only {gpus} GPU(s) "
                    f"visible on {env.device.type}"
                )
            return nn.DataParallel(model, device_ids=self.device_ids)
        if gpus < 2:
            log.warning(
                "strategy=dp: %d GPU(s) on %s, DataParallel needs 2 or more; running as single",
                gpus,
                env.device.type,
            )
            return model
        return nn.DataParallel(model)


class DDP(Strategy):
    """One process per device; `batch_size` is per process; gradients are all-reduced in buckets.

    `comm_hook` and `sync_batchnorm` are dpt's keys; every other key of strategy=ddp is
    DistributedDataParallel's keyword of the same name (dpt.config.strategies), passed on."""

    name = "ddp"

    def __init__(
        self, comm_hook: str | None, sync_batchnorm: bool, tensor_parallel: int = 1, **wrapper: Any
    ) -> None:
        if comm_hook is not None and comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {', '.join(COMM_HOOKS)} or None")
        self.comm_hook, self.sync_batchnorm, self.wrapper = comm_hook, sync_batchnorm, wrapper
        split_tensors(self, tensor_parallel)
        self.replica_mean: ReplicaMean | None = None  # tensor parallel: over the data dimension

    def wrap(self, model: nn.Module, env: DistEnv, precision: str) -> nn.Module:
        if not torch.distributed.is_initialized():
            return model  # a world of one: nothing to synchronise
        if self.tensor_parallel > 1:  # DDP takes no DTensors: dpt's own buckets, as DDP's
            replicas = tensor_mesh(self, model, env)["dp"]
            if replicas.size() > 1:
                cap = self.wrapper.get("bucket_cap_mb") or 25.0  # as DDP's own, unset
                self.replica_mean = ReplicaMean(model, replicas.get_group(), replicas.size(), cap)
            return model
        self._leave_out_unused(model, env)  # before sync BatchNorm, whose forward gathers
        if self.sync_batchnorm:
            model = _sync_batchnorm(model, env)
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, **self.wrapper)
        if self.comm_hook is not None:
            # state=None: the hooks then use the default process group (the training world).
            ddp.register_comm_hook(state=None, hook=COMM_HOOKS[self.comm_hook])
        return ddp

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return super().no_sync(model) if self.replica_mean is None else self.replica_mean.no_sync()

    def _leave_out_unused(self, model: nn.Module, env: DistEnv) -> None:
        """Parameters that no step's backward reaches (a ViT's mask token, used only in masked
        pretraining), found on the meta device, left out of DDP's buckets: DDP would wait for
        their gradients and fail at the second step. Without a strategy they get none either.
        `find_unused_parameters` looks for them at every step instead."""
        if self.wrapper.get("find_unused_parameters") or self.sample_input is None:
            return
        unused = unused_parameters(model, *self.sample_input)
        if not unused:
            return
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, unused)
        if env.is_main:
            them = "it" if len(unused) == 1 else "them"
            log.warning(f"strategy=ddp: the model's forward leaves {some_of(unused, 4)} without "
                        f"a gradient (as under any strategy): DDP leaves {them} out of its "
                        "buckets")  # fmt: skip

    def sync_gradients(self, model: nn.Module) -> None:
        # The replicas' means of each rank's slices first: a gradient still a partial sum over
        # the tensor ranks (an embedding split by rows) averages as its parts do.
        if self.replica_mean is not None:
            self.replica_mean.finish()
        super().sync_gradients(model)


class FSDP(Strategy):
    """One process per device; `batch_size` is per process. Parameters, gradients and optimizer
    state are split over the ranks (PyTorch's FSDP2): each block's weights are all-gathered for
    its forward and backward, its gradients reduce-scattered (mean) to their owners."""

    name = "fsdp"
    lockstep_forward = True
    shards_gradients = True
    builds_on_meta = True

    def __init__(
        self,
        cpu_offload: bool,
        reduce_dtype: str,
        sync_batchnorm: bool,
        tensor_parallel: int = 1,
        **wrapper: Any,
    ) -> None:
        """`cpu_offload`, `reduce_dtype` and `sync_batchnorm` are dpt's keys; every other key of
        strategy=fsdp is `fully_shard`'s keyword of the same name (dpt.config.strategies)."""
        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}")
        self.cpu_offload = cpu_offload
        self.reduce_dtype = getattr(torch, REDUCE_DTYPES[reduce_dtype])
        self.sync_batchnorm, self.wrapper = sync_batchnorm, wrapper
        split_tensors(self, tensor_parallel)

    def wrap(self, model: nn.Module, env: DistEnv, precision: str) -> nn.Module:
        if not torch.distributed.is_initialized():
            return model  # a world of one: nothing to shard; its checkpoints load sharded
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if self.tensor_parallel > 1:  # sharded over the data dimension of the run's mesh
            mesh = tensor_mesh(self, model, env)["dp"]
            if mesh.size() == 1:
                return model  # the whole world splits the layers: nothing left to shard
        else:
            mesh = init_device_mesh(env.device.type, (env.world_size,))
        if self.sync_batchnorm:
            # Every rank runs the same forwards (lockstep_forward), so the statistics'
            # all-reduces inside them stay in step with the blocks' all-gathers.
            model = _sync_batchnorm(model, env)
        options: dict[str, Any] = {
            "mesh": mesh,
            **self.wrapper,
            "mp_policy": fsdp_precision(precision, self.reduce_dtype),
            "offload_policy": CPUOffloadPolicy() if self._offloads(env) else OffloadPolicy(),
        }
        shard_by_blocks(model, blocks(model), options)
        return model

    def _offloads(self, env: DistEnv) -> bool:
        # FSDP2 computes on the accelerator and keeps the shards in CPU memory between uses; on
        # the CPU there is nothing to offload (and it would look for CUDA).
        if self.cpu_offload and env.device.type == "cpu":
            if env.is_main:
                log.warning("strategy.cpu_offload=true: the device is the CPU already; ignored")
            return False
        return self.cpu_offload


def split_tensors(strategy: Strategy, degree: int) -> None:
    """A strategy whose layers split over `degree` ranks: each sample trained by all of them,
    a gradient norm over their slices, the whole model built on every rank (each keeps its
    slices: no sharded read of a transformers folder)."""
    strategy.tensor_parallel = degree
    if degree > 1:
        strategy.copies = degree
        strategy.grad_norm = global_norm
        strategy.shards_gradients = False  # type: ignore[misc] (the norm above is the world's)
        strategy.builds_on_meta = False  # type: ignore[misc]
        strategy.lockstep_forward = True  # type: ignore[misc] (a forward is a collective)


def tensor_mesh(strategy: Strategy, model: nn.Module, env: DistEnv) -> Any:
    """The run's mesh (data x tensor), `model`'s layers split over its tensor dimension."""
    from dpt.models.tensor_plans import parallelize

    degrees = Degrees.of(env.world_size, strategy.tensor_parallel)
    mesh = degrees.build(env.device.type)
    parallelize(model, mesh["tp"], strategy.split_logits)
    _, replica, part = degrees.position(env.rank)
    strategy.split_layout = (f" | layers split over {degrees.tp} ranks (part {part + 1}), "
                             f"replica {replica + 1} of {degrees.dp}")  # fmt: skip
    return mesh


def global_norm(model: nn.Module) -> torch.Tensor:
    """The gradients' norm over the whole model: their DTensors' slices summed over the mesh."""
    norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return norm.full_tensor() if is_dtensor(norm) else norm


def grads_as_params(model: nn.Module) -> None:
    """Each gradient laid out as its parameter: an embedding split by rows leaves its gradient a
    partial sum on each tensor rank (a whole matrix each), which the optimizer's state would
    copy whole, and replicas, tied ends and norms would add up as if it were a slice."""
    for param in model.parameters():
        grad = param.grad
        if is_dtensor(grad) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def mean_gradients(model: nn.Module, group: Any, size: int) -> None:
    """What DistributedDataParallel does, after backward rather than during it, for what it
    cannot wrap as the step runs (a pipeline stage whose schedule runs several forwards before
    their backwards): each gradient (this rank's slice of it) averaged over the replicas in
    `group`, one all-reduce per dtype over the gradients laid end to end; then the buffers that
    can differ (BatchNorm's statistics) made the group's first rank's, as DDP broadcasts them."""
    ReplicaMean(model, group, size, bucket_cap_mb=math.inf, overlap=False).finish()


def fsdp_precision(precision: str, reduce_dtype: torch.dtype) -> Any:
    """bf16-mixed: parameters gathered and computed in bf16, the fp32 shards updated; the
    gradients reduce-scattered in `reduce_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def shard_by_blocks(model: nn.Module, units: list[nn.Module], options: dict[str, Any]) -> None:
    """FSDP2 over `model`: each of its blocks `units` first, then the root (whose own parameters
    are what no block holds): each block is one all-gather, freed again after use. BatchNorm
    stays fp32 where the parameters are gathered in bf16."""
    from torch.distributed.fsdp import fully_shard

    if options["mp_policy"].param_dtype is not None:
        _keep_batchnorm_fp32(model, options)
    for block in units:
        fully_shard(block, **options)
    fully_shard(model, **options)


def _sync_batchnorm(model: nn.Module, env: DistEnv) -> nn.Module:
    """BatchNorm layers normalising over all ranks' samples (`strategy.sync_batchnorm=true`);
    PyTorch's SyncBatchNorm on accelerators, dpt's on the CPU."""
    if not has_batchnorm(model):
        if env.is_main:
            log.warning(
                "strategy.sync_batchnorm=true: %s has no BatchNorm layer; nothing to synchronise",
                type(model).__name__,
            )
        return model
    return convert_sync_batchnorm(model, env.device)


def _keep_batchnorm_fp32(model: nn.Module, options: dict[str, Any]) -> None:
    """BatchNorm's running statistics are fp32 buffers, which FSDP does not cast: its weights
    must stay fp32 too (its own unit, inputs cast up; autocast casts back for the next layer)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=options["mp_policy"].reduce_dtype
    )
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            fully_shard(module, **{**options, "mp_policy": fp32})
