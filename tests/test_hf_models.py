"""model=hf, weights from anywhere (model.init_from) and dpt-export, on tiny models that
transformers builds from configs and saves here (tests/hf_folders.py): nothing is downloaded.

One 2-rank world trains the Llama-shaped model under ddp, under fsdp (per decoder layer, with
recomputation) and as 2 pipeline stages; each equals one process on the same global batch (SGD).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp  # the peak-memory test's own processes

from dpt.commands import export, generate
from dpt.launch.launchers import resolved
from dpt.state.results import HF_CONFIG_FILE
from tests import hf_folders
from tests.helpers import (
    build_trainer,
    compose,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    run_config_here,
    spawn,
    train_rank,
)

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH = 10, 8
SGD = ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0", "trainer.log_every_n_steps=5",
       f"trainer.max_steps={STEPS}", "trainer.seed=1"]  # fmt: skip
OFF = ["checkpoint.enabled=false"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("hf")
    (out / "sums.txt").write_text(hf_folders.SUMS)
    (out / "products.txt").write_text(hf_folders.OTHER_TEXT)
    made = {"llama": hf_folders.llama(out / "llama"), "gpt2": hf_folders.gpt2(out / "gpt2"),
            "bert": hf_folders.bert(out / "bert"), "vit": hf_folders.vit(out / "vit"),
            "neox": hf_folders.neox(out / "neox")}  # fmt: skip
    return {**made, "out": out, "sums": out / "sums.txt", "products": out / "products.txt"}


def llama_run(folders: dict[str, Path], *extra: str, family: str = "llama") -> list[str]:
    return ["model=hf", f"model.path={folders[family]}", "model.block_size=16",
            "task=language_model", "dataset=text", f"dataset.root={folders['sums']}",
            f"dataset.cache_dir={folders['out'] / 'cache'}", *SGD, *extra]  # fmt: skip


def gpt_run(text: Path, folders: dict[str, Path], *extra: str) -> list[str]:
    """dpt's GPT in GPT-2's tiny shape (bytes: 256 tokens)."""
    return ["model=gpt", "model.block_size=16", "model.n_layer=2", "model.n_head=2",
            "model.n_embd=32", "model.bias=true", "model.gelu=tanh", "task=language_model",
            "dataset=text", f"dataset.root={text}", f"dataset.cache_dir={folders['out'] / 'cache'}",
            *SGD, *extra]  # fmt: skip


def _world_runs(folders: dict[str, Path]) -> dict[str, list[str]]:
    per_rank = f"trainer.batch_size={GLOBAL_BATCH // 2}"
    recompute, every = "model.activation_checkpointing=true", "checkpoint.every_n_steps=5"
    pipeline = [
        "strategy=pipeline",
        "strategy.microbatches=4",
        f"trainer.batch_size={GLOBAL_BATCH}",
    ]
    return {
        "ddp": llama_run(folders, "strategy=ddp", per_rank, *OFF),
        "fsdp": llama_run(folders, "strategy=fsdp", per_rank, recompute, every),
        "pipeline": llama_run(folders, *pipeline, *OFF),
        # GPTNeoX saves its head as `embed_out` (the model's `lm_head`): each rank reads its
        # rows of it by the saved name
        "neox-fsdp": llama_run(folders, "strategy=fsdp", per_rank, *OFF, family="neox"),
    }


def _ranks(rank: int, world: int, port: int, folders: dict[str, Path]) -> None:
    with joined_world(rank, world, port) as env:
        for name, overrides in _world_runs(folders).items():
            train_rank(env, folders["out"] / name, *overrides)


def _single(run_dir: Path, overrides: list[str]) -> dict:
    """One process, as `dpt` runs it, its config kept where Hydra keeps it."""
    return run_config_here(resolved(compose(*overrides)), run_dir, hydra_config=True)


@pytest.fixture(scope="module")
def runs(folders: dict[str, Path]) -> dict[str, Path]:
    out = folders["out"]
    _single(out / "single", llama_run(folders, f"trainer.batch_size={GLOBAL_BATCH}", *OFF))
    _single(out / "neox-single", llama_run(folders, f"trainer.batch_size={GLOBAL_BATCH}", *OFF,
                                            family="neox"))  # fmt: skip
    spawn(_ranks, 2, free_port(), folders, nprocs=2)
    return {name: out / name for name in ("single", "ddp", "fsdp", "pipeline", "neox-single",
                                          "neox-fsdp")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline"])
def test_a_llama_folder_trains_under_every_strategy_as_one_process(
    runs: dict[str, Path], strategy: str
) -> None:
    one = load_weights(runs["single"])
    assert max_abs_diff(load_weights(runs[strategy]), one) < 1e-5
    assert "model.layers.0.self_attn.q_proj.weight" in one  # transformers' own names
    summary = json.loads((runs[strategy] / "metrics.json").read_text())
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * GLOBAL_BATCH
    # The folder's config kept in the run by every strategy: dpt-export and dpt-generate rebuild
    # the model from it once the folder has moved (a ddp run wrote none).
    kept = json.loads((runs[strategy] / HF_CONFIG_FILE).read_text())
    assert kept == json.loads((runs["single"] / HF_CONFIG_FILE).read_text())
    assert kept["model_type"] == "llama"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_gpt_neox_folder_under_fsdp_reads_its_saved_head_and_equals_one_process(
    runs: dict[str, Path],
) -> None:
    one = load_weights(runs["neox-single"])
    assert "lm_head.weight" in one  # the model's name for the saved `embed_out.weight`
    from safetensors.torch import load_file

    saved = load_file(runs["neox-single"].parent / "neox" / "model.safetensors")
    assert "embed_out.weight" in saved and "lm_head.weight" not in saved
    assert max_abs_diff({"w": one["lm_head.weight"]}, {"w": saved["embed_out.weight"]}) > 0
    assert max_abs_diff(load_weights(runs["neox-fsdp"]), one) < 1e-5  # ...as under fsdp


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_shards_per_decoder_layer_and_reports_tflops(runs: dict[str, Path]) -> None:
    log = (runs["fsdp"] / "logs" / "rank0.log").read_text()
    assert "TFLOP/s" in log
    from dpt.models.blocks import blocks
    from dpt.models.hf import pretrained

    model = pretrained("language_model", 300, (16,), path=str(runs["fsdp"].parent / "llama"))
    assert [type(b).__name__ for b in blocks(model)] == ["LlamaDecoderLayer"] * 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dpt_generate_continues_a_prompt_with_the_folders_tokenizer(
    runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    generate.main([str(runs["single"]), "--prompt", "3+4", "--max-new-tokens", "6",
                   "--temperature", "0"])  # fmt: skip
    text = capsys.readouterr().out
    # The same greedy tokens from the run's model and the folder's tokenizer, by hand.
    tokenizer = transformers.AutoTokenizer.from_pretrained(runs["single"].parent / "llama")
    model = _run_model(runs["single"], runs["single"] / "model_best.pt")
    ids = torch.tensor([tokenizer("3+4")["input_ids"]])
    for _ in range(6):
        ids = torch.cat([ids, _logits(model, ids)[:, -1:].argmax(-1)], dim=1)
    expected = tokenizer.decode(ids[0])
    assert len(expected) > len("3+4") and text.rstrip("\n") == expected.rstrip("\n")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(ids)
    return getattr(out, "logits", out)


def _run_model(run_dir: Path, weights: Path) -> torch.nn.Module:
    from dpt.commands.run_model import build_run_model, load_state, model_config
    from dpt.state.results import read_run_data

    model = build_run_model(model_config(run_dir), read_run_data(run_dir))
    load_state(model, weights)
    return model


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["single", "fsdp-checkpoint"])
def test_dpt_export_to_hf_loads_in_transformers_with_the_runs_logits(
    runs: dict[str, Path], source: str, tmp_path: Path
) -> None:
    run_dir = runs["single" if source == "single" else "fsdp"]
    out = tmp_path / "export"
    if source == "single":
        export.main([str(run_dir), "--to", "hf", str(out)])
    else:  # the sharded checkpoint of the last step: the same weights as the run's model.pt
        step = run_dir / "checkpoints" / f"step-{STEPS:08d}"
        export.main([str(run_dir), "--to", "hf", str(out), "--checkpoint", str(step)])
    weights = run_dir / ("model_best.pt" if source == "single" else "model.pt")
    ids = torch.randint(0, hf_folders.VOCAB, (2, 16))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    diff = (_logits(loaded, ids) - _logits(_run_model(run_dir, weights), ids)).abs().max()
    assert diff < 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("12+30=42\n")["input_ids"]) == "12+30=42\n"


@pytest.fixture(scope="module")
def gpt_runs(folders: dict[str, Path]) -> dict[str, Path]:
    """A GPT trained on sums; one that starts from it on products (its first steps)."""
    out = folders["out"]
    first = _single(out / "gpt-sums", gpt_run(folders["sums"], folders, "trainer.batch_size=8",
                                              *OFF))  # fmt: skip
    (out / "gpt-sums" / "summary.json").write_text(json.dumps(first["val"]))
    return {"sums": out / "gpt-sums"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pretrain_then_fine_tune_starts_from_the_first_runs_weights(
    gpt_runs: dict[str, Path], folders: dict[str, Path], tmp_path: Path
) -> None:
    first = gpt_runs["sums"]
    again = ["trainer.batch_size=8", *OFF, f"model.init_from={first}"]
    tuned = build_trainer(tmp_path / "products", torch_env(),
                          *gpt_run(folders["products"], folders, *again))  # fmt: skip
    before = {k: v.clone() for k, v in tuned.model.state_dict().items()}
    assert max_abs_diff(before, load_weights(first)) < 1e-6
    # Its first validation, on the first text, is the first run's last.
    on_sums = build_trainer(tmp_path / "sums", torch_env(),
                            *gpt_run(folders["sums"], folders, *again))  # fmt: skip
    val = on_sums.parts.validation.run(on_sums.model)
    expected = json.loads((first / "summary.json").read_text())
    assert val["val/loss"] == pytest.approx(expected["val/loss"], abs=1e-6)


def torch_env():
    from dpt.distributed import env_from_environment

    return env_from_environment("cpu")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_gpt_run_exports_as_gpt2(gpt_runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "gpt2"
    export.main([str(gpt_runs["sums"]), "--to", "hf", str(out), "--last"])
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    # GPT-2's own bos/eos id (50256) is no token of a 256-byte vocabulary: the run's tokenizer
    # (bytes) has none, so the export names none, for generate() as for the config
    for config in (loaded.config, loaded.generation_config):
        assert (config.bos_token_id, config.eos_token_id) == (None, None)
    ids = torch.randint(0, 256, (2, 16))
    mine = _run_model(gpt_runs["sums"], gpt_runs["sums"] / "model.pt")
    assert (_logits(loaded, ids) - _logits(mine, ids)).abs().max() < 1e-5


@pytest.mark.timeout(120)
def test_dpts_gpt_from_gpt2_weights_gives_gpt2s_logits(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    overrides = gpt_run(folders["sums"], folders, f"model.init_from={folders['gpt2']}",
                        "trainer.batch_size=8", *OFF)  # fmt: skip
    trainer = build_trainer(tmp_path / "run", torch_env(), *overrides)
    reference = transformers.GPT2LMHeadModel.from_pretrained(folders["gpt2"])
    ids = torch.randint(0, 256, (2, 16))
    assert (_logits(trainer.model, ids) - _logits(reference, ids)).abs().max() < 1e-4


@pytest.mark.slow  # two training runs
@pytest.mark.timeout(120)
def test_a_bert_and_a_vit_folder_train_as_classifiers_with_the_datas_head(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    bert = build_trainer(
        tmp_path / "bert", torch_env(), "model=hf", f"model.path={folders['bert']}",
        "dataset=custom", "+dataset.train._target_=tests.hf_folders.LabelledTokens",
        "+dataset.train.num_samples=64", f"dataset.num_classes={hf_folders.LABELS}",
        "trainer.batch_size=16", "trainer.max_steps=2", *OFF,
    )  # fmt: skip
    vit = build_trainer(
        tmp_path / "vit", torch_env(), "model=hf", f"model.path={folders['vit']}",
        "dataset=fake_images", "dataset.image_size=32", "dataset.num_samples=32",
        "dataset.num_val_samples=16", "trainer.batch_size=16", "trainer.max_steps=2", *OFF,
    )  # fmt: skip
    for trainer, labels in ((bert, hf_folders.LABELS), (vit, 10)):
        assert trainer.model.config.num_labels == labels  # the folder's head had 2 / 5
        result = trainer.fit()
        trainer.metrics.close()
        assert result.final_loss is not None and torch.isfinite(torch.tensor(result.final_loss))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_init_from_reads_the_same_weights_from_every_kind_of_source(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    from dpt.state.model_state import read_model_state

    run_dir = runs["fsdp"]  # its last checkpoint is its final step, sharded over 2 ranks
    export.main([str(run_dir), "--to", "safetensors", str(tmp_path / "st"), "--last"])
    export.main([str(run_dir), "--to", "hf", str(tmp_path / "hf"), "--last"])
    final = load_weights(run_dir)
    sources = [run_dir, run_dir / "model.pt", run_dir / "checkpoints" / f"step-{STEPS:08d}",
               tmp_path / "st" / "model.safetensors", tmp_path / "hf"]  # fmt: skip
    for source in sources:
        state = read_model_state(source, f"model.init_from={source}")
        assert max_abs_diff(state, final) == 0.0, source


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_pretrained_guide_runs_from_a_folder_to_exported_folders(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """docs/guides/pretrained.md's lines, as written, from a folder laid out like a clone."""
    from tests.helpers import run_docs_block

    folder, results = run_docs_block("hf", tmp_path_factory.mktemp("guide"))
    # From another folder than the runs' (model.path=tiny-llama is relative): the run folder
    # keeps the model's config (hf_config.json), and dpt builds the model from it.
    assert Path.cwd() != folder
    generated = next(r for c, r in results.items() if c.startswith("dpt-generate")).stdout
    assert generated.startswith("12+34=")
    ids = torch.randint(0, hf_folders.VOCAB, (2, 16))
    llama = transformers.AutoModelForCausalLM.from_pretrained(folder / "exported" / "llama")
    run = folder / "outputs" / "llama"
    mine = _run_model(run, run / "model_best.pt")
    assert (_logits(llama, ids) - _logits(mine, ids)).abs().max() < 1e-5
    tuned = folder / "outputs" / "gpt_tuned"
    gpt2 = transformers.GPT2LMHeadModel.from_pretrained(folder / "exported" / "gpt2")
    mine = _run_model(tuned, tuned / "model.pt")
    assert (_logits(gpt2, ids % 256) - _logits(mine, ids % 256)).abs().max() < 1e-5
    assert "model.init_from=outputs/gpt" in (tuned / ".hydra" / "overrides.yaml").read_text()


def _memory(field: str) -> int:
    """A line of /proc/self/status in bytes: VmHWM, the process's peak resident memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_growth(rank: int, world: int, port: int, folders: dict[str, Path], strategy: str) -> None:
    """How much the rank's peak memory grows while it builds the big model's parts, after a
    build of the tiny one has paid for the imports and the tokenized text."""
    with joined_world(rank, world, port) as env:
        common = (f"strategy={strategy}", "trainer.batch_size=2", *OFF)
        build_trainer(folders["out"] / f"warm-{strategy}", env, *llama_run(folders, *common))
        before = _memory("VmHWM")
        big = f"model.path={folders['big']}"
        build_trainer(folders["out"] / f"big-{strategy}", env, *llama_run(folders, big, *common))
        (folders["out"] / f"peak-{strategy}-{rank}.json").write_text(
            json.dumps({"grown": _memory("VmHWM") - before})
        )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_ranks_never_hold_the_whole_model_of_a_folder(folders: dict[str, Path]) -> None:
    """A 240 MB Llama under fsdp on 2 ranks: built on the meta device, each rank reads only its
    rows of each tensor from the safetensors file, so its peak memory grows by little more than
    half the model; under ddp (every rank builds and loads a whole copy) by more than the whole."""
    big = hf_folders.llama(folders["out"] / "big", vocab_size=32000, hidden_size=512,
                           intermediate_size=1536, num_hidden_layers=8)  # fmt: skip
    size = (big / "model.safetensors").stat().st_size
    assert size > 200e6
    grown = {}
    for strategy in ("fsdp", "ddp"):
        mp.spawn(_peak_growth, args=(2, free_port(), {**folders, "big": big}, strategy),
                 nprocs=2, join=True)  # fmt: skip
        for rank in (0, 1):
            row = json.loads((folders["out"] / f"peak-{strategy}-{rank}.json").read_text())
            grown[strategy, rank] = round(row["grown"] / size, 3)
    print(f"peak memory grown, in model sizes ({size / 1e6:.0f} MB): {grown}")
    assert all(grown["fsdp", rank] < 0.7 for rank in (0, 1)), grown
    assert all(grown["ddp", rank] > 1.0 for rank in (0, 1)), grown


@pytest.mark.slow  # two training runs, in process
@pytest.mark.timeout(300)
def test_a_fresh_configs_vocabulary_is_the_datas_and_generate_samples_the_tokenizers_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """model.config without vocab_size: the data's (256 bytes), not transformers' 32,000 (a
    head of logits no token has, 125 times the work); given one larger (a padded vocabulary),
    dpt-generate samples only ids the tokenizer has (an id past 255 raised in its decoding)."""
    from tests.helpers import train_in_process

    (tmp_path / "sums.txt").write_text(hf_folders.SUMS)
    llama = ("model.config={model_type: llama, hidden_size: 32, intermediate_size: 64, "
             "num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2")  # fmt: skip
    for name, vocabulary in (("datas", ""), ("padded", ", vocab_size: 320")):
        run = tmp_path / name
        result = train_in_process(
            "model=hf", llama + vocabulary + "}", "task=language_model", "dataset=text",
            f"dataset.root={tmp_path / 'sums.txt'}", "trainer.max_steps=2", "model.block_size=16",
            "checkpoint.enabled=false", f"hydra.run.dir={run}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        kept = json.loads((run / HF_CONFIG_FILE).read_text())["vocab_size"]
        assert kept == (256 if name == "datas" else 320)
    capsys.readouterr()
    generate.main([str(tmp_path / "padded"), "--prompt", "1+2=", "--max-new-tokens", "24",
                   "--temperature", "1", "--seed", "0"])  # fmt: skip
    assert capsys.readouterr().out.startswith("1+2=")
