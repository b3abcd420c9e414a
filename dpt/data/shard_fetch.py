"""Shards and index files fetched from where `dataset=shards` points: a local path read in place,
HTTP(S) through urllib, anything else through fsspec (an object store: s3://, gs://, ...).

A source that does not answer (refused, timed out, 5xx) is retried with a doubling backoff for
`dataset.outage_s`, then the run stops (`SourceUnreachable`: the same command resumes); a
transfer that comes damaged (cut off, the wrong MD5) is retried `dataset.retries` times, then
the shard is skipped (`ShardUnavailable`). Each failure is one line naming the URL and why.
Downloads go into a file-like sink (dpt.data.shard_cache's pre-sized cache file), a chunk at a
time: a shard never sits whole in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import itertools
import logging
import re
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dpt.errors import DptError

log = logging.getLogger("dpt")

COPY_CHUNK = 1 << 20  # bytes per read and write of a download: shards never sit whole in memory
MAX_BACKOFF_S = 8.0
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-:]*://")  # also fsspec's chained "a::b://"
_RETRY_STATUS = (408, 429)  # 4xx that do pass: a slow request, a rate limit


class ShardUnavailable(DptError):
    """A shard (or index file) that cannot be had: one line naming the URL and why."""


class SourceUnreachable(ShardUnavailable):
    """The source failed for longer than `dataset.outage_s` in ways that pass (refused, timed
    out, 5xx): not one damaged shard to skip but data the run cannot do without; it stops."""


@dataclass(frozen=True)
class FetchPolicy:
    retries: int = 3  # tries after the first for a transfer that comes damaged (cut off, MD5)
    outage_s: float = 120.0  # how long a source that does not answer (refused, 5xx) is retried
    backoff_s: float = 0.5  # first wait; doubles each retry (capped at MAX_BACKOFF_S)
    timeout_s: float = 30.0  # per connect and per read (socket timeout; HTTP(S) only)


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


def megabytes(size: int) -> str:
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


class SinkError(Exception):
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
            raise ShardUnavailable(f"{what} {path}: {local_reason(error)}") from None
    sink = io.BytesIO()
    try:
        fetch(url, sink, policy, what=what, size=None, md5=None)
    except SinkError as error:  # a BytesIO does not fail short of memory
        raise error.error from None
    return sink.getvalue()


def fetch(
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
            chunk = source.read(COPY_CHUNK)
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
        raise SinkError(error) from None


def _fsspec_try(
    url: str, sink: _Sink, policy: FetchPolicy, size: int | None, digest: _Hash | None
) -> int:
    opened = _fsspec_open(url)
    try:
        with opened as source:
            return _copy(source, sink, size, digest, policy, "the file ended")
    except (_Failure, SinkError):
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


def local_reason(error: OSError) -> str:
    if isinstance(error, FileNotFoundError):
        return "not found"
    return (error.strerror or str(error)).lower()
