"""The pieces the families' tensor-parallel plans are made of: torch's own parallel styles
(`parallelize_module` with ColwiseParallel, RowwiseParallel, SequenceParallel,
PrepareModuleInput), a style for a module every rank holds whole, and Megatron's pairing of a
column split with a row split."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def styles() -> Any:
    """torch's parallel styles, Replicate and Shard (imported where a plan is applied)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp

    return tp, Replicate, Shard


def split(module: nn.Module, mesh: Any, plan: dict[str, Any]) -> None:
    """`parallelize_module` with the plan's modules that `module` holds (a pipeline stage's
    copy of the model holds its own units alone)."""
    from torch.distributed.tensor.parallel import parallelize_module

    held = {name: style for name, style in plan.items() if _holds(module, name)}
    parallelize_module(module, mesh, held)


def _holds(module: nn.Module, name: str) -> bool:
    """Whether `module` holds `name` with weights (a stage's copy holds another stage's module
    as None, or as a stand-in without any)."""
    try:
        held = module.get_submodule(name)
    except AttributeError:
        return False
    return held is not None and next(held.parameters(), None) is not None


def columns_then_rows(parent: str, columns: tuple[str, ...], rows: str) -> dict[str, Any]:
    """Projections split by columns (their outputs: this rank's heads or MLP slice, local
    tensors), then one by rows whose partial sums are reduce-scattered over the sequence."""
    tp, _, Shard = styles()
    plan = {f"{parent}.{name}": tp.ColwiseParallel() for name in columns}
    plan[f"{parent}.{rows}"] = tp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def Replicated() -> Any:
    """A module whose parameters every rank holds whole (a position embedding, a norm of a
    stream every rank holds whole): its tensor inputs whole DTensors (by position or by keyword;
    a split one gathered), its output one, so that it adds to the stream."""
    _, Replicate, _ = styles()
    return _whole_weights(Replicate(), local_output=False)


def HeadsNorm() -> Any:
    """A norm of each head's queries or keys (B, T, heads, head width) inside a split attention:
    its input the rank's heads (split on dim 2), its weight whole on each rank, so that its
    gradient sums every rank's heads; its output the rank's heads, a local tensor as the
    attention's others."""
    _, _, Shard = styles()
    return _whole_weights(Shard(2), local_output=True)


def _whole_weights(placement: Any, local_output: bool) -> Any:
    """A style for a module whose weights every rank holds whole (replicated DTensors): its
    tensor inputs laid out as `placement` (a local tensor as this rank's part, a DTensor
    redistributed); its output a local tensor or the DTensor."""
    from torch.distributed.tensor import DTensor, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    def laid_out(value: Any, mesh: Any) -> Any:
        if isinstance(value, DTensor):
            return value.redistribute(mesh, [placement])
        if isinstance(value, torch.Tensor):
            return DTensor.from_local(value, mesh, [placement], run_check=False)
        return value

    class _WholeWeights(ParallelStyle):
        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            def inputs(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                return (tuple(laid_out(a, mesh) for a in args),
                        {key: laid_out(value, mesh) for key, value in kwargs.items()})  # fmt: skip

            def outputs(_: nn.Module, output: Any, device_mesh: Any) -> Any:
                return output.to_local() if local_output else output

            distribute_module(module, mesh, output_fn=outputs)
            module.register_forward_pre_hook(inputs, with_kwargs=True)
            return module

    return _WholeWeights()


def whole_stream_layer(
    layer: nn.Module, attention: str, columns: tuple[str, ...], hidden: int
) -> dict[str, Any]:
    """A decoder layer whose stream every rank holds whole (no sequence parallelism): the
    attention's `columns` projections (queries, keys, values) split by columns, each rank its
    heads, its other projection by rows; the MLP's projections out of the stream's width by
    columns, the others by rows (their sums all-reduced into the stream); every other module
    with weights whole on each rank (a norm inside the attention: on the rank's heads)."""
    tp, _, _ = styles()
    plan: dict[str, Any] = {}
    for name, module in layer.named_modules():
        if not name or next(module.parameters(recurse=False), None) is None:
            continue
        inside = name.startswith(attention + ".")
        if isinstance(module, nn.Linear):
            by_columns = name.rpartition(".")[2] in columns if inside \
                else module.in_features == hidden  # fmt: skip
            plan[name] = tp.ColwiseParallel() if by_columns \
                else tp.RowwiseParallel(use_local_output=False)  # fmt: skip
        else:
            plan[name] = HeadsNorm() if inside else Replicated()
    return plan


def vocabulary_ends(embedding: str, norm: str, head: str, split_logits: bool) -> dict[str, Any]:
    """The token embedding split by rows of the vocabulary (each rank embeds the tokens it
    holds, the partial sums reduce-scattered to each rank's part of the sequence), the final norm
    on that part, the head by columns (`logits_head`)."""
    tp, Replicate, Shard = styles()
    return {
        embedding: tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                      use_local_output=False),
        norm: tp.SequenceParallel(),
        head: logits_head(Shard(1), split_logits),
    }  # fmt: skip


def logits_head(input_layout: Any, split_logits: bool) -> Any:
    """The head split by columns of the vocabulary, its input laid out as `input_layout`. Its
    logits whole on each rank; or (`split_logits`), in training, left split over the vocabulary
    (a DTensor, each rank its slice: the loss computes on the split under `loss_parallel`, and no
    rank holds the whole vocabulary's logits), gathered whole in evaluation (validation's
    metrics, a prediction)."""
    tp, Replicate, Shard = styles()
    if not split_logits:
        return tp.ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate())

    class SplitLogits(tp.ColwiseParallel):
        @staticmethod
        def _prepare_output_fn(layouts: Any, local: bool, mod: nn.Module, outputs: Any,
                               mesh: Any) -> Any:  # fmt: skip
            if mod.training:
                return outputs
            return outputs.redistribute(placements=[Replicate()]).to_local()

    return SplitLogits(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)


def pre_norm_block(
    norms: tuple[str, ...],
    attention: tuple[str, tuple[str, ...], str],
    attention_input: Any,
    mlp: tuple[str, tuple[str, ...], str],
) -> dict[str, Any]:
    """A pre-norm transformer block: its norms on each rank's part of the sequence; the
    attention (name, column-split projections, row-split one) and the MLP (the same) each take
    their input whole (`attention_input`: the attention's PrepareModuleInput, by position or by
    keyword as its forward takes it)."""
    tp, Replicate, Shard = styles()
    (attn, attn_columns, attn_rows), (ff, ff_columns, ff_rows) = attention, mlp
    return {
        **{norm: tp.SequenceParallel() for norm in norms},
        attn: attention_input,
        **columns_then_rows(attn, attn_columns, attn_rows),
        ff: tp.PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **columns_then_rows(ff, ff_columns, ff_rows),
    }
