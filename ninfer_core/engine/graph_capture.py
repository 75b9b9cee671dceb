"""Capturing a CUDA graph, and how many rows a captured forward may carry (shared by the decode /
verify graphs and the MTP draft chains)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..layers.moe import Experts

Result = TypeVar("Result")


def capture(fn: Callable[[], Result], pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, Result]:
    """Run fn once on a side stream (lazy initialisation, autotuning stay out of the graph), capture
    it, and replay it once; returns the graph and what the captured call returned (its static
    outputs). The replay, over the same static inputs as the warm-up run (the callers' spare rows,
    scratch slot and page), pays a graph's first launch here: the driver uploads the graph then. On
    an H100 a prompt's first use of its bucket's graph took 2-4 ms longer than later ones (35B, TTFT
    at 128 tokens 21.5 against 18.5 ms, forty-ninth session), where a bucket that the load's warm-up
    had replayed took 0.5 ms longer."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        result = fn()
    graph.replay()
    return graph, result


def graph_row_limit(model: torch.nn.Module) -> int | None:
    """The most tokens one captured forward may carry (None: no limit): MoE experts run without a
    host sync only up to `graph_max_tokens` rows of the model's activations."""
    dtype = getattr(model, "dtype", None)
    limits = [m.graph_max_tokens(dtype) for m in model.modules() if isinstance(m, Experts)]
    return min(limits, default=None)
