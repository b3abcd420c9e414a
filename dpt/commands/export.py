"""The `dpt-export` command: a run's model in a form the rest of the ecosystem loads.

`dpt-export RUN_DIR --to hf OUT` writes a folder that transformers' `from_pretrained` loads
(safetensors weights, config.json, the run's tokenizer): a `model=hf` run's model as its own
class, dpt's GPT as GPT-2 (`GPT2LMHeadModel`). `--to safetensors OUT` writes the weights alone
(`OUT/model.safetensors`, dpt's names) for any model. The weights are `model_best.pt` by default;
`--last` takes the run's final weights (`model.pt`, else its newest committed checkpoint, whose
shards of any world size DCP joins here), `--checkpoint PATH` one committed checkpoint.

A run that trained LoRA adapters (`finetune.lora.rank` > 0) is written merged by `--to hf` and
`--to safetensors` (each adapted weight W + alpha / rank * B @ A: a plain model), and as the
adapters alone by `--to peft OUT` (`adapter_config.json` + `adapter_model.safetensors`, peft's
layout: `PeftModel.from_pretrained(base, OUT)` loads them onto the run's base). A checkpoint of
such a run holds the adapters alone: the base comes from the run's `model.init_from` or
`model.path`.

torch is imported only after the arguments are parsed: `--help` and bad arguments answer fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpt.commands.command import run_command
from dpt.errors import DptError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpt.commands.run_model import RunLora
    from dpt.state.results import RunData

TO_HF, TO_SAFETENSORS, TO_PEFT = "hf", "safetensors", "peft"  # --to
WEIGHTS_FILE = "model.safetensors"  # --to safetensors: the file in OUT


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="dpt-export", description="Write a run's model for transformers or as safetensors."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds data.json)")
    parser.add_argument(
        "--to", choices=(TO_HF, TO_SAFETENSORS, TO_PEFT), required=True,
        help="hf: a transformers folder; safetensors: the weights alone; peft: a LoRA run's "
             "adapters alone, in peft's layout",
    )  # fmt: skip
    parser.add_argument("out", metavar="OUT", help="the folder to write (created)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--last", action="store_true",
                       help="the final weights (model.pt, else the newest checkpoint), "
                            "not model_best.pt")  # fmt: skip
    which.add_argument(
        "--checkpoint", metavar="PATH",
        help="a committed checkpoint folder (e.g. RUN_DIR/checkpoints/step-00000100)",
    )  # fmt: skip
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from dpt.commands.run_model import (
        build_run_model,
        load_into,
        model_config,
        run_config,
        run_folder,
        run_lora,
        with_base,
    )
    from dpt.state.results import read_run_data

    run_dir, out = run_folder(Path(args.run_dir)), Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise DptError(f"{out}: not empty (dpt-export writes a new folder)")
    cfg, data = run_config(run_dir), read_run_data(run_dir)
    lora = run_lora(cfg)  # before model_config, which forgets model.path
    if args.to == TO_PEFT and lora is None:
        raise DptError(
            f"--to peft: {run_dir} trained no LoRA adapters (its finetune.lora.rank is 0); "
            "--to hf or --to safetensors writes its model"
        )
    model_cfg = model_config(run_dir, cfg)
    model = build_run_model(model_cfg, data, lora)
    source, state = _weights(run_dir, args)
    load_into(model, with_base(model, state, lora, data.num_classes), source)
    if args.to == TO_PEFT:
        assert lora is not None
        written = _to_peft(model, lora, data.task, out)
    else:
        if lora is not None:  # a plain model of the run's, its adapters merged in
            model = _merged(model, build_run_model(model_cfg, data), lora.scaling)
        written = _to_hf(model, run_dir, out, data) if args.to == TO_HF \
            else _to_safetensors(model, out)  # fmt: skip
    print(f"wrote {out} ({written})")


def _merged(adapted: nn.Module, plain: nn.Module, scaling: float) -> nn.Module:
    """`plain` (the run's model without adapters) holding `adapted`'s weights, merged."""
    from dpt.commands.run_model import load_into
    from dpt.models.lora import merged_state, transposed_layers

    merged = merged_state(adapted.state_dict(), scaling, transposed_layers(adapted))
    load_into(plain, merged, "the merged weights")
    return plain


def _to_peft(model: nn.Module, lora: RunLora, task: str, out: Path) -> str:
    import json

    from safetensors.torch import save_file

    from dpt.models.families import family_of
    from dpt.models.lora import (
        PEFT_CONFIG,
        PEFT_WEIGHTS,
        peft_files,
        saved_whole,
        transposed_layers,
    )

    kind = family_of(model).peft_task_type(task)
    transposed = bool(transposed_layers(model))
    whole = saved_whole(model, lora.modules_to_save)
    config, tensors = peft_files(model.state_dict(), lora.rank, lora.alpha, lora.dropout,
                                 lora.targets, lora.base, kind, transposed, whole)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out / PEFT_WEIGHTS, metadata={"format": "pt"})
    return f"{PEFT_CONFIG} and {PEFT_WEIGHTS}, {len(tensors)} tensors, peft loads them"


def _weights(run_dir: Path, args: argparse.Namespace) -> tuple[Path, dict[str, torch.Tensor]]:
    """Where the weights come from, and the weights."""
    from dpt.commands.run_model import weights_file
    from dpt.state.model_state import read_model_state

    if args.checkpoint or args.last:
        source = Path(args.checkpoint) if args.checkpoint else run_dir
        return source, read_model_state(source, "--checkpoint" if args.checkpoint else "--last")
    path, notice = weights_file(run_dir)
    if notice:
        print(notice)
    return path, read_model_state(path, str(path))


def _to_hf(model: nn.Module, run_dir: Path, out: Path, data: RunData) -> str:
    from dpt.models.families import family_of

    family = family_of(model)
    hf_model = family.as_transformers(model)
    if hf_model is None:
        raise DptError(
            f"--to hf: transformers has no class for {type(model).__name__} (a model=hf run's "
            "model or dpt's GPT); --to safetensors writes any model's weights"
        )
    family.name_outputs(hf_model, data.task, data.classes)
    tokenizer = _tokenizer(run_dir)
    _special_ids(hf_model, tokenizer)
    hf_model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return f"{type(hf_model).__name__}, from_pretrained loads it"


def _tokenizer(run_dir: Path) -> Any:
    """The run's tokenizer as transformers' (None for a byte-level run: its ids are the text's
    UTF-8 bytes): with the special tokens and chat template of the folder it came from, where
    the run kept them."""
    from dpt.data.tokenizer import COMPANION_FILES, RUN_FILE

    if not (run_dir / RUN_FILE).is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    if any((run_dir / name).is_file() for name in COMPANION_FILES):  # read as transformers does
        return PreTrainedTokenizerFast.from_pretrained(run_dir)
    return PreTrainedTokenizerFast(tokenizer_file=str(run_dir / RUN_FILE))


def _special_ids(model: nn.Module, tokenizer: Any) -> None:
    """The model's bos, eos and pad ids as the exported tokenizer has them; an id past the
    vocabulary (GPT-2's 50256 on dpt's GPT of 384 tokens) or the tokenizer lacks: none."""
    config = model.config
    vocabulary = getattr(config, "vocab_size", None)  # an image model has none
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        mine = getattr(tokenizer, name, None)  # a byte-level run's tokenizer: None
        value = mine if mine is not None else getattr(config, name, None)
        if value is not None and vocabulary is not None and not 0 <= value < vocabulary:
            value = None
        setattr(config, name, value)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            setattr(generation, name, value)


def _to_safetensors(model: nn.Module, out: Path) -> str:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = _untied(model.state_dict())
    save_file(state, out / WEIGHTS_FILE)
    return f"{WEIGHTS_FILE}, {len(state)} tensors"


def _untied(state: dict[str, Any]) -> dict[str, Any]:
    """Each tensor its own contiguous copy: safetensors stores no shared storage."""
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    run_command(lambda: run(args), also=(OSError,))


if __name__ == "__main__":
    main()
