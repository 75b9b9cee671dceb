"""`pull`: download a model's inference files, verify every one, and mark the model ready.

Order: the repository listing (commit, sizes, hashes), then the small files one by one (so an
architecture ninfer cannot run is refused before any weights move), then the weights on a few
threads. A file already in the cache is not downloaded again; it is re-hashed unless the registry
saw it verified with the same modification time. The model becomes ready (its registry entry
written) only after every file matched the hub's hash.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import constants, hf_hub_url
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import WeakFileLock, build_hf_headers, get_session, validate_repo_id

from ..errors import ModelLoadError
from .aliases import resolve_alias
from .download import Transport, download_file
from .errors import HubError, PullCancelled
from .events import Done, Event, EventCallback, Failed, FileVerified, PullStarted, Retry
from .files import RemoteFile, RepoSnapshot, select_files
from .hashing import file_matches
from .layout import RepoCache, hub_cache_dir
from .meter import ProgressReporter
from .metadata import fetch_snapshot, offline_error
from .registry import FileRecord, ModelEntry, Registry, entry_key
from .retry import RetryPolicy
from .summary import ModelSummary, summarize_checkpoint, summarize_gguf


@dataclass(frozen=True)
class PullOptions:
    max_workers: int = 4  # weight files downloaded at once
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    endpoint: str | None = None  # default: HF_ENDPOINT
    token: str | bool | None = None  # default: HF_TOKEN or the saved `hf auth login` token
    cache_dir: Path | None = None  # default: HF_HUB_CACHE ($HF_HOME/hub)
    timeout: float | None = None  # seconds without data before a retry; default: HF_HUB_DOWNLOAD_TIMEOUT


def parse_spec(spec: str, revision: str | None = None) -> tuple[str, str]:
    """(repo id, revision) from `alias`, `org/name` or either with `@revision`."""
    name, at, spec_revision = spec.partition("@")
    if at and revision and revision != spec_revision:
        raise HubError(f"'{spec}' names revision '{spec_revision}' but --revision says '{revision}'")
    alias = resolve_alias(name)
    repo_id = alias.repo_id if alias else name
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"'{name}' is neither a model alias nor a hub repository id ({e})") from None
    if "/" not in repo_id:
        raise HubError(f"'{name}' is not a known alias (see `ninfer ls --aliases`); name a hub repository as org/name")
    return repo_id, (spec_revision if at else revision) or "main"


class _Emitter:
    """Calls the user's callback one event at a time, whichever thread the event comes from."""

    def __init__(self, callback: EventCallback | None):
        self._callback = callback
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        if self._callback is not None:
            with self._lock:
                self._callback(event)


class _Pull:
    def __init__(self, spec, revision, gguf_file, on_event, cancel, options: PullOptions, registry: Registry):
        self.spec, self.requested_revision = spec, revision
        self.repo_id, self.revision = spec, revision or "main"  # until parsed, for messages
        self.gguf_file = gguf_file
        self.emit = _Emitter(on_event)
        self.cancel = cancel
        self.options = options
        self.registry = registry
        self.stop = threading.Event()  # set when one file fails, to stop the others
        self.endpoint = (options.endpoint or constants.ENDPOINT).rstrip("/")

    def should_stop(self) -> bool:
        return self.stop.is_set() or (self.cancel is not None and self.cancel.is_set())

    def run(self) -> ModelEntry:
        try:
            return self._run()
        except PullCancelled:
            message = f"{self.repo_id}: pull cancelled; partial files are kept and the next pull resumes them"
            self.emit(Failed(None, message))
            raise PullCancelled(message) from None
        except HubError as e:
            self.emit(Failed(None, str(e)))
            raise
        except OSError as e:  # disk full, permissions: say where
            message = f"{self.repo_id}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
            self.emit(Failed(None, message))
            raise HubError(message) from None

    def _run(self) -> ModelEntry:
        started = time.monotonic()
        self.repo_id, self.revision = parse_spec(self.spec, self.requested_revision)
        if constants.HF_HUB_OFFLINE:
            raise offline_error(self.repo_id)
        snapshot = fetch_snapshot(
            self.repo_id, self.revision, endpoint=self.endpoint, token=self.options.token,
            policy=self.options.retry, should_stop=self.should_stop,
            on_retry=lambda attempt, delay, reason: self.emit(Retry("metadata", attempt, delay, reason)),
        )
        files = select_files(snapshot, self.gguf_file)
        gguf_name = files[0].name if self.gguf_file else None
        cache = RepoCache(self.options.cache_dir or hub_cache_dir(), snapshot.repo_id)
        key = entry_key(snapshot.repo_id, gguf_name)
        previous = self.registry.load(key)
        known = self._verified_records(key, previous)
        entry = ModelEntry(
            key=key, repo_id=snapshot.repo_id, revision=self.revision, commit=snapshot.commit,
            gguf_file=gguf_name, cache_dir=str(cache.cache_dir),
            files={f.name: FileRecord.of(f, None) for f in files},
        )
        _check_disk_space(files, cache)
        self.registry.save_partial(entry)
        self.emit(PullStarted(snapshot.repo_id, self.revision, snapshot.commit, tuple((f.name, f.size) for f in files)))
        transport = Transport(
            session=get_session(), headers=build_hf_headers(token=self.options.token),
            timeout=self.options.timeout or constants.HF_HUB_DOWNLOAD_TIMEOUT, repo_id=snapshot.repo_id,
            endpoint=self.endpoint, policy=self.options.retry, emit=self.emit, should_stop=self.should_stop,
        )
        small, large = [f for f in files if not f.lfs], [f for f in files if f.lfs]
        downloaded = self._fetch_all(small, 1, entry, cache, snapshot, transport, known)
        summary = None if gguf_name else self._checkpoint_summary(entry)
        downloaded += self._fetch_all(large, self.options.max_workers, entry, cache, snapshot, transport, known)
        cache.write_ref(self.revision, snapshot.commit)
        entry.summary = summary or self._gguf_summary(entry)
        entry.verified_at = time.time()
        self.registry.save_ready(entry)
        if previous is not None and previous.commit != entry.commit:
            cache.remove_files(previous.commit, {r.name: r.digest for r in previous.files.values()})
        self.emit(Done(entry.key, entry.path, downloaded, time.monotonic() - started))
        return entry

    def _verified_records(self, key: str, previous: ModelEntry | None) -> dict[str, FileRecord]:
        """Files an earlier pull of this model verified, by digest (valid across commits)."""
        known = {}
        for entry in (previous, self.registry.load_partial(key)):
            if entry is not None:
                known.update({r.digest: r for r in entry.files.values() if r.verified_mtime_ns is not None})
        return known

    def _checkpoint_summary(self, entry: ModelEntry) -> ModelSummary:
        try:
            return summarize_checkpoint(entry.snapshot_dir)
        except ModelLoadError as e:
            raise HubError(f"{entry.repo_id}: ninfer cannot run this checkpoint (no weights downloaded): {e}") from None

    def _gguf_summary(self, entry: ModelEntry) -> ModelSummary:
        try:
            return summarize_gguf(entry.path)
        except ModelLoadError as e:
            raise HubError(f"{entry.key}: {e}") from None
        except (ValueError, OSError, KeyError) as e:
            raise HubError(f"{entry.key}: not a readable GGUF file ({e})") from None

    def _fetch_all(self, files, workers, entry, cache, snapshot, transport, known) -> int:
        """Fetch files on `workers` threads, recording each verified one; returns the bytes downloaded."""
        downloaded = 0
        errors: list[BaseException] = []
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = [pool.submit(self._fetch_file, f, cache, snapshot, transport, known.get(f.digest)) for f in files]
            try:
                for future in as_completed(futures):
                    try:
                        record, fetched = future.result()
                    except Exception as e:
                        errors.append(e)
                        self.stop.set()
                        continue
                    entry.files[record.name] = record
                    self.registry.save_partial(entry)
                    downloaded += fetched
            except BaseException:  # KeyboardInterrupt: stop the workers, keep their partial files
                self.stop.set()
                raise
        if errors:
            raise next((e for e in errors if not isinstance(e, PullCancelled)), errors[0])
        return downloaded

    def _fetch_file(
        self, f: RemoteFile, cache: RepoCache, snapshot: RepoSnapshot, transport: Transport, known: FileRecord | None
    ) -> tuple[FileRecord, int]:
        """Make the file's blob present and verified, link it into the snapshot; returns (record, bytes fetched)."""
        if self.should_stop():
            raise PullCancelled("cancelled")
        blob = cache.blob(f.digest)
        cache.lock(f.digest).parent.mkdir(parents=True, exist_ok=True)
        fetched = 0
        with WeakFileLock(cache.lock(f.digest)):
            if blob.exists() and not self._cached_blob_ok(f, blob, known):
                blob.unlink()
                reason = f"the cached copy does not match the hub's {f.algorithm}; downloading again"
                self.emit(Retry(f.name, 1, 0.0, reason))
            if blob.exists():
                self.emit(FileVerified(f.name, f.algorithm, f.digest, cached=True))
            else:
                url = hf_hub_url(snapshot.repo_id, f.name, revision=snapshot.commit, endpoint=self.endpoint)
                fetched = download_file(url, f, cache, transport)
                self.emit(FileVerified(f.name, f.algorithm, f.digest, cached=False))
            cache.link(snapshot.commit, f.name, f.digest)
            return FileRecord.of(f, blob.stat().st_mtime_ns), fetched

    def _cached_blob_ok(self, f: RemoteFile, blob: Path, known: FileRecord | None) -> bool:
        stat = blob.stat()
        if stat.st_size != f.size:
            return False
        if known is not None and known.verified_mtime_ns == stat.st_mtime_ns:
            return True
        reporter = ProgressReporter(self.emit, f.name, "hash", f.size)
        ok, _ = file_matches(f, blob, reporter.update, self.should_stop)
        return ok


def _check_disk_space(files: list[RemoteFile], cache: RepoCache) -> None:
    """Refuse to start a download that cannot fit on the cache's disk."""
    needed = 0
    for f in files:
        if not cache.blob(f.digest).exists():
            partial = cache.incomplete(f.digest)
            needed += f.size - (partial.stat().st_size if partial.exists() else 0)
    where = cache.cache_dir
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if needed > free:
        raise HubError(
            f"{cache.repo_id}: needs {needed / 1e9:.1f} GB more in {cache.cache_dir} but only {free / 1e9:.1f} GB "
            "are free (set HF_HOME or HF_HUB_CACHE to a bigger disk)"
        )


def pull(
    spec: str,
    revision: str | None = None,
    *,
    gguf_file: str | None = None,
    on_event: EventCallback | None = None,
    cancel: threading.Event | None = None,
    options: PullOptions | None = None,
    registry: Registry | None = None,
) -> ModelEntry:
    """Download and verify a model (alias, `org/name`, or `org/name@revision`); returns its ready entry.

    `gguf_file` picks one GGUF file of the repository (a path, or a unique part of the name such
    as "Q4_K_M") instead of the safetensors checkpoint. Setting `cancel` stops the pull soon after
    (PullCancelled); partial files stay and the next pull resumes them. Every failure raises a
    HubError subclass after a Failed event.
    """
    return _Pull(spec, revision, gguf_file, on_event, cancel, options or PullOptions(), registry or Registry()).run()
