"""The conformance matrix: every transformers family that dpt lists (scripts/family_table.py)
under every strategy, generated over the families, not written per family. Each a tiny folder
made here (tests/hf_folders); 4 SGD steps on the same global batch.

Causal LMs: under ddp, fsdp, 2 pipeline stages and tensor parallel 2, each run equals one
process (< 1e-5), but tensor parallelism where the family projects queries, keys and values in
one layer, refused in the family's one line before any rank starts. LoRA with no targets named
adapts what the family names and leaves the base as it was; the export gives the run's logits in
transformers; dpt-generate answers from the run folder alone.

Classifiers (an encoder on labeled records, an image classifier on an image folder), each
folder's head of another size than the data's (a fresh head, as fine-tuning has it): under ddp
and fsdp each run equals one process (< 1e-5); the export gives the run's logits.

The multi-process runs go through this pytest worker's resident 2-rank world, one list of runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dpt.commands import export, generate
from dpt.config.build import build
from dpt.errors import DptError
from dpt.launch.launchers import resolved
from dpt.models.lora import is_lora_key
from dpt.state.results import HF_CONFIG_FILE
from scripts.family_table import TRANSFORMERS
from tests import hf_folders
from tests.helpers import (
    colour_images,
    compose,
    load_weights,
    max_abs_diff,
    run_config_here,
    run_world,
    world_run,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # runs, in process and on the resident world

KINDS = tuple(kind for kind, auto in TRANSFORMERS.items() if auto == "AutoModelForCausalLM")
CLASSIFIERS = tuple(kind for kind in TRANSFORMERS if kind not in KINDS)
TEXT, IMAGES = "AutoModelForSequenceClassification", "AutoModelForImageClassification"
DECODER = "llama-classifier"  # a causal LM's folder, trained as a sequence classifier
STRATEGIES = ("ddp", "fsdp", "pipeline", "tensor_parallel")
STEPS, BATCH = 4, 8
SGD = ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0", "trainer.seed=1",
       f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=2",
       "checkpoint.enabled=false"]  # fmt: skip
# Each strategy's overrides on 2 ranks, for the same global batch as one process's BATCH.
ON_TWO = {
    "ddp": ["strategy=ddp", f"trainer.batch_size={BATCH // 2}"],
    "fsdp": ["strategy=fsdp", f"trainer.batch_size={BATCH // 2}"],  # each rank its rows
    "pipeline": ["strategy=pipeline", "strategy.microbatches=4", f"trainer.batch_size={BATCH}"],
    "tensor_parallel": ["strategy=ddp", "strategy.tensor_parallel=2",
                        f"trainer.batch_size={BATCH}"],
}  # fmt: skip


def _run(folder: Path, text: Path, *extra: str) -> list[str]:
    return ["model=hf", f"model.path={folder}", "model.block_size=16", "task=language_model",
            "dataset=text", f"dataset.root={text}", f"dataset.cache_dir={text.parent / 'cache'}",
            *SGD, *extra]  # fmt: skip


def _refusal(folder: Path, text: Path, strategy: str) -> str | None:
    """The family's one line for `strategy`, from the model built on the meta device as the
    launcher builds it; None: the family has the answer, and the run goes ahead."""
    from dpt.models.hf import build_auto

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = build_auto("AutoModelForCausalLM", config)
    try:
        build(compose(*_run(folder, text, *ON_TWO[strategy])).strategy).check(model)
    except DptError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("matrix")
    text = out / "sums.txt"
    text.write_text(hf_folders.SUMS)
    folders = {kind: hf_folders.causal_lm(out / "folders" / kind, kind) for kind in KINDS}
    refused = {(kind, s): _refusal(folders[kind], text, s) for kind in KINDS for s in STRATEGIES}
    runs = out / "runs"
    for kind in KINDS:
        one = _run(folders[kind], text, f"trainer.batch_size={BATCH}")
        run_config_here(resolved(compose(*one)), runs / kind / "single", hydra_config=True)
        lora = [*one, "finetune.lora.rank=4", "finetune.lora.alpha=8"]
        run_config_here(resolved(compose(*lora)), runs / kind / "lora", hydra_config=True)
    run_world(2, [world_run(f"{kind}-{s}", runs / kind / s, *_run(folders[kind], text,
                                                                   *ON_TWO[s]))
                  for kind in KINDS for s in STRATEGIES if refused[kind, s] is None])  # fmt: skip
    return {"folders": folders, "runs": runs, "refused": refused}


@pytest.mark.timeout(900)  # the first test of the module builds the matrix
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", KINDS)
def test_each_strategy_equals_one_process_or_is_refused_in_one_line(
    matrix: dict[str, Any], kind: str, strategy: str
) -> None:
    refusal = matrix["refused"][kind, strategy]
    if refusal is not None:  # the family has no answer: said before any rank, in one line
        assert "\n" not in refusal
        # Every decoder trains under ddp, fsdp and the pipeline, and split over tensor ranks but
        # where its attention projects queries, keys and values in one layer (the line says so).
        assert strategy == "tensor_parallel", refusal
        assert "strategy.tensor_parallel=2" in refusal and "in one layer" in refusal, refusal
        return
    runs = matrix["runs"] / kind
    one = load_weights(runs / "single")
    assert max_abs_diff(load_weights(runs / strategy), one) < 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_lora_without_targets_adapts_the_familys_layers_and_leaves_the_base(
    matrix: dict[str, Any], kind: str
) -> None:
    trained = load_weights(matrix["runs"] / kind / "lora")
    adapted = {k.rsplit(".", 2)[0].rpartition(".")[2] for k in trained if is_lora_key(k)}
    family = {
        "gpt2": {"c_attn"},
        "gpt_neox": {"query_key_value"},
        "falcon": {"query_key_value"},
        "phi3": {"qkv_proj"},
    }
    assert adapted == family.get(kind, {"q_proj", "v_proj"})  # its attention's projections
    adapters = [k for k in trained if is_lora_key(k) and k.endswith("lora_B.weight")]
    assert any(trained[k].abs().sum() > 0 for k in adapters)  # they trained
    model = transformers.AutoModelForCausalLM.from_pretrained(matrix["folders"][kind])
    for key, value in model.state_dict().items():  # the folder's own, as transformers reads it
        assert torch.equal(trained[key], value), key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_the_export_gives_the_runs_logits_and_generate_answers(
    matrix: dict[str, Any], kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = matrix["runs"] / kind / "single"
    capsys.readouterr()
    export.main([str(run), "--to", "hf", str(tmp_path / "hf")])
    said = capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    name = type(exported).__name__
    assert said.out == f"wrote {tmp_path / 'hf'} ({name}, from_pretrained loads it)\n"
    assert said.err == ""  # its one line: no progress bar of transformers' writing
    trained = transformers.AutoModelForCausalLM.from_pretrained(matrix["folders"][kind]).eval()
    trained.load_state_dict(load_weights(run))
    ids = torch.randint(0, hf_folders.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (exported(ids).logits - trained(ids).logits).abs().max() < 1e-5
    capsys.readouterr()
    generate.main([str(run), "--prompt", "3+4", "--max-new-tokens", "4", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("3+4")


def _classifier_run(kind: str, folder: Path, data: Path, *extra: str) -> list[str]:
    reads = (["dataset=records", f"dataset.root={data}", "dataset.max_length=16"]
             if TRANSFORMERS.get(kind, TEXT) == TEXT else
             ["dataset=image_folder", f"dataset.root={data}", "dataset.image_size=32",
              "dataset.num_workers=0"])  # fmt: skip
    return ["model=hf", f"model.path={folder}", "task=classification", *reads, *SGD, *extra]


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("classifiers")
    records = out / "reviews"
    records.mkdir()
    train = hf_folders.reviews(64, seed=0)
    hf_folders.write_csv(records / "train.csv", train)
    hf_folders.write_csv(records / "val.csv", hf_folders.reviews(16, seed=1))
    # 32 x 32 images of two colours: 8 a class to train, 2 to validate
    images = colour_images(
        out / "images", {"train": 8, "val": 2}, {"blue": (30, 30, 200), "red": (200, 30, 30)}, 32
    )
    texts = [row["text"] for row in train]
    # Folders of 3 labels for data of 2 classes: each run's head is fresh, drawn alike under
    # every strategy (fsdp's model is built on the meta device, drawn in another order)
    folders = {kind: hf_folders.text_classifier(out / kind, kind, texts, labels=3)
               if TRANSFORMERS[kind] == TEXT else
               hf_folders.image_classifier(out / kind, kind, labels=3)
               for kind in CLASSIFIERS}  # fmt: skip
    data = {kind: records if TRANSFORMERS[kind] == TEXT else images for kind in CLASSIFIERS}
    # A causal LM's folder (its head lm_head, no pad token) as a sequence classifier: its head
    # (score) fresh, the folder's lm_head left out, the data's pad id its own
    folders[DECODER] = hf_folders.causal_lm(out / DECODER, "llama")
    data[DECODER] = records
    runs = out / "runs"
    for kind in (*CLASSIFIERS, DECODER):
        one = _classifier_run(kind, folders[kind], data[kind], f"trainer.batch_size={BATCH}")
        run_config_here(resolved(compose(*one)), runs / kind / "single", hydra_config=True)
    run_world(2, [world_run(f"{kind}-{s}", runs / kind / s,
                            *_classifier_run(kind, folders[kind], data[kind], *ON_TWO[s]))
                  for kind in (*CLASSIFIERS, DECODER) for s in ("ddp", "fsdp")])  # fmt: skip
    return {"folders": folders, "runs": runs}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_causal_lm_folder_classifies_alike_under_each_strategy(
    classifiers: dict[str, Any], strategy: str
) -> None:
    runs = classifiers["runs"] / DECODER
    one = load_weights(runs / "single")
    assert max_abs_diff(load_weights(runs / strategy), one) < 1e-5
    assert "score.weight" in one and "lm_head.weight" not in one
    kept = json.loads((runs / strategy / HF_CONFIG_FILE).read_text())
    assert kept["pad_token_id"] == 0  # the data's: the sums tokenizer names no pad token


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", CLASSIFIERS)
def test_a_classifier_under_each_strategy_equals_one_process(
    classifiers: dict[str, Any], kind: str, strategy: str
) -> None:
    runs = classifiers["runs"] / kind
    one = load_weights(runs / "single")
    assert max_abs_diff(load_weights(runs / strategy), one) < 1e-5
    assert max_abs_diff(_folders_weights(classifiers, kind), one) > 1e-4  # the steps moved it


def _folders_model(classifiers: dict[str, Any], kind: str) -> torch.nn.Module:
    """The folder's model with the run's head of 2 classes (fresh: the folder's has 3)."""
    auto = getattr(transformers, TRANSFORMERS[kind])
    folder = classifiers["folders"][kind]
    return auto.from_pretrained(folder, num_labels=2, ignore_mismatched_sizes=True)


def _folders_weights(classifiers: dict[str, Any], kind: str) -> dict[str, torch.Tensor]:
    return _folders_model(classifiers, kind).state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", CLASSIFIERS)
def test_a_classifiers_export_gives_the_runs_logits(
    classifiers: dict[str, Any], kind: str, tmp_path: Path
) -> None:
    run = classifiers["runs"] / kind / "single"
    export.main([str(run), "--to", "hf", str(tmp_path / "hf")])
    auto = getattr(transformers, TRANSFORMERS[kind])
    exported = auto.from_pretrained(tmp_path / "hf").eval()
    trained = _folders_model(classifiers, kind).eval()
    trained.load_state_dict(load_weights(run))
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randint(4, 100, (2, 12), generator=generator) if TRANSFORMERS[kind] == TEXT
              else torch.randn(2, 3, 32, 32, generator=generator))  # fmt: skip
    with torch.no_grad():
        assert (exported(inputs).logits - trained(inputs).logits).abs().max() < 1e-5
