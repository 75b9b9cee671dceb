"""Where reasoning lives in Qwen-style output: between <think> and </think>.

With thinking on, the generation prompt itself opens the block (`<|im_start|>assistant\n<think>\n`),
so the model's output starts inside reasoning and only `</think>` appears in it. Whether a prompt
did that is read from the rendered prompt rather than from the request's flag, because a
checkpoint's own template decides what the generation prompt contains.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block."""
    return prompt.rstrip().endswith(THINK_OPEN)
