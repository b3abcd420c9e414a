"""Bad input to model=hf, model.init_from and dpt-export: one line each, before any rank starts
(and no run folder made), or from the command at once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests import hf_folders
from tests.helpers import train_in_process

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf-inputs")
    (out / "sums.txt").write_text(hf_folders.SUMS)
    llama = hf_folders.llama(out / "llama")
    remote = out / "remote"
    shutil.copytree(llama, remote)
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
    (remote / "config.json").write_text(json.dumps(config))
    (out / "empty").mkdir()
    return {"out": out, "llama": llama, "remote": remote, "empty": out / "empty",
            "small": hf_folders.llama(out / "small", vocab_size=200),
            "vit": hf_folders.vit(out / "vit"), "sums": out / "sums.txt"}  # fmt: skip


def _text(made: dict[str, Path], *extra: str) -> list[str]:
    return ["task=language_model", "dataset=text", f"dataset.root={made['sums']}",
            f"dataset.cache_dir={made['out'] / 'cache'}", *extra]  # fmt: skip


def _cases(made: dict[str, Path]) -> dict[str, tuple[list[str], str]]:
    tiny_gpt = ["model=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=16"]
    return {
        "no config.json": (
            ["model=hf", f"model.path={made['empty']}", *_text(made, "dataset.tokenizer=bytes")],
            f"Error: model.path={made['empty']}: no config.json there (a folder written by "
            "transformers' save_pretrained; nothing is downloaded)",
        ),
        "remote code": (
            ["model=hf", f"model.path={made['remote']}", *_text(made)],
            f"Error: model.path={made['remote']}: its config.json runs the folder's own Python "
            "code (auto_map); set model.trust_remote_code=true only if you trust it",
        ),
        "keys that do not fit": (
            [*tiny_gpt, f"model.init_from={made['llama']}", *_text(made)],
            f"Error: model.init_from={made['llama']}: its weights do not fit the model (missing: "
            "wte.weight, wpe.weight, h.0.ln_1.weight and 18 more; not in the model: "
            "model.embed_tokens.weight, model.layers.0.input_layernorm.weight, "
            "model.layers.0.mlp.down_proj.weight and 17 more)",
        ),
        "vocabulary larger than the embedding": (
            ["model=hf", f"model.path={made['small']}", *_text(made)],
            "Error: the data set's tokenizer has 300 tokens, more than the embedding of "
            f"model.path={made['small']} (200): use the model's own tokenizer "
            "(dataset.tokenizer=<its folder>)",
        ),
        "a task its Auto class cannot serve": (
            ["model=hf", f"model.path={made['vit']}", *_text(made, "dataset.tokenizer=bytes")],
            "Error: model=hf: transformers has no AutoModelForCausalLM for model_type=vit "
            "(the task needs it)",
        ),
    }


CASE_NAMES = [
    "no config.json",
    "remote code",
    "keys that do not fit",
    "vocabulary larger than the embedding",
    "a task its Auto class cannot serve",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_model_input_is_one_line_before_any_rank_starts(
    made: dict[str, Path], case: str, tmp_path: Path
) -> None:
    overrides, message = _cases(made)[case]
    run_dir = tmp_path / "run"
    result = train_in_process(*overrides, "strategy=ddp", f"hydra.run.dir={run_dir}")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == message
    assert "[rank" not in result.stdout  # no rank ever started
    assert not run_dir.exists()


@pytest.mark.timeout(120)
def test_dpt_export_to_hf_refuses_a_model_transformers_has_no_class_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dpt.commands import export

    run_dir = tmp_path / "mlp"
    result = train_in_process("dataset.num_samples=64", "dataset.num_val_samples=16",
                              "trainer.max_steps=1", "trainer.batch_size=16",
                              f"hydra.run.dir={run_dir}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    with pytest.raises(SystemExit) as exit_:
        export.main([str(run_dir), "--to", "hf", str(tmp_path / "out")])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == (
        "Error: --to hf: transformers has no class for MLP (a model=hf run's model or dpt's "
        "GPT); --to safetensors writes any model's weights\n"
    )
    export.main([str(run_dir), "--to", "safetensors", str(tmp_path / "weights")])
    import torch
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "weights" / "model.safetensors")
    best = torch.load(run_dir / "model_best.pt", weights_only=True)
    assert saved.keys() == best.keys() and all(torch.equal(saved[k], best[k]) for k in best)


@pytest.mark.timeout(120)
def test_a_weights_file_that_pickles_code_is_refused_naming_the_folder(
    made: dict[str, Path], tmp_path: Path
) -> None:
    """transformers reads a folder's pytorch_model.bin with torch.load(weights_only=True): an
    object to import in it (here `print`) is refused, and the line says which folder and what
    to do, not torch's paragraph on weights_only."""
    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(made["llama"], folder)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**weights, "callable": print}, folder / "pytorch_model.bin")
    run_dir = tmp_path / "run"
    result = train_in_process("model=hf", f"model.path={folder}", *_text(made),
                              "trainer.max_steps=1", f"hydra.run.dir={run_dir}")  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: model.path={folder}: its pickled weights file cannot be read as tensors alone "
        "(it pickles print, not only tensors); dpt runs no code from a weights file: save the "
        "weights as safetensors (save_pretrained(folder) writes model.safetensors)"
    )


def test_an_exports_special_ids_are_the_tokenizers_and_within_the_vocabulary() -> None:
    """dpt-export --to hf sets the model's bos, eos and pad ids: the tokenizer's, none past the
    vocabulary, and an image model (no vocabulary) keeps its own."""
    import transformers

    from dpt.commands.export import _special_ids

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_layer=1,
                                                                n_embd=8, n_head=2))  # fmt: skip
    _special_ids(gpt2, None)  # a byte-level run: no tokenizer, and 50256 is no byte
    assert (gpt2.config.bos_token_id, gpt2.config.eos_token_id) == (None, None)

    class Tokenizer:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, None

    _special_ids(gpt2, Tokenizer())
    assert (gpt2.config.eos_token_id, gpt2.generation_config.eos_token_id) == (2, 2)
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        image_size=8, patch_size=4, pad_token_id=0))  # fmt: skip
    _special_ids(vit, None)
    assert vit.config.pad_token_id == 0
