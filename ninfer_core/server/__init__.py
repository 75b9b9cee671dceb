"""The OpenAI / Anthropic-compatible HTTP server (FastAPI + uvicorn) over the engine service.

The engine (ninfer_core outside this package) never imports the server; the server uses the
engine's public API only: LLM, EngineService and their events.
"""
