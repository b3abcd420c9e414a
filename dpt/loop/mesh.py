"""The run's one DeviceMesh: pipeline x data x tensor, with named dimensions (torchtitan's
`ParallelDims`). Ranks are laid out with the tensor dimension innermost (a layer's split stays
within one machine, where its every forward's collectives are fastest), the pipeline's
outermost (its stages on different machines, their sends the only traffic between them):
rank = (stage x data + replica) x tensor + part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dpt.config.strategies import data_degree
from dpt.distributed import DistEnv

DIMENSIONS = ("pp", "dp", "tp")  # the mesh's names, outermost first


@dataclass(frozen=True)
class Degrees:
    """How many ranks each dimension takes; their product is the world."""

    pp: int
    dp: int
    tp: int

    @classmethod
    def of(cls, world_size: int, tensor_parallel: int = 1, stages: int = 1) -> Degrees:
        """The data-parallel degree is what remains; one line where the world does not split."""
        return cls(stages, data_degree(world_size, tensor_parallel, stages), tensor_parallel)

    def position(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, part) of `rank`."""
        stage, rest = divmod(rank, self.dp * self.tp)
        return stage, rest // self.tp, rest % self.tp

    def rank(self, stage: int, replica: int, part: int) -> int:
        """The rank at (stage, replica, part): `position`'s inverse."""
        return (stage * self.dp + replica) * self.tp + part

    def data_env(self, env: DistEnv) -> DistEnv:
        """Where this rank stands among the replicas: every rank of a replica (its stages and
        its tensor parts) reads the replica's batches."""
        _, replica, _ = self.position(env.rank)
        return replace(env, rank=replica, world_size=self.dp)

    def build(self, device_type: str) -> Any:
        """The DeviceMesh (a collective of every rank: all build it, in one order)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp),
                                mesh_dim_names=DIMENSIONS)  # fmt: skip
