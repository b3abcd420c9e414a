"""Fine-tuning recipes on what a run trains: a frozen ResNet-18 backbone from local weights with
a fresh head, learning rates per group of parameters (optimizer.groups, optimizer.layer_decay),
and the start line's count of the parameters that train. LoRA on a chat file is
tests/test_lora_runs.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dpt.distributed import DistEnv
from dpt.errors import DptError
from dpt.launch import preflight
from dpt.loop.param_groups import param_groups
from dpt.models.gpt import GPT
from tests.helpers import build_trainer, compose, load_weights, run_here

RESNET = ["model=resnet18", "dataset=fake_images", "dataset.num_samples=32",
          "dataset.num_val_samples=8", "dataset.image_size=32", "dataset.num_classes=4",
          "dataset.num_workers=0", "trainer.batch_size=8", "trainer.max_steps=4",
          "trainer.log_every_n_steps=2", "optimizer=sgd", "optimizer.lr=0.1",
          "checkpoint.enabled=false"]  # fmt: skip
CPU1 = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
BACKBONE = "[conv1,bn1,layer1,layer2,layer3,layer4]"


@pytest.fixture(scope="module")
def imagenet_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ResNet-18's weights as a local file, in torchvision's layout with its 1000-class head."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    return path


def _scalars(run_dir: Path, tag: str) -> list[float]:
    found = [f.parent for f in run_dir.rglob("events.out.tfevents.*") if "rank0" in str(f)]
    events = EventAccumulator(str(found[0]), size_guidance={"scalars": 0})
    events.Reload()
    return [e.value for e in events.Scalars(tag)]


@pytest.mark.slow  # a ResNet's training run
@pytest.mark.timeout(300)
def test_a_frozen_backbone_keeps_its_weights_and_a_fresh_head_trains(
    imagenet_weights: Path, tmp_path: Path
) -> None:
    run = tmp_path / "frozen"
    _, out = run_here(run, *RESNET, f"model.weights={imagenet_weights}",
                      f"finetune.freeze={BACKBONE}")  # fmt: skip
    trained, start = load_weights(run), torch.load(imagenet_weights, weights_only=True)
    statistics = ("running_mean", "running_var", "num_batches_tracked")
    backbone = [k for k in start if not k.startswith("fc.") and not k.endswith(statistics)]
    assert len(backbone) == 60  # every convolution and BatchNorm weight and bias
    assert all(torch.equal(trained[k], start[k]) for k in backbone)
    assert trained["fc.weight"].shape == (4, 512)  # the data's head, fresh, and trained
    assert "2,052 of 11,178,564 parameters train (0.0184 %)" in out


@pytest.mark.slow  # a ResNet's training run
@pytest.mark.timeout(300)
def test_a_group_at_a_tenth_trains_the_backbone_at_a_tenth_of_the_heads_lr(
    imagenet_weights: Path, tmp_path: Path
) -> None:
    groups = "optimizer.groups=[{match: fc, lr_scale: 1},{match: '*', lr_scale: 0.1}]"
    run = tmp_path / "groups"
    overrides = [*RESNET, f"model.weights={imagenet_weights}", groups]
    trainer = build_trainer(tmp_path / "built", CPU1, *overrides)
    lrs = {g["name"]: g["lr"] for g in trainer.parts.optimizer.param_groups}
    assert lrs == {"fc": 0.1, "*": pytest.approx(0.01)}
    groups_made = trainer.parts.optimizer.param_groups
    sizes = {g["name"]: sum(p.numel() for p in g["params"]) for g in groups_made}
    assert sizes == {"fc": 2052, "*": 11_176_512}
    run_here(run, *overrides)
    head, backbone = _scalars(run, "optim/lr/fc"), _scalars(run, "optim/lr/*")
    assert head == pytest.approx([0.1, 0.1]) and backbone == pytest.approx([0.01, 0.01])


def test_layer_decay_gives_each_gpt_block_its_share_of_the_lr() -> None:
    torch.manual_seed(0)
    model = GPT(num_outputs=64, block_size=8, n_layer=3, n_head=2, n_embd=16, dropout=0.0,
                bias=True)  # fmt: skip
    groups = param_groups(model, [], 0.5, 1.0)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert lr_of[id(named["wte.weight"])] == 0.5**4  # embeddings: below the first block
    assert lr_of[id(named["h.0.attn.q_proj.weight"])] == 0.5**3
    assert lr_of[id(named["h.2.mlp.fc.weight"])] == 0.5**1
    assert lr_of[id(named["ln_f.weight"])] == 1.0  # after the last block: the head's
    assert sorted(g["name"] for g in groups) == ["default@0", "default@1", "default@2",
                                                 "default@3", "default@4"]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["finetune.freeze=[conv1,bn1,layer1,layer2,layer3,layer4,fc]"],
            "finetune.freeze=[conv1, bn1, layer1, layer2, layer3, layer4, fc] leaves no parameter "
            "to train",
        ),
        (
            ["optimizer.groups=[{match: backbone, lr_scale: 0.1}]"],
            "optimizer.groups: match 'backbone' matches no parameter of the model (its modules: "
            "bn1, conv1, fc, layer1, layer2, layer3, layer4)",
        ),
    ],
)
def test_patterns_that_leave_nothing_or_match_nothing_are_one_line(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(DptError) as error:
        preflight.check(compose(*RESNET, *overrides))
    assert str(error.value) == message
