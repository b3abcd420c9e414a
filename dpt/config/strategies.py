"""`strategy`: how the model is spread over the devices (dpt/loop/strategy.py, pipeline.py).

A strategy's own keys are dpt's; every other key of its schema is a keyword of the PyTorch
wrapper it builds, of the same name (`DistributedDataParallel(bucket_cap_mb=...)`), passed on as
it is: a key added to the schema and its YAML reaches the wrapper with nothing else to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf

from dpt.config.checks import Check, at_least, checked, one_of
from dpt.errors import ConfigError

# `strategy.comm_hook` of ddp: gradients cast to 16 bits for the all-reduce and back (half the
# bytes on the wire), for worlds whose network, not compute, bounds the step; each name is
# torch's `<name>_compress_hook`. bf16 keeps fp32's exponent range (no overflow); fp16 has 3
# more mantissa bits and overflows above 65504.
COMM_HOOK_NAMES = ("bf16", "fp16")
# `strategy.reduce_dtype` of fsdp, by the name of its torch dtype: bf16 halves the
# reduce-scatter's bytes, fp32 sums exactly.
REDUCE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# `strategy.schedule` of pipeline, by the name of its class in torch.distributed.pipelining.
PIPELINE_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",  # several stages per rank
}
INTERLEAVED = "interleaved_1f1b"
PIPELINE_DATA_PARALLEL = ("none", "ddp", "fsdp")  # how copies of a pipeline train together


# `distributed`: one process per device, started by the launcher. A class variable, not a config
# key: the launcher reads it from the composed config's schema without importing torch.


@dataclass
class SingleConfig:
    _target_: str = "dpt.loop.strategy.Single"
    distributed: ClassVar[bool] = False


@dataclass
class DPConfig:
    _target_: str = "dpt.loop.strategy.DataParallel"
    distributed: ClassVar[bool] = False
    device_ids: list[int] | None = MISSING  # null = every visible GPU


@dataclass
class TensorParallel:
    """`strategy.tensor_parallel`, on each strategy of one process per device: the ranks each
    layer's matrices are split over (Megatron's column and row splits, dpt/models/tensor_plans.py),
    the innermost dimension of the run's mesh (dpt/loop/mesh.py); the data-parallel degree is
    what remains of the world."""

    tensor_parallel: int = at_least(1)  # ranks each layer is split over; 1 = none


@dataclass
class DDPConfig(TensorParallel):
    _target_: str = "dpt.loop.strategy.DDP"
    distributed: ClassVar[bool] = True
    bucket_cap_mb: float = at_least(1e-3)
    gradient_as_bucket_view: bool = MISSING
    static_graph: bool = MISSING
    find_unused_parameters: bool = MISSING
    init_sync: bool = MISSING  # rank 0's parameters and buffers to all when DDP wraps the model
    # bf16 | fp16: compress gradients for the all-reduce
    comm_hook: str | None = one_of(COMM_HOOK_NAMES)
    sync_batchnorm: bool = MISSING  # BatchNorm statistics over the global batch, not the rank's


@dataclass
class FSDPConfig(TensorParallel):
    _target_: str = "dpt.loop.strategy.FSDP"
    distributed: ClassVar[bool] = True
    reshard_after_forward: bool = MISSING
    cpu_offload: bool = MISSING
    # fp32 | bf16: the dtype of the gradient reduce-scatter
    reduce_dtype: str = one_of(tuple(REDUCE_DTYPES))
    sync_batchnorm: bool = MISSING  # BatchNorm statistics over the global batch, not the rank's


@dataclass
class PipelineConfig(TensorParallel):
    _target_: str = "dpt.loop.pipeline.Pipeline"
    distributed: ClassVar[bool] = True
    # ranks one copy of the model is cut over
    stages: int = checked(Check(lambda n: n >= 2, "must be >= 2 (one stage is strategy=single)"))
    schedule: str = one_of(tuple(PIPELINE_SCHEDULES))  # gpipe | 1f1b | interleaved_1f1b
    microbatches: int = at_least(1)  # per step and replica; divides trainer.batch_size
    stages_per_rank: int = MISSING  # interleaved_1f1b: stages each rank holds (virtual stages)
    split_points: list[str] | None = MISSING  # names of the blocks where stages begin
    # none | ddp | fsdp: how copies of the pipeline (world > stages) train
    data_parallel: str = one_of(PIPELINE_DATA_PARALLEL)


STRATEGIES: dict[str, type] = {
    "single": SingleConfig,
    "dp": DPConfig,
    "ddp": DDPConfig,
    "fsdp": FSDPConfig,
    "pipeline": PipelineConfig,
}


def is_distributed(strategy: DictConfig) -> bool:
    """Whether the composed `strategy` runs one process per device (its schema says so)."""
    return bool(getattr(OmegaConf.get_type(strategy), "distributed", False))


def pipeline_replicas(stages: int, world_size: int, tensor_parallel: int = 1) -> int:
    """How many copies of a pipeline of `stages` (each stage over `tensor_parallel` ranks) a
    world of `world_size` ranks holds; one line where it does not split (the launching process
    asks before any rank starts where it knows the world's size, every rank asks again)."""
    return data_degree(world_size, tensor_parallel, stages)


def data_degree(world_size: int, tensor_parallel: int, stages: int = 1) -> int:
    """The data-parallel degree: what remains of the world once each copy of the model takes
    `stages` x `tensor_parallel` ranks; one line where the world does not split so."""
    per_copy = stages * tensor_parallel
    if world_size % per_copy == 0:
        return world_size // per_copy
    if tensor_parallel == 1:
        named, copies = f"strategy.stages={stages}", f"pipelines of {stages} stages"
    elif stages == 1:
        named, copies = f"strategy.tensor_parallel={tensor_parallel}", f"groups of {per_copy} ranks"
    else:
        named = f"strategy.stages={stages} x strategy.tensor_parallel={tensor_parallel}"
        copies = f"pipelines of {stages} stages of {tensor_parallel} ranks each"
    raise ConfigError(
        f"{named}: a world of {world_size} ranks does not split into {copies}; "
        f"use a multiple of {per_copy} ranks"
    )
