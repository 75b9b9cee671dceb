"""Ask the hub which files a commit holds, with sizes and hashes (one `model_info` call)."""

from __future__ import annotations

from typing import Callable

from huggingface_hub import HfApi
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .errors import HubError, HubOfflineError, ModelNotFoundError
from .files import RemoteFile, RepoSnapshot
from .retry import (
    RETRYABLE_STATUS,
    TRANSPORT_ERRORS,
    RetryPolicy,
    TransientError,
    retry_after_seconds,
    run_with_retries,
)


def hub_http_error(e: HfHubHTTPError, repo_id: str, endpoint: str) -> HubError | TransientError:
    """A clear message for a hub HTTP error, or TransientError when it is worth retrying."""
    status = e.response.status_code if e.response is not None else None
    if isinstance(e, GatedRepoError) or status == 403:
        return HubError(
            f"{repo_id} is gated: accept its terms at {endpoint}/{repo_id} and set HF_TOKEN "
            "(or run `hf auth login`) with an account that has access"
        )
    if isinstance(e, RepositoryNotFoundError) or status == 401:
        return ModelNotFoundError(
            f"{repo_id}: no such model repository on {endpoint} (or it is private: set HF_TOKEN to a token with access)"
        )
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFoundError(f"{repo_id}: no such revision (branch, tag or commit)")
    if status in RETRYABLE_STATUS:
        return TransientError(f"{repo_id}: hub answered HTTP {status}", retry_after_seconds(e.response.headers))
    return HubError(f"{repo_id}: hub request failed (HTTP {status}): {str(e).splitlines()[0]}")


def offline_error(repo_id: str) -> HubOfflineError:
    return HubOfflineError(
        f"cannot download {repo_id}: offline mode is on (HF_HUB_OFFLINE=1); unset HF_HUB_OFFLINE to pull, "
        "or use a model already on disk (`ninfer ls`)"
    )


def fetch_snapshot(
    repo_id: str,
    revision: str,
    *,
    endpoint: str,
    token: str | bool | None,
    policy: RetryPolicy,
    on_retry: Callable[[int, float, str], None],
    should_stop: Callable[[], bool],
) -> RepoSnapshot:
    """The commit `revision` resolves to and every file in it, with size and digest."""
    api = HfApi(endpoint=endpoint, token=token)

    def attempt() -> RepoSnapshot:
        try:
            info = api.model_info(repo_id, revision=revision, files_metadata=True)
        except OfflineModeIsEnabled:
            raise offline_error(repo_id) from None
        except HfHubHTTPError as e:
            raise hub_http_error(e, repo_id, endpoint) from None
        except TRANSPORT_ERRORS as e:
            raise TransientError(f"{repo_id}: cannot reach {endpoint} ({type(e).__name__}: {e})") from None
        return _snapshot(info, repo_id, revision)

    return run_with_retries(attempt, policy, on_retry, should_stop)


def _snapshot(info, repo_id: str, revision: str) -> RepoSnapshot:
    if not info.sha or info.siblings is None:
        raise HubError(f"{repo_id}: the hub's answer has no commit or file list")
    files = []
    for s in info.siblings:
        if s.size is None:
            raise HubError(f"{repo_id}: the hub gave no size for {s.rfilename}")
        if s.lfs is not None:
            files.append(RemoteFile(s.rfilename, int(s.lfs.size), s.lfs.sha256.lower(), lfs=True))
        elif s.blob_id:
            files.append(RemoteFile(s.rfilename, int(s.size), s.blob_id.lower(), lfs=False))
        else:
            raise HubError(f"{repo_id}: the hub gave no hash for {s.rfilename}, so it cannot be verified")
    return RepoSnapshot(repo_id=repo_id, revision=revision, commit=info.sha, files=tuple(files))
