"""`threads.release_openmp_workers`: the engine thread's start frees the loading thread's OpenMP
pool (its idle workers made libgomp stop spinning for the engine thread's ops)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ninfer_core import threads


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(threads._loaded_libgomp() is None, reason="torch runs without GNU OpenMP here")
def test_the_released_pool_ends_its_workers_and_ops_still_run():
    seen: dict[str, object] = {}

    def work() -> None:  # a thread of its own: the test leaves the main thread's pool alone
        torch.set_num_threads(2)
        x = torch.arange(1 << 20, dtype=torch.float32)
        torch.add(x, x)  # large enough to run as a parallel region: a worker joins this thread's team
        seen["with_pool"] = _tasks()
        seen["released"] = threads.release_openmp_workers()
        seen["without_pool"] = _tasks()
        seen["sum"] = float(torch.add(x, x).sum())  # a new pool, the same result

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen["released"] is True
    assert seen["without_pool"] < seen["with_pool"]
    assert seen["sum"] == float((2 * torch.arange(1 << 20, dtype=torch.float64)).sum())


def test_a_cpu_service_releases_the_starting_threads_pool(tmp_path_factory, monkeypatch):
    """Starting a CPU engine's service frees the starting thread's pool (the thread that loaded the
    model), once, before the engine thread runs its first op; the service then answers."""
    from ninfer_core.engine import service as service_module
    from ninfer_core.engine.sampling import SamplingParams
    from server_harness import load_tiny_llm, write_model

    directory, _ = write_model(tmp_path_factory, "tiny_openmp")
    llm = load_tiny_llm(directory)
    calls = []
    monkeypatch.setattr(service_module, "release_openmp_workers", lambda: calls.append(threading.current_thread()))
    with service_module.EngineService(llm) as service:
        assert calls == [threading.current_thread()]
        stream = service.submit([5, 17, 42], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        tokens = [t for event in stream if not isinstance(event, service_module.Admitted) for t in event.new_token_ids]
        assert len(tokens) == 3
