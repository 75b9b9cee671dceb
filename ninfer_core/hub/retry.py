"""Retries with exponential backoff for transient hub failures (5xx, 429, dropped connections).

huggingface_hub >= 1.0 talks HTTP through httpx (renamed httpx2 in 2.x); we use the same client
(`huggingface_hub.utils.get_session`), so proxies, offline mode and its request hooks apply, and
its exception classes tell transient transport errors from the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from .errors import HubError, PullCancelled

try:
    import httpx2 as httpx  # huggingface_hub 2.x
except ImportError:  # pragma: no cover - huggingface_hub 1.x
    import httpx  # type: ignore[no-redef]

T = TypeVar("T")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
TRANSPORT_ERRORS = (httpx.TransportError,)  # connect / read errors, timeouts, truncated bodies


class TransientError(Exception):
    """One attempt failed in a way worth retrying. `progressed`: bytes arrived before it failed."""

    def __init__(self, reason: str, retry_after: float | None = None, progressed: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.progressed = progressed


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6  # consecutive failed attempts before giving up
    base_s: float = 1.0  # first delay; doubles after each failure
    max_s: float = 30.0

    def delay(self, failure: int, retry_after: float | None = None) -> float:
        """Delay after the `failure`-th consecutive failure (1, 2, ...): base * 2^(n-1), capped."""
        backoff = self.base_s * 2 ** (failure - 1)
        if retry_after is not None:
            backoff = max(backoff, retry_after)
        return min(backoff, self.max_s)


def retry_after_seconds(headers) -> float | None:
    value = headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:  # an HTTP date: not worth parsing, the backoff covers it
        return None


def sleep_unless_stopped(seconds: float, should_stop: Callable[[], bool]) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if should_stop():
            raise PullCancelled("cancelled")
        time.sleep(min(left, 0.05))


def run_with_retries(
    attempt: Callable[[], T],
    policy: RetryPolicy,
    on_retry: Callable[[int, float, str], None],
    should_stop: Callable[[], bool],
) -> T:
    """Call `attempt` until it returns; TransientError means try again after a backoff.

    The failure count restarts whenever an attempt made progress, so a long download over a
    flaky link is not abandoned for failures spread over hours.
    """
    failures = 0
    while True:
        try:
            return attempt()
        except TransientError as e:
            failures = 1 if e.progressed else failures + 1
            if failures >= policy.attempts:
                raise HubError(f"{e.reason} (gave up after {failures} attempts)") from None
            delay = policy.delay(failures, e.retry_after)
            on_retry(failures, delay, e.reason)
            sleep_unless_stopped(delay, should_stop)
