"""What a loaded model can do beyond plain chat: call tools, read images, reason in <think> blocks.

Read from the model itself (its chat template, its vision tower), so the server's model list, the
editor snippets and the TUI never advertise what the model would silently ignore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llm import LLM


@dataclass(frozen=True)
class Capabilities:
    tools: bool
    vision: bool
    thinking: bool

    @classmethod
    def of(cls, llm: LLM) -> Capabilities:
        return cls(tools=llm.template.supports_tools, vision=llm.vision is not None,
                   thinking=llm.template.supports_thinking)

    def names(self) -> list[str]:
        """Ollama's spelling (`/api/show`), also on our /v1/models cards."""
        return ["completion", *(name for name, on in (("tools", self.tools), ("vision", self.vision),
                                                      ("thinking", self.thinking)) if on)]
