"""Pipeline parallelism (`strategy=pipeline`): the model cut into stages on different ranks,
micro-batches streamed through them by one of torch.distributed.pipelining's schedules; with
`strategy.data_parallel=ddp` or `fsdp`, replicas of the whole pipeline on a 2-D mesh
(pipeline x data).

Ranks are laid out as torchtitan lays them: the pipeline dimension outermost (rank = stage
position x replicas + replica), so a pipeline's stages sit on different machines and the
gradient all-reduce of a replica group stays within one. Every stage of a replica reads the
same batches (the first its inputs, the last its targets): the data is split over the
replicas only. The trainer keeps its loop; this strategy runs the step's forwards and
backwards (`forward_backward`) and gives validation, `model_best.pt` and `model.pt` the whole
model (`whole_model`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpt.config.strategies import INTERLEAVED, PIPELINE_SCHEDULES, pipeline_replicas
from dpt.distributed import DistEnv, is_dtensor, local_part
from dpt.errors import DptError
from dpt.loop.mesh import Degrees
from dpt.loop.strategy import (
    Strategy,
    fsdp_precision,
    grads_as_params,
    mean_gradients,
    shard_by_blocks,
)
from dpt.models import stages as cut
from dpt.models.blocks import blocks
from dpt.models.sync_batchnorm import has_batchnorm
from dpt.observe.stage_clock import StageClock

log = logging.getLogger("dpt")


class Pipeline(Strategy):
    name = "pipeline"

    def __init__(
        self,
        stages: int,
        schedule: str,
        microbatches: int,
        stages_per_rank: int,
        split_points: Sequence[str] | None,
        data_parallel: str,
        tensor_parallel: int = 1,
    ) -> None:
        self.stages, self.schedule_name, self.microbatches = stages, schedule, microbatches
        self.stages_per_rank = stages_per_rank
        self.split_points = list(split_points) if split_points else None
        self.data_parallel, self.tensor_parallel = data_parallel, tensor_parallel
        # a replica's stages and their tensor parts all train its samples: counted once
        self.copies = stages * tensor_parallel
        self.whole: nn.Module | None = None  # the whole model, for validation and its weights
        self.clock = StageClock()

    # --- the world ----------------------------------------------------------------------------

    def replicas(self, world_size: int) -> int:
        """How many copies of the pipeline the world holds; one line where it does not split."""
        replicas = pipeline_replicas(self.stages, world_size, self.tensor_parallel)
        if replicas > 1 and self.data_parallel == "none":
            raise DptError(
                f"strategy.stages={self.stages} on {world_size} ranks makes {replicas} copies "
                "of the pipeline: set strategy.data_parallel=ddp or fsdp to train them as one"
            )
        return replicas

    def data_env(self, env: DistEnv) -> DistEnv:
        """Where this rank stands among the replicas: its batches are its replica's."""
        self.replicas(env.world_size)  # one line where the world does not split
        return self._degrees(env).data_env(env)

    def val_env(self, env: DistEnv) -> DistEnv:
        return env  # validation runs the whole model, data-parallel over every rank

    def counts_validation(self, env: DistEnv) -> bool:
        return True

    def _degrees(self, env: DistEnv) -> Degrees:
        return Degrees.of(env.world_size, self.tensor_parallel, self.stages)

    # --- the model ----------------------------------------------------------------------------

    def check(self, model: nn.Module) -> None:
        """One line where the model does not cut into these stages (or does not split)."""
        super().check(model)
        cut.plan(model, self.stages * self.stages_per_rank, self.split_points)

    def wrap(self, model: nn.Module, env: DistEnv, precision: str) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage

        replicas = self.replicas(env.world_size)
        if not dist.is_initialized():
            raise DptError("strategy=pipeline needs a process per stage: launch it on "
                           f"{self.stages} or more ranks")  # fmt: skip
        degrees = self._degrees(env)
        self.position, self.replica, self.part = degrees.position(env.rank)
        self.replica_count = replicas
        mesh = degrees.build(env.device.type)
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        total = self.stages * self.stages_per_rank
        plan = cut.plan(model, total, self.split_points)
        mine = [s for s in range(total) if s % self.stages == self.position]  # loop order
        holder = cut.stage_model(model, [u for s in mine for u in plan[s]])
        self.whole = model  # kept whole: validation and the saved weights (see whole_model)
        if has_batchnorm(model) and self.microbatches > 1 and env.is_main:
            log.warning(
                "strategy=pipeline: BatchNorm normalises each micro-batch (trainer.batch_size / "
                "strategy.microbatches samples), and updates its running statistics once per "
                "micro-batch: not the same as one process on the whole batch"
            )
        self._tie(model, plan, degrees)
        self.holder = holder.to(env.device)
        tensor_mesh = mesh["tp"] if self.tensor_parallel > 1 else None
        if tensor_mesh is not None:  # this stage's layers split over its tensor ranks
            from dpt.models.tensor_plans import parallelize

            parallelize(self.holder, tensor_mesh)
        self.views: list[nn.Module] = []
        for s in mine:
            view: nn.Module = cut.StageView(self.holder, plan[s], self.autocast, tensor_mesh)
            if replicas > 1 and self.data_parallel == "fsdp":
                self._sharded(view, mesh["dp"], precision)
            self.views.append(view)
        self.stage_objects = [
            PipelineStage(view, s, total, env.device, group=self.pp_group)
            for view, s in zip(self.views, mine, strict=True)
        ]
        for stage in self.stage_objects:
            self.clock.watch(stage, env.device)
        self.first, self.last = 0 in mine, total - 1 in mine
        self.held = [(s, plan[s]) for s in mine]
        return self.holder

    def layout(self) -> str:
        """` | stage 1 of 2 (embed-h.1), replica 1 of 1 | 1f1b x 4 micro-batches`."""
        total = self.stages * self.stages_per_rank
        held = ", ".join(f"{s + 1} of {total} ({_span(units)})" for s, units in self.held)
        split = (f", layers split over {self.tensor_parallel} ranks (part {self.part + 1})"
                 if self.tensor_parallel > 1 else "")  # fmt: skip
        return (f" | stage {held}{split}, replica {self.replica + 1} of {self.replica_count} | "
                f"{self.schedule_name} x {self.microbatches} micro-batches")  # fmt: skip

    def _sharded(self, view: nn.Module, dp: Any, precision: str) -> None:
        """fsdp: a stage sharded over its replicas, each block one unit (gathered for its
        forward and backward), then the stage's other parameters (a GPT's embedding or head).
        ddp wraps nothing: `_mean_over_replicas` averages the gradients after the schedule."""
        # as strategy=fsdp shards, at its default reduce_dtype
        options = {"mesh": dp, "mp_policy": fsdp_precision(precision, torch.float32)}
        shard_by_blocks(view, blocks_of(view), options)

    def _tie(self, model: nn.Module, plan: list[list[cut.Unit]], degrees: Degrees) -> None:
        """Parameters that stages on different ranks share (a GPT's embedding and head): each
        holds its copy, their gradients are summed between those ranks after backward, and the
        norm counts the one on the lowest stage."""
        first = {id(p): name for name, p in model.named_parameters()}
        stages: dict[str, set[int]] = {}
        for s, kept in enumerate(plan):
            for unit in kept:
                for module in unit.modules:
                    for p in model.get_submodule(module).parameters():
                        stages.setdefault(first[id(p)], set()).add(s)
        self.counted = {name for name, held in stages.items()
                        if min(held) % self.stages == self.position}  # fmt: skip
        self.ties: list[tuple[str, Any]] = []
        for name, held in sorted(stages.items()):
            positions = sorted({s % self.stages for s in held})
            if len(positions) < 2:
                continue
            # Every rank makes every group, in one order: one per replica and tensor part (both
            # ends hold the same slice of the matrix).
            for replica, part in itertools.product(range(degrees.dp), range(degrees.tp)):
                ranks = [degrees.rank(p, replica, part) for p in positions]
                group = dist.new_group(ranks)
                if self.position in positions and (replica, part) == (self.replica, self.part):
                    self.ties.append((name, group))

    def autocast(self) -> Any:
        return self._autocast()

    def attach(
        self,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        autocast: Callable[[], Any],
        to_device: Callable[[torch.Tensor], torch.Tensor],
        grad_accum_steps: int,
    ) -> None:
        """The schedule, once the task's loss and the run's precision are known."""
        from torch.distributed.pipelining import schedules

        self._autocast, self.to_device = autocast, to_device
        chunks = self.microbatches * grad_accum_steps
        scale = 1.0 / chunks  # the mean over the step's samples; the schedule scales nothing

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            with autocast():
                return loss(output, target) * scale

        kind = getattr(schedules, PIPELINE_SCHEDULES[self.schedule_name])
        # An interleaved schedule runs several stages per rank; the others, this rank's one.
        held = self.stage_objects if self.schedule_name == INTERLEAVED else self.stage_objects[0]
        self.schedule = kind(held, n_microbatches=chunks, loss_fn=loss_fn, scale_grads=False)

    # --- a step -------------------------------------------------------------------------------

    def forward_backward(
        self, micro_batches: list[Any], step_start: float
    ) -> tuple[torch.Tensor, float]:
        """The step's gradients over all micro-batches, through the schedule; returns the
        replica's loss (its last stage's, sent to the other stages) and this rank's time until
        the schedule's end."""
        inputs, targets = [], []
        for batch_inputs, batch_targets, _ in micro_batches:
            inputs += [(self.to_device(x),) for x in batch_inputs.tensor_split(self.microbatches)]
            targets += [self.to_device(t) for t in batch_targets.tensor_split(self.microbatches)]
        losses: list[torch.Tensor] = []
        with self.clock.step():  # waits for the stages before and after it: the bubble
            self.schedule.step(
                arg_mbs=inputs if self.first else None,
                target_mbs=targets if self.last else None,
                losses=losses if self.last else None,
                return_outputs=False,
            )
        work_s = time.perf_counter() - step_start
        if self.tensor_parallel > 1:
            grads_as_params(self.holder)
        self._mean_over_replicas()
        self._sum_ties()
        loss = (
            torch.stack(losses).sum().detach()
            if self.last
            else torch.zeros((), device=self._device())
        )
        dist.broadcast(loss, group=self.pp_group, group_src=self.stages - 1)
        return loss, work_s

    def _device(self) -> torch.device:
        return next(self.holder.parameters()).device

    def _mean_over_replicas(self) -> None:
        """ddp: the gradients averaged over the replicas (`mean_gradients`). Not DDP itself: its
        reducer expects one backward per forward, and the schedules run several forwards
        before their backwards (gpipe; 1f1b at 2 micro-batches), and some stages hold no
        parameter (interleaved)."""
        if self.data_parallel == "ddp" and self.replica_count > 1:
            mean_gradients(self.holder, self.dp_group, self.replica_count)

    def _sum_ties(self) -> None:
        params = dict(self.holder.named_parameters())
        for name, group in self.ties:
            param = params[name]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            # Under fsdp both ends hold the same rows of it (the same shard of the replicas).
            dist.all_reduce(local_part(param.grad), group=group)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The gradients' norm over the whole model: every stage's squares summed (a shared
        parameter once, a tensor-parallel slice once per part, a replicated one once); the
        same on every rank."""
        squares = torch.zeros((), device=self._device())
        for name, p in model.named_parameters():
            if p.grad is not None and name in self.counted and self._owns(p.grad):
                squares = squares + local_part(p.grad).float().pow(2).sum()
        # The world's squares: fsdp's replicas hold other rows of a stage, so they add up to the
        # norm; ddp's hold the same (averaged) gradients, counted once per replica.
        dist.all_reduce(squares)
        sharded = self.data_parallel == "fsdp" and self.replica_count > 1
        return (squares if sharded else squares / self.replica_count).sqrt()

    def _owns(self, grad: torch.Tensor) -> bool:
        """Whether this rank counts `grad`'s slice: all but a tensor part's copy of what each
        part holds whole (a norm's weight, under sequence parallelism)."""
        if not is_dtensor(grad) or "tp" not in (grad.device_mesh.mesh_dim_names or ()):
            return True
        split = not grad.placements[grad.device_mesh.mesh_dim_names.index("tp")].is_replicate()
        return split or self.part == 0

    # --- the whole model ----------------------------------------------------------------------

    def whole_model(self, model: nn.Module) -> nn.Module:
        """The whole model with every stage's current weights, on every rank (validation runs
        it data-parallel over all ranks; `model_best.pt` and `model.pt` are its weights)."""
        assert self.whole is not None
        # fsdp: each stage's shards gathered first (among its replicas, in one order of names).
        own = {name: full(t).detach().cpu() for name, t in model.state_dict().items()}
        parts: list[dict[str, torch.Tensor]] = [{} for _ in range(self.stages)]
        dist.all_gather_object(parts, own, group=self.pp_group)
        merged = {name: t for part in parts for name, t in part.items()}
        self.whole.load_state_dict(merged)
        self.whole.to(self._device())
        self.whole.train(model.training)
        return self.whole

    def rank_scalars(self) -> dict[str, float]:
        """This stage's compute and idle time per step, and its bubble (idle / step)."""
        return self.clock.scalars()


def _span(units: list[cut.Unit]) -> str:
    """`h.0` or `embed-h.1`: the blocks a stage runs."""
    first, last = units[0].name, units[-1].name
    return first if first == last else f"{first}-{last}"


def blocks_of(view: cut.StageView) -> list[nn.Module]:
    """The model's blocks (dpt.models.blocks: fsdp's units) among this stage's modules."""
    held = {id(m) for m in view.parts}
    return [m for m in blocks(view.holder) if id(m) in held]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh); a plain tensor as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def bubble(stages: int, microbatches: int) -> float:
    """The textbook bubble of GPipe and 1F1B: (p - 1) / (m + p - 1) of a step idles."""
    return (stages - 1) / (microbatches + stages - 1)
