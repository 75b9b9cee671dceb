"""Prefix reuse (cache/prefix_cache.py) on a tiny Qwen3.5 MoE model (GDN + attention), CPU fp32, and on
the real SmolLM2 (no recurrent state).

The reference is the same engine with the prefix cache off: every answer must be identical, hit or
miss. Hits are checked through the engine's counters (prompt tokens served from the cache).
"""

from __future__ import annotations

import pytest
import torch

from ninfer_core.cache.prefix_cache import SPLIT_MIN, PrefixCache
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.llm import LLM, EngineOptions
from tiny_model_dir import write_tiny_model_dir

torch.set_num_threads(1)
SYSTEM = list(range(40, 90))  # a 50-token "system prompt" several requests share


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen_prefix")
    write_tiny_model_dir(directory, moe=True, max_positions=1024)
    return directory


def make_llm(directory, cache: bool = True, **overrides) -> LLM:
    options = dict(device="cpu", dtype="float32", max_seqs=4, max_context=512, prefix_cache=cache)
    return LLM.load(str(directory), EngineOptions(**{**options, **overrides}))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def answer(llm: LLM, prompt: list[int], params: SamplingParams | None = None) -> tuple[list[int], int]:
    """(tokens, prompt tokens served from the cache) of one request run alone."""
    outs = list(llm.engine.generate([GenerationRequest(prompt, params or greedy(10))]))
    return [t for o in outs for t in o.new_token_ids], outs[-1].timings.cached_tokens


def test_multi_turn_chat_reuses_prompt_and_answer(model_dir):
    """Turn 2 repeats turn 1's prompt and answer: it starts after both (the end-of-answer
    checkpoint), and every turn's answer equals the cache-off engine's."""
    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    history = SYSTEM + [7, 8, 9]
    for turn in range(4):
        want, _ = answer(plain, history)
        got, hit = answer(cached, history)
        assert got == want
        if turn:
            assert hit >= previous, (turn, hit, previous)  # at least the whole previous exchange
        previous = len(history) + len(got) - 1  # the last answer token was never fed
        history = history + got + [100 + turn, 101 + turn]
    stats = cached.stats()
    assert stats.prefix_hit_tokens > 0 and stats.prefix_queried_tokens > stats.prefix_hit_tokens


def test_branching_histories_share_the_common_prefix(model_dir):
    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    answer(cached, SYSTEM + [1, 2, 3])  # caches the system prompt's pages + a checkpoint at its end
    for branch in ([4, 5, 6, 7], [9, 9], list(range(200, 240))):
        prompt = SYSTEM + [1, 2, 3] + branch
        got, hit = answer(cached, prompt)
        assert got == answer(plain, prompt)[0]
        assert hit == len(SYSTEM) + 3  # the first request's whole prompt


def test_a_cached_prefix_longer_than_the_request(model_dir):
    """The request is a strict prefix of a cached prompt (or equals it): its last token is
    computed again (its logits are needed), so the hit stops before it."""
    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    long = SYSTEM + list(range(300, 340))
    answer(cached, long)
    for prompt in (long, long[:60], SYSTEM[:20]):
        got, hit = answer(cached, prompt)
        assert got == answer(plain, prompt)[0]
        assert hit < len(prompt)


def test_eviction_under_memory_pressure_stays_correct(model_dir):
    """A KV cache of 12 pages: each new prompt evicts older cached pages (and checkpoints holding
    the last one) to fit; answers never change, and a repeat after eviction is a plain miss."""
    cached = make_llm(model_dir, kv_capacity=192, max_seqs=2)
    plain = make_llm(model_dir, cache=False, kv_capacity=192, max_seqs=2)
    prompts = [[i] * 5 + list(range(10 * i, 10 * i + 90)) for i in range(1, 7)]
    for prompt in prompts + prompts[:2]:
        assert answer(cached, prompt)[0] == answer(plain, prompt)[0]
    cache = cached.engine.cache
    assert cache.active_tokens == 0 and cache.free_pages == cache.num_pages


def test_concurrent_sharers_hold_the_same_pages(model_dir):
    """Two requests with one long common prefix run together: the second shares the first's pages
    (each page held twice), and both answers equal the cache-off ones."""
    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    answer(cached, SYSTEM + list(range(300, 340)))
    engine = cached.engine
    a = GenerationRequest(SYSTEM + list(range(300, 340)) + [1], greedy(12))
    b = GenerationRequest(SYSTEM + list(range(300, 340)) + [2, 3], greedy(12))
    engine.add_request(a)
    engine.add_request(b)
    tokens: dict[str, list[int]] = {a.request_id: [], b.request_id: []}
    for out in engine.step():
        tokens[out.request_id] += out.new_token_ids
    seqs = {s.request_id: s for s in engine.running}
    shared = set(seqs[a.request_id].cache.pages) & set(seqs[b.request_id].cache.pages)
    assert len(shared) == (len(SYSTEM) + 40) // engine.cache.page_size
    assert all(engine.cache._refs[p] == 2 for p in shared)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens[a.request_id] == answer(plain, a.prompt_token_ids, greedy(12))[0]
    assert tokens[b.request_id] == answer(plain, b.prompt_token_ids, greedy(12))[0]


@pytest.mark.parametrize("spec", ["ngram", "mtp"])
def test_speculative_decoding_with_the_cache(model_dir, spec):
    cached, plain = make_llm(model_dir, spec=spec), make_llm(model_dir, cache=False, spec=spec)
    history = SYSTEM + [3]
    for _ in range(3):
        got, hit = answer(cached, history, greedy(12))
        assert got == answer(plain, history, greedy(12))[0]
        history = history + got + [5, 6]
    assert cached.stats().prefix_hit_tokens > 0


def test_sampled_answers_with_penalties_are_unchanged(model_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True,
                            presence_penalty=0.7, repetition_penalty=1.2)
    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    answer(cached, SYSTEM + [1], params)
    prompt = SYSTEM + [1, 2, 3]
    got, hit = answer(cached, prompt, params)
    assert hit > 0 and got == answer(plain, prompt, params)[0]


def test_checkpoints_stay_within_their_slots(model_dir):
    llm = make_llm(model_dir, prefix_cache_gb=1e-4)  # room for a handful of tiny-model checkpoints
    prefix = llm.engine.cache.prefix
    slots = len(prefix.free_slots)
    assert 0 < slots < 256
    for i in range(slots + 5):
        answer(llm, [i + 1] * 3 + SYSTEM)
    assert len(prefix.checkpoints) <= slots
    assert llm.stats().prefix_checkpoints == len(prefix.checkpoints)


def test_without_recurrent_state_whole_pages_are_resume_points():
    """A model without GDN layers resumes after any indexed full page its prompt repeats, with no
    checkpoint (and none of its state to copy); short of one token, as with a checkpoint."""
    from ninfer_core.cache.prefix_cache import page_hashes

    cache = PrefixCache(page_size=4, checkpoint_slots=[9], interval=16, stateless=True)
    tokens = list(range(1, 12))
    for page, h in enumerate(page_hashes(tokens, None, 4)):  # pages 0 and 1: tokens 1..8
        cache.index(page, h, tuple(tokens[4 * page : 4 * page + 4]))
    hit = cache.lookup(tokens + [50], None, 12)
    assert (hit.tokens, hit.pages, hit.checkpoint) == (8, [0, 1], None)
    assert cache.lookup(tokens[:8], None, 8).tokens == 4  # the last prompt token is always computed
    assert cache.lookup(tokens[:4] + [60] * 6, None, 10).pages == [0]
    assert cache.lookup([60] + tokens, None, 12) is None
    stateful = PrefixCache(page_size=4, checkpoint_slots=[9], interval=16)
    for page, h in enumerate(page_hashes(tokens, None, 4)):
        stateful.index(page, h, tuple(tokens[4 * page : 4 * page + 4]))
    assert stateful.lookup(tokens + [50], None, 12) is None  # a GDN state exists only at checkpoints


def test_a_model_without_recurrent_state_reuses_pages_and_short_prompts(smollm_path):
    """The README's model (Llama family, no GDN): a short prompt sent again (a regenerated answer)
    computes only its last token, a prompt sharing another's beginning resumes after their common
    whole pages, and every answer equals the cache-off engine's."""
    options = dict(device="cpu", max_seqs=2, max_context=512, kv_dtype="fp32")
    cached = LLM.load(str(smollm_path), EngineOptions(**options))
    plain = LLM.load(str(smollm_path), EngineOptions(**options, prefix_cache=False))
    page = cached.engine.cache.page_size
    short = list(range(1000, 1000 + 2 * page + 5))
    first, hit = answer(cached, short)
    assert hit == 0
    again, hit = answer(cached, short)
    assert first == again == answer(plain, short)[0] and hit == len(short) - 1
    other = short[: page + 3] + [7, 8, 9]  # shares one whole page and three tokens of the next
    got, hit = answer(cached, other)
    assert got == answer(plain, other)[0] and hit == page


def test_a_resumed_prompt_keeps_a_far_checkpoint_only_where_it_doubles_the_cached_prefix(model_dir):
    """A requested checkpoint before the prompt's last page is a fork far from the chunk's end: kept
    for a prompt that resumed from nothing, or where it at least doubles the cached prefix (a long
    new shared part), not where it adds a little to it (a continuing conversation's turn); one in the
    last page (a chat's answer start) always. Every answer equals the cache-off engine's."""
    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    prefix = cached.engine.cache.prefix

    def run(prompt: list[int], checkpoints: tuple[int, ...]) -> int:
        request = GenerationRequest(prompt, greedy(4), checkpoints=checkpoints)
        outs = list(cached.engine.generate([request]))
        assert [t for o in outs for t in o.new_token_ids] == answer(plain, prompt, greedy(4))[0]
        return outs[-1].timings.cached_tokens

    def taken() -> set[int]:
        return {c.tokens for c in prefix.checkpoints.values()}

    first = [40 + i % 200 for i in range(300)]
    assert run(first, (100,)) == 0 and {100, 299} <= taken()  # nothing cached: kept (and the split)
    grown = first[:299] + [7] * 40  # resumes at 299: 320 adds 21, 336 is in its last page
    assert run(grown, (320, 336)) == 299
    assert 320 not in taken() and 336 in taken()
    branch = first[:100] + [9] * 200  # resumes at 100: 250 more than doubles it
    assert run(branch, (250,)) == 100 and 250 in taken()


def test_lookup_matches_tokens_not_just_hashes():
    """An index entry whose stored tokens differ from the prompt's is not a hit (a hash collision
    cannot serve another text)."""
    cache = PrefixCache(page_size=4, checkpoint_slots=[9], interval=16)
    from ninfer_core.cache.prefix_cache import Checkpoint, page_hashes

    tokens = [1, 2, 3, 4, 5, 6]
    (h,) = page_hashes(tokens, None, 4)
    cache.index(0, h, (1, 2, 3, 9))  # a corrupted entry under the right hash
    cache.add(Checkpoint(6, h, (5, 6), 9, None))
    assert cache.lookup(tokens + [7], None, 7) is None


def test_the_same_long_prompt_again_misses_one_token(model_dir):
    """A long prompt is checkpointed one token before its end (inside its one prompt chunk): sent
    again (a regenerated answer), only its last token is computed; short prompts are not split (the checkpoint at their end
    serves prompts that extend them)."""
    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    long = [40 + i % 300 for i in range(300)]
    first, _ = answer(cached, long)
    assert cached.stats().prefill_chunks == 1  # the checkpoint is a fork inside the one chunk
    again, hit = answer(cached, long)
    assert first == again == answer(plain, long)[0] and hit == len(long) - 1
    short = SYSTEM + [1]
    answer(cached, short)
    assert answer(cached, short)[1] < len(short) - 1


def test_chat_requests_checkpoint_where_their_last_message_starts(model_dir):
    """A chat's prompt asks for a checkpoint where its last message starts: two questions under one
    system prompt share everything before the second question, whatever its length."""
    from ninfer_core.llm import ChatRequest

    llm = make_llm(model_dir)
    system = {"role": "system", "content": "You answer in one word. " * 16}
    first = ChatRequest([system, {"role": "user", "content": "Capital of France?"}], sampling=greedy(4))
    prepared = llm.prepare_chat(first)
    start, _answer_start = prepared.checkpoints
    history = llm.tokenizer.encode(llm.template.render([system], add_generation_prompt=False))
    assert prepared.prompt_token_ids[:start] == history[:start] and SPLIT_MIN <= start < len(prepared.prompt_token_ids)
    chunks = llm.stats().prefill_chunks
    llm.chat_result(first)
    assert llm.stats().prefill_chunks == chunks + 1  # the checkpoint is a fork inside the one chunk
    second = llm.chat_result(ChatRequest([system, {"role": "user", "content": "And of Spain, please?"}],
                                         sampling=greedy(4)))
    assert second.timings.cached_tokens == start


def test_a_short_history_takes_no_checkpoint(model_dir):
    """Under SPLIT_MIN tokens of history a chat asks for no checkpoint where its last message starts
    (the fork would cost its first send more than a resume there saves): its prompt runs plain, and
    a second question under the same short system prompt starts from scratch."""
    from ninfer_core.llm import ChatRequest

    llm = make_llm(model_dir)
    system = {"role": "system", "content": "You answer in one word. " * 10}
    first = ChatRequest([system, {"role": "user", "content": "Capital of France?"}], sampling=greedy(4))
    assert llm.prepare_chat(first).checkpoints == ()
    llm.chat_result(first)
    second = llm.chat_result(ChatRequest([system, {"role": "user", "content": "And of Spain, please?"}],
                                         sampling=greedy(4)))
    assert second.timings.cached_tokens == 0


def test_the_next_turn_resumes_at_the_answer_start(model_dir):
    """A long chat prompt also asks for a checkpoint after its assistant header, before the
    `<think>` opener the next turn's history drops: turn 2 recomputes only turn 1's answer and its
    own question, not turn 1's long question; answers equal the cache-off engine's."""
    from ninfer_core.llm import ChatRequest

    cached, plain = make_llm(model_dir), make_llm(model_dir, cache=False)
    question = {"role": "user", "content": "Please review this code: " + "x = x + 1\n" * 30}
    first = ChatRequest([question], sampling=greedy(6))
    prepared = cached.prepare_chat(first)
    assert len(prepared.prompt_token_ids) >= 256
    answer_start = prepared.checkpoints[-1]
    assert cached.tokenizer.decode(prepared.prompt_token_ids[answer_start:]) == "<think>\n"
    chunks = cached.stats().prefill_chunks
    reply = cached.chat_result(first)
    assert reply.token_ids == plain.chat_result(first).token_ids
    assert cached.stats().prefill_chunks == chunks + 1  # forked at the answer start, not split there
    turn2 = ChatRequest([question, {"role": "assistant", "content": reply.text or "ok"},
                         {"role": "user", "content": "And now?"}], sampling=greedy(6))
    second = cached.chat_result(turn2)
    assert second.token_ids == plain.chat_result(turn2).token_ids
    assert second.timings.cached_tokens == answer_start


def test_a_failed_forward_gives_its_fork_slots_back(model_dir):
    """A step whose forward fails after its prompt chunk reserved a checkpoint slot for a fork (the
    long prompt's last-but-one token) hands the slot back: the free checkpoint slots are as before,
    and the engine serves the prompt afterwards with the usual fork."""
    llm = make_llm(model_dir)
    engine, prefix = llm.engine, llm.engine.cache.prefix
    free = len(prefix.free_slots)
    long = [40 + i % 300 for i in range(300)]
    engine.add_request(GenerationRequest(long, greedy(2)))
    forward, reserved = engine._forward, []

    def failing(parts):
        reserved.extend(len(p.fork.tokens) for p in parts if p.fork is not None)
        raise RuntimeError("a kernel failed")

    engine._forward = failing
    with pytest.raises(RuntimeError, match="a kernel failed"):
        engine.step()
    assert reserved == [1] and len(prefix.free_slots) == free
    engine._forward = forward
    for request_id in [s.request_id for s in engine.scheduler.running]:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    assert answer(llm, long)[0] == answer(make_llm(model_dir, cache=False), long)[0]
