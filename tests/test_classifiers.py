"""model=torchvision: any classification model of torchvision's registry, built in process at
32 px (nothing downloaded), its weights from a local file, its blocks for fsdp and recomputation."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision
from omegaconf import OmegaConf
from torch import nn

from dpt.errors import ConfigError, DptError
from dpt.models import build_model
from dpt.models.blocks import blocks, recompute_in_backward
from dpt.models.classifiers import check_name, classification_models, torchvision_classifier
from tests.helpers import compose, one_thread

IMAGES = (3, 32, 32)
LIST_HINT = (
    'list them with: python -c "import torchvision.models as m; print(m.list_models(module=m))"'
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Batches of 4 at 32 px gain nothing from threads (tests/helpers.one_thread)."""
    with one_thread():
        yield


def _build(name: str, weights: Path | None = None, **options: Any) -> nn.Module:
    path = str(weights) if weights else None
    return torchvision_classifier(IMAGES, 7, name, path, channels_last=False, options=options)


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "efficientnet_b0", "resnet18"])
def test_registry_models_give_logits_and_train(name: str) -> None:
    torch.manual_seed(0)
    model = _build(name)
    inputs, labels = torch.randn(4, *IMAGES), torch.tensor([0, 3, 6, 2])
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        logits = model(inputs)
        assert logits.shape == (4, 7)
        loss = nn.functional.cross_entropy(logits, labels)
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_only_classification_models_are_listed() -> None:
    names = classification_models()
    assert {"resnet18", "efficientnet_b0", "mobilenet_v3_small", "vit_b_16"} <= set(names)
    assert not {"fasterrcnn_resnet50_fpn", "fcn_resnet50", "r3d_18", "raft_small"} & set(names)
    check_name("efficientnet_b0")  # no error


def test_an_unknown_name_is_one_line_with_close_matches() -> None:
    with pytest.raises(ConfigError) as error:
        check_name("efficientnet_b9")
    assert str(error.value) == (
        "model.name=efficientnet_b9: not a torchvision classification model; close matches: "
        "efficientnet_b0, efficientnet_b1, efficientnet_b2, efficientnet_b3, efficientnet_b4"
    )
    with pytest.raises(ConfigError) as error:
        check_name("foo")
    assert (
        str(error.value) == f"model.name=foo: not a torchvision classification model; {LIST_HINT}"
    )
    with pytest.raises(ConfigError) as error:
        check_name("fasterrcnn_resnet50_fpn")
    assert str(error.value) == (
        "model.name=fasterrcnn_resnet50_fpn: a torchvision detection model, not a classification "
        f"model; {LIST_HINT}"
    )
    with pytest.raises(ConfigError, match=r"^model\.name=efficientnet_b9: "):
        _build("efficientnet_b9")  # the builder checks too


def test_vectors_are_refused_in_one_line() -> None:
    with pytest.raises(DptError) as error:
        torchvision_classifier((32,), 7, "efficientnet_b0", None, False, {})
    assert str(error.value) == (
        "model=torchvision (efficientnet_b0) takes images (C, H, W), but the dataset gives inputs "
        "of shape (32,) (use model=mlp for vectors)"
    )


def test_images_a_model_cannot_take_are_refused_at_build() -> None:
    with pytest.raises(DptError) as error:
        _build("vit_b_32")
    assert str(error.value) == (
        "model=torchvision (vit_b_32) does not take the dataset's images of shape (3, 32, 32): "
        "Wrong image height! Expected 224 but got 32! (it is built for 224x224: set "
        "model.options.image_size=32)"
    )
    with pytest.raises(DptError) as error:
        _build("inception_v3")
    assert str(error.value).startswith(
        "model=torchvision (inception_v3) does not take the dataset's images of shape (3, 32, 32): "
    )
    assert str(error.value).endswith(" (larger images may fit)")
    with pytest.raises(DptError) as error:
        torchvision_classifier((1, 32, 32), 7, "resnet18", None, False, {})
    assert str(error.value).endswith(" (torchvision's models take 3-channel images)")


def test_options_reach_the_builder() -> None:
    torch.manual_seed(0)
    vit = _build("vit_b_32", image_size=32)
    assert vit(torch.randn(2, *IMAGES)).shape == (2, 7)
    model = torchvision_classifier(
        IMAGES, 7, "efficientnet_b0", None, False, OmegaConf.create({"dropout": 0.5})
    )
    assert model.classifier[0].p == 0.5
    with pytest.raises(DptError) as error:
        _build("efficientnet_b0", foo=1)
    assert str(error.value) == (
        "model=torchvision (efficientnet_b0): torchvision cannot build it with "
        "model.options={'foo': 1} (EfficientNet.__init__() got an unexpected keyword argument "
        "'foo')"
    )
    with pytest.raises(ConfigError) as error:
        _build("efficientnet_b0", num_classes=3)
    assert str(error.value) == (
        "model.options.num_classes: not an option of model=torchvision (set from the dataset)"
    )


def test_auxiliary_heads_are_off_so_training_gives_logits() -> None:
    torch.manual_seed(0)
    model = torchvision_classifier((3, 64, 64), 7, "googlenet", None, False, {})
    assert model.training
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)


def test_channels_last() -> None:
    model = torchvision_classifier(IMAGES, 7, "mobilenet_v3_small", None, True, {})
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_local_weights_load_except_a_head_of_another_size(tmp_path: Path) -> None:
    torch.manual_seed(1)
    imagenet = torchvision.models.efficientnet_b0(weights=None)  # 1000 classes
    path = tmp_path / "efficientnet_b0.pt"
    torch.save(imagenet.state_dict(), path)
    torch.manual_seed(2)
    fresh = _build("efficientnet_b0")
    torch.manual_seed(2)
    model = _build("efficientnet_b0", weights=path)
    assert torch.equal(model.features[0][0].weight, imagenet.features[0][0].weight)
    assert torch.equal(model.classifier[1].weight, fresh.classifier[1].weight)  # left fresh
    assert model.classifier[1].weight.shape == (7, 1280)
    # A training checkpoint's {"model": ...} wrapper, and a file without the head at all.
    backbone = {k: v for k, v in imagenet.state_dict().items() if not k.startswith("classifier")}
    torch.save({"model": backbone, "step": torch.tensor(3)}, path)
    model = _build("efficientnet_b0", weights=path)
    assert torch.equal(model.features[0][0].weight, imagenet.features[0][0].weight)


def test_a_head_with_a_class_dimension_of_the_file_loads_it(tmp_path: Path) -> None:
    """The same number of classes: the head is loaded too (nothing is left fresh)."""
    torch.manual_seed(1)
    seven = torchvision.models.mobilenet_v3_small(weights=None, num_classes=7)
    torch.save(seven.state_dict(), tmp_path / "seven.pt")
    model = _build("mobilenet_v3_small", weights=tmp_path / "seven.pt")
    assert torch.equal(model.classifier[3].weight, seven.classifier[3].weight)


def test_weights_that_do_not_fit_are_one_line(tmp_path: Path) -> None:
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), tmp_path / "resnet18.pt")
    own = _build("efficientnet_b0").state_dict()
    with pytest.raises(DptError) as error:
        _build("efficientnet_b0", weights=tmp_path / "resnet18.pt")
    # Everything but the head, which a file may leave out.
    assert str(error.value) == (
        f"model.weights={tmp_path / 'resnet18.pt'}: does not fit model=torchvision "
        f"(efficientnet_b0) ({len(own) - 2} tensors missing or of another shape, e.g. "
        "features.0.0.weight)"
    )
    with pytest.raises(DptError) as error:
        _build("efficientnet_b0", weights=tmp_path / "nope.pt")
    assert str(error.value) == f"model.weights={tmp_path / 'nope.pt'}: file not found"
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(DptError) as error:
        _build("efficientnet_b0", weights=tmp_path / "list.pt")
    assert str(error.value) == (
        f"model.weights={tmp_path / 'list.pt'}: not a state_dict (a dict of tensors)"
    )


def test_a_mis_shaped_backbone_tensor_is_not_taken_for_the_head(tmp_path: Path) -> None:
    state = torchvision.models.mobilenet_v3_small(weights=None, num_classes=7).state_dict()
    state["features.0.0.weight"] = torch.zeros(7, 3, 5, 5)  # first dimension 7, but not a head
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(DptError, match=r"\(1 tensors missing or of another shape, e.g. features"):
        _build("mobilenet_v3_small", weights=tmp_path / "bad.pt")


def test_the_composed_config_builds() -> None:
    cfg = compose(
        "model=torchvision", "model.name=efficientnet_b0", "dataset=fake_images",
        "dataset.image_size=32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg.model, IMAGES, 10)
    assert model(torch.randn(2, *IMAGES)).shape == (2, 10)


def test_a_resnet_through_the_registry_has_its_residual_blocks() -> None:
    model = _build("resnet18")
    found = blocks(model)
    assert len(found) == 8
    assert all(isinstance(b, torchvision.models.resnet.BasicBlock) for b in found)


# One small model of each family whose blocks dpt knows, with the options that make it take
# 32 px images; the class of the blocks and their number.
FAMILIES: dict[str, tuple[dict[str, Any], str, int]] = {
    "resnet18": ({}, "BasicBlock", 8),
    "mobilenet_v2": ({}, "InvertedResidual", 17),
    "mobilenet_v3_small": ({}, "InvertedResidual", 11),
    "efficientnet_b0": ({}, "MBConv", 16),
    "efficientnet_v2_s": ({}, "FusedMBConv", 10),  # and 30 MBConvs
    "convnext_tiny": ({}, "CNBlock", 18),
    "regnet_y_400mf": ({}, "ResBottleneckBlock", 16),
    "mnasnet0_5": ({}, "_InvertedResidual", 16),
    "swin_t": ({}, "SwinTransformerBlock", 12),
    "swin_v2_t": ({}, "SwinTransformerBlockV2", 12),
    "vit_b_32": ({"image_size": 32}, "EncoderBlock", 12),
}


def _gradients(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(5)  # the same stochastic depth and dropout draws for both models
    nn.functional.cross_entropy(model(inputs), labels).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.slow  # a torchvision model's backward twice: seconds each
@pytest.mark.parametrize("name", list(FAMILIES))
def test_activation_checkpointing_of_known_blocks_gives_the_same_gradients(name: str) -> None:
    options, kind, count = FAMILIES[name]
    torch.manual_seed(0)
    plain = _build(name, **options)
    found = blocks(plain)
    assert sum(type(b).__name__ == kind for b in found) == count
    recomputed = copy.deepcopy(plain)
    recompute_in_backward(recomputed)
    wrapped = blocks(recomputed)
    assert len(wrapped) == len(found)
    assert all(hasattr(b, "_checkpoint_wrapped_module") for b in wrapped)
    inputs, labels = torch.randn(4, *IMAGES), torch.tensor([0, 3, 6, 2])
    expected = _gradients(plain, inputs, labels)
    got = _gradients(recomputed, inputs, labels)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # BatchNorm's running statistics counted one batch, not two (the recomputation's).
    for a, b in zip(plain.buffers(), recomputed.buffers(), strict=True):
        torch.testing.assert_close(b, a)
    assert recomputed.state_dict().keys() == plain.state_dict().keys()


def test_a_family_without_known_blocks_has_none() -> None:
    assert blocks(_build("squeezenet1_1")) == []
    assert blocks(_build("shufflenet_v2_x0_5")) == []  # its blocks' outputs are views
