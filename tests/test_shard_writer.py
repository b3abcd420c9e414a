"""`dpt-shards`: WebDataset shards of an image folder or a COCO set, byte for byte the same from
the same input (dpt/data/shard_writer.py)."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest

from scripts.make_coco_fixture import make_fixture
from tests.helpers import write_shards


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    make_fixture(root)
    return root


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_the_same_coco_set_gives_the_same_bytes(coco: Path, tmp_path: Path) -> None:
    for out in ("a", "b"):
        write_shards("--coco", str(coco), "--out", str(tmp_path / out), "--shard-size-mb", "0.05")
    first, second = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    assert first == second
    assert len([name for name in first if name.endswith(".tar")]) > 2  # several shards a split


def test_the_index_lists_shards_samples_and_classes(coco: Path, tmp_path: Path) -> None:
    write_shards("--coco", str(coco), "--out", str(tmp_path), "--shard-size-mb", "0.05")
    index = json.loads((tmp_path / "index.json").read_text())
    assert set(index["splits"]) == {"train2017", "val2017"}
    train = json.loads((tmp_path / index["splits"]["train2017"]).read_text())
    assert train["__kind__"] == "wids-shard-index-v1" and train["classes"] == index["classes"]
    for shard in train["shardlist"]:
        path = tmp_path / shard["url"]
        assert path.stat().st_size == shard["filesize"]
        assert hashlib.md5(path.read_bytes()).hexdigest() == shard["md5sum"]
        with tarfile.open(path) as tar:
            names = tar.getnames()
        keys = sorted({name.split(".", 1)[0] for name in names})
        assert len(keys) == shard["nsamples"] and len(names) == 2 * len(keys)


def test_an_image_folder_keeps_its_labels(tmp_path: Path, coco: Path) -> None:
    image = next((coco / "train2017").glob("*.jpg"))
    for split, cls in (("train", "cat"), ("train", "dog"), ("val", "cat"), ("val", "dog")):
        (tmp_path / "in" / split / cls).mkdir(parents=True)
        (tmp_path / "in" / split / cls / "a.jpg").write_bytes(image.read_bytes())
    write_shards("--image-folder", str(tmp_path / "in"), "--out", str(tmp_path / "out"))
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["classes"] == ["cat", "dog"] and set(index["splits"]) == {"train", "val"}
    with tarfile.open(tmp_path / "out" / "train-000000.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert members == {
        "00000000.jpg": image.read_bytes(), "00000000.cls": b"0",
        "00000001.jpg": image.read_bytes(), "00000001.cls": b"1",
    }  # fmt: skip
