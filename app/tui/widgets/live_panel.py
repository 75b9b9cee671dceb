"""The live panels: throughput with a sparkline, speculative decoding, KV cache, GPU memory."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

from ninfer_core.engine.request import SpecStats

from ...units import human_bytes
from ..live import LiveFrame

GIB = 1024**3


def bar(fraction: float, width: int = 20) -> str:
    filled = int(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def rate(value: float | None) -> str:
    return "–" if not value else f"{value:,.1f} tok/s"


def room_text(capacity: int, context_limit: int | None) -> str:
    """The KV capacity in chats of the context limit, so the screen shows one context number (the gauge's)."""
    if not context_limit:
        return f"room for {capacity:,} tok"
    chats = capacity // context_limit
    return f"room for {chats} chat{'s' if chats != 1 else ''} of {context_limit:,}"


def cached_text(cached_bytes: int, hit_ratio: float | None) -> str:
    """The prefix cache beside the active KV: what it holds, and how much of the prompts it served."""
    if hit_ratio is None:
        return "prefix cache off"
    return f"cached {human_bytes(cached_bytes)} · {hit_ratio:.0%} reused"


def spec_text(spec: SpecStats | None) -> str:
    if spec is None:
        return "off"
    head = f"{spec.method}, {spec.draft_tokens} drafts/round"
    if not spec.rounds:
        return f"{head}\nno rounds yet"
    return f"{head}\n{spec.acceptance_rate:.0%} accepted · {spec.tokens_per_round:.2f} tok/round"


class LivePanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Label("Throughput", classes="panel-title")
        yield Label("prefill –", id="prefill")
        yield Label("decode  –", id="decode")
        yield Sparkline([], id="decode-history", summary_function=max)
        yield Label("Speculative", classes="panel-title")
        yield Label("off", id="spec")
        yield Label("KV cache", classes="panel-title")
        yield Label("–", id="kv")
        yield Label("", id="kv-bar")
        yield Label("this chat –", id="kv-chat")
        yield Label("", id="kv-room")
        yield Label("", id="kv-cached")
        yield Label("Memory", classes="panel-title")
        yield Label("–", id="gpu")
        yield Label("", id="requests")

    def show(self, frame: LiveFrame, history: list[float], context_limit: int | None = None) -> None:
        """`context_limit`: the chat's limit (the gauge's number); the KV capacity is shown in chats of it."""
        self.query_one("#prefill", Label).update(f"prefill {rate(frame.prefill_tok_s)}")
        self.query_one("#decode", Label).update(f"decode  {rate(frame.decode_tok_s)}")
        self.query_one("#decode-history", Sparkline).data = history
        self.query_one("#spec", Label).update(spec_text(frame.spec))
        if frame.kv_capacity:
            used, cap = frame.kv_used or 0, frame.kv_capacity
            self.query_one("#kv", Label).update(f"{used:,} tok in use ({used / cap:.0%})")
            self.query_one("#kv-bar", Label).update(bar(used / cap))
            self.query_one("#kv-chat", Label).update(f"this chat {frame.chat_tokens:,} tok")
            self.query_one("#kv-room", Label).update(room_text(cap, context_limit))
            self.query_one("#kv-cached", Label).update(cached_text(frame.prefix_cached_bytes, frame.prefix_hit_ratio))
        else:
            self.query_one("#kv", Label).update("n/a (remote server)")
            self.query_one("#kv-chat", Label).update(f"this chat {frame.chat_tokens:,} tok")
        if frame.gpu is not None:
            self.query_one("#gpu", Label).update(
                f"GPU {frame.gpu.used / GIB:.1f} / {frame.gpu.total / GIB:.1f} GiB")
        else:
            self.query_one("#gpu", Label).update("remote server" if frame.device == "remote" else f"{frame.device}: no GPU")
        self.query_one("#requests", Label).update(
            f"requests {frame.requests_running} running · {frame.requests_waiting} waiting")
