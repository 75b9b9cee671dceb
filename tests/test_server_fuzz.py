"""Property-based fuzzing of every endpoint of the real server (tiny random Qwen3.5 MoE, CPU, real
uvicorn on loopback): well-formed requests with mutated fields, bodies that are not JSON, odd ids
in URLs. The property (fuzz_bodies.check_response): no 5xx, errors in the endpoint's shape,
streams without a server error. The suite's run is derandomized (repeatable). A long run draws
fresh examples each time (Hypothesis prints how to reproduce a failure) and prints the status
counts: `NINFER_FUZZ_EXAMPLES=2000 pytest -s tests/test_server_fuzz.py`.
"""

from __future__ import annotations

import os
from collections import Counter
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_bodies import ENDPOINTS, check_response, encode, mutated, raw_bodies
from ninfer_core.server.app import ServerHandle
from server_harness import serve_tiny

LONG_RUN = os.environ.get("NINFER_FUZZ_EXAMPLES")
FUZZ = settings(max_examples=int(LONG_RUN or 40), deadline=None, derandomize=not LONG_RUN, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STATUSES: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory, "tiny_fuzz", 1024)
    print("\nfuzz statuses:", ", ".join(f"{path} {status}: {n}" for (path, status), n in sorted(STATUSES.items())))


def send(handle: ServerHandle, path: str, content: bytes) -> int:
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", handle.url + path, content=content, headers=headers, timeout=120) as response:
        data = response.read()
    STATUSES[(path, response.status_code)] += 1
    is_stream = response.headers.get("content-type", "").startswith(("text/event-stream", "application/x-ndjson"))
    check_response(response, data if is_stream else None)
    return response.status_code


@pytest.mark.parametrize("path, base", ENDPOINTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(ENDPOINTS)])
def test_mutated_requests_never_get_a_server_error(server, path, base):
    @FUZZ
    @given(body=mutated(base))
    def run(body):
        send(server, path, encode(body))

    run()
    stats = server.service.stats()
    assert stats.engine.running == 0 and stats.waiting == 0  # nothing left behind


@FUZZ
@given(raw=raw_bodies, path=st.sampled_from(sorted({p for p, _ in ENDPOINTS})))
def test_bodies_that_are_not_json_requests_are_400(server, raw, path):
    assert send(server, path, raw) == 400


@FUZZ
@given(name=st.text(max_size=40), method=st.sampled_from(["GET", "DELETE"]),
       route=st.sampled_from(["/v1/responses/", "/v1/models/"]))
def test_odd_ids_in_urls_are_4xx(server, name, method, route):
    response = httpx.request(method, server.url + route + quote(name.encode("utf-8", "surrogatepass"), safe=""),
                             timeout=30)
    STATUSES[(route, response.status_code)] += 1
    check_response(response)
