"""The prefix cache seen by clients: cached prompt tokens in every API's usage shape, the /metrics
counters, and answers equal to a server without the cache (tiny random Qwen3.5 MoE, CPU)."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

from ninfer_core.server.app import ServerHandle
from server_harness import load_tiny_llm, wait_for, write_model

SYSTEM = "You are a careful assistant. " * 45  # a shared system prompt past SPLIT_MIN (256 tokens): checkpointed


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory, "tiny_prefix_server")


@pytest.fixture(scope="module")
def servers(model):
    cached = ServerHandle.start(load_tiny_llm(model[0], max_context=512), port=0, model_id="m")
    plain = ServerHandle.start(load_tiny_llm(model[0], max_context=512, prefix_cache=False), port=0, model_id="m")
    yield cached, plain
    cached.stop()
    plain.stop()


def chat(server, question: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(
        model="m", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def test_cached_tokens_in_every_api_and_metrics(servers):
    cached, plain = servers
    first = chat(cached, "What is 2 + 2?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(cached, "And what is 3 + 3?")
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < hit < second.usage.prompt_tokens
    assert second.choices[0].message.content == chat(plain, "And what is 3 + 3?").choices[0].message.content

    client = openai.OpenAI(base_url=cached.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(model="m", max_output_tokens=4, instructions=SYSTEM, input="Hello?")
    assert response.usage.input_tokens_details.cached_tokens > 0
    long = SYSTEM + "Q: hi"  # a long prompt sent twice: all but its last token is cached
    completion = client.completions.create(model="m", prompt=long, max_tokens=3, temperature=0)
    completion_again = client.completions.create(model="m", prompt=long, max_tokens=3, temperature=0)
    assert completion.choices[0].text == completion_again.choices[0].text
    assert completion_again.usage.prompt_tokens_details.cached_tokens == completion_again.usage.prompt_tokens - 1
    streamed = list(client.completions.create(model="m", prompt=long, max_tokens=3, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == completion_again.usage.prompt_tokens - 1

    claude = anthropic.Anthropic(base_url=cached.url, api_key="x", max_retries=0)
    message = claude.messages.create(model="m", max_tokens=4, system=SYSTEM,
                                     messages=[{"role": "user", "content": "Hello there"}])
    assert message.usage.cache_read_input_tokens > 0
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > message.usage.cache_read_input_tokens

    metrics = httpx.get(cached.url + "/metrics").text
    hits = float(re.search(r"^ninfer_prefix_cache_hits_total (\S+)$", metrics, re.M).group(1))
    queries = float(re.search(r"^ninfer_prefix_cache_queries_total (\S+)$", metrics, re.M).group(1))
    assert 0 < hits < queries
    assert float(re.search(r"^ninfer_prefix_cache_bytes (\S+)$", metrics, re.M).group(1)) > 0


def test_a_burst_of_mixed_prompts_leaves_no_kv_held(servers):
    """16 concurrent requests (short and long prompts, streamed and not, some cancelled by their
    client mid-stream): afterwards no sequence holds a KV page or a slot."""
    import concurrent.futures

    cached, _ = servers
    client = openai.OpenAI(base_url=cached.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def one(i: int) -> None:
        messages = [{"role": "user", "content": ("word " * (5 + 25 * (i % 4))) + str(i)}]
        if i % 3 == 0:
            stream = client.chat.completions.create(model="m", messages=messages, max_tokens=30, stream=True)
            for n, _ in enumerate(stream):
                if i % 2 and n == 3:
                    stream.close()  # the client leaves mid-answer
                    return
        else:
            client.chat.completions.create(model="m", messages=messages, max_tokens=1 + i % 7)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(16)))
    service = cached.service
    wait_for(lambda: not service.stats().engine.running and not service.stats().waiting, what="the burst to end")
    stats = service.stats().engine
    assert stats.running == 0 and stats.kv_used_tokens == 0
    assert service.engine.cache.num_free_slots == service.engine.cache.max_seqs


def test_a_responses_conversation_by_previous_response_id_hits_the_cache(servers):
    """Turn 2 names turn 1 by `previous_response_id`: the server rebuilds the history, and its
    prefix (system prompt, turn 1's question and answer) comes from the cache, same answer as a
    server without it."""
    answers = []
    for server in servers:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        first = client.responses.create(model="m", max_output_tokens=6, temperature=0, instructions=SYSTEM,
                                        input="Name a colour.")
        second = client.responses.create(model="m", max_output_tokens=6, temperature=0, instructions=SYSTEM,
                                         input="And another one?", previous_response_id=first.id)
        answers.append((first.output_text, second.output_text, first.usage, second.usage))
    (cached_first, cached_second, turn1, usage), (plain_first, plain_second, _, plain_usage) = answers
    assert (cached_first, cached_second) == (plain_first, plain_second)
    assert plain_usage.input_tokens_details.cached_tokens == 0
    # the system prompt (45 x 6 tokens) at least, never turn 2's new message (Qwen's template drops
    # turn 1's reasoning from turn 2's history, so turn 1's answer itself is not reused)
    assert 270 <= usage.input_tokens_details.cached_tokens < usage.input_tokens
    assert turn1.input_tokens < usage.input_tokens
