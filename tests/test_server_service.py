"""The concurrent engine service (no HTTP): same answers as the single-caller API, admission by
KV capacity (requests wait instead of failing), cancellation and shutdown of pending requests.
Real engine on the tiny random Qwen3.5 MoE.
"""

from __future__ import annotations

import threading

import pytest

from ninfer_core.engine.request import StepOutput, Timings
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.engine.service import Admitted, EngineService, QueueFullError, ServiceStoppedError
from ninfer_core.errors import ContextLengthError
from ninfer_core.llm import ChatAssembler, ChatFinished, ChatRequest, PreparedChat
from server_harness import load_tiny_llm, wait_for, write_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [20, 21, 22, 23, 24], [30, 31]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory, "tiny_service")[0]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens_of(stream) -> list[int]:
    return [t for item in stream if isinstance(item, StepOutput) for t in item.new_token_ids]


def test_service_chat_equals_llm_chat(model_dir):
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}], sampling=greedy(10))
    expected = load_tiny_llm(model_dir).chat_result(request)
    with EngineService(load_tiny_llm(model_dir)) as service:
        events = list(service.chat(request))
    result = events[-1].result
    assert isinstance(events[-1], ChatFinished)
    assert (result.token_ids, result.text, result.reasoning) == (expected.token_ids, expected.text, expected.reasoning)
    assert result.reasoning_tokens == 10  # the prompt opened <think> and no </think> came (random model)
    assert not any(isinstance(e, Admitted) for e in events)


def test_first_start_warms_the_engine_thread_and_forgets_it(model_dir, monkeypatch):
    """start() returns after a throw-away request ran in the engine thread (its per-thread state is
    then made before the first user's request), once per service; counters and prefix cache show
    nothing of it, and answers are unchanged."""
    llm = load_tiny_llm(model_dir)
    expected = [t for o in llm.complete(PROMPTS[0], greedy(6)) for t in o.new_token_ids]
    llm.engine.cache.forget_prefixes()
    ran_in: list[str] = []
    warm_thread = llm.engine.warm_thread
    monkeypatch.setattr(llm.engine, "warm_thread", lambda: (ran_in.append(threading.current_thread().name), warm_thread()))
    service = EngineService(llm)
    service.start()
    assert ran_in == ["ninfer-engine"]
    stats = llm.engine.stats()
    assert (stats.requests_finished, stats.prompt_tokens, stats.generated_tokens, stats.decode_steps) == (0, 0, 0, 0)
    assert stats.last_prefill_tok_s == stats.last_decode_tok_s == 0.0  # no rate of the throw-away requests
    assert llm.engine.cache.prefix_cached_bytes == 0
    assert tokens_of(service.submit(PROMPTS[0], greedy(6))) == expected
    service.stop()
    service.start()  # a restart keeps its counters: no second throw-away request
    assert ran_in == ["ninfer-engine"]
    service.stop()


def test_admission_reaches_the_caller_before_the_first_step_ends(model_dir, monkeypatch):
    """Admitted is handed out while the engine runs the request's first step (a server starts its
    response meanwhile)."""
    llm = load_tiny_llm(model_dir)
    with EngineService(llm) as service:
        stepping, release = threading.Event(), threading.Event()
        step = llm.engine.step

        def gated_step():
            stepping.set()
            release.wait(30)
            return step()

        monkeypatch.setattr(llm.engine, "step", gated_step)
        items = iter(service.submit(PROMPTS[0], greedy(2)))
        first: list[object] = []
        reader = threading.Thread(target=lambda: first.append(next(items)))
        reader.start()
        try:
            assert stepping.wait(30)
            reader.join(10)
            assert first and isinstance(first[0], Admitted)
        finally:
            release.set()
            reader.join(30)
        assert len(tokens_of(items)) == 2


def test_kv_capacity_admission_queues_instead_of_failing(model_dir):
    """A cache too small for every answer at once: requests wait or are preempted and recomputed,
    never failed, and each gets its solo tokens."""
    serial = load_tiny_llm(model_dir)
    expected = [[t for o in serial.complete(p, greedy(20)) for t in o.new_token_ids] for p in PROMPTS]
    # 64 KV tokens = 4 pages of 16; each request may reach prompt + 20 <= 27 tokens = 2 pages: 2 fit at once
    llm = load_tiny_llm(model_dir, kv_capacity=64, max_seqs=4)
    with EngineService(llm) as service:
        assert service.context_limit == 64
        streams = [service.submit(p, greedy(20)) for p in PROMPTS]
        got = [tokens_of(s) for s in streams]
        stats = service.stats()
    assert got == expected
    assert stats.engine.preemptions > 0  # all four started (their prompts fit), the answers did not
    assert stats.engine.kv_used_tokens == 0 and stats.kv_reserved_tokens == 0
    with EngineService(llm) as service, pytest.raises(ContextLengthError) as err:
        service.submit(list(range(1, 70)), greedy(4))  # longer than the whole cache
    assert err.value.limit == 64 and err.value.prompt_tokens == 69


def test_cancel_queue_full_and_stop(model_dir):
    llm = load_tiny_llm(model_dir)
    service = EngineService(llm, max_concurrency=1, max_queue=1).start()
    running = service.submit(PROMPTS[0], greedy(200))
    first = iter(running)
    assert isinstance(next(first), Admitted)
    waiting = service.submit(PROMPTS[1], greedy(5))
    wait_for(lambda: service.stats().waiting == 1, what="the second request to queue")
    with pytest.raises(QueueFullError) as err:
        service.submit(PROMPTS[2], greedy(5))
    assert err.value.retry_after >= 1
    waiting.cancel()
    with pytest.raises(ServiceStoppedError, match="cancelled"):
        list(waiting)
    assert service.stats().waiting == 0
    queued = service.submit(PROMPTS[3], greedy(5))
    stopper = threading.Thread(target=service.stop)
    stopper.start()
    for stream in (running, queued):
        with pytest.raises(ServiceStoppedError, match="stopped"):
            list(stream)
    stopper.join(30)
    stats = service.stats()
    assert stats.engine.running == 0 and stats.engine.kv_used_tokens == 0 and stats.waiting == 0
    with pytest.raises(ServiceStoppedError):
        service.submit(PROMPTS[0], greedy(2))


@pytest.mark.parametrize("deltas, opened, expected", [
    (["ab", "c</th", "ink>", "\n\nhi", " there"], True, (3, "abc", "hi there")),  # </think> split over deltas
    (["\n<th", "ink>", "x", "</think>", "yo"], False, (4, "x", "yo")),  # an explicit <think> opens it
    (["<thi", "s is", " text"], False, (0, "", "<this is text")),  # looked like <think>, was not
    (["plain", " answer"], False, (0, "", "plain answer")),
])
def test_assembler_counts_reasoning_tokens(deltas, opened, expected):
    """One token per delta; reasoning tokens run up to the one that completes </think>."""
    assembler = ChatAssembler(PreparedChat(prompt="", prompt_token_ids=[1], starts_in_reasoning=opened))
    events = []
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        events += assembler.feed(StepOutput("r", [i], delta, finished=last, finish_reason="stop" if last else None,
                                            timings=Timings() if last else None))
    result = events[-1].result
    assert (result.reasoning_tokens, result.reasoning, result.text) == expected
