"""Text embeddings from a causal model: the final norm of the prompt's last token's hidden state, the
pooling Qwen3-Embedding is trained for and llama.cpp's `--pooling last` gives (the engine computes it
at the prompt's last chunk: engine/request.py GenerationRequest.embed).

OpenAI's /v1/embeddings and Ollama's /api/embed answer unit vectors; `dimensions` keeps the first ones
(Matryoshka-trained models) before they are normalized. Ollama's older /api/embeddings answers the raw
values."""

from __future__ import annotations

import math

from .engine.sampling import SamplingParams
from .errors import NinferError

# an embedding request samples the one token the engine's step needs, greedily, and drops it
EMBED_SAMPLING = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def normalized(values: list[float], dimensions: int | None = None) -> list[float]:
    """The first `dimensions` values (all by default) scaled to unit length (a zero vector stays zero)."""
    if dimensions is not None:
        if not 0 < dimensions <= len(values):
            raise NinferError(f"dimensions must be 1 to {len(values)} (the model's embedding width), got {dimensions}")
        values = values[:dimensions]
    norm = math.sqrt(math.fsum(v * v for v in values))
    return [v / norm for v in values] if norm > 0 else list(values)
