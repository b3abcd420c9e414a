"""transformers' models (`model=hf`): blocks are the classes a model names in
`_no_split_modules` (the signal accelerate and FSDP's auto-wrapping use too). A decoder-only
causal LM (`decoder_layers`: its blocks one `ModuleList`, a head) cuts into pipeline stages
between its layers, each stage running the model's own forward (its masks, positions and
soft-capping) over its layers alone; one in Llama's shape (an embedding, decoder layers taking
rotary positions, a final norm and a head: Llama, Mistral, Qwen2) also splits over
tensor-parallel ranks as torchtitan plans Llama. Found by structure, whatever its `model_type`.
transformers is never imported here: a model that is one was built by it.
"""

from __future__ import annotations

import copy
import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dpt.config.tasks import BINARY, CLASSIFICATION, LANGUAGE_MODEL, MULTILABEL, REGRESSION
from dpt.distributed import copy_whole
from dpt.models.families.base import (
    Family,
    Plan,
    Unit,
    inner,
    is_conv1d,
    loaded_instance,
    outermost,
)
from dpt.models.gpt import QKV

# The attention's query and value projections as transformers' families name them (peft's
# defaults for them alike): separate (Llama, Mistral, Qwen, Gemma, OPT; BERT, RoBERTa; DistilBERT;
# DeBERTa), or one fused projection of all three (GPTNeoX, Falcon; Phi-3; GPT-2's Conv1D;
# ModernBERT).
QUERY_VALUE = (("q_proj", "v_proj"), ("query", "value"), ("q_lin", "v_lin"),
               ("query_proj", "value_proj"), ("query_key_value",), ("qkv_proj",), ("c_attn",),
               ("Wqkv",))  # fmt: skip
# One layer projecting queries, keys and values together (GPTNeoX, Falcon; Phi-3; GPT-2's Conv1D;
# ModernBERT).
FUSED_ATTENTION = ("query_key_value", "qkv_proj", "c_attn", "Wqkv")
# Norms of each head's queries and keys (Qwen 3), inside the attention.
HEAD_NORMS = ("q_norm", "k_norm")
# The config key of the MLP's width, as transformers' families name it (Llama's, OPT's).
MLP_WIDTHS = ("intermediate_size", "ffn_dim")
FRESH_SEED = 0x5EED  # with a parameter's owner's name: its fresh draw (init_fresh)
# A classifier's head as transformers' classifiers name it (BERT's, ViT's; Llama's score).
CLASSIFIER_HEADS = ("classifier", "score")
# transformers' problem type of each task's loss (a classifier's config.problem_type).
PROBLEM_TYPES = {
    CLASSIFICATION: "single_label_classification",
    MULTILABEL: "multi_label_classification",
    BINARY: "multi_label_classification",  # one sigmoid per logit, as multi-label's
    REGRESSION: "regression",
}
# An attention's counts of heads, as its forward may read them (OPT's reshapes by num_heads).
HEAD_COUNTS = ("num_heads", "num_key_value_heads")


class TransformersFamily(Family):
    def owns(self, model: nn.Module) -> bool:
        return loaded_instance(model, "transformers.modeling_utils", "PreTrainedModel")

    def blocks(self, model: nn.Module) -> list[nn.Module | None]:
        return list(_blocks(model))

    def units(self, model: nn.Module) -> list[Unit] | None:
        """A decoder's layers, the first with the embeddings, the last with what follows the
        layers (the final norm, the head)."""
        parts = _decoder_parts(model)
        if parts is None:
            return None
        layers, before, after = parts
        count = len(model.get_submodule(layers))
        return [Unit(f"{layers}.{i}", (f"{layers}.{i}", *(before if i == 0 else ()),
                                       *(after if i == count - 1 else ())))
                for i in range(count)]  # fmt: skip

    def run_stage(self, model: nn.Module, kept: Sequence[Unit], x: torch.Tensor) -> torch.Tensor:
        """The model's own forward over the stage's layers: the first stage from the token ids;
        a later one from the hidden states it receives (given as `inputs_embeds` for the shapes
        of the masks and positions the model computes, and handed to its first layer as they
        are); the forward ends at the stage's last layer, or in the logits at the last stage."""
        layers, _, first = kept[0].modules[0].rpartition(".")
        last = kept[-1].modules[0].rpartition(".")[2]
        held = model.get_submodule(layers)
        starts, ends = first == "0", int(last) == len(held) - 1
        hooks = []
        if not starts:
            hooks.append(held[int(first)].register_forward_pre_hook(
                functools.partial(_hidden_in, x), with_kwargs=True))  # fmt: skip
        if not ends:
            hooks.append(held[int(last)].register_forward_hook(_stage_end))
        try:
            out = model(x) if starts else model(inputs_embeds=x)
            return getattr(out, "logits", out)  # without model=hf's hook: transformers' output
        except _StageEnd as end:
            return end.hidden
        finally:
            for hook in hooks:
                hook.remove()

    def absent(self, module: nn.Module) -> nn.Module:
        return NoLookup() if isinstance(module, nn.Embedding) else PassOn()

    def tensor_plan(self, model: nn.Module) -> Plan | None:
        if _splits_as_llama(model):
            return self._parallelize
        return self._parallelize_whole_stream if _separate_attention(model) else None

    def no_plan_reason(self, model: nn.Module) -> str:
        kind = f"model=hf of model_type={model.config.model_type}"
        instead = "train it with strategy=fsdp or strategy=ddp"
        fused = next((name.rpartition(".")[2] for name, _ in model.named_modules()
                      if name.endswith(FUSED_ATTENTION)), None)  # fmt: skip
        if fused is not None:
            return (f"{kind} projects its attention's queries, keys and values in one layer "
                    f"({fused}), which dpt's plan does not split by heads; {instead}")  # fmt: skip
        return (f"{kind} is not a decoder-only language model whose attention projects queries, "
                f"keys and values apart, which dpt's plans split; {instead}")  # fmt: skip

    def split_widths(self, model: nn.Module) -> dict[str, int]:
        config = model.config
        heads = int(config.num_attention_heads)
        mlp = next(key for key in MLP_WIDTHS if hasattr(config, key))
        return {"num_attention_heads": heads,
                "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
                mlp: int(getattr(config, mlp))}  # fmt: skip

    def _parallelize(self, model: nn.Module, mesh: Any, split_logits: bool) -> None:
        """The attention reads its heads' count from the projections' width, so each rank
        computes its own heads; every norm of a layer (two in Llama's, four in Gemma 2's) on
        the rank's part of the sequence, a head's norm (Qwen 3's q_norm, k_norm) on its heads."""
        from dpt.models.tensor_styles import (
            HeadsNorm,
            pre_norm_block,
            split,
            styles,
            vocabulary_ends,
        )

        tp, Replicate, Shard = styles()
        ends = vocabulary_ends("model.embed_tokens", "model.norm", "lm_head", split_logits)
        split(model, mesh, ends)
        for block in self.blocks(model):
            if block is None:
                continue
            layer = inner(block)
            attention_input = tp.PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
            plan = pre_norm_block(
                _norms(layer),
                ("self_attn", QKV, "o_proj"),  # as dpt's GPT names them
                attention_input,
                ("mlp", ("gate_proj", "up_proj"), "down_proj"),
            )
            heads = [f"self_attn.{name}" for name in HEAD_NORMS if hasattr(layer.self_attn, name)]
            split(layer, mesh, plan | {name: HeadsNorm() for name in heads})

    def _parallelize_whole_stream(self, model: nn.Module, mesh: Any, split_logits: bool) -> None:
        """Any other decoder whose attention projects queries, keys and values apart (OPT), found
        by structure: Megatron's splits of the attention and the MLP, the stream between them
        whole on each rank (a layer may reshape it: OPT's flattens the batch), the embedding
        split by rows of the vocabulary, the head by columns."""
        from dpt.models.tensor_styles import (
            Replicated,
            logits_head,
            split,
            styles,
            whole_stream_layer,
        )

        tp, Replicate, _ = styles()
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        layers = [inner(block) for block in self.blocks(model) if block is not None]
        inside = {id(m) for layer in layers for m in layer.modules()}
        ends: dict[str, Any] = {}
        for name, module in model.named_modules():
            if id(module) in inside or next(module.parameters(recurse=False), None) is None:
                continue
            ends[name] = (
                tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(),
                                   use_local_output=False) if module is embedding
                else logits_head(Replicate(), split_logits) if module is head
                else Replicated()
            )  # fmt: skip
        split(model, mesh, ends)
        hidden = int(model.config.hidden_size)
        for layer in layers:
            attention = _attention(layer)
            assert attention is not None  # as the plan was chosen (_separate_attention)
            split(layer, mesh, whole_stream_layer(layer, attention, QKV, hidden))
            _local_heads(layer.get_submodule(attention), mesh.size())

    def names_in(self, model: nn.Module, stored: list[str]) -> dict[str, str]:
        """transformers' own renames of saved names (GPTNeoX saves its head as `embed_out`, the
        model names it `lm_head`), and a base model's names into a model with a head (and the
        reverse), as `from_pretrained` renames them. Tensors that transformers converts (merges
        or splits) are left as stored. transformers 4 renamed nothing of the kind."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming, rename_source_key
        except ImportError:
            return {}
        renamings = [t for t in get_model_conversion_mapping(model)
                     if isinstance(t, WeightRenaming)]  # fmt: skip
        own = model.state_dict()  # shapes only: on the meta device too
        prefix = getattr(model, "base_model_prefix", None)
        renamed = {key: rename_source_key(key, renamings, [], prefix, own)[0] for key in stored}
        return {key: name for key, name in renamed.items() if name != key}

    def lora_targets(self, model: nn.Module) -> tuple[str, ...]:
        """Its attention's query and value projections, by the names transformers' families
        give them (separate, or one fused projection)."""
        linears = {name.rpartition(".")[2] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) or is_conv1d(module)}  # fmt: skip
        return next((names for names in QUERY_VALUE if set(names) <= linears), ())

    def lora_modules_to_save(self, model: nn.Module) -> tuple[str, ...]:
        """A classifier's head, as transformers' classifiers name it (peft's defaults for a
        sequence classifier): sized to the task's outputs, often fresh; a language model's head
        stays frozen."""
        if model.get_output_embeddings() is not None:
            return ()
        return tuple(name for name, _ in model.named_children() if name in CLASSIFIER_HEADS)

    def pads_with(self, model: nn.Module, pad_id: int) -> str | None:
        """A sequence classifier whose config names no pad token (a decoder's: Llama's folder)
        cannot find each text's last token, nor leave the padding out of its attention: the
        data's pad id becomes its own."""
        config = model.config
        if (
            model.get_output_embeddings() is not None
            or getattr(config, "pad_token_id", 0) is not None
        ):
            return None
        config.pad_token_id = pad_id
        return (f"{type(model).__name__}: its config names no pad token; the data pads texts "
                f"with id {pad_id}, which it now takes as its own")  # fmt: skip

    def init_fresh(self, model: nn.Module, names: list[str]) -> None:
        """transformers' own initialisation of each owner module (its `_init_weights`), on a
        stand-in holding whole tensors, from a generator seeded by the owner's name; each rank
        keeps its shard of a DTensor."""
        owners: dict[str, list[str]] = {}
        for name in names:
            owner, _, leaf = name.rpartition(".")
            owners.setdefault(owner, []).append(leaf)
        for owner, leaves in owners.items():
            module = model.get_submodule(owner)
            stand_in = _stand_in(module)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(FRESH_SEED + zlib.crc32(owner.encode()))
                model._init_weights(stand_in)
                for leaf in leaves:
                    copy_whole(getattr(module, leaf), getattr(stand_in, leaf))

    def flops_per_token(self, model: nn.Module) -> Callable[[int], float]:
        return functools.partial(_flops_per_token, model)

    def as_transformers(self, model: nn.Module) -> nn.Module:
        return model

    def peft_task_type(self, task: str) -> str | None:
        return "CAUSAL_LM" if task == LANGUAGE_MODEL else None

    def name_outputs(self, model: nn.Module, task: str, names: list[str]) -> None:
        """A classifier's config says what its outputs are, for transformers' own use (its
        pipelines' label names, the loss its forward computes from `labels`): each output's
        name, and the problem type of the task's loss (binary: one sigmoid per logit, as
        multi-label)."""
        problem = PROBLEM_TYPES.get(task)
        config = model.config
        if problem is None or len(names) != getattr(config, "num_labels", None):
            return
        config.id2label = dict(enumerate(names))
        config.label2id = {name: i for i, name in enumerate(names)}
        config.problem_type = problem

    def transformers_config(self, model: nn.Module) -> str:
        return model.config.to_json_string()


def _stand_in(module: nn.Module) -> nn.Module:
    """A module of `module`'s class holding whole float32 CPU tensors of its own parameters'
    and buffers' shapes (a DTensor's: the global one), no children: what its initialisation
    draws, on any strategy."""
    twin = copy.copy(module)
    twin._parameters = {k: None if p is None else nn.Parameter(torch.empty(p.shape))
                        for k, p in module._parameters.items()}  # fmt: skip
    twin._buffers = {k: None if b is None else torch.empty(b.shape, dtype=b.dtype)
                     for k, b in module._buffers.items()}  # fmt: skip
    twin._modules = {}
    return twin


def is_llama_shaped(model: nn.Module) -> bool:
    """An embedding, decoder layers taking rotary positions, a final norm and a head."""
    base = getattr(model, "model", None)
    return all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")) \
        and hasattr(model, "lm_head")  # fmt: skip


def _blocks(model: nn.Module) -> list[nn.Module]:
    names = frozenset(getattr(model, "_no_split_modules", None) or ())
    return list(outermost(model, lambda c: c.__name__ in names))


def decoder_layers(model: nn.Module) -> str | None:
    """Where a decoder-only causal LM holds its layers: the `ModuleList` of all the blocks
    `_no_split_modules` names, in a model with a head and no encoder. None: not one."""
    if getattr(model.config, "is_encoder_decoder", False) or model.get_output_embeddings() is None:
        return None
    found = [id(b) for b in _blocks(model)]  # a stage's copy: its own (the others PassOn)
    return next((name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
                 and found and [id(b) for b in m if not isinstance(b, PassOn)] == found),
                None)  # fmt: skip


def _decoder_parts(model: nn.Module) -> tuple[str, list[str], list[str]] | None:
    """A decoder's layers, the modules with weights that run before them (its embeddings) and
    after them (its final norm, its head). None: not a decoder, or one that projects between
    the embeddings' width and the layers' (OPT's project_in and project_out)."""
    layers = decoder_layers(model)
    if layers is None:
        return None
    outside = [(name, m) for name, m in model.named_modules()
               if name != layers and not name.startswith(layers + ".")
               and next(m.parameters(recurse=False), None) is not None]  # fmt: skip
    head = model.get_output_embeddings()
    if any(isinstance(m, nn.Linear) and m is not head for _, m in outside):
        return None
    before = [name for name, m in outside if isinstance(m, nn.Embedding)]
    after = [name for name, m in outside if not isinstance(m, nn.Embedding)]
    return layers, before, after


# What a stage's copy holds in place of another stage's modules. The model's forward still calls
# the layers before the stage's first and its position embeddings; what they return is not used
# (the stage's first layer receives the stage's input).


class PassOn(nn.Module):
    """Another stage's layer (or norm, or head): its input passes on."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class NoLookup(nn.Module):
    """Another stage's embedding: its lookup adds nothing."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(())


class _StageEnd(Exception):
    """Raised after a stage's last layer: what follows it is the next stage's."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _hidden_in(
    x: torch.Tensor, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The stage's first layer takes the hidden states the stage received."""
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _stage_end(module: nn.Module, args: Any, output: Any) -> None:
    raise _StageEnd(output[0] if isinstance(output, tuple) else output)


def _splits_as_llama(model: nn.Module) -> bool:
    """In Llama's shape, with the layers Llama's plan splits: separate query, key, value and
    output projections, and the MLP's gate, up and down projections."""
    layers = _blocks(model)  # a stage's copy: its own
    if not is_llama_shaped(model) or not layers:
        return False
    layer = inner(layers[0])
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return all(hasattr(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) \
        and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))  # fmt: skip


def _attention(layer: nn.Module) -> str | None:
    """The name of a decoder layer's attention: its child with query, key and value layers of
    their own; None: it has none."""
    return next((name for name, child in layer.named_children()
                 if all(isinstance(getattr(child, n, None), nn.Linear) for n in QKV)),
                None)  # fmt: skip


def _separate_attention(model: nn.Module) -> bool:
    """A decoder whose attention projects queries, keys and values in layers of their own."""
    if decoder_layers(model) is None or any(name.endswith(FUSED_ATTENTION)
                                            for name, _ in model.named_modules()):  # fmt: skip
        return False
    has_width = any(hasattr(model.config, key) for key in MLP_WIDTHS)
    return has_width and _attention(inner(_blocks(model)[0])) is not None


def _local_heads(attention: nn.Module, degree: int) -> None:
    """The attention's counts of heads as this rank holds them, where its forward reads them."""
    for name in HEAD_COUNTS:
        count = getattr(attention, name, None)
        if isinstance(count, int):
            setattr(attention, name, count // degree)


def _norms(layer: nn.Module) -> tuple[str, ...]:
    """A decoder layer's norms: its children with weights besides the attention and the MLP."""
    return tuple(name for name, child in layer.named_children() if name not in ("self_attn", "mlp")
                 and next(child.parameters(), None) is not None)  # fmt: skip


def _flops_per_token(model: nn.Module, steps: int) -> float:
    """As for dpt's GPT (6N plus attention's 12 L H Q T): N all the model's parameters (a tied
    head once), the attention's sizes from its config."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head = getattr(config, "head_dim", None) or config.hidden_size // heads
    parameters = sum(p.numel() for p in model.parameters())
    return 6.0 * parameters + 12.0 * layers * heads * head * steps
