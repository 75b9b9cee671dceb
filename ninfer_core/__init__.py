"""ninfer engine: local inference for the Qwen3.5 / Qwen3.6 family (and Llama-family models)."""

__version__ = "0.1.0"
