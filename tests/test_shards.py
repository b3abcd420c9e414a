"""`dataset=shards` in process: the order's purity and locality, samples equal to the files they
were written from, and a shard that cannot be had under each bad-data policy."""

from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from dpt.data.coco import CocoClassification
from dpt.data.crop_decode import RandomResizedCropDecode
from dpt.data.loaders import MISSING
from dpt.data.shard_fetch import ShardUnavailable
from dpt.data.shards import ShardOrder, ShardsData
from dpt.errors import ConfigError, DptError
from scripts.make_coco_fixture import make_fixture
from tests.helpers import write_shards
from tests.http_server import serve


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    make_fixture(root)
    return root


@pytest.fixture(scope="module")
def written(coco: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    write_shards("--coco", str(coco), "--out", str(out), "--shard-size-mb", "0.02")
    return out


def _data(root: Path | str, tmp_path: Path, **options: object) -> ShardsData:
    settings: dict[str, object] = {
        "image_size": 32, "num_workers": 0, "on_bad_image": "skip", "shuffle_window": 8,
        "cache_dir": str(tmp_path / "cache"), "cache_limit_gb": 1.0, "retries": 0,
        "outage_s": 0.0, "max_skipped_fraction": 1.0, "timeout_s": 5.0, "seed": 0,
    }  # fmt: skip
    settings.update(options)
    return ShardsData(root=str(root), **settings)  # type: ignore[arg-type]


def test_the_order_is_a_permutation_drawn_from_seed_and_epoch_alone() -> None:
    order = ShardOrder([5, 3, 7, 2], window=4)
    first = order(seed=1, epoch=0)
    assert sorted(first) == list(range(17))
    assert order(seed=1, epoch=0) == first  # a pure function: every rank, every resume
    assert ShardOrder([5, 3, 7, 2], window=4)(1, 0) == first
    assert order(seed=1, epoch=1) != first and order(seed=2, epoch=0) != first


def test_a_window_spans_few_shards_so_a_rank_reads_few_at_a_time() -> None:
    counts = [100] * 40
    order = ShardOrder(counts, window=64)(seed=0, epoch=3)
    for start in range(0, len(order), 64):
        shards = {index // 100 for index in order[start : start + 64]}
        assert len(shards) <= 2, (start, shards)
    # The shards come in a seeded order, not in the written one.
    firsts = [order[start] // 100 for start in range(0, len(order), 100)]
    assert firsts != sorted(firsts)


def test_window_one_keeps_each_shard_in_order_and_a_whole_window_shuffles_everything() -> None:
    order = ShardOrder([3, 3], window=1)(seed=0, epoch=0)
    assert order in ([0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2])
    everything = ShardOrder([50, 50], window=100)(seed=0, epoch=0)
    assert everything[:50] != sorted(everything[:50])


def test_samples_equal_the_files_they_were_written_from(
    coco: Path, written: Path, tmp_path: Path
) -> None:
    data = _data(written, tmp_path)
    files = CocoClassification(coco, "train2017")
    readable = [(p, label) for p, label in files.samples if Path(p).exists()]
    assert len(data.train) == len(readable) == 29
    assert data.classes == files.classes and data.num_classes == 5
    assert data.val is not None and len(data.val) == 13
    decode = RandomResizedCropDecode(32)
    for index, (path, label) in enumerate(readable):
        shard, k = data.train.locate(index)
        samples = data.train._samples(shard)
        assert samples is not None
        sample = samples[k]
        assert int(sample[".cls"].getvalue()) == label
        assert sample[".jpg"].getvalue() == Path(path).read_bytes()
        torch.manual_seed(index)
        item = data.train[index]
        torch.manual_seed(index)
        if item is None:  # the fixture's truncated JPEG, skipped like its file
            assert path.endswith("000000000109.jpg")
            continue
        assert item[1] == label
        assert torch.equal(item[0], decode(bytearray(Path(path).read_bytes()), path))


def test_a_missing_shard_is_skipped_once_said_and_counted(
    written: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    for file in written.iterdir():
        (root / file.name).symlink_to(file)
    (root / "train2017-000001.tar").unlink()
    data = _data(root, tmp_path)
    lost = [i for i in range(len(data.train)) if data.train.locate(i)[0] == 1]
    with caplog.at_level(logging.WARNING, logger="dpt"):
        assert all(data.train[i] is MISSING for i in lost)  # missing, not an unreadable image
    said = [r.getMessage() for r in caplog.records if "train2017-000001.tar" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"skipping shard {root}/train2017-000001.tar")
    assert said[0].endswith(f"(its {len(lost)} samples)")
    assert data.train[0 if 0 not in lost else lost[-1] + 1] is not None


def test_a_truncated_shard_stops_the_run_naming_it_under_on_bad_image_error(
    written: Path, tmp_path: Path
) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    for file in written.iterdir():
        (root / file.name).write_bytes(file.read_bytes())
    cut = root / "train2017-000002.tar"
    cut.write_bytes(cut.read_bytes()[:1000])
    data = _data(root, tmp_path, on_bad_image="error")
    first = next(i for i in range(len(data.train)) if data.train.locate(i)[0] == 2)
    with pytest.raises(ShardUnavailable) as raised:
        data.train[first]
    assert str(raised.value) == f"shard {cut}: truncated: 1,000 bytes of 30,720 the index lists"


def test_a_folder_without_an_index_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(DptError, match=r"index\.json"):
        _data(tmp_path, tmp_path)


def test_a_cache_smaller_than_a_shard_is_refused_before_training(
    written: Path, tmp_path: Path
) -> None:
    with serve(written) as server, pytest.raises(ConfigError) as raised:
        _data(server.url, tmp_path, cache_limit_gb=0.00001)
    assert str(raised.value) == (
        f"dataset.cache_limit_gb=1e-05 is smaller than shard {server.url}/train2017-000000.tar "
        "(3.07e-05 GB); raise it (to a few shards at least)"
    )
    assert [path for path in server.requests if path.endswith(".tar")] == []  # nothing fetched


def test_over_http_the_samples_are_the_local_ones(written: Path, tmp_path: Path) -> None:
    local = _data(written, tmp_path)
    with serve(written) as server:
        remote = _data(server.url, tmp_path)
        for index in range(len(local.train)):
            torch.manual_seed(index)
            here = local.train[index]
            torch.manual_seed(index)
            there = remote.train[index]
            assert (here is None) == (there is None)
            if here is not None and there is not None:
                assert torch.equal(here[0], there[0]) and here[1] == there[1]
    assert remote.train._cache is not None
    assert remote.train._cache.stats.misses == 5  # each training shard downloaded once


def test_a_shard_of_another_layout_is_one_line(written: Path, tmp_path: Path) -> None:
    """A WebDataset shard whose labels are not in <key>.cls (another tool's layout)."""
    root = tmp_path / "shards"
    shutil.copytree(written, root)
    shard = root / "train2017-000000.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            member.name = member.name.replace(".cls", ".json")
            tar.addfile(member, io.BytesIO(data))
    descriptor = json.loads((root / "train2017.json").read_text())
    descriptor["shardlist"][0]["filesize"] = shard.stat().st_size
    (root / "train2017.json").write_text(json.dumps(descriptor))
    data = _data(root, tmp_path)
    with pytest.raises(DptError) as raised:
        data.train[0]
    assert str(raised.value) == (
        f"shard {shard}: sample 00000000 has members ['.jpg', '.json']; dataset=shards reads "
        "<key>.<image extension> and <key>.cls (as dpt-shards writes)"
    )
