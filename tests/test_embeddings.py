"""Embeddings: the engine's (the final norm of the prompt's last token's hidden state) against
transformers' last_hidden_state, and the served endpoints through real clients: OpenAI's /v1/embeddings
with the `openai` package (its default asks for base64 and decodes it), Ollama's /api/embed and
/api/embeddings with httpx."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from ninfer_core.embeddings import normalized
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.errors import NinferError
from server_harness import MAX_CONTEXT, load_tiny_llm, serve, write_model

PROMPTS = [[5, 9, 33, 41, 7, 100, 3], list(range(50, 150)), [12]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory, "tiny_embeddings")


def hf_embedding(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' final-normed hidden state of the last token."""
    with torch.no_grad():
        return hf_model.model(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0, -1].double()


def test_the_engine_embeds_like_transformers(model):
    """Prompts of 1, 7 and 100 tokens (the last read in chunks of 32) in one batch: each embedding is
    transformers' last_hidden_state of the last token; read again (the prefix cache holds them) the
    same values to fp32 rounding."""
    directory, hf_model = model
    llm = load_tiny_llm(directory, prefill_chunk=32)
    got = llm.embed(PROMPTS)
    for ids, vector in zip(PROMPTS, got):
        want = hf_embedding(hf_model, ids)
        assert len(vector) == want.numel()
        torch.testing.assert_close(torch.tensor(vector, dtype=torch.float64), want, rtol=1e-5, atol=1e-5)
    again = llm.embed(PROMPTS[1:2])[0]  # its prefix from the cache: the last tokens read in other chunks
    assert again == pytest.approx(got[1], abs=1e-5)
    with pytest.raises(NinferError, match="an embedding request samples one token"):
        llm.engine.add_request(GenerationRequest([1, 2], SamplingParams(max_tokens=4), embed=True))


def test_normalized_keeps_the_first_dimensions():
    assert normalized([3.0, 4.0, 12.0]) == pytest.approx([3 / 13, 4 / 13, 12 / 13])
    assert normalized([3.0, 4.0, 12.0], 2) == pytest.approx([0.6, 0.8])
    assert normalized([0.0, 0.0]) == [0.0, 0.0]
    for bad in (0, 4):
        with pytest.raises(NinferError, match="dimensions must be 1 to 3"):
            normalized([1.0, 2.0, 3.0], bad)


@pytest.fixture(scope="module")
def server(model):
    yield from serve(model[0])


def unit(vector: torch.Tensor) -> list[float]:
    return (vector / vector.norm()).tolist()


def test_openai_client_gets_unit_vectors(server, model):
    """The openai package's embeddings.create: its default (base64, decoded by the client) and float
    give the same unit vectors, transformers' normed; strings and token ids; dimensions; usage."""
    _, hf_model = model
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = ["The quick brown fox", "Paris is the capital of France."]
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": texts[1]}).json()["tokens"]
    default = client.embeddings.create(model="m", input=texts)
    floats = client.embeddings.create(model="m", input=texts, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1] and default.model == "m"
    for a, b in zip(default.data, floats.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)  # float32 on the wire either way
    assert math.isclose(sum(v * v for v in floats.data[0].embedding), 1.0, rel_tol=1e-6)
    want = unit(hf_embedding(hf_model, tokenized))
    assert floats.data[1].embedding == pytest.approx(want, abs=1e-5)
    by_ids = client.embeddings.create(model="m", input=tokenized, encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(floats.data[1].embedding, abs=1e-5)  # cached prefix: other chunks
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == len(tokenized)
    short = client.embeddings.create(model="m", input=texts[1], dimensions=8, encoding_format="float")
    assert short.data[0].embedding == pytest.approx(normalized(floats.data[1].embedding[:8]), abs=1e-6)


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "input is an empty list"),
    ({"input": ""}, "input is empty"),
    ({"input": ["a", ""]}, "input[1] is empty"),
    ({"input": [5, 100000]}, "input token id 100000 is outside the vocabulary"),
    ({"input": list(range(1, MAX_CONTEXT + 1))}, "context limit"),
    ({"input": "hello", "dimensions": 100000}, "dimensions must be 1 to"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
])
def test_openai_bad_requests_get_a_clear_400(server, body, message):
    response = httpx.post(server.url + "/v1/embeddings", json={"model": "m", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_ollama_embed_and_embeddings(server, model):
    """/api/embed: unit vectors for a string or a list, prompt_eval_count; an input past the context keeps
    its first tokens (truncate: false refuses it); /api/embeddings: the raw values."""
    _, hf_model = model
    text = "Paris is the capital of France."
    ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    one = httpx.post(server.url + "/api/embed", json={"model": "m", "input": text}, timeout=60).json()
    many = httpx.post(server.url + "/api/embed", json={"model": "m", "input": [text, "fox"]}, timeout=60).json()
    assert one["model"] == "m" and len(one["embeddings"]) == 1 and len(many["embeddings"]) == 2
    assert one["embeddings"][0] == pytest.approx(unit(hf_embedding(hf_model, ids)), abs=1e-5)
    assert many["embeddings"][0] == pytest.approx(one["embeddings"][0], abs=1e-5)  # cached prefix
    assert one["prompt_eval_count"] == len(ids) and one["total_duration"] > 0
    raw = httpx.post(server.url + "/api/embeddings", json={"model": "m", "prompt": text}, timeout=60).json()
    assert raw["embedding"] == pytest.approx(hf_embedding(hf_model, ids).tolist(), abs=1e-5)
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    long_ids = httpx.post(server.url + "/tokenize", json={"prompt": long_text}).json()["tokens"]
    assert len(long_ids) >= MAX_CONTEXT
    kept = httpx.post(server.url + "/api/embed", json={"model": "m", "input": long_text}, timeout=60).json()
    assert kept["prompt_eval_count"] == MAX_CONTEXT - 1
    assert kept["embeddings"][0] == pytest.approx(unit(hf_embedding(hf_model, long_ids[: MAX_CONTEXT - 1])), abs=1e-5)
    refused = httpx.post(server.url + "/api/embed", json={"model": "m", "input": long_text, "truncate": False},
                         timeout=60)
    assert refused.status_code == 400 and "truncate: true keeps the first ones" in refused.text
    for body in ({"model": "m", "input": []}, {"model": "m", "input": ["x", ""]}, {"input": "x"}):
        assert httpx.post(server.url + "/api/embed", json=body, timeout=60).status_code == 400, body


@pytest.mark.cuda
def test_the_engine_embeds_on_the_gpu(model):
    """On the GPU (fp32, decode and prompt graphs on, steps overlapped): the embeddings come back
    through the pinned copy the step's event guards, beside a request that decodes."""
    directory, hf_model = model
    llm = load_tiny_llm(directory, device="cuda", prefill_chunk=32)
    talking = GenerationRequest(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    llm.engine.add_request(talking)
    got = llm.embed(PROMPTS)
    for ids, vector in zip(PROMPTS, got):
        torch.testing.assert_close(torch.tensor(vector, dtype=torch.float64), hf_embedding(hf_model, ids),
                                   rtol=1e-4, atol=1e-4)


def test_the_ollama_client_reads_the_answers(server):
    """The `ollama` package's embed / embeddings parse what the server sends."""
    import ollama

    client = ollama.Client(host=server.url)
    answer = client.embed(model="m", input=["The quick brown fox", "Paris"])
    assert answer.model == "m" and len(answer.embeddings) == 2 and answer.prompt_eval_count > 2
    assert math.isclose(sum(v * v for v in answer.embeddings[1]), 1.0, rel_tol=1e-6)
    raw = client.embeddings(model="m", prompt="Paris").embedding
    assert normalized(list(raw)) == pytest.approx(answer.embeddings[1], abs=1e-5)
