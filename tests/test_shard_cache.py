"""Fetching shards and the node-wide shard cache, against a real HTTP server on loopback that
can fail on demand: a status, a connection dropped mid-body, a stall; "refused" is a closed port."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import http.server
import logging
import multiprocessing
import os
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pytest
from fsspec.registry import known_implementations

from dpt.data.shard_cache import CacheFull, CacheStats, ShardCache
from dpt.data.shard_fetch import (
    FetchPolicy,
    ShardUnavailable,
    SourceUnreachable,
    is_local,
    join_url,
    read_bytes,
)
from dpt.errors import DptError
from tests.helpers import small_tmpfs

# A source that does not answer is waited for 0.07 s: tries at about 0, 0.01, 0.03 and 0.07 s.
FAST = FetchPolicy(retries=3, outage_s=0.07, backoff_s=0.01, timeout_s=5.0)
MB = 1_000_000


# --- a server that fails on demand -------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """What the server does instead of (or before) serving a request."""

    status: int | None = None  # answer this status
    drop_after: int | None = None  # send the head and this many bytes of the body, then close
    sleep_s: float = 0.0  # stall this long, then serve


class Server(http.server.ThreadingHTTPServer):
    block_on_close = False  # a stalled handler must not hold up the fixture's teardown

    def __init__(self, folder: Path) -> None:
        handler = functools.partial(Handler, directory=str(folder))
        super().__init__(("127.0.0.1", 0), handler)
        self.folder = folder
        self.faults: dict[str, list[Fault]] = {}
        self.requests: Counter[str] = Counter()
        self.lock = threading.Lock()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_port}/{name}"

    def fail(self, name: str, fault: Fault, times: int = 1000) -> None:
        self.faults[name] = [fault] * times

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and left: the stalled handler's write fails, as expected


class Handler(http.server.SimpleHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        with self.server.lock:
            self.server.requests[name] += 1
            faults = self.server.faults.get(name)
            fault = faults.pop(0) if faults else Fault()
        time.sleep(fault.sleep_s)
        if fault.status is not None:
            self.send_error(fault.status)
        elif fault.drop_after is not None:
            body = (self.server.folder / name).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: fault.drop_after])
            self.close_connection = True
        else:
            super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    folder = tmp_path / "served"
    folder.mkdir()
    served = Server(folder)
    # A short poll: shutdown() waits for it (half a second by default, in every test).
    threading.Thread(target=served.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield served
    finally:
        served.shutdown()
        served.server_close()


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """The lines logged on "dpt" at WARNING and above (a handler of its own: the run's logging
    setup, where an earlier test made it, stops "dpt" propagating to caplog's root handler)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("dpt")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real file system of 64 kB (tmpfs), to fill."""
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        yield disk


# --- helpers -----------------------------------------------------------------------------------


def serve(server: Server, name: str, size: int) -> bytes:
    """A shard of `size` seeded bytes, served as `name`."""
    data = random.Random(name).randbytes(size)
    path = server.folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def read(handle: BinaryIO) -> bytes:
    with handle:
        return handle.read()


def closed_port() -> int:
    """A loopback port with nothing listening: connecting is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def used_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # renamed or evicted while we looked
            total += path.stat().st_size if path.is_file() else 0
    return total


def cached_shards(folder: Path) -> list[str]:
    """The complete shards in the cache, by their file names (without the URL's hash)."""
    return sorted(
        p.name.split("-", 1)[1]
        for p in folder.iterdir()
        if re.fullmatch(r"[0-9a-f]{12}-.*", p.name)
    )


def lock_files(folder: Path) -> list[str]:
    return [f for f in files(folder) if f == ".lock" or f.startswith(".locks/")]


def gave_up(url: str, reason: str, tries: int) -> str:
    return (
        rf"shard {re.escape(url)}: {re.escape(reason)}, gave up after {tries} tries over \d+\.\d s"
    )


def no_answer(url: str, reason: str, outage_s: float) -> str:
    """A source that did not answer for `outage_s`, after however many tries fit in it."""
    return (
        rf"shard {re.escape(url)}: {re.escape(reason)}; no answer for 0 s "
        rf"\(dataset\.outage_s={outage_s:g}, \d+ tries\)"
    )


def waits(url: str, reason: str, warnings: list[str]) -> bool:
    """Every warning a retry of a source that did not answer, numbered from 1."""
    return bool(warnings) and all(
        re.fullmatch(
            rf"shard {re.escape(url)}: {re.escape(reason)}; retry {k + 1} in [\d.e-]+ s "
            r"\(0 s of outage_s left\)",
            warning,
        )
        for k, warning in enumerate(warnings)
    )


def retries(url: str, reason: str, n: int, of: int = 3) -> list[str]:
    """The warnings of `n` retries out of `of`, FAST's backoff doubling from 0.01 s."""
    return [f"shard {url}: {reason}; retry {k + 1} of {of} in {0.01 * 2**k:g} s" for k in range(n)]


# --- URLs --------------------------------------------------------------------------------------


def test_urls() -> None:
    assert is_local("/data/shards") and is_local("shards") and is_local("file:///data")
    assert not is_local("http://host/x") and not is_local("s3://bucket/x")
    assert not is_local("simplecache::s3://bucket/x")
    assert join_url("/data/shards/", "a.tar") == "/data/shards/a.tar"
    assert join_url("file:///data/", "a.tar") == "file:///data/a.tar"
    assert join_url("http://h:8000/set/", "/a.tar") == "http://h:8000/set/a.tar"
    assert join_url("s3://bucket", "a.tar") == "s3://bucket/a.tar"
    assert join_url("s3://bucket/set", "https://elsewhere/a.tar") == "https://elsewhere/a.tar"


# --- 1. download, then a hit -------------------------------------------------------------------


def test_a_download_then_a_hit(server: Server, tmp_path: Path) -> None:
    data = serve(server, "a.tar", 100_000)
    cache = ShardCache(tmp_path / "cache", MB, FAST)
    url = server.url("a.tar")
    assert read(cache.open(url, len(data), md5(data))) == data
    assert read(cache.open(url, len(data), md5(data))) == data
    assert cache.stats == CacheStats(hits=1, misses=1, bytes_downloaded=100_000)
    assert cache.stats.hit_rate == 0.5
    assert server.requests["a.tar"] == 1
    assert cached_shards(tmp_path / "cache") == ["a.tar"]
    assert read_bytes(url, FAST) == data


def test_two_data_sets_with_the_same_shard_names_are_cached_apart(
    server: Server, tmp_path: Path
) -> None:
    one, two = serve(server, "one/a.tar", 1000), serve(server, "two/a.tar", 1000)
    cache = ShardCache(tmp_path / "cache", MB, FAST)
    assert read(cache.open(server.url("one/a.tar"), 1000)) == one
    assert read(cache.open(server.url("two/a.tar"), 1000)) == two
    assert read(cache.open(server.url("one/a.tar"), 1000)) == one
    assert cached_shards(tmp_path / "cache") == ["a.tar", "a.tar"]
    assert cache.stats.hits == 1


def test_a_second_process_waits_for_the_first_download(server: Server, tmp_path: Path) -> None:
    """Two caches on one folder (as two processes: flock excludes per open file, not per
    process) ask for one shard at once: one downloads, the other waits and hits."""
    data = serve(server, "a.tar", 100_000)
    server.fail("a.tar", Fault(sleep_s=0.3), times=1)  # long enough for both to be asking
    caches = [ShardCache(tmp_path / "cache", MB, FAST) for _ in range(2)]
    got: list[bytes] = []
    threads = [
        threading.Thread(target=lambda c=c: got.append(read(c.open(server.url("a.tar"), 100_000))))
        for c in caches
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == [data, data]
    assert server.requests["a.tar"] == 1
    assert sorted((c.stats.hits, c.stats.misses) for c in caches) == [(0, 1), (1, 0)]


# --- 2-7. failures: at once, or after retries --------------------------------------------------


def test_404_is_one_line_at_once(server: Server, tmp_path: Path, warnings: list[str]) -> None:
    cache = ShardCache(tmp_path / "cache", MB, FAST)
    url = server.url("train-000003.tar")
    with pytest.raises(ShardUnavailable) as error:
        cache.open(url, 1000)
    assert str(error.value) == f"shard {url}: HTTP 404 Not Found"
    assert server.requests["train-000003.tar"] == 1 and warnings == []
    with pytest.raises(ShardUnavailable) as error:
        read_bytes(server.url("index.json"), FAST, what="file")
    assert str(error.value) == f"file {server.url('index.json')}: HTTP 404 Not Found"


def test_403_is_not_retried_either(server: Server, tmp_path: Path) -> None:
    serve(server, "a.tar", 1000)
    server.fail("a.tar", Fault(status=403))
    with pytest.raises(ShardUnavailable) as error:
        ShardCache(tmp_path / "cache", MB, FAST).open(server.url("a.tar"), 1000)
    assert str(error.value) == f"shard {server.url('a.tar')}: HTTP 403 Forbidden"
    assert server.requests["a.tar"] == 1


def test_refused_is_waited_for_outage_s_then_one_line(tmp_path: Path, warnings: list[str]) -> None:
    url = f"http://127.0.0.1:{closed_port()}/a.tar"
    start = time.monotonic()
    with pytest.raises(SourceUnreachable) as error:
        ShardCache(tmp_path / "cache", MB, FAST).open(url, 1000)
    assert time.monotonic() - start >= 0.07  # dataset.outage_s, waited between tries
    assert re.fullmatch(no_answer(url, "connection refused", 0.07), str(error.value))
    assert len(warnings) >= 3 and waits(url, "connection refused", warnings)
    assert lock_files(tmp_path / "cache") == files(tmp_path / "cache")


def test_a_stalled_server_times_out(server: Server, tmp_path: Path, warnings: list[str]) -> None:
    serve(server, "a.tar", 1000)
    server.fail("a.tar", Fault(sleep_s=1.0))
    url = server.url("a.tar")
    policy = FetchPolicy(retries=0, outage_s=0.3, backoff_s=0.01, timeout_s=0.2)
    with pytest.raises(SourceUnreachable) as error:  # no answer: an outage, not a bad shard
        ShardCache(tmp_path / "cache", MB, policy).open(url, 1000)
    assert re.fullmatch(no_answer(url, "timed out after 0.2 s", 0.3), str(error.value))
    assert len(warnings) == 1 and waits(url, "timed out after 0.2 s", warnings)
    assert server.requests["a.tar"] == 2


def test_a_dropped_connection_is_retried(
    server: Server, tmp_path: Path, warnings: list[str]
) -> None:
    data = serve(server, "a.tar", 300_000)
    server.fail("a.tar", Fault(drop_after=100_000), times=2)
    url = server.url("a.tar")
    cache = ShardCache(tmp_path / "cache", MB, FAST)
    assert read(cache.open(url, len(data), md5(data))) == data
    assert warnings == retries(url, "connection closed after 100,000 of 300,000 bytes", 2)
    assert server.requests["a.tar"] == 3
    assert cache.stats == CacheStats(misses=1, bytes_downloaded=300_000)


def test_a_connection_dropped_every_time_says_how_much_came(server: Server, tmp_path: Path) -> None:
    data = serve(server, "a.tar", 300_000)
    server.fail("a.tar", Fault(drop_after=12_345))
    url = server.url("a.tar")
    with pytest.raises(ShardUnavailable) as error:
        ShardCache(tmp_path / "cache", MB, FAST).open(url, len(data))
    reason = "connection closed after 12,345 of 300,000 bytes"
    assert re.fullmatch(gave_up(url, reason, 4), str(error.value))
    assert lock_files(tmp_path / "cache") == files(tmp_path / "cache")  # no partial download


def test_503_then_success(server: Server, tmp_path: Path, warnings: list[str]) -> None:
    data = serve(server, "a.tar", 1000)
    server.fail("a.tar", Fault(status=503), times=2)
    url = server.url("a.tar")
    assert read(ShardCache(tmp_path / "cache", MB, FAST).open(url, 1000)) == data
    assert len(warnings) == 2 and waits(url, "HTTP 503 Service Unavailable", warnings)


def test_a_wrong_md5_gives_up_after_the_retries_and_caches_nothing(
    server: Server, tmp_path: Path
) -> None:
    data = serve(server, "a.tar", 1000)
    url = server.url("a.tar")
    wrong = "0" * 32
    with pytest.raises(ShardUnavailable) as error:
        ShardCache(tmp_path / "cache", MB, FAST).open(url, 1000, wrong)
    reason = f"MD5 {md5(data)} is not the {wrong} the index lists"
    assert re.fullmatch(gave_up(url, reason, 4), str(error.value))
    assert server.requests["a.tar"] == 4
    assert lock_files(tmp_path / "cache") == files(tmp_path / "cache") != []


def test_a_server_with_another_size_than_the_index(server: Server, tmp_path: Path) -> None:
    serve(server, "a.tar", 1000)
    url = server.url("a.tar")
    with pytest.raises(ShardUnavailable) as error:
        ShardCache(tmp_path / "cache", MB, FAST).open(url, 2000)
    assert str(error.value) == f"shard {url}: the server has 1,000 bytes, the index lists 2,000"
    assert server.requests["a.tar"] == 1


# --- 8-10. the bound ---------------------------------------------------------------------------


def test_the_least_recently_used_are_evicted_within_the_limit(
    server: Server, tmp_path: Path
) -> None:
    size = 10_000
    data = {i: serve(server, f"s{i}.tar", size) for i in range(6)}
    folder = tmp_path / "cache"
    cache = ShardCache(folder, int(2.5 * size), FAST)

    def get(i: int) -> None:
        assert read(cache.open(server.url(f"s{i}.tar"), size, md5(data[i]))) == data[i]
        assert used_bytes(folder) <= 2.5 * size

    for i in range(6):
        get(i)
        assert cached_shards(folder) == sorted({f"s{max(i - 1, 0)}.tar", f"s{i}.tar"})
    get(5)  # a hit: s5 becomes the most recently used, s4 the least
    assert server.requests["s5.tar"] == 1
    get(0)
    assert cached_shards(folder) == ["s0.tar", "s5.tar"]
    assert server.requests["s0.tar"] == 2
    assert cache.stats == CacheStats(hits=1, misses=7, bytes_downloaded=7 * size, evictions=5)


def _reader(
    folder: Path, limit: int, shards: list[tuple[str, int, str]], seed: int, out: Any
) -> None:
    """One process of the concurrency test: every shard, in an order of its own."""
    try:
        cache = ShardCache(folder, limit, FAST)
        order = list(range(len(shards)))
        random.Random(seed).shuffle(order)
        wrong = []
        for i in order:
            url, size, digest = shards[i]
            if md5(read(cache.open(url, size, digest))) != digest:
                wrong.append(url)
        out.put((asdict(cache.stats), wrong))
    except BaseException as error:
        out.put(({}, [repr(error)]))


def test_four_processes_share_one_bounded_cache(server: Server, tmp_path: Path) -> None:
    size, n = 200_000, 8
    shards = []
    for i in range(n):
        data = serve(server, f"s{i}.tar", size)
        server.fail(f"s{i}.tar", Fault(sleep_s=0.02))  # slow enough for downloads to overlap
        shards.append((server.url(f"s{i}.tar"), size, md5(data)))
    folder, limit = tmp_path / "cache", 3 * size
    peak, stop = [0], threading.Event()

    def watch() -> None:
        """The bytes in the cache, under its lock: a listing taken while a name changes may
        count it twice (readdir makes no promise), and the cache renames under that lock."""
        while not stop.is_set():
            if (folder / ".lock").exists():
                with open(folder / ".lock") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    peak[0] = max(peak[0], used_bytes(folder))
            time.sleep(0.001)  # leave the lock to the readers between looks

    # Started after the fork: a child forked while the watcher holds the lock would inherit it.
    watcher = threading.Thread(target=watch)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    readers = [
        context.Process(target=_reader, args=(folder, limit, shards, seed, out))
        for seed in range(4)
    ]
    try:
        for reader in readers:
            reader.start()
        watcher.start()
        results = [out.get(timeout=60) for _ in readers]
        for reader in readers:
            reader.join(timeout=10)
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        for reader in readers:
            if reader.is_alive():  # a reader stuck: fail, without leaving it behind
                reader.kill()
    assert [wrong for _, wrong in results] == [[]] * 4  # every byte right, no error
    assert [reader.exitcode for reader in readers] == [0] * 4
    assert 0 < peak[0] <= limit
    stats = [CacheStats(**s) for s, _ in results]
    downloads = sum(server.requests.values())
    assert downloads == sum(s.misses for s in stats)  # no retries: each miss one request
    assert n <= downloads <= n + sum(s.evictions for s in stats)  # again only once evicted
    assert sum(s.hits + s.misses for s in stats) == 4 * n
    assert used_bytes(folder) <= limit and not any(f.endswith(".part") for f in files(folder))


def test_a_shard_bigger_than_the_limit_is_one_line(server: Server, tmp_path: Path) -> None:
    serve(server, "a.tar", 200_000)
    url = server.url("a.tar")
    with pytest.raises(CacheFull) as error:
        ShardCache(tmp_path / "cache", 100_000, FAST).open(url, 200_000)
    assert str(error.value) == (
        f"dataset.cache_limit_gb=0.0001 is smaller than shard {url} (0.2 MB); raise it (to a few "
        "shards at least)"
    )
    assert server.requests["a.tar"] == 0


def test_room_held_by_another_download_is_waited_for(server: Server, tmp_path: Path) -> None:
    """Another process's download in progress (its part file, its shard lock held) holds room:
    the cache waits rather than overrun the limit; once that process is gone, its part is
    known abandoned and removed."""
    data = serve(server, "a.tar", 10_000)
    folder = tmp_path / "cache"
    (folder / ".locks").mkdir(parents=True)
    other = "0123456789ab-other.tar"
    (folder / f"{other}.part").write_bytes(b"\0" * 15_000)
    held = os.open(folder / ".locks" / f"{other}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    cache = ShardCache(folder, 20_000, FAST)
    cache.space_wait_s = 0.2
    url = server.url("a.tar")
    try:
        with pytest.raises(DptError) as error:
            cache.open(url, 10_000)
    finally:
        os.close(held)  # the other process dies
    assert str(error.value) == (
        f"shard cache {folder}: no room for shard {url} (10,000 bytes) within "
        "dataset.cache_limit_gb=2e-05 after waiting 0.2 s for other downloads to finish; raise "
        "dataset.cache_limit_gb (to a few shards per process at least)"
    )
    assert server.requests["a.tar"] == 0
    assert read(cache.open(url, 10_000)) == data
    assert cached_shards(folder) == ["a.tar"]  # the abandoned part is gone


# --- 11. local shards --------------------------------------------------------------------------


def test_local_shards_are_read_in_place_and_checked(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", MB, FAST)
    shard = tmp_path / "train-000001.tar"
    shard.write_bytes(b"x" * 1000)
    assert read(cache.open(str(shard), 1000)) == b"x" * 1000
    assert read(cache.open(f"file://{shard}", 1000)) == b"x" * 1000
    with pytest.raises(ShardUnavailable) as error:
        cache.open(str(shard), 52_224)
    assert str(error.value) == f"shard {shard}: truncated: 1,000 bytes of 52,224 the index lists"
    with pytest.raises(ShardUnavailable) as error:
        cache.open(f"file://{tmp_path}/missing.tar", 1000)
    assert str(error.value) == f"shard {tmp_path}/missing.tar: not found"
    with pytest.raises(ShardUnavailable) as error:
        read_bytes(str(tmp_path / "index.json"), FAST, what="file")
    assert str(error.value) == f"file {tmp_path}/index.json: not found"
    assert not (tmp_path / "cache").exists()  # nothing local is cached
    assert cache.stats == CacheStats()


# --- 12. fsspec --------------------------------------------------------------------------------


def test_fsspec_protocols(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = random.Random(0).randbytes(50_000)
    url = "memory://dpt-test-shards/a.tar"
    with fsspec.open(url, "wb") as f:
        f.write(data)
    cache = ShardCache(tmp_path / "cache", MB, FAST)
    try:
        assert read(cache.open(url, len(data), md5(data))) == data
        assert read(cache.open(url, len(data), md5(data))) == data
        assert cache.stats == CacheStats(hits=1, misses=1, bytes_downloaded=50_000)
        with pytest.raises(ShardUnavailable) as error:
            cache.open("memory://dpt-test-shards/b.tar", 1000)
        assert str(error.value) == "shard memory://dpt-test-shards/b.tar: not found"
    finally:
        fsspec.filesystem("memory").rm("/dpt-test-shards", recursive=True)
    with pytest.raises(DptError) as error:
        cache.open("nosuch://x/y.tar", 1000)
    assert str(error.value) == "shard nosuch://x/y.tar: fsspec knows no protocol 'nosuch'"
    # As s3:// without s3fs: a protocol fsspec knows, whose package is not installed.
    monkeypatch.setitem(
        known_implementations, "dptfake", {"class": "dpt_no_such.FS", "err": "Install dpt_no_such"}
    )
    with pytest.raises(DptError) as error:
        cache.open("dptfake://bucket/y.tar", 1000)
    assert str(error.value) == (
        "shard dptfake://bucket/y.tar: reading dptfake:// needs the package dpt_no_such "
        "(pip install dpt_no_such)"
    )


# --- 13. a full disk ---------------------------------------------------------------------------


def full_disk_line(disk: Path, url: str) -> str:
    return (
        f"shard cache {disk}: no space left on device for shard {url} (0.2 MB); set "
        "dataset.cache_limit_gb lower (below the room on that disk), or dataset.cache_dir to a "
        "disk with room"
    )


def test_a_full_disk_is_one_line_before_the_download(server: Server, tiny_disk: Path) -> None:
    serve(server, "a.tar", 200_000)
    url = server.url("a.tar")
    with pytest.raises(CacheFull) as error:
        ShardCache(tiny_disk, MB, FAST).open(url, 200_000)
    assert str(error.value) == full_disk_line(tiny_disk, url)
    assert lock_files(tiny_disk) == files(tiny_disk)  # no temporary file left
    assert server.requests["a.tar"] == 0  # fallocate found no room: nothing fetched


def test_a_disk_filling_up_during_the_download_is_one_line(
    server: Server, tiny_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without fallocate: the room is claimed by writing, and runs out midway."""

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    serve(server, "a.tar", 200_000)
    url = server.url("a.tar")
    with pytest.raises(CacheFull) as error:
        ShardCache(tiny_disk, MB, FAST).open(url, 200_000)
    assert str(error.value) == full_disk_line(tiny_disk, url)
    assert lock_files(tiny_disk) == files(tiny_disk)
    assert server.requests["a.tar"] == 1  # not retried: the disk will not empty itself
