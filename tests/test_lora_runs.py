"""LoRA (r = 8) on a tiny Llama-shaped transformers folder, trained on a chat file with the loss
on the answers: only the adapters train, checkpoints hold them alone, ddp and fsdp (the base
sharded, each rank reading its rows) equal one process, a run stopped on 2 ranks resumes on 1 to
the uninterrupted run's weights, and the exports load in transformers and in peft."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.commands import export
from scripts.make_chat_fixture import make_chat
from tests import hf_folders
from tests.helpers import (
    committed_checkpoints,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    read_checkpoint,
    run_here,
    spawn,
    train_rank,
)
from tests.test_hf_models import _single

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, KILLED_AT = 12, 8, 4
SGD = ["optimizer=sgd", "optimizer.lr=0.1", "optimizer.momentum=0", "trainer.log_every_n_steps=4",
       "trainer.seed=1"]  # fmt: skip
ADAPTER = [
    "finetune.lora.rank=8",
    "finetune.lora.alpha=16",
    "finetune.lora.targets=[q_proj,v_proj]",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("lora")
    llama = hf_folders.llama(out / "llama")
    chat = out / "chat"
    make_chat(chat, rows=120, val_rows=16)
    return {"out": out, "llama": llama, "chat": chat}


def lora_run(folders: dict[str, Path], *extra: str) -> list[str]:
    return ["model=hf", f"model.path={folders['llama']}", "model.block_size=64",
            "task=language_model", "dataset=chat", f"dataset.root={folders['chat']}",
            *ADAPTER, *SGD, f"trainer.max_steps={STEPS}", *extra]  # fmt: skip


def _ranks(rank: int, world: int, port: int, folders: dict[str, Path]) -> None:
    per_rank = f"trainer.batch_size={GLOBAL_BATCH // 2}"
    with joined_world(rank, world, port) as env:
        for strategy in ("ddp", "fsdp"):
            overrides = lora_run(folders, f"strategy={strategy}", per_rank,
                                 "checkpoint.enabled=false")  # fmt: skip
            train_rank(env, folders["out"] / strategy, *overrides)
        # stopped at KILLED_AT with a checkpoint (adapters alone): resumed on one process
        train_rank(
            env,
            folders["out"] / "stopped",
            *lora_run(
                folders,
                "strategy=ddp",
                per_rank,
                f"trainer.max_steps={KILLED_AT}",
                f"checkpoint.every_n_steps={KILLED_AT}",
            ),
        )


@pytest.fixture(scope="module")
def runs(folders: dict[str, Path]) -> dict[str, Path]:
    out = folders["out"]
    every = f"checkpoint.every_n_steps={KILLED_AT}"
    _single(out / "single", lora_run(folders, f"trainer.batch_size={GLOBAL_BATCH}", every))
    spawn(_ranks, 2, free_port(), folders, nprocs=2)
    return {name: out / name for name in ("single", "ddp", "fsdp")}


def _base(folders: dict[str, Path]) -> dict[str, torch.Tensor]:
    return load_file(folders["llama"] / "model.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_only_the_adapters_train_and_the_answers_loss_falls(
    runs: dict[str, Path], folders: dict[str, Path]
) -> None:
    trained, base = load_weights(runs["single"]), _base(folders)
    adapters = sorted(k for k in trained if k not in base)
    assert adapters == sorted(f"model.layers.{i}.self_attn.{p}_proj.lora_{m}.weight"
                              for i in range(2) for p in "qv" for m in "AB")  # fmt: skip
    assert all(torch.equal(trained[k], base[k]) for k in base)  # bit-identical
    assert all(trained[k].abs().sum() > 0 for k in adapters if "lora_B" in k)  # they trained
    losses = _world_scalars(runs["single"], "val/loss")
    assert len(losses) >= 2 and losses[-1] < losses[0]
    console = (runs["single"] / "logs" / "rank0.log").read_text()
    assert "1,792 of 40,864 parameters train (4.39 %)" in console


def _world_scalars(run_dir: Path, tag: str) -> list[float]:
    found = [f.parent for f in run_dir.rglob("events.out.tfevents.*") if "world" in str(f)]
    events = EventAccumulator(str(found[0]), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.slow  # two training runs
@pytest.mark.timeout(300)
def test_a_lora_checkpoint_holds_the_adapters_alone(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """One step of LoRA and one of a full fine-tune, of a Llama wide enough that its weights,
    not a checkpoint's bookkeeping (its RNG states, one record per tensor), weigh."""
    wide = hf_folders.llama(tmp_path / "wide", hidden_size=256, intermediate_size=1024)
    one_step = [f"model.path={wide}", "trainer.max_steps=1", "checkpoint.every_n_steps=1",
                f"trainer.batch_size={GLOBAL_BATCH}"]  # fmt: skip
    run_here(tmp_path / "lora", *lora_run(folders), *one_step)
    run_here(tmp_path / "full", *lora_run(folders), *one_step, "finetune.lora.rank=0")
    lora, full = (committed_checkpoints(tmp_path / name)[0] for name in ("lora", "full"))
    assert _bytes(lora) < 0.05 * _bytes(full)
    stored = read_checkpoint(lora)["model"]
    assert sorted(stored) == sorted(f"model.layers.{i}.self_attn.{p}_proj.lora_{m}.weight"
                                    for i in range(2) for p in "qv" for m in "AB")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_under_ddp_and_fsdp_equals_one_process(runs: dict[str, Path], strategy: str) -> None:
    assert max_abs_diff(load_weights(runs[strategy]), load_weights(runs["single"])) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stopped_on_two_ranks_and_resumed_on_one_equals_the_uninterrupted_run(
    runs: dict[str, Path], folders: dict[str, Path]
) -> None:
    run_dir = folders["out"] / "resumed"
    shutil.copytree(folders["out"] / "stopped", run_dir)
    assert committed_checkpoints(run_dir)[-1].name == f"step-{KILLED_AT:08d}"
    _, out = run_here(run_dir, *lora_run(folders, f"trainer.batch_size={GLOBAL_BATCH}"))
    assert "resumed from" in out
    assert max_abs_diff(load_weights(run_dir), load_weights(runs["single"])) < 1e-6


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _adapted(run_dir: Path, folders: dict[str, Path]) -> torch.nn.Module:
    """The run's model as it trained: the base folder, its adapters, the run's weights."""
    from dpt.models.lora import add_lora

    model = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    add_lora(model, 8, 16.0, 0.0, ["q_proj", "v_proj"])
    model.load_state_dict(load_weights(run_dir))
    return model.eval()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_merged_and_the_adapter_exports_load_with_the_runs_logits(
    runs: dict[str, Path], folders: dict[str, Path], tmp_path: Path
) -> None:
    expected = _logits(_adapted(runs["single"], folders))
    export.main([str(runs["single"]), "--to", "hf", str(tmp_path / "merged")])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert (_logits(merged) - expected).abs().max() < 1e-5
    # The folder's chat template (and special tokens) exported with the model
    chat = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "046"}]
    source = transformers.AutoTokenizer.from_pretrained(folders["llama"])
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert exported.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(
        chat, tokenize=False
    )
    export.main([str(runs["single"]), "--to", "peft", str(tmp_path / "adapter")])
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {
        "adapter_config.json", "adapter_model.safetensors"}  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    peft = pytest.importorskip("peft")  # here, not at collection: 1.7 s of each pytest worker
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert (_logits(adapted) - expected).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_fine_tuning_guide_runs_from_a_chat_file_to_an_adapter_and_a_frozen_backbone(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """docs/guides/fine-tuning.md's lines, as written, from a folder laid out like a clone."""
    from tests.helpers import run_docs_block

    folder, results = run_docs_block("finetune", tmp_path_factory.mktemp("guide"))
    generated = next(r for c, r in results.items() if c.startswith("dpt-generate"))
    assert generated.returncode == 0 and generated.stdout.strip(), generated.output
    run, base_folder = folder / "outputs" / "lora", folder / "tiny-llama"
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder)
    from dpt.models.lora import add_lora

    add_lora(model, 8, 16.0, 0.0, ["q_proj", "v_proj"])
    model.load_state_dict(torch.load(run / "model_best.pt", weights_only=True))
    expected = _logits(model.eval())
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder / "exported" / "merged")
    assert (_logits(merged.eval()) - expected).abs().max() < 1e-5
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder)
    peft = pytest.importorskip("peft")
    adapted = peft.PeftModel.from_pretrained(base, folder / "exported" / "adapter").eval()
    assert (_logits(adapted) - expected).abs().max() < 1e-5
    frozen, start = load_weights(folder / "outputs" / "frozen"), torch.load(
        folder / "resnet18.pth", weights_only=True)  # fmt: skip
    kept = [k for k in start if k.startswith(("conv1.", "bn1.", "layer1.", "layer2.", "layer3."))
            and k.endswith(("weight", "bias"))]  # fmt: skip
    assert kept and all(torch.equal(frozen[k], start[k]) for k in kept)
    assert not torch.equal(frozen["layer4.0.conv1.weight"], start["layer4.0.conv1.weight"])
