"""GPT-2's weights in Hugging Face's layout (dpt/models/gpt2_weights.py): a tiny GPT2LMHeadModel
saved as safetensors loads into dpt's GPT with the same logits, a larger vocabulary is padded,
dpt's GPT is written back as GPT-2 with the same logits, and weights that do not fit are
refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from dpt.errors import DptError  # noqa: E402
from dpt.models.gpt import GPT  # noqa: E402
from dpt.models.gpt2_weights import from_gpt2, to_gpt2  # noqa: E402

SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 32}
VOCAB, POSITIONS, BLOCK = 100, 32, 16


def _gpt2(**changes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **(SHAPE | changes),
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _saved(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """`model` as save_pretrained writes it (safetensors, the tied head left out), read back."""
    model.save_pretrained(folder)
    return safetensors_torch.load_file(folder / "model.safetensors")


def _gpt(**changes: int | str) -> GPT:
    torch.manual_seed(1)
    sizes = {"num_outputs": VOCAB, "block_size": BLOCK, "gelu": "tanh"} | SHAPE | changes
    return GPT(dropout=0.0, bias=True, **sizes).eval()  # type: ignore[arg-type]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, dict]:
    model = _gpt2()
    return model, _saved(model, tmp_path_factory.mktemp("gpt2"))


@pytest.mark.timeout(60)
def test_gpt2_weights_load_into_the_gpt_with_the_same_logits(gpt2: tuple) -> None:
    reference, state = gpt2
    model = _gpt()
    model.load_state_dict(from_gpt2(state, model), strict=True)
    with torch.no_grad():
        diff = (model(_tokens()) - reference(_tokens()).logits).abs().max().item()
    print(f"max |logits difference|, GPT-2 -> dpt: {diff:.3g}")
    assert diff < 1e-4


@pytest.mark.timeout(60)
def test_a_larger_vocabulary_is_padded_with_the_models_own_rows(gpt2: tuple) -> None:
    reference, state = gpt2
    model = _gpt(vocab_size=128)
    initial = model.wte.weight.detach().clone()
    model.load_state_dict(from_gpt2(state, model), strict=True)
    assert torch.equal(model.wte.weight[VOCAB:], initial[VOCAB:])
    with torch.no_grad():
        logits, expected = model(_tokens()), reference(_tokens()).logits
    assert logits.shape[-1] == 128
    assert (logits[..., :VOCAB] - expected).abs().max().item() < 1e-4


@pytest.mark.timeout(60)
def test_gpt2_models_keys_without_prefix_and_old_mask_buffers_load_too(gpt2: tuple) -> None:
    """GPT2Model saves no `transformer.` prefix; older transformers saved `h.N.attn.bias`."""
    _, state = gpt2
    bare = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    bare["h.0.attn.bias"] = torch.ones(1, 1, POSITIONS, POSITIONS, dtype=torch.bool)
    bare["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    model = _gpt()
    model.load_state_dict(from_gpt2(bare, model), strict=True)
    assert torch.equal(model.h[1].mlp.fc.weight, state["transformer.h.1.mlp.c_fc.weight"].t())


@pytest.mark.timeout(60)
def test_the_gpt_written_as_gpt2_gives_the_same_logits() -> None:
    model = _gpt()
    state, config = to_gpt2(model.state_dict(), model)
    assert config["activation_function"] == "gelu_new" and config["n_positions"] == BLOCK
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
    result = gpt2.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith(("attn.bias", "attn.masked_bias")) for k in result.missing_keys)
    with torch.no_grad():
        diff = (gpt2(_tokens()).logits - model(_tokens())).abs().max().item()
    print(f"max |logits difference|, dpt -> GPT-2: {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.timeout(60)
def test_a_file_with_fewer_layers_is_refused_in_one_line(gpt2: tuple) -> None:
    _, state = gpt2
    model = _gpt(n_layer=3)
    with pytest.raises(DptError) as error:
        from_gpt2(state, model)
    assert str(error.value) == (
        "GPT-2 weights do not fit model=gpt: missing h.2.ln_1.weight, h.2.ln_1.bias, "
        "h.2.attn.q_proj.weight and 13 more (n_layer=3, the file has 2 layers)"
    )


@pytest.mark.timeout(60)
def test_a_file_with_more_layers_is_refused_in_one_line(gpt2: tuple) -> None:
    _, state = gpt2
    with pytest.raises(DptError) as error:
        from_gpt2(state, _gpt(n_layer=1))
    assert str(error.value) == (
        "GPT-2 weights do not fit model=gpt: unexpected h.1.attn.proj.bias, h.1.attn.proj.weight, "
        "h.1.ln_1.bias and 13 more (n_layer=1, the file has 2 layers)"
    )


@pytest.mark.timeout(60)
def test_a_vocabulary_larger_than_the_models_is_refused(gpt2: tuple) -> None:
    _, state = gpt2
    with pytest.raises(DptError) as error:
        from_gpt2(state, _gpt(num_outputs=64))
    assert str(error.value) == (
        "GPT-2 weights do not fit model=gpt: the file's vocabulary of 100 tokens is larger than "
        "model.vocab_size=64"
    )


@pytest.mark.timeout(60)
def test_fewer_positions_than_the_block_and_another_width_are_refused(gpt2: tuple) -> None:
    _, state = gpt2
    with pytest.raises(DptError) as error:
        from_gpt2(state, _gpt(block_size=64))
    assert str(error.value) == (
        "GPT-2 weights do not fit model=gpt: the file has 32 positions, fewer than "
        "model.block_size=64"
    )
    with pytest.raises(DptError) as error:
        from_gpt2(state, _gpt(n_embd=64))
    assert str(error.value) == (
        "GPT-2 weights do not fit model=gpt: wte.weight is (100, 32) in the file, (100, 64) in "
        "the model (model.n_embd=64)"
    )


@pytest.mark.timeout(60)
def test_an_unknown_gelu_and_a_gpt_without_biases_are_refused() -> None:
    with pytest.raises(DptError) as error:
        _gpt(gelu="relu")
    assert str(error.value) == "model.gelu='relu': one of 'none', 'tanh'"
    model = GPT(num_outputs=VOCAB, block_size=BLOCK, dropout=0.0, bias=False, **SHAPE)
    with pytest.raises(DptError) as error:
        to_gpt2(model.state_dict(), model)
    assert str(error.value) == (
        "model.bias=false: GPT-2 has biases in its linear layers and LayerNorms; only a GPT "
        "built with model.bias=true can be written as GPT-2"
    )


# dpt's GPT fused its attention's projections (`attn.qkv`) before tensor parallelism split them.


def _fused(model: GPT) -> dict[str, torch.Tensor]:
    """`model`'s weights as dpt wrote them while the projections were one `qkv` layer."""
    from dpt.models.gpt2_weights import fuse_qkv

    return fuse_qkv({k: v.clone() for k, v in model.state_dict().items()})


@pytest.mark.timeout(60)
def test_weights_of_the_fused_layout_load_with_the_same_logits(tmp_path: Path) -> None:
    """A model.pt of before (rows of queries, keys, values in one `qkv`) loads by
    load_state_dict and as model.init_from, and computes what the model that wrote it did."""
    from dpt.models.weights import fit_state

    written = _gpt()
    fused = _fused(written)
    assert "h.0.attn.qkv.weight" in fused and "h.0.attn.q_proj.weight" not in fused
    tokens = _tokens()
    with torch.no_grad():
        expected = written(tokens)
        loaded = _gpt()
        loaded.load_state_dict(fused)
        assert torch.equal(loaded(tokens), expected)
        initialised = _gpt()
        fit_state(initialised, fused, "model.init_from=old/model.pt", VOCAB)
        assert torch.equal(initialised(tokens), expected)


def test_a_checkpoint_of_the_fused_layout_is_one_line() -> None:
    """Its optimizer state is keyed by the fused names: resuming it is refused in one line,
    which says how to keep its weights."""
    from dpt.state.stateful import ModelState

    with pytest.raises(DptError) as error:
        ModelState(_gpt()).expect({"h.0.attn.qkv.weight", "h.0.attn.proj.weight"})
    assert str(error.value) == (
        "this checkpoint was written while dpt's GPT fused its attention's projections "
        "(attn.qkv): its optimizer state cannot resume; start from its weights with "
        "model.init_from=<its run folder>, which splits them"
    )
