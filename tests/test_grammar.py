"""Grammar-constrained decoding below the engine: the mask op against its reference, the UTF-8
filter against Python's decoder, the compiler's cache and errors, and constrained random walks
(random logits, the real mask and matcher) whose every end validates, over the tiny tokenizer and
the real Qwen3.6 vocabulary."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ninfer_core.chat.constraints import JsonOutput, ToolCallOutput, structural_tag
from ninfer_core.chat.output_parser import parse_output
from ninfer_core.engine.grammar import GrammarCompiler, GrammarError, GrammarMatcher, constrain
from ninfer_core.engine.utf8_mask import BOUNDARY, Utf8Filter
from ninfer_core.ops.token_mask import apply_token_mask, apply_token_mask_ref, words
from ninfer_core.tokenizer import Tokenizer
from qwen_assets import IM_END, THINK_END, qwen_tokenizer, qwen_tokenizer_dir  # noqa: F401 - fixtures
from tiny_model_dir import build_tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}}, "required": ["hourly"]},
    "note": {"type": ["string", "null"], "maxLength": 4}},
    "required": ["city", "code", "days"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tiny() -> tuple[Tokenizer, GrammarCompiler]:
    backend = build_tokenizer()
    eos = backend.token_to_id("<|im_end|>")
    tokenizer = Tokenizer(backend, eos_token_ids=[eos])
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size, [eos])


def walk(matcher: GrammarMatcher, vocab: int, seed: int, limit: int = 3000) -> tuple[list[int], bool]:
    """Sample from random logits through the mask until the grammar ends (or `limit` tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    while len(ids) < limit and not matcher.terminated:
        logits = constrain(torch.randn(1, vocab, generator=generator) * 3, [matcher])
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert matcher.accept(token)
        ids.append(token)
    return ids, matcher.terminated


def test_token_mask_kernel_matches_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(6, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words(vocab)), dtype=torch.int32, generator=generator)
    rows = [1, 4, 5]
    kernel, reference = logits.clone(), logits.clone()
    apply_token_mask(kernel, bitmask, rows)
    apply_token_mask_ref(reference, bitmask, rows)
    assert torch.equal(kernel, reference)
    assert torch.equal(kernel[[0, 2, 3]], logits[[0, 2, 3]])  # unconstrained rows untouched
    bits = [(int(bitmask[1, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
    assert [bool(b) for b in bits] == torch.isfinite(kernel[1]).tolist()


def test_utf8_filter_follows_the_unicode_table() -> None:
    vocab = [bytes([b]) for b in range(256)] + [b"\xe4\xb8", b"\xad", "é".encode(), b"\xed\xa0\x80", b"", b"ok"]
    utf8 = Utf8Filter.build(vocab)
    reject = len(utf8.masks)

    def run(*tokens: bytes) -> int:
        state = BOUNDARY
        for token in tokens:
            state = utf8.advance(state, vocab.index(token))
            if state == reject:
                return state
        return state

    assert run(b"\xe4\xb8", b"\xad") == BOUNDARY  # 中 across two tokens
    assert run("é".encode(), b"ok", b"") == BOUNDARY
    for bad in [(b"\xed", b"\xa0"), (b"\xf0", b"\x80"), (b"\xe0", b"\x80"), (b"\xc0",), (b"\xf4", b"\x90"),
                (b"\x80",), (b"\xed\xa0\x80",), (b"\xe4\xb8", b"a")]:
        assert run(*bad) == reject, bad
    for state in range(reject):  # the packed masks say exactly what next_state says
        allowed = [(int(utf8.masks[state, t // 32]) >> (t % 32)) & 1 == 1 for t in range(len(vocab))]
        assert allowed == [int(s) != reject for s in utf8.next_state[state]]
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):  # random allowed walks decode strictly
        state, text = BOUNDARY, b""
        for _ in range(30):
            options = [t for t in range(len(vocab)) if int(utf8.next_state[state, t]) != reject]
            token = options[int(torch.randint(len(options), (1,), generator=generator))]
            state, text = int(utf8.next_state[state, token]), text + vocab[token]
        if state == BOUNDARY:
            text.decode("utf-8")


def test_compiled_grammars_are_cached_by_constraint(tiny) -> None:
    _, compiler = tiny
    tag = structural_tag(JsonOutput(PERSON), reasoning=False)
    grammar = compiler.compile(tag)
    assert compiler.compile(json.loads(json.dumps(tag))) is grammar
    assert compiler.compile(structural_tag(JsonOutput(PERSON), reasoning=True)) is not grammar
    with pytest.raises(GrammarError, match="objectx"):
        compiler.compile(structural_tag(JsonOutput({"type": "objectx"}), reasoning=False))


def test_properties_come_in_the_schema_order(tiny) -> None:
    """As OpenAI's strict mode: a schema that puts `reasoning` before `answer` gets it first."""
    _, compiler = tiny
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"]}
    grammar = compiler.compile(structural_tag(JsonOutput(schema), reasoning=False))
    assert grammar.matcher().raw.accept_string('{"reasoning": "x", "answer": 1}')
    assert not grammar.matcher().raw.accept_string('{"answer": 1, "reasoning": "x"}')


@pytest.mark.parametrize("seed", range(12))
def test_json_schema_walks_validate(tiny, seed: int) -> None:
    tokenizer, compiler = tiny
    ids, ended = walk(compiler.compile(structural_tag(JsonOutput(PERSON), reasoning=False)).matcher(),
                      tokenizer.vocab_size, seed)
    assert ended and ids[-1] in compiler.stop_token_ids
    jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), PERSON)


@pytest.mark.parametrize("seed", range(12))
def test_forced_tool_call_walks_parse_to_valid_calls(tiny, seed: int) -> None:
    tokenizer, compiler = tiny
    tools = [WEATHER, PING]
    constraint = ToolCallOutput(tools, single=seed % 2 == 1)
    ids, ended = walk(compiler.compile(structural_tag(constraint, reasoning=False)).matcher(),
                      tokenizer.vocab_size, seed)
    assert ended
    parsed = parse_output(tokenizer.decode(ids[:-1]), starts_in_reasoning=False, tools=tools)
    assert parsed.content == "" and parsed.tool_calls and (len(parsed.tool_calls) == 1 or not constraint.single)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in parsed.tool_calls:
        assert call.complete
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_qwen_vocabulary_reasoning_then_json(qwen_tokenizer: Tokenizer) -> None:
    """The real vocabulary: </think> (one token) closes the reasoning, then only JSON of the
    schema, then only an end-of-answer token; <|im_end|> is never text."""
    compiler = GrammarCompiler(qwen_tokenizer, qwen_tokenizer.vocab_size, [IM_END])
    matcher = compiler.compile(structural_tag(JsonOutput(PERSON), reasoning=True)).matcher()
    for token in qwen_tokenizer.encode("Let me think.") + [THINK_END]:
        assert matcher.accept(token)
    ids, ended = walk(matcher, qwen_tokenizer.vocab_size, seed=3)
    assert ended and ids[-1] == IM_END and IM_END not in ids[:-1]
    text = qwen_tokenizer.decode(ids[:-1])
    assert text.startswith("\n\n")
    jsonschema.validate(json.loads(text), PERSON)
    fresh = compiler.compile(structural_tag(JsonOutput(PERSON), reasoning=False)).matcher()
    assert not fresh.accept(THINK_END)  # without thinking the answer starts with the JSON


@pytest.mark.cuda
def test_cuda_mask_kernel_and_sampler_keep_to_the_allowed_tokens() -> None:
    """xgrammar's Triton kernel = the reference on the GPU; the sampling kernel never draws a
    masked token, greedy or filtered (rows with very few tokens left take its full-vocabulary path)."""
    from ninfer_core.engine.sampling import Sampler, SamplingParams, TokenHistory

    generator = torch.Generator().manual_seed(0)
    vocab = 248_320
    logits = torch.randn(8, vocab, generator=generator).cuda()
    bitmask = torch.zeros(8, words(vocab), dtype=torch.int32)
    allowed = [torch.randperm(vocab, generator=generator)[: n] for n in (1, 2, 5, 50, 4000, 9000, 100_000, 3)]
    for row, ids in enumerate(allowed):
        for t in ids.tolist():
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    rows = list(range(8))
    kernel, reference = logits.clone(), logits.clone()
    apply_token_mask(kernel, bitmask.cuda(), rows)
    apply_token_mask_ref(reference, bitmask.cuda(), rows)
    assert torch.equal(kernel, reference)
    params = [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=i)
                                                    for i in range(6)]
    for _ in range(5):
        tokens = Sampler().sample(kernel, params, [TokenHistory([])] * 8,
                                  [None if p.is_greedy else p.make_generator("cuda") for p in params]).tolist()
        assert all(t in ids.tolist() for t, ids in zip(tokens, allowed))
