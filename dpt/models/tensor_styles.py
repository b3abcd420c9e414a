"""The pieces the families' tensor-parallel plans are made of: torch's own parallel styles
(`parallelize_module` with ColwiseParallel, RowwiseParallel, SequenceParallel,
PrepareModuleInput), a style for a module every rank holds whole, and Megatron's pairing of a
column split with a row split."""

from __future__ import annotations

from typing import Any

from torch import nn


def styles() -> Any:
    """torch's parallel styles, Replicate and Shard (imported where a plan is applied)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp

    return tp, Replicate, Shard


def split(module: nn.Module, mesh: Any, plan: dict[str, Any]) -> None:
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


def columns_then_rows(parent: str, columns: tuple[str, ...], rows: str) -> dict[str, Any]:
    """Projections split by columns (their outputs: this rank's heads or MLP slice, local
    tensors), then one by rows whose partial sums are reduce-scattered over the sequence."""
    tp, _, Shard = styles()
    plan = {f"{parent}.{name}": tp.ColwiseParallel() for name in columns}
    plan[f"{parent}.{rows}"] = tp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


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


def vocabulary_ends(embedding: str, norm: str, head: str) -> dict[str, Any]:
    """The token embedding split by rows of the vocabulary (each rank embeds the tokens it
    holds, the partial sums reduce-scattered to each rank's part of the sequence), the final norm
    on that part, the head by columns, gathered to whole logits for the task's loss."""
    tp, Replicate, Shard = styles()
    return {
        embedding: tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                      use_local_output=False),
        norm: tp.SequenceParallel(),
        head: tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }  # fmt: skip


def pre_norm_block(
    norms: tuple[str, str],
    attention: tuple[str, tuple[str, ...], str],
    attention_input: Any,
    mlp: tuple[str, tuple[str, ...], str],
) -> dict[str, Any]:
    """A pre-norm transformer block: its two norms on each rank's part of the sequence; the
    attention (name, column-split projections, row-split one) and the MLP (the same) each take
    their input whole (`attention_input`: the attention's PrepareModuleInput, by position or by
    keyword as its forward takes it)."""
    tp, Replicate, Shard = styles()
    first, second = norms
    (attn, attn_columns, attn_rows), (ff, ff_columns, ff_rows) = attention, mlp
    return {
        first: tp.SequenceParallel(),
        attn: attention_input,
        **columns_then_rows(attn, attn_columns, attn_rows),
        second: tp.SequenceParallel(),
        ff: tp.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **columns_then_rows(ff, ff_columns, ff_rows),
    }
