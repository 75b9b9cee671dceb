"""Download one file into the Hugging Face cache's blob store: resume, retry, hash while streaming.

Why not `hf_hub_download`: in huggingface_hub 2.x it reports progress only through a tqdm class,
retries dropped connections but neither 5xx answers nor short bodies, cannot be cancelled, never
checks sha256, and for Xet-backed repositories hands the transfer to hf_xet, where HTTP Range
resume and our progress events do not reach. The hub's resolve URL serves every file (Xet-backed
ones through a redirect to a CDN that honours Range), so this module streams it with a plain GET
on huggingface_hub's own HTTP client; metadata, URLs, cache paths and the token still come from
huggingface_hub.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable

from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import hf_raise_for_status

from .errors import HubError, IntegrityError, PullCancelled
from .events import EventCallback, FileStarted, Retry
from .files import RemoteFile
from .hashing import new_hasher, update_from_file
from .layout import RepoCache
from .meter import ProgressReporter
from .metadata import hub_http_error
from .retry import (
    RETRYABLE_STATUS,
    TRANSPORT_ERRORS,
    RetryPolicy,
    TransientError,
    retry_after_seconds,
    run_with_retries,
)


@dataclass(frozen=True)
class Transport:
    """What every file download of one pull shares."""

    session: Any  # huggingface_hub.utils.get_session(): an httpx(2).Client
    headers: dict[str, str]  # auth and user agent (huggingface_hub.utils.build_hf_headers)
    timeout: float
    repo_id: str
    endpoint: str
    policy: RetryPolicy
    emit: EventCallback
    should_stop: Callable[[], bool]


@dataclass
class _Partial:
    """The bytes of a file on disk so far, and their running hash."""

    file: RemoteFile
    out: BinaryIO
    done: int
    hasher: Any = field(init=False)
    fetched: int = 0  # bytes received over the network by this pull

    def __post_init__(self) -> None:
        self.hasher = new_hasher(self.file)

    def restart(self) -> None:
        self.out.seek(0)
        self.out.truncate()
        self.hasher = new_hasher(self.file)
        self.done = 0


def download_file(url: str, file: RemoteFile, cache: RepoCache, t: Transport) -> int:
    """Fetch `file` into `cache.blob(file.digest)`; returns the bytes that came over the network.

    A `{digest}.incomplete` file left by an interrupted pull continues with a Range request. The
    blob appears only once size and digest match; on a mismatch the partial file is deleted and
    IntegrityError raised (the bytes are not retried: a corrupting server or proxy would loop).
    """
    path = cache.incomplete(file.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > file.size:
        path.unlink()
    with open(path, "ab") as out:
        partial = _Partial(file, out, done=0)
        partial.done = update_from_file(partial.hasher, path, should_stop=t.should_stop) if out.tell() else 0
        t.emit(FileStarted(file.name, file.size, partial.done))
        reporter = ProgressReporter(t.emit, file.name, "download", file.size)
        run_with_retries(
            lambda: _attempt(url, partial, reporter, t),
            t.policy,
            lambda attempt, delay, reason: t.emit(Retry(file.name, attempt, delay, reason)),
            t.should_stop,
        )
    actual = partial.hasher.hexdigest()
    if actual != file.digest:
        path.unlink()
        raise IntegrityError(
            f"{file.name}: {file.algorithm} mismatch: the hub lists {file.digest}, the download hashes to {actual}; "
            "the bad file was deleted and nothing was marked ready (pull again; if it recurs, a proxy or the "
            "server is corrupting the data)"
        )
    os.replace(path, cache.blob(file.digest))
    return partial.fetched


def _attempt(url: str, partial: _Partial, reporter: ProgressReporter, t: Transport) -> None:
    file = partial.file
    if partial.done == file.size:
        return
    start = partial.done
    headers = dict(t.headers, **{"Accept-Encoding": "identity"})  # byte ranges and sizes of the stored file
    if start:
        headers["Range"] = f"bytes={start}-"
    try:
        with t.session.stream("GET", url, headers=headers, timeout=t.timeout) as response:
            _check_status(response, partial, t)
            reporter.restart(partial.done)
            for chunk in response.iter_bytes():
                if t.should_stop():
                    raise PullCancelled("cancelled")
                partial.out.write(chunk)
                partial.hasher.update(chunk)
                partial.done += len(chunk)
                partial.fetched += len(chunk)
                if partial.done > file.size:
                    partial.out.flush()
                    raise IntegrityError(f"{file.name}: the server sent more than the {file.size} bytes the hub lists")
                reporter.update(partial.done)
    except TRANSPORT_ERRORS as e:
        partial.out.flush()
        raise TransientError(
            f"{file.name}: {type(e).__name__} after {partial.done} of {file.size} bytes ({e})",
            progressed=partial.done > start,
        ) from None
    partial.out.flush()
    if partial.done < file.size:
        raise TransientError(
            f"{file.name}: body ended after {partial.done} of {file.size} bytes", progressed=partial.done > start
        )


def _check_status(response, partial: _Partial, t: Transport) -> None:
    """Accept 200/206 (restarting the file when a Range was ignored); raise for everything else."""
    status = response.status_code
    name = partial.file.name
    if status == 206:
        content_range = response.headers.get("Content-Range", "")
        if not content_range.startswith(f"bytes {partial.done}-"):
            raise HubError(f"{name}: asked for bytes from {partial.done}, the server sent '{content_range}'")
        return
    if status == 200:
        if partial.done:
            partial.restart()  # the server ignored Range: take the whole body from the start
        return
    if status == 416:  # our partial file does not fit the remote one: start over
        partial.restart()
        raise TransientError(f"{name}: server refused the byte range; restarting the file")
    if status in RETRYABLE_STATUS:
        raise TransientError(f"{name}: HTTP {status}", retry_after_seconds(response.headers))
    response.read()
    try:
        hf_raise_for_status(response)
    except HfHubHTTPError as e:
        raise hub_http_error(e, t.repo_id, t.endpoint) from None
    raise HubError(f"{name}: unexpected HTTP {status} from {response.url}")
