"""Shards opened for reading: local ones in place, remote ones (fetched by dpt.data.shard_fetch)
through a cache folder bounded in bytes and shared by every process of a node.

The cache is shared by every process of a node (ranks and their loader workers); it evicts the
least recently used shards (the oldest mtime; a hit touches it).

The cache folder holds, all under names derived from the URL (`<hash of the URL>-<file name>`):
- `<key>`: a complete shard, only ever made by renaming a finished, checked download;
- `<key>.part`: a download in progress, pre-sized to the shard's full size when it starts. The
  temporary file IS the reservation: every process sees it in the same directory listing that
  counts the complete shards, it vanishes with its download (done or failed), and one left by a
  killed process is known by its shard lock being free, so no separate ledger can go stale;
- `.lock`: flock'ed while counting, evicting, reserving and renaming, so that is one step for
  the node; outside it, files only shrink (are removed) or are written within their size;
- `.locks/<key>.lock`: flock'ed while a shard is being fetched, so a node downloads it once; a
  second process asking for it waits, then finds it cached.

Locks are opened afresh each time they are taken: a file description inherited across a fork
(a loader worker's) shares its flock with the parent, which would then exclude nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dpt.data.shard_fetch import (
    FetchPolicy,
    ShardUnavailable,
    SinkError,
    fetch,
    is_local,
    local_path,
    local_reason,
    megabytes,
)
from dpt.errors import DptError, is_disk_full

log = logging.getLogger("dpt")

SPACE_WAIT_S = 600.0  # how long a download waits for room that other downloads hold
SPACE_POLL_S = 0.05
_PART = ".part"
_KEY = re.compile(r"^[0-9a-f]{12}-")  # the cache's own files; anything else there is left alone


class CacheFull(DptError):
    """The cache folder's disk is full, or the cache's limit is below one shard: one line
    naming the folder or the limit, the shard, and what to change."""


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_downloaded: int = 0  # of complete, checked shards put in the cache
    evictions: int = 0  # shards this process removed

    @property
    def hit_rate(self) -> float:
        opened = self.hits + self.misses
        return self.hits / opened if opened else 0.0


# --- the cache ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    path: Path
    size: int
    mtime_ns: int

    @property
    def complete(self) -> bool:
        return not self.path.name.endswith(_PART)


class ShardCache:
    """Shards by URL: local ones opened in place, remote ones through a node-wide cache folder
    of at most `limit_bytes` (complete shards and downloads in progress together)."""

    space_wait_s: float = SPACE_WAIT_S  # an attribute, so tests can wait less

    def __init__(
        self, cache_dir: str | Path, limit_bytes: int, policy: FetchPolicy | None = None
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.limit_bytes = limit_bytes
        self.policy = policy or FetchPolicy()
        self.stats = CacheStats()  # per process

    def open(self, url: str, size: int, md5: str | None = None) -> BinaryIO:
        """An open binary file holding shard `url` of `size` bytes (as the index lists it).

        It is returned open so that a shard another process evicts afterwards stays readable
        through this handle (an unlinked file lives while open): callers never race eviction."""
        if is_local(url):
            return _open_local(url, size)
        if size > self.limit_bytes:
            raise CacheFull(
                f"dataset.cache_limit_gb={self.limit_bytes / 1e9:g} is smaller than shard {url} "
                f"({megabytes(size)}); raise it (to a few shards at least)"
            )
        try:
            return self._open_remote(url, size, md5)
        except SinkError as error:
            raise self._disk_error(error.error, url, size) from None
        except OSError as error:
            raise self._disk_error(error, url, size) from None

    def _open_remote(self, url: str, size: int, md5: str | None) -> BinaryIO:
        self._make_dirs()
        path = self.cache_dir / _cache_name(url)
        cached = _open_cached(path, size)
        if cached is None:
            # One download per shard per node: whoever holds the shard's lock fetches it, the
            # others wait for it here and then find it cached.
            with _flock(self._shard_lock(path)):
                cached = _open_cached(path, size)
                if cached is None:
                    self.stats.misses += 1
                    handle = self._download(url, size, md5, path)
                    self.stats.bytes_downloaded += size
                    return handle
        self.stats.hits += 1
        return cached

    def _download(self, url: str, size: int, md5: str | None, path: Path) -> BinaryIO:
        """Fetch into `<key>.part` (the reservation, made under the cache lock), then rename it
        into place: a killed download never looks complete. Called holding the shard's lock."""
        part = path.with_name(path.name + _PART)
        with contextlib.suppress(FileNotFoundError):
            part.unlink()  # a killed earlier download's: ours to replace, we hold the lock
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale copy of another size (an index that changed)
        self._reserve(part, url, size)
        try:
            with open(part, "r+b", buffering=0) as sink:
                fetch(url, sink, self.policy, what="shard", size=size, md5=md5)
                os.fsync(sink.fileno())  # the rename must never name a file still in flight
            handle = open(part, "rb")  # noqa: SIM115  (returned open)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
            raise
        # Under the cache lock: a listing that runs while a name changes may see it under both
        # names or neither (readdir makes no promise), and counting it under neither would
        # let a reservation overrun the limit. The open handle follows the file: eviction
        # cannot take it from the caller.
        with _flock(self.cache_dir / ".lock"):
            os.replace(part, path)
        _touch(handle)
        return handle

    def _reserve(self, part: Path, url: str, size: int) -> None:
        """Make room for `size` bytes (evicting the least recently used shards) and create
        `part` at its full size, as one step under the cache lock. Room that downloads in
        progress hold is waited for, with the lock released, rather than overrun."""
        deadline = time.monotonic() + self.space_wait_s
        while True:
            with _flock(self.cache_dir / ".lock"):
                if self._make_room(size):
                    _create_presized(part, size)
                    return
            if time.monotonic() > deadline:
                raise DptError(
                    f"shard cache {self.cache_dir}: no room for shard {url} ({megabytes(size)}) "
                    f"within dataset.cache_limit_gb={self.limit_bytes / 1e9:g} after waiting "
                    f"{self.space_wait_s:g} s for other downloads to finish; raise "
                    "dataset.cache_limit_gb (to a few shards per process at least)"
                )
            time.sleep(SPACE_POLL_S)

    def _make_room(self, size: int) -> bool:
        """Evict complete shards, oldest first, until `size` more bytes fit; False (evicting
        nothing) where even evicting all of them would not do. Called under the cache lock."""
        entries = self._entries()
        used = sum(e.size for e in entries)
        evictable = sorted((e for e in entries if e.complete), key=lambda e: (e.mtime_ns, e.path))
        if used - sum(e.size for e in evictable) + size > self.limit_bytes:
            return False  # downloads in progress hold the room: wait for them
        for entry in evictable:
            if used + size <= self.limit_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()  # readers holding it open keep reading it
                self.stats.evictions += 1
            used -= entry.size
        return True

    def _entries(self) -> list[_Entry]:
        """The cache's files (complete and in progress) with their sizes; a download left by a
        killed process (its shard lock free) is removed, giving back its room."""
        entries = []
        for item in os.scandir(self.cache_dir):
            if not _KEY.match(item.name):
                continue
            try:
                stat = item.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            path = Path(item.path)
            if item.name.endswith(_PART) and self._abandoned(path):
                path.unlink(missing_ok=True)
                continue
            entries.append(_Entry(path, stat.st_size, stat.st_mtime_ns))
        return entries

    def _abandoned(self, part: Path) -> bool:
        """Nobody holds the shard's lock: its downloader died (a live one holds it throughout,
        and removes or renames its part before letting go)."""
        shard = part.with_name(part.name.removesuffix(_PART))
        fd = os.open(self._shard_lock(shard), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # closing releases a lock taken here
        return True

    def _shard_lock(self, path: Path) -> Path:
        return self.cache_dir / ".locks" / f"{path.name}.lock"

    def _make_dirs(self) -> None:
        """Each time (one cheap call): a folder someone emptied meanwhile is made again."""
        (self.cache_dir / ".locks").mkdir(parents=True, exist_ok=True)

    def _disk_error(self, error: OSError, url: str, size: int) -> DptError:
        if is_disk_full(error):
            return CacheFull(
                f"shard cache {self.cache_dir}: no space left on device for shard {url} "
                f"({megabytes(size)}); set dataset.cache_limit_gb lower (below the room on that "
                "disk), or dataset.cache_dir to a disk with room"
            )
        where = error.filename or self.cache_dir
        reason = (error.strerror or str(error)).lower()
        return DptError(
            f"shard cache {self.cache_dir}: cannot use {where} for shard {url}: {reason}; set "
            "dataset.cache_dir to a folder this user can write"
        )


def _cache_name(url: str) -> str:
    """`<hash of the URL>-<its file name>`: two data sets' `train-000000.tar` stay apart, and
    the name still says which shard it is."""
    name = urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1] or "shard"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")
    return f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{safe}"


def _open_cached(path: Path, size: int) -> BinaryIO | None:
    """The cached copy, open and touched (most recently used), or None: not there (never
    fetched, or just evicted: opening is the check, so no eviction can slip in between), or of
    another size than the index lists (an index that changed: fetched again)."""
    try:
        handle = open(path, "rb")  # noqa: SIM115  (returned open)
    except FileNotFoundError:
        return None
    if os.fstat(handle.fileno()).st_size != size:
        handle.close()
        return None
    _touch(handle)
    return handle


def _touch(handle: BinaryIO) -> None:
    """Most recently used now. The clock's own nanoseconds: the kernel's default stamp is a
    coarse tick (milliseconds), which would tie shards opened in quick succession."""
    now = time.time_ns()
    os.utime(handle.fileno(), ns=(now, now))


def _create_presized(part: Path, size: int) -> None:
    """`part` at `size` bytes: its size counts as reserved for every process's accounting.
    fallocate also claims the blocks, so a disk without room fails here, before the download;
    where the file system cannot, a sparse file still reserves the bytes in the accounting."""
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        part.unlink(missing_ok=True)
        raise
    os.close(fd)


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the block; its own open file (see the module's doc)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _open_local(url: str, size: int) -> BinaryIO:
    path = local_path(url)
    try:
        handle = open(path, "rb")  # noqa: SIM115  (returned open)
    except OSError as error:
        raise ShardUnavailable(f"shard {path}: {local_reason(error)}") from None
    actual = os.fstat(handle.fileno()).st_size
    if actual != size:
        handle.close()
        if actual < size:
            raise ShardUnavailable(
                f"shard {path}: truncated: {actual:,} bytes of {size:,} the index lists"
            )
        raise ShardUnavailable(f"shard {path}: {actual:,} bytes, not the {size:,} the index lists")
    return handle
