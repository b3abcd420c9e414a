"""strategy.tensor_parallel trained for real against one process on the same global batch (SGD
at a small rate): tp = 2 for dpt's GPT and a tiny Llama-shaped transformers model, their loss on
logits split over the vocabulary (each rank its slice: torch's loss_parallel); fsdp 2 x tp 2, ddp
2 x tp 2 (the replicas' means in buckets, overlapped with the last of the accumulated backwards)
and pipeline 2 x tp 2 on 4 ranks (with clipping by the global norm; the tiny Llama's stages too);
bf16 with recomputation under tp = 2. A run stopped under fsdp 2 x tp 2 resumes on tp = 2 alone
and on one process with the uninterrupted weights; validation counts each sample once; a rank's
parameters, gradients and optimizer state (TensorBoard's memory/*) are half of one process's but
for what each rank holds whole (the norms).

The runs share the resident worlds (tests/worlds.py: 4 ranks, then 2) and run through the
rank's own run function (`dpt.loop.train.train`); the one-process runs run in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.config.build import build
from dpt.config.models import HFModelConfig
from dpt.config.tensor_parallel import check_tensor_parallel
from dpt.errors import DptError
from tests import hf_folders
from tests.helpers import (
    committed_checkpoints,
    compose,
    dpt_logger_kept,
    free_port,
    joined_world,
    load_weights,
    max_abs_diff,
    run_here,
    spawn,
    train_rank,
)

# Steps of a run; a checkpoint every EVERY: the stopped run's newest is at STEPS.
STEPS, EVERY, GLOBAL_BATCH = 6, 3, 16
SGD = ["optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0",
       "trainer.log_every_n_steps=3"]  # fmt: skip
LINES = "".join(f"{a}+{b}={a + b}\n" for a in range(40) for b in range(40))
OFF = ["checkpoint.enabled=false"]
CLIP = ["trainer.grad_clip_norm=0.3"]
TP2 = ["strategy.tensor_parallel=2"]
# bf16 with each block recomputed in backward
BF16 = ["trainer.precision=bf16-mixed", "model.activation_checkpointing=true"]


def gpt(out: Path) -> list[str]:
    return ["model=gpt", "task=language_model", "model.block_size=16", "model.n_layer=2",
            "model.n_head=2", "model.n_embd=32", "dataset=text", f"dataset.root={out / 'text'}",
            f"dataset.cache_dir={out / 'cache'}", f"trainer.max_steps={STEPS}"]  # fmt: skip


def llama(out: Path) -> list[str]:
    """The tiny Llama (4 heads, 2 key-value heads, MLP 64), with momentum: optimizer state."""
    return ["model=hf", f"model.path={out / 'llama'}", "model.block_size=16",
            "task=language_model", "dataset=text", f"dataset.root={out / 'text'}",
            f"dataset.cache_dir={out / 'cache'}", f"trainer.max_steps={STEPS}",
            "optimizer.momentum=0.9"]  # fmt: skip


def batch(per_replica: int) -> str:
    return f"trainer.batch_size={per_replica}"


def _world_runs(out: Path, world: int) -> dict[str, list[str]]:
    if world == 4:
        return {
            "gpt-pp2-tp2": [
                *gpt(out),
                *OFF,
                "strategy=pipeline",
                *TP2,
                *CLIP,
                batch(GLOBAL_BATCH),
            ],
            # a transformers decoder's stages, each running the model's own forward
            "llama-pp2-tp2": [*llama(out), *OFF, "strategy=pipeline", *TP2, batch(GLOBAL_BATCH)],
            # fsdp 2 x tp 2, stopped by max_steps (STEPS) with a checkpoint: checked against
            # one process (its checkpoints change no weight), and what the resumed runs start from
            "gpt-fsdp2-tp2": [*fsdp_tp(out), f"checkpoint.every_n_steps={EVERY}"],
            # ddp 2 x tp 2: the replicas' means in buckets of 10 kB (several), all-reduced in
            # the last of 2 accumulated backwards
            "gpt-ddp2-tp2": [
                *gpt(out),
                *OFF,
                "strategy=ddp",
                *TP2,
                "strategy.bucket_cap_mb=0.01",
                batch(GLOBAL_BATCH // 4),
                "trainer.grad_accum_steps=2",
                *CLIP,
            ],
        }
    ddp = ["strategy=ddp", *TP2, batch(GLOBAL_BATCH)]
    return {
        "llama-tp2": [*llama(out), *OFF, *ddp],
        "gpt-tp2": [*gpt(out), *OFF, *ddp],
        "gpt-tp2-bf16": [*gpt(out), *OFF, *ddp, *BF16],
        # the stopped fsdp 2 x tp 2 run's checkpoint, on 2 ranks: tensor parallel alone
        "resumed-on-tp2": [*resumed(out), "strategy=ddp", *TP2, batch(GLOBAL_BATCH)],
    }


def fsdp_tp(out: Path) -> list[str]:
    """fsdp 2 x tp 2 on 4 ranks, clipped by the global norm."""
    return [*gpt(out), "strategy=fsdp", *TP2, batch(GLOBAL_BATCH // 2), *CLIP]


def resumed(out: Path) -> list[str]:
    """The stopped run's config, EVERY steps past its newest checkpoint (`end`)."""
    return [*gpt(out), *CLIP, f"trainer.max_steps={(out / 'end').read_text()}",
            f"checkpoint.every_n_steps={EVERY}", "checkpoint.strict=true"]  # fmt: skip


def _resume_the_stopped_run(out: Path) -> None:
    """The fsdp 2 x tp 2 run stopped at step STEPS, copied for the resumed runs (a kill is no
    part of this: tests/test_faults.py kills ranks)."""
    newest = int(committed_checkpoints(out / "gpt-fsdp2-tp2")[-1].name.removeprefix("step-"))
    assert newest == STEPS
    (out / "end").write_text(str(newest + EVERY))
    for name in ("resumed-on-tp2", "resumed-on-1"):
        shutil.copytree(out / "gpt-fsdp2-tp2", out / name)


def _ranks(rank: int, world: int, port: int, out: Path) -> None:
    with joined_world(rank, world, port) as env:
        for name, overrides in _world_runs(out, world).items():
            train_rank(env, out / name, *SGD, *overrides)
        if world == 2:
            _logits_layout(env.rank, out / f"logits-{env.rank}.json")


def _logits_layout(rank: int, found: Path) -> None:
    """dpt's GPT split over the 2 ranks with split logits: what its head gives in training and
    in evaluation, and the loss on the split (under loss_parallel) against the whole logits'."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from dpt.models.gpt import GPT
    from dpt.models.tensor_plans import parallelize

    torch.manual_seed(0)
    model = GPT(num_outputs=64, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0,
                bias=True)  # fmt: skip
    parallelize(model, init_device_mesh("cpu", (2,)), split_logits=True)
    ids, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    split = model.train()(ids)
    with loss_parallel():
        loss = F.cross_entropy(split.flatten(0, 1), targets.flatten())
        loss.backward()
    whole = model.eval()(ids)
    found.write_text(json.dumps({
        "train": [type(split).__name__, str(split.placements), list(split.to_local().shape)],
        "eval": [type(whole).__name__, list(whole.shape)],
        "loss_difference": abs(loss.full_tensor().item()
                               - F.cross_entropy(whole.flatten(0, 1), targets.flatten()).item()),
        "head_gradient": isinstance(model.lm_head.weight.grad, DTensor),
    }))  # fmt: skip


def _single(run_dir: Path, *overrides: str) -> dict:
    return run_here(run_dir, *SGD, *overrides)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    (out / "text").mkdir()
    (out / "text" / "lines.txt").write_text(LINES)
    hf_folders.llama(out / "llama")
    spawn(_ranks, 4, free_port(), out, nprocs=4)
    _resume_the_stopped_run(out)
    spawn(_ranks, 2, free_port(), out, nprocs=2)
    return out


@pytest.fixture(scope="module")
def single(runs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted one-process runs on the same global batch."""
    out = tmp_path_factory.mktemp("single")
    whole = batch(GLOBAL_BATCH)
    _single(out / "gpt", *gpt(runs), *OFF, whole)
    _single(out / "gpt-clip", *gpt(runs), *OFF, whole, *CLIP)
    _single(out / "llama", *llama(runs), *OFF, whole)
    _single(out / "gpt-bf16", *gpt(runs), *OFF, whole, *BF16)
    _single(out / "uninterrupted", *resumed(runs), *OFF, whole)
    _single(runs / "resumed-on-1", *resumed(runs), whole)
    return {path.name: path for path in out.iterdir()}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("run", "reference"),
    [
        ("gpt-tp2", "gpt"),
        ("llama-tp2", "llama"),
        ("gpt-fsdp2-tp2", "gpt-clip"),
        ("gpt-ddp2-tp2", "gpt-clip"),
        ("gpt-pp2-tp2", "gpt-clip"),
        ("llama-pp2-tp2", "llama"),
    ],
)
def test_split_layers_train_as_one_process(
    runs: Path, single: dict[str, Path], run: str, reference: str
) -> None:
    assert max_abs_diff(load_weights(runs / run), load_weights(single[reference])) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_rank_holds_its_slice_of_the_logits_in_training_and_the_whole_in_evaluation(
    runs: Path,
) -> None:
    """The loss computes on the vocabulary's slices (loss_parallel): no rank holds the whole
    logits in training; validation gets them whole; the split loss is the whole logits' loss."""
    for rank in (0, 1):
        found = json.loads((runs / f"logits-{rank}.json").read_text())
        assert found["train"] == ["DTensor", "(Shard(dim=2),)", [2, 8, 32]]
        assert found["eval"] == ["Tensor", [2, 8, 64]]
        assert found["loss_difference"] < 1e-6 and found["head_gradient"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_and_recomputation_under_tensor_parallelism(
    runs: Path, single: dict[str, Path]
) -> None:
    split = load_weights(runs / "gpt-tp2-bf16")
    # bf16 rounds the split products' partial sums otherwise: close, not equal
    assert max_abs_diff(split, load_weights(single["gpt-bf16"])) < 1e-3
    assert max_abs_diff(split, load_weights(single["gpt"])) > 1e-5  # bf16 did compute


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("resumed", ["resumed-on-tp2", "resumed-on-1"])
def test_stopped_under_fsdp_and_tp_resumes_on_other_degrees(
    runs: Path, single: dict[str, Path], resumed: str
) -> None:
    """Stopped after step STEPS under fsdp 2 x tp 2 (its checkpoints: DCP's slices of every
    tensor), resumed from its newest checkpoint on 2 ranks of tensor parallelism alone, and on
    one process, to EVERY steps past it: the weights of one process that never stopped."""
    end = int((runs / "end").read_text())
    assert json.loads((runs / resumed / "metrics.json").read_text())["steps"] == end
    weights = load_weights(runs / resumed)
    assert max_abs_diff(weights, load_weights(single["uninterrupted"])) < 1e-6


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", ["gpt-tp2", "gpt-fsdp2-tp2", "gpt-pp2-tp2"])
def test_validation_counts_each_sample_once(runs: Path, single: dict[str, Path], run: str) -> None:
    val = json.loads((runs / run / "metrics.json").read_text())["val"]
    reference = "gpt" if run == "gpt-tp2" else "gpt-clip"
    expected = json.loads((single[reference] / "metrics.json").read_text())["val"]
    assert val["val/samples"] == expected["val/samples"]
    assert val["val/loss"] == pytest.approx(expected["val/loss"], abs=1e-5)
    best = torch.load(runs / run / "model_best.pt", weights_only=True)
    assert max_abs_diff(best, load_weights(runs / run)) == 0  # one validation: the last


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_rank_says_where_it_stands_in_the_mesh(runs: Path) -> None:
    """Ranks are laid out tensor innermost: rank 3 of 4 is the second part of the second
    replica (fsdp), or of the second stage (pipeline)."""
    fsdp = (runs / "gpt-fsdp2-tp2" / "logs" / "rank3.log").read_text()
    assert "strategy=fsdp | layers split over 2 ranks (part 2), replica 2 of 2 |" in fsdp
    pipeline = (runs / "gpt-pp2-tp2" / "logs" / "rank3.log").read_text()
    assert (
        "strategy=pipeline | stage 2 of 2 (h.1-head), layers split over 2 ranks (part 2), "
        "replica 1 of 1 |"
    ) in pipeline


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dpt_export_writes_the_whole_model_of_a_split_run(runs: Path, tmp_path: Path) -> None:
    """The fsdp 2 x tp 2 run's model.pt (its slices gathered) exported as GPT-2: transformers'
    logits are dpt's GPT's with those weights."""
    from transformers import GPT2LMHeadModel

    from dpt.commands import export
    from dpt.models.gpt import GPT

    with dpt_logger_kept():
        export.main([str(runs / "gpt-fsdp2-tp2"), "--to", "hf", str(tmp_path / "hf"), "--last"])
    gpt2 = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = GPT(256, 16, 2, 2, 32, dropout=0.0, bias=True).eval()
    ours.load_state_dict(load_weights(runs / "gpt-fsdp2-tp2"))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (gpt2(tokens).logits - ours(tokens)).abs().max() < 1e-5


def _memory(run: Path, folder: str) -> dict[str, float]:
    acc = EventAccumulator(str(run / "tb" / folder))
    acc.Reload()
    return {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]
            if tag.startswith("memory/")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_each_rank_holds_half_of_the_split_layers(runs: Path, single: dict[str, Path]) -> None:
    """Parameters, gradients and momentum per rank at tp = 2: half of one process's, but for
    the norms' weights, which each rank holds whole (sequence parallelism)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs / "llama")
    whole_mb = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    norms_mb = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n) / 2**20
    one = _memory(single["llama"], "rank0")
    assert one["memory/params_mb"] == pytest.approx(whole_mb, rel=1e-6)
    for rank in ("rank0", "rank1"):
        split = _memory(runs / "llama-tp2", rank)
        for tag in ("memory/params_mb", "memory/grads_mb", "memory/optimizer_mb"):
            assert split[tag] == pytest.approx((one[tag] - norms_mb) / 2 + norms_mb, rel=1e-6)
        # The start line counts the whole model, and the rank's own share of it
        whole, held = (sum(p.numel() for p in model.parameters()),
                       round(split["memory/params_mb"] * 2**20 / 4))  # fmt: skip
        log = (runs / "llama-tp2" / "logs" / f"{rank}.log").read_text()
        assert (f"{whole:,} of {whole:,} parameters train; {held:,} of them on this rank "
                "(strategy.tensor_parallel=2)") in log  # fmt: skip


# One line each, before any rank starts: on the model the launcher builds on the meta device
# (dpt.launch.preflight; the catalogue runs dpt's own models' lines).


def build_strategy(degree: str) -> Any:
    return build(compose("strategy=ddp", degree).strategy)


def _meta_hf(kind: str, **config: object) -> torch.nn.Module:
    """A tiny model of `kind` on the meta device, as the launcher builds it."""
    from dpt.models.hf import build_auto
    from scripts.family_table import tiny_config

    with torch.device("meta"):
        return build_auto("AutoModelForCausalLM", tiny_config(kind, num_hidden_layers=1, **config))


@pytest.mark.parametrize(
    ("kind", "config", "degree", "message"),
    [
        ("llama", {"intermediate_size": 65}, 2, "does not divide intermediate_size=65"),
        ("llama", {}, 4, "does not divide num_key_value_heads=2"),
        ("gpt2", {}, 2, "model=hf of model_type=gpt2 projects its attention's queries, keys and "
                        "values in one layer (c_attn), which dpt's plan does not split by heads; "
                        "train it with strategy=fsdp or strategy=ddp"),
        ("gpt_neox", {}, 2, "model=hf of model_type=gpt_neox projects its attention's queries, "
                            "keys and values in one layer (query_key_value)"),
        ("bert", {}, 2, "model=hf of model_type=bert is not a decoder-only language model "
                        "whose attention projects queries, keys and values apart, which dpt's "
                        "plans split; train it with strategy=fsdp or strategy=ddp"),
        ("opt", {"ffn_dim": 65}, 2, "does not divide ffn_dim=65"),
    ],
)  # fmt: skip
def test_a_model_that_does_not_split_is_one_line(
    kind: str, config: dict, degree: int, message: str
) -> None:
    with pytest.raises(DptError) as error:
        build_strategy(f"strategy.tensor_parallel={degree}").check(_meta_hf(kind, **config))
    assert message in str(error.value)
    assert str(error.value).startswith(f"strategy.tensor_parallel={degree}")
    assert "\n" not in str(error.value)


def test_a_llama_that_splits_passes_and_a_config_defers_to_the_model() -> None:
    build_strategy("strategy.tensor_parallel=2").check(_meta_hf("llama"))
    build_strategy("strategy.tensor_parallel=2").check(_meta_hf("opt"))  # split by structure
    # The config alone says nothing of a transformers model (its family does, on the model)
    check_tensor_parallel(OmegaConf.structured(HFModelConfig), 2)  # type: ignore[arg-type]
