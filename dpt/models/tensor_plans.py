"""Tensor-parallel plans: how each model family's layers split over the ranks of the mesh's
tensor dimension (`strategy.tensor_parallel`), with sequence parallelism between them.

Megatron's splits as torchtitan plans Llama: queries, keys, values and the MLP's first
projections by columns (each rank whole heads, a slice of the MLP's width), the attention's and
the MLP's output projections by rows (their partial sums reduce-scattered over the sequence),
the norms on each rank's part of the sequence (`SequenceParallel`), the token embedding by rows
of the vocabulary and the head by columns, gathered to whole logits for the task's loss. The
residual stream between blocks stays a DTensor split over the sequence.

A plan is torch's own machinery (`parallelize_module` with ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput); a model without one is refused in one line. Which widths
must divide by the degree is known from the config alone: dpt.config.tensor_parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from dpt.errors import DptError
from dpt.models import hf
from dpt.models.blocks import blocks
from dpt.models.gpt import GPT, QKV
from dpt.models.weights import tied_twins


def plan_of(model: nn.Module) -> Callable[[nn.Module, Any], None] | None:
    """The function that splits `model` over a 1-D tensor mesh; None where dpt has no plan."""
    if isinstance(model, GPT):
        return _gpt
    if hf.is_transformers_model(model) and hf.is_llama_shaped(model):
        return _llama
    return None


def parallelize(model: nn.Module, mesh: Any) -> None:
    """Split `model`'s layers over `mesh` (the tensor dimension) in place; tied parameters (a
    head sharing the embedding's matrix) stay one."""
    plan = plan_of(model)
    if plan is None:
        raise DptError(no_plan(model))
    tied = tied_twins(model)
    plan(model, mesh)
    for name, twin in tied.items():  # parallelize_module gave each its own DTensor
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(twin))


def no_plan(model: nn.Module) -> str:
    return (f"strategy.tensor_parallel: dpt has no tensor-parallel plan for "
            f"{type(model).__name__} (it has plans for model=gpt and Llama-shaped "
            "model=hf)")  # fmt: skip


def _styles() -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp

    return tp, Replicate, Shard


def _gpt(model: nn.Module, mesh: Any) -> None:
    tp, Replicate, Shard = _styles()
    _split(model, mesh, {
        # The vocabulary's rows split: each rank embeds the tokens it holds, the partial sums
        # reduce-scattered to each rank's part of the sequence.
        "wte": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                  use_local_output=False),
        "wpe": Replicated(),
        "ln_f": tp.SequenceParallel(),
        "lm_head": tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })  # fmt: skip
    for block in blocks(model):
        _split(_inner(block), mesh, {
            "ln_1": tp.SequenceParallel(),
            "attn": tp.PrepareModuleInput(input_layouts=(Shard(1), None),
                                          desired_input_layouts=(Replicate(), None)),
            **_columns_then_rows("attn", QKV, "proj"),
            "ln_2": tp.SequenceParallel(),
            "mlp": tp.PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),)),
            **_columns_then_rows("mlp", ("fc",), "proj"),
        })  # fmt: skip


def _llama(model: nn.Module, mesh: Any) -> None:
    """transformers' Llama-shaped models (Llama, Mistral, Qwen2: model.embed_tokens,
    model.layers' self_attn and mlp, model.norm, lm_head); the attention reads its heads'
    count from the projections' width, so each rank computes its own heads."""
    tp, Replicate, Shard = _styles()
    _split(model, mesh, {
        "model.embed_tokens": tp.RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1), use_local_output=False),
        "model.norm": tp.SequenceParallel(),
        "lm_head": tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })  # fmt: skip
    for block in blocks(model):
        _split(_inner(block), mesh, {
            "input_layernorm": tp.SequenceParallel(),
            "self_attn": tp.PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            **_columns_then_rows("self_attn", QKV, "o_proj"),  # as dpt's GPT names them
            "post_attention_layernorm": tp.SequenceParallel(),
            "mlp": tp.PrepareModuleInput(input_layouts=(Shard(1),),
                                         desired_input_layouts=(Replicate(),)),
            **_columns_then_rows("mlp", ("gate_proj", "up_proj"), "down_proj"),
        })  # fmt: skip


def _split(module: nn.Module, mesh: Any, plan: dict[str, Any]) -> None:
    """`parallelize_module` with the plan's modules that `module` holds (a pipeline stage's
    copy of the model holds its own units alone, the others None)."""
    from torch.distributed.tensor.parallel import parallelize_module

    held = {name: style for name, style in plan.items() if _holds(module, name)}
    parallelize_module(module, mesh, held)


def _holds(module: nn.Module, name: str) -> bool:
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False


def _columns_then_rows(parent: str, columns: tuple[str, ...], rows: str) -> dict[str, Any]:
    """Projections split by columns (their outputs: this rank's heads or MLP slice, local
    tensors), then one by rows whose partial sums are reduce-scattered over the sequence."""
    tp, _, Shard = _styles()
    plan = {f"{parent}.{name}": tp.ColwiseParallel() for name in columns}
    plan[f"{parent}.{rows}"] = tp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def _inner(block: nn.Module) -> nn.Module:
    """The block inside activation checkpointing's wrapper: the plan's names are its own."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def Replicated() -> Any:
    """A module whose parameters every rank holds whole (GPT's position embedding): its input
    and output DTensors replicated, so that its output adds to the sequence-split stream."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Replicated(ParallelStyle):
        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            def inputs(_: nn.Module, args: tuple[Any, ...], device_mesh: Any) -> tuple[Any, ...]:
                return tuple(DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
                             for a in args)  # fmt: skip

            return distribute_module(module, mesh, input_fn=inputs)

    return _Replicated()
