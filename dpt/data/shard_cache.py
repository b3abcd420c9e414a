"""Shards fetched from where `dataset=shards` points: a local folder, HTTP(S), or an object store.

Local shards are opened in place. Remote ones are downloaded into a cache folder bounded in bytes
and shared by every process of a node (ranks and their loader workers), which evicts the least
recently used shards (the oldest mtime; a hit touches it).

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
import http.client
import io
import itertools
import logging
import os
import re
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from dpt.errors import DptError, is_disk_full

log = logging.getLogger("dpt")

CHUNK = 1 << 20  # bytes per read and write of a download: shards never sit whole in memory
MAX_BACKOFF_S = 8.0
SPACE_WAIT_S = 600.0  # how long a download waits for room that other downloads hold
SPACE_POLL_S = 0.05
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-:]*://")  # also fsspec's chained "a::b://"
_PART = ".part"
_KEY = re.compile(r"^[0-9a-f]{12}-")  # the cache's own files; anything else there is left alone
_RETRY_STATUS = (408, 429)  # 4xx that do pass: a slow request, a rate limit


class ShardUnavailable(DptError):
    """A shard (or index file) that cannot be had: one line naming the URL and why."""


class SourceUnreachable(ShardUnavailable):
    """The source failed for longer than `dataset.outage_s` in ways that pass (refused, timed
    out, 5xx): not one damaged shard to skip but data the run cannot do without; it stops."""


class CacheFull(DptError):
    """The cache folder's disk is full, or the cache's limit is below one shard: one line
    naming the folder or the limit, the shard, and what to change."""


@dataclass(frozen=True)
class FetchPolicy:
    retries: int = 3  # tries after the first for a transfer that comes damaged (cut off, MD5)
    outage_s: float = 120.0  # how long a source that does not answer (refused, 5xx) is retried
    backoff_s: float = 0.5  # first wait; doubles each retry (capped at MAX_BACKOFF_S)
    timeout_s: float = 30.0  # per connect and per read (socket timeout; HTTP(S) only)


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


# --- URLs --------------------------------------------------------------------------------------


def is_local(root: str) -> bool:
    """A plain path or a file:// URL: read in place, never cached."""
    return root.startswith("file://") or not _SCHEME.match(root)


def join_url(root: str, name: str) -> str:
    """`name` (as an index lists it: relative, or a whole URL) under `root`."""
    if _SCHEME.match(name) or (name.startswith("/") and is_local(root)):
        return name
    return f"{root.rstrip('/')}/{name.lstrip('/')}"


def local_path(url: str) -> Path:
    """The path of a local root or shard (`is_local`): a plain path, or a file:// URL's."""
    if url.startswith("file://"):
        return Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
    return Path(url)


def _mb(size: int) -> str:
    return f"{size / 1e6:,.1f} MB" if size >= 100_000 else f"{size:,} bytes"


def _tries(n: int) -> str:
    return f"{n} {'try' if n == 1 else 'tries'}"


# --- fetching, with retries --------------------------------------------------------------------


class _Sink(Protocol):
    def write(self, data: bytes | memoryview, /) -> int | None: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def truncate(self, size: int | None = None, /) -> int: ...


class _Failure(Exception):
    """One try's failure, in words, and whether another try may do better: `outage`, the
    source did not answer (refused, timed out, 5xx: waited for up to `outage_s`); else, if
    `retryable`, what came was damaged (retried `retries` times)."""

    def __init__(self, reason: str, retryable: bool, outage: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable or outage
        self.outage = outage


class _SinkError(Exception):
    """Writing the download failed (a full disk): the cache's problem, never retried. Not an
    OSError, so the network's OSError handlers cannot take it for a network error."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def read_bytes(url: str, policy: FetchPolicy, what: str = "shard") -> bytes:
    """A small file (index.json, a descriptor), read in place or fetched with `policy`'s
    retries; ShardUnavailable ("<what> <url>: <why>") where it cannot be had."""
    if is_local(url):
        path = local_path(url)
        try:
            return path.read_bytes()
        except OSError as error:
            raise ShardUnavailable(f"{what} {path}: {_local_reason(error)}") from None
    sink = io.BytesIO()
    try:
        _fetch(url, sink, policy, what=what, size=None, md5=None)
    except _SinkError as error:  # a BytesIO does not fail short of memory
        raise error.error from None
    return sink.getvalue()


def _fetch(
    url: str, sink: _Sink, policy: FetchPolicy, what: str, size: int | None, md5: str | None
) -> int:
    """Fetch `url` into `sink` (rewritten from its start on each try): the number of bytes.
    A source that does not answer is retried, with a doubling backoff, for `policy.outage_s`;
    a transfer that comes damaged, `policy.retries` times."""
    start, damaged = time.monotonic(), 0
    for attempt in itertools.count():
        sink.seek(0)
        try:
            count = _try_once(url, sink, policy, size, md5)
        except _Failure as failure:
            spent = time.monotonic() - start
            if not failure.retryable:
                raise ShardUnavailable(f"{what} {url}: {failure.reason}") from None
            wait = min(policy.backoff_s * 2**attempt, MAX_BACKOFF_S)
            if failure.outage:
                left = policy.outage_s - spent
                if left <= 0:
                    raise SourceUnreachable(
                        f"{what} {url}: {failure.reason}; no answer for {spent:.0f} s "
                        f"(dataset.outage_s={policy.outage_s:g}, {_tries(attempt + 1)})"
                    ) from None
                wait = min(wait, left)
                then = f"retry {attempt + 1} in {wait:.3g} s ({left:.0f} s of outage_s left)"
            else:
                damaged += 1
                if damaged > policy.retries:
                    raise ShardUnavailable(
                        f"{what} {url}: {failure.reason}, gave up after "
                        f"{_tries(attempt + 1)} over {spent:.1f} s"
                    ) from None
                then = f"retry {damaged} of {policy.retries} in {wait:g} s"
            log.warning(f"{what} {url}: {failure.reason}; {then}")
            time.sleep(wait)
            continue
        sink.truncate(count)  # a longer earlier try's tail (a pre-sized file is exactly `count`)
        return count
    raise AssertionError("unreachable")  # the loop returns or raises


def _try_once(url: str, sink: _Sink, policy: FetchPolicy, size: int | None, md5: str | None) -> int:
    digest = hashlib.md5(usedforsecurity=False) if md5 else None
    if urllib.parse.urlsplit(url).scheme in ("http", "https"):
        count = _http_try(url, sink, policy, size, digest)
    else:
        count = _fsspec_try(url, sink, policy, size, digest)
    if digest is not None and md5 and digest.hexdigest() != md5.lower():
        # The size was right, the bytes were not: a corrupt transfer may pass; a wrong index
        # will not, and says so after the retries.
        raise _Failure(f"MD5 {digest.hexdigest()} is not the {md5} the index lists", True)
    return count


def _http_try(
    url: str, sink: _Sink, policy: FetchPolicy, size: int | None, digest: _Hash | None
) -> int:
    request = urllib.request.Request(url, headers={"User-Agent": "dpt"})
    try:
        with urllib.request.urlopen(request, timeout=policy.timeout_s) as response:
            expected = _expected_size(response, size)
            return _copy(response, sink, expected, digest, policy, "connection closed")
    except urllib.error.HTTPError as error:
        raise _status_failure(error.code, error.reason) from None
    except urllib.error.URLError as error:
        if isinstance(error.reason, OSError):
            raise _os_failure(error.reason, policy) from None
        raise _Failure(str(error.reason), False) from None  # e.g. "unknown url type"
    except (OSError, http.client.HTTPException) as error:  # waiting for the response's head
        raise _os_failure(error, policy) from None


def _expected_size(response: http.client.HTTPResponse, size: int | None) -> int | None:
    """The body's size: the index's, checked against the server's Content-Length."""
    length = response.headers.get("Content-Length")
    served = int(length) if length and length.isdigit() else None
    if size is not None and served is not None and served != size:
        # A different file than the index describes: another try gets the same file.
        raise _Failure(f"the server has {served:,} bytes, the index lists {size:,}", False)
    return size if size is not None else served


def _status_failure(code: int, reason: str | None) -> _Failure:
    phrase = _phrase(code) or reason or ""
    return _Failure(f"HTTP {code} {phrase}".rstrip(), False, code >= 500 or code in _RETRY_STATUS)


def _phrase(code: int) -> str:
    """The standard phrase: servers word theirs freely (Python's says "File not found")."""
    try:
        return http.HTTPStatus(code).phrase
    except ValueError:
        return ""


def _os_failure(
    error: OSError | http.client.HTTPException, policy: FetchPolicy, progress: str = ""
) -> _Failure:
    """A network (or object store) error in words, and whether it may pass: with no bytes come
    yet (`progress` empty) the source did not answer, an outage; else the transfer broke."""
    reason, retryable = _os_reason(error, policy)
    return _Failure(f"{reason}{progress}", retryable, outage=retryable and not progress)


def _os_reason(error: OSError | http.client.HTTPException, policy: FetchPolicy) -> tuple[str, bool]:
    if isinstance(error, TimeoutError):
        return f"timed out after {policy.timeout_s:g} s", True
    if isinstance(error, ConnectionRefusedError):
        return "connection refused", True
    if isinstance(error, http.client.RemoteDisconnected):
        return "connection closed before a response", True
    if isinstance(error, ConnectionResetError):
        return "connection reset", True
    if isinstance(error, socket.gaierror):  # only "try again later" passes; a wrong name stays
        return f"cannot resolve the host ({error.strerror})", error.errno == socket.EAI_AGAIN
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"TLS certificate not trusted ({error.verify_message})", False
    if isinstance(error, FileNotFoundError):
        return "not found", False
    if isinstance(error, PermissionError):
        return f"permission denied ({error})", False
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror[0].lower()}{error.strerror[1:]}", True
    return f"{type(error).__name__}: {error}".rstrip(": "), True


class _Hash(Protocol):
    def update(self, data: bytes, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def _copy(
    source: _Readable,
    sink: _Sink,
    expected: int | None,
    digest: _Hash | None,
    policy: FetchPolicy,
    cut_off: str,
) -> int:
    """Stream `source` into `sink` in chunks; a body shorter or longer than `expected` fails."""
    count = 0
    while True:
        try:
            chunk = source.read(CHUNK)
        except http.client.IncompleteRead as error:  # a chunked body cut off
            count += len(error.partial)
            break
        except (OSError, http.client.HTTPException) as error:
            raise _os_failure(error, policy, _progress(count, expected)) from None
        if not chunk:
            break
        count += len(chunk)
        if expected is not None and count > expected:
            raise _Failure(f"more than the {expected:,} bytes the index lists", False)
        _write(sink, chunk)
        if digest is not None:
            digest.update(chunk)
    if expected is not None and count < expected:
        raise _Failure(f"{cut_off} after {count:,} of {expected:,} bytes", True)
    return count


def _progress(count: int, expected: int | None) -> str:
    of = f" of {expected:,}" if expected is not None else ""
    return f" ({count:,}{of} bytes came)" if count else ""


def _write(sink: _Sink, chunk: bytes) -> None:
    view = memoryview(chunk)
    try:
        while view:  # an unbuffered file may take part of a chunk (the disk filling up)
            written = sink.write(view)
            view = view[written if written is not None else len(view) :]
    except OSError as error:
        raise _SinkError(error) from None


def _fsspec_try(
    url: str, sink: _Sink, policy: FetchPolicy, size: int | None, digest: _Hash | None
) -> int:
    opened = _fsspec_open(url)
    try:
        with opened as source:
            return _copy(source, sink, size, digest, policy, "the file ended")
    except (_Failure, _SinkError):
        raise
    except OSError as error:
        raise _os_failure(error, policy) from None
    except Exception as error:  # a backend's own error (no credentials, ...): retrying won't help
        raise _Failure(f"{type(error).__name__}: {error}", False) from None


def _fsspec_open(url: str) -> contextlib.AbstractContextManager[_Readable]:
    """fsspec's lazy file for `url`; a protocol it does not know, or whose package is missing,
    is a one-line reason."""
    scheme = url.split("://", 1)[0]
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise _Failure(f"reading {scheme}:// needs the package fsspec", False) from None
    try:
        return fsspec.open(url, "rb")
    except ImportError:
        known = known_implementations.get(scheme.split("::")[-1], {"class": "?"})
        package = known["class"].split(".")[0]
        raise _Failure(
            f"reading {scheme}:// needs the package {package} (pip install {package})", False
        ) from None
    except ValueError as error:
        if "Protocol not known" in str(error):
            raise _Failure(f"fsspec knows no protocol '{scheme}'", False) from None
        raise _Failure(str(error), False) from None


def _local_reason(error: OSError) -> str:
    if isinstance(error, FileNotFoundError):
        return "not found"
    return (error.strerror or str(error)).lower()


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
        self, cache_dir: str | Path, limit_bytes: int, policy: FetchPolicy = FetchPolicy()
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.limit_bytes = limit_bytes
        self.policy = policy
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
                f"({_mb(size)}); raise it (to a few shards at least)"
            )
        try:
            return self._open_remote(url, size, md5)
        except _SinkError as error:
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
                _fetch(url, sink, self.policy, what="shard", size=size, md5=md5)
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
                    f"shard cache {self.cache_dir}: no room for shard {url} ({_mb(size)}) "
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
                f"({_mb(size)}); set dataset.cache_limit_gb lower (below the room on that "
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
        raise ShardUnavailable(f"shard {path}: {_local_reason(error)}") from None
    actual = os.fstat(handle.fileno()).st_size
    if actual != size:
        handle.close()
        if actual < size:
            raise ShardUnavailable(
                f"shard {path}: truncated: {actual:,} bytes of {size:,} the index lists"
            )
        raise ShardUnavailable(f"shard {path}: {actual:,} bytes, not the {size:,} the index lists")
    return handle
