"""dpt's LoRA (dpt/models/lora.py) and frozen parameters (dpt/models/freezing.py), in process on
tiny models: dpt's GPT and a Llama-shaped transformers folder (tests/hf_folders.py). The base's
keys stay, only the adapters train, the merged weights and peft's layout give the adapted
model's logits, the adapters' first values depend on nothing but the layers' names, and the
patterns that match nothing are one line. Whole runs and dpt-export: tests/test_lora_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dpt.errors import DptError
from dpt.models.freezing import freeze, trainable_count
from dpt.models.gpt import GPT
from dpt.models.lora import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapter_state,
    add_lora,
    init_lora,
    is_lora_key,
    merged_state,
    peft_files,
    transposed_layers,
)
from tests import hf_folders

RANK, ALPHA = 4, 8.0
IDS = torch.tensor([[5, 17, 42, 99, 3, 25, 7, 8]])


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(num_outputs=128, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
               bias=True).eval()  # fmt: skip


def adapted_gpt(targets: tuple[str, ...] = ("q_proj", "mlp.fc")) -> tuple[GPT, list[str]]:
    model = gpt()
    return model, add_lora(model, RANK, ALPHA, 0.0, targets)


def trained(model: nn.Module, steps: int = 3) -> nn.Module:
    """A few SGD steps on the parameters that train (the adapters: B leaves zero)."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(steps):
        logits = model(IDS)
        loss = nn.functional.cross_entropy(logits[0, :-1], IDS[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_the_base_keeps_its_keys_and_only_the_adapters_train() -> None:
    base_keys = list(gpt().state_dict())
    model, names = adapted_gpt()
    assert names == ["h.0.attn.q_proj", "h.0.mlp.fc", "h.1.attn.q_proj", "h.1.mlp.fc"]
    keys = list(model.state_dict())
    assert [k for k in keys if not is_lora_key(k)] == base_keys
    assert sorted(k for k in keys if is_lora_key(k)) == sorted(
        f"{n}.lora_{m}.weight" for n in names for m in "AB"
    )
    train = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert train == sorted(adapter_state(model.state_dict()))
    assert model.h[0].attn.q_proj.lora_A.weight.shape == (RANK, 32)
    assert model.h[0].attn.q_proj.lora_B.weight.shape == (32, RANK)
    n_adapter = sum(RANK * (32 + out) for out in (32, 128)) * 2
    assert trainable_count(model) == (n_adapter, sum(p.numel() for p in gpt().parameters()) +
                                      n_adapter)  # fmt: skip


def test_a_whole_name_pattern_chooses_the_layers_it_names() -> None:
    assert adapted_gpt(("h.1.attn.*",))[1] == [
        "h.1.attn.q_proj",
        "h.1.attn.k_proj",
        "h.1.attn.v_proj",
        "h.1.attn.proj",
    ]
    assert adapted_gpt(("h.*.attn.v_proj",))[1] == ["h.0.attn.v_proj", "h.1.attn.v_proj"]


def test_the_adapted_model_starts_as_its_base_and_only_the_adapters_change() -> None:
    base = gpt()
    model, _ = adapted_gpt()
    with torch.no_grad():
        assert torch.equal(model(IDS), base(IDS))  # B = 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    after = trained(model.train()).state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {k for k in after if is_lora_key(k)}  # the base bit-identical
    with torch.no_grad():
        assert (model(IDS) - base(IDS)).abs().max() > 1e-4


def test_the_merged_weights_give_the_adapted_models_logits() -> None:
    model, _ = adapted_gpt()
    trained(model.train())
    plain = gpt(seed=1)  # other weights: the merged state replaces them all
    plain.load_state_dict(merged_state(model.state_dict(), ALPHA / RANK))
    with torch.no_grad():
        assert (plain(IDS) - model(IDS)).abs().max() < 1e-5


def test_the_adapters_first_values_depend_on_the_layers_names_alone() -> None:
    torch.manual_seed(1)
    one, _ = adapted_gpt()  # gpt() seeds its base: the global RNG differs below
    torch.manual_seed(2)
    two = gpt(seed=3)
    add_lora(two, RANK, ALPHA, 0.0, ["q_proj", "mlp.fc"])
    first = adapter_state(one.state_dict())
    assert all(torch.equal(v, two.state_dict()[k]) for k, v in first.items())
    assert first["h.0.attn.q_proj.lora_A.weight"].abs().sum() > 0
    assert not torch.equal(
        first["h.0.attn.q_proj.lora_A.weight"], first["h.1.attn.q_proj.lora_A.weight"]
    )
    trained(one.train())
    init_lora(one)  # drawn anew: the same values again, B zero
    assert all(torch.equal(v, one.state_dict()[k]) for k, v in first.items())


def test_adapters_on_the_meta_device_are_left_uninitialised() -> None:
    with torch.device("meta"):
        model = GPT(num_outputs=64, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                    bias=True)  # fmt: skip
    names = add_lora(model, RANK, ALPHA, 0.1, ["proj"])
    assert names == ["h.0.attn.proj", "h.0.mlp.proj", "h.1.attn.proj", "h.1.mlp.proj"]
    assert model.h[0].mlp.proj.lora_A.weight.device.type == "meta"
    assert isinstance(model.h[0].mlp.proj.lora_dropout, nn.Dropout)


def _sharded_rank(rank: int, world: int, port: int, out: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import joined_world

    with joined_world(rank, world, port):
        model, _ = adapted_gpt()
        trained(model.train())  # adapters away from their first values
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
        init_lora(model)
        local = model.h[0].attn.q_proj.lora_A.weight.to_local()
        state = {k: v.full_tensor() for k, v in adapter_state(model.state_dict()).items()}
        torch.save({"state": state, "local_rows": local.shape[0]}, out / f"rank{rank}.pt")


@pytest.mark.slow  # a world of 2 ranks
@pytest.mark.timeout(120)
def test_init_lora_draws_each_fsdp_shard_of_the_same_adapters(tmp_path: Path) -> None:
    """fsdp's DTensors on 2 ranks: each rank's shard of the draw an unsharded model makes."""
    from tests.helpers import free_port, spawn

    expected = adapter_state(adapted_gpt()[0].state_dict())
    spawn(_sharded_rank, 2, free_port(), tmp_path, nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["local_rows"] == RANK // 2  # sharded: half the rows each
        assert all(torch.equal(got["state"][k], v) for k, v in expected.items())


# One line each: the exact messages.


def test_a_target_that_matches_no_linear_layer_is_one_line() -> None:
    with pytest.raises(DptError) as error:
        adapted_gpt(("q_proj", "qkv"))
    assert str(error.value) == (
        "finetune.lora.targets: 'qkv' matches no linear layer of the model (its linear "
        "layers end in: q_proj, k_proj, v_proj, proj, fc, lm_head)"
    )


def test_modules_to_save_train_whole_and_a_pattern_that_names_none_is_one_line() -> None:
    """finetune.lora.modules_to_save: the modules named train whole beside the adapters (the
    outermost that a pattern names); null (the default): the family's (dpt's GPT: none)."""
    model = gpt()
    add_lora(model, RANK, ALPHA, 0.0, [], ["h.1.mlp*"])
    trains = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    whole = {f"h.1.mlp.{layer}.{p}" for layer in ("fc", "proj") for p in ("weight", "bias")}
    assert trains == whole
    plain = gpt()
    add_lora(plain, RANK, ALPHA, 0.0, [], None)
    assert all("lora_" in n for n, p in plain.named_parameters() if p.requires_grad)
    with pytest.raises(DptError) as error:
        add_lora(gpt(), RANK, ALPHA, 0.0, [], ["head"])
    assert str(error.value) == "finetune.lora.modules_to_save: 'head' names no module of GPT"


def test_lora_without_targets_adapts_what_the_family_names() -> None:
    """No targets named: the attention's query and value projections, as the model's family
    names them (dpt's GPT and Llama's shape, BERT's, GPTNeoX's and Falcon's fused one); a model
    whose family names none is one line that lists its linear layers."""
    assert add_lora(gpt(), RANK, ALPHA, 0.0, []) == [
        f"h.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]  # fmt: skip
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    small = {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
             "intermediate_size": 32, "vocab_size": 64}  # fmt: skip
    for kind, auto, ends in [
        ("llama", AutoModelForCausalLM, {"q_proj", "v_proj"}),
        ("gpt_neox", AutoModelForCausalLM, {"query_key_value"}),
        ("falcon", AutoModelForCausalLM, {"query_key_value"}),
        ("bert", AutoModelForSequenceClassification, {"query", "value"}),
    ]:
        model = auto.from_config(AutoConfig.for_model(kind, **small))
        adapted = add_lora(model, RANK, ALPHA, 0.0, [])
        assert {name.rpartition(".")[2] for name in adapted} == ends, kind
    with pytest.raises(DptError) as error:
        add_lora(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), RANK, ALPHA, 0.0, [])
    assert str(error.value) == (
        "finetune.lora.rank=4: dpt knows no attention projections of Sequential to adapt; "
        "name its layers in finetune.lora.targets (its linear layers end in: 0, 2)"
    )


class Backbone(nn.Module):
    """A ResNet's names in little: conv1, bn1, layer1..layer3, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.layer1, self.layer2, self.layer3 = (nn.Sequential(nn.Linear(4, 4)) for _ in "123")
        self.fc = nn.Linear(4, 2)


def _training(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_freeze_takes_parameter_and_module_patterns() -> None:
    model = Backbone()
    freeze(model, ["conv1", "layer[1-2]", "bn1.weight"])
    assert _training(model) == ["bn1.bias", "layer3.0.weight", "layer3.0.bias", "fc.weight",
                                "fc.bias"]  # fmt: skip
    assert trainable_count(model) == (4 + 20 + 10, sum(p.numel() for p in model.parameters()))
    freeze(model, ["*.bias"])
    assert _training(model) == ["layer3.0.weight", "fc.weight"]


def test_freeze_and_then_lora_train_the_adapters_alone() -> None:
    model = Backbone()
    freeze(model, ["conv1"])
    add_lora(model, 2, 4.0, 0.0, ["fc"])
    assert _training(model) == ["fc.lora_A.weight", "fc.lora_B.weight"]


def test_a_freeze_pattern_that_matches_nothing_is_one_line() -> None:
    with pytest.raises(DptError) as error:
        freeze(Backbone(), ["conv1", "backbone"])
    assert str(error.value) == (
        "finetune.freeze: 'backbone' matches no parameter of the model (its modules: bn1, conv1, "
        "fc, layer1, layer2, layer3)"
    )


def test_freezing_everything_is_one_line_and_freezes_nothing() -> None:
    model = Backbone()
    with pytest.raises(DptError) as error:
        freeze(model, ["conv1", "bn1", "layer*", "fc"])
    assert (
        str(error.value) == "finetune.freeze=[conv1, bn1, layer*, fc] leaves no parameter to train"
    )
    assert len(_training(model)) == len(list(model.parameters()))


# peft's layout, on a Llama-shaped transformers model.


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return hf_folders.llama(tmp_path_factory.mktemp("lora") / "llama")


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _adapted_llama(folder: Path) -> nn.Module:
    """The folder's model with adapters on q_proj and v_proj, trained a little (B not zero)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert len(add_lora(model, 8, 16.0, 0.0, ["q_proj", "v_proj"])) == 4
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=IDS, labels=IDS).loss.backward()
        optimizer.step()
    return model.eval()


def _write_peft(model: nn.Module, folder: Path, base: Path) -> dict:
    config, tensors = peft_files(model.state_dict(), 8, 16.0, 0.0, ["q_proj", "v_proj"],
                                 str(base), task_type="CAUSAL_LM")  # fmt: skip
    folder.mkdir()
    (folder / PEFT_CONFIG).write_text(json.dumps(config))
    save_file(tensors, folder / PEFT_WEIGHTS)
    return config


def test_peft_loads_the_adapters_onto_the_base_with_the_same_logits(
    llama: Path, tmp_path: Path
) -> None:
    peft = pytest.importorskip("peft")
    import transformers

    model = _adapted_llama(llama)
    assert model.model.layers[0].self_attn.q_proj.lora_B.weight.abs().sum() > 0
    config = _write_peft(model, tmp_path / "adapter", llama)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(llama)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert (_logits(loaded) - _logits(model)).abs().max() < 1e-5
    # The keys peft writes itself for the same adapters.
    own = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(llama),
        peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        task_type="CAUSAL_LM"),
    )  # fmt: skip
    own.save_pretrained(tmp_path / "peft")
    ours = load_file(tmp_path / "adapter" / PEFT_WEIGHTS)
    assert sorted(load_file(tmp_path / "peft" / PEFT_WEIGHTS)) == sorted(ours)


def test_peft_gets_the_whole_names_of_layers_a_wildcard_chose(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model, names = adapted_gpt(("h.1.*",))
    trained(model.train())
    config, tensors = peft_files(model.state_dict(), RANK, ALPHA, 0.0, ["h.1.*"], None)
    assert config["target_modules"] == names and config["task_type"] is None
    (tmp_path / PEFT_CONFIG).write_text(json.dumps(config))
    save_file(tensors, tmp_path / PEFT_WEIGHTS)
    loaded = peft.PeftModel.from_pretrained(gpt(), tmp_path).eval()
    with torch.no_grad():
        assert (loaded(IDS) - model(IDS)).abs().max() < 1e-5


# A LoRA run of dpt's GPT on a base file (model.init_from), and dpt-export's three forms.

GPT_RUN = ["model=gpt", "model.block_size=8", "model.n_layer=2", "model.n_head=2",
           "model.n_embd=32", "model.bias=true", "model.gelu=tanh", "task=language_model",
           "dataset=text", "optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=4",
           "trainer.log_every_n_steps=2", "trainer.batch_size=8", "finetune.lora.rank=4",
           "finetune.lora.alpha=8", "finetune.lora.targets=[q_proj,mlp.fc]"]  # fmt: skip


def _gpt_of_run() -> GPT:
    """The run's model, bytes for tokens (256), as dpt builds it from GPT_RUN."""
    return GPT(num_outputs=256, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
               bias=True, gelu="tanh").eval()  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from dpt.launch.launchers import resolved
    from tests.helpers import compose, run_config_here

    out = tmp_path_factory.mktemp("lora_run")
    (out / "sums.txt").write_text(hf_folders.SUMS)
    torch.manual_seed(5)
    torch.save(_gpt_of_run().state_dict(), out / "base.pt")
    run_dir = out / "run"
    cfg = resolved(compose(*GPT_RUN, f"dataset.root={out / 'sums.txt'}",
                           f"dataset.cache_dir={out / 'cache'}",
                           f"model.init_from={out / 'base.pt'}"))  # fmt: skip
    run_config_here(cfg, run_dir, hydra_config=True)
    return {"run": run_dir, "base": out / "base.pt"}


def _run_logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return getattr(out, "logits", out)


@pytest.mark.timeout(300)
def test_dpt_export_writes_a_lora_run_merged_and_as_peft_adapters(
    lora_run: dict[str, Path], tmp_path: Path
) -> None:
    from dpt.commands import export
    from dpt.commands.run_model import Predictor

    run = lora_run["run"]
    adapted = _gpt_of_run()
    add_lora(adapted, RANK, ALPHA, 0.0, ["q_proj", "mlp.fc"])
    adapted.load_state_dict(torch.load(run / "model_best.pt", weights_only=True))
    expected = _run_logits(adapted)
    base = torch.load(lora_run["base"], weights_only=True)
    assert all(torch.equal(adapted.state_dict()[k], v) for k, v in base.items())  # frozen
    assert adapted.h[0].attn.q_proj.lora_B.weight.abs().sum() > 0  # the adapters trained
    assert (_run_logits(Predictor.from_run(run).model) - expected).abs().max() < 1e-6
    for to in ("hf", "safetensors", "peft"):
        export.main([str(run), "--to", to, str(tmp_path / to)])
    gpt2 = pytest.importorskip("transformers").GPT2LMHeadModel
    merged = gpt2.from_pretrained(tmp_path / "hf").eval()
    assert (_run_logits(merged) - expected).abs().max() < 1e-5
    plain = _gpt_of_run()
    plain.load_state_dict(load_file(tmp_path / "safetensors" / "model.safetensors"))
    assert (_run_logits(plain) - expected).abs().max() < 1e-5
    config = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    assert config["r"] == RANK and config["base_model_name_or_path"] == str(lora_run["base"])
    peft = pytest.importorskip("peft")
    on_base = _gpt_of_run()
    on_base.load_state_dict(base)
    loaded = peft.PeftModel.from_pretrained(on_base, tmp_path / "peft").eval()
    assert (_run_logits(loaded) - expected).abs().max() < 1e-5


@pytest.mark.timeout(300)
def test_a_lora_checkpoint_is_exported_on_the_runs_base(
    lora_run: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint holds the adapters alone: the base comes from model.init_from."""
    from dpt.commands import export
    from dpt.state.model_state import read_model_state
    from tests.helpers import committed_checkpoints

    run = lora_run["run"]
    checkpoint = committed_checkpoints(run)[-1]
    held = read_model_state(checkpoint, "checkpoint")
    assert "h.0.attn.q_proj.lora_A.weight" in held and "h.0.attn.q_proj.weight" not in held
    export.main([str(run), "--to", "safetensors", "--checkpoint", str(checkpoint),
                 str(tmp_path / "from_checkpoint")])  # fmt: skip
    export.main([str(run), "--to", "safetensors", "--last", str(tmp_path / "final")])
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert final.keys() == load_file(tmp_path / "from_checkpoint" / "model.safetensors").keys()
    assert all(not is_lora_key(k) for k in final)
    from_checkpoint = load_file(tmp_path / "from_checkpoint" / "model.safetensors")
    assert all(torch.equal(from_checkpoint[k], v) for k, v in final.items())


def test_dpt_export_to_peft_refuses_a_run_without_lora(
    lora_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from dpt.commands import export

    run = tmp_path / "run"
    shutil.copytree(lora_run["run"] / ".hydra", run / ".hydra")
    shutil.copy(lora_run["run"] / "data.json", run / "data.json")
    config = run / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace("rank: 4", "rank: 0"))
    with pytest.raises(SystemExit):
        export.main([str(run), "--to", "peft", str(tmp_path / "out")])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"Error: --to peft: {run} trained no LoRA adapters (its finetune.lora.rank is 0); "
        "--to hf or --to safetensors writes its model"
    )


def test_gpt2s_conv1d_projections_take_adapters_that_merge_and_load_in_peft(tmp_path: Path) -> None:
    """transformers' GPT-2 projects with Conv1D (its weight in x out): with no targets named,
    LoRA adapts its fused c_attn, as peft does by default; the merged weights (transposed back)
    and peft's files (fan_in_fan_out) give the adapted model's logits."""
    peft = pytest.importorskip("peft")
    import transformers

    folder = hf_folders.gpt2(tmp_path / "gpt2")
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    names = add_lora(model, RANK, ALPHA, 0.0, [])
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(IDS).logits[0, :-1], IDS[0, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        expected = model(IDS).logits
    plain = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    plain.load_state_dict(merged_state(model.state_dict(), ALPHA / RANK, transposed_layers(model)))
    with torch.no_grad():
        assert (plain(IDS).logits - expected).abs().max() < 1e-5
    config, tensors = peft_files(model.state_dict(), RANK, ALPHA, 0.0, [], str(folder),
                                 "CAUSAL_LM", fan_in_fan_out=True)  # fmt: skip
    assert config["target_modules"] == ["c_attn"]
    (tmp_path / PEFT_CONFIG).write_text(json.dumps(config))
    save_file(tensors, tmp_path / PEFT_WEIGHTS)
    base = transformers.GPT2LMHeadModel.from_pretrained(folder)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        assert (loaded(IDS).logits - expected).abs().max() < 1e-5
