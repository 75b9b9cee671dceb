"""Which file beside a GGUF model is its vision projector (llama.cpp's `mmproj-*.gguf`).

llama.cpp keeps a multimodal model's vision tower in a file of its own, named with `mmproj`
(`mmproj-F16.gguf`, `mmproj-Qwen3.5-35B-A3B-Q8_0.gguf`, ...). A repository often holds it in
several types; the one picked is the first of `PREFERENCE` (bfloat16 is what the tower runs in on
a GPU; a float32 copy doubles the bytes for nothing), then by name. No heavy imports: `ninfer pull`
uses this too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

PREFERENCE = ("bf16", "f16", "q8_0", "f32")


def is_mmproj(name: str) -> bool:
    """A vision projector's file name (any folder)."""
    base = PurePosixPath(name).name.lower()
    return "mmproj" in base and base.endswith(".gguf")


def _rank(name: str) -> tuple[int, str]:
    parts = re.split(r"[-.]", PurePosixPath(name).name.lower())
    found = [PREFERENCE.index(p) for p in parts if p in PREFERENCE]
    return (min(found) if found else len(PREFERENCE), name)


def pick_mmproj(names: Iterable[str]) -> str | None:
    """The projector to use among `names` (None when no name is one)."""
    candidates = [n for n in names if is_mmproj(n)]
    return min(candidates, key=_rank) if candidates else None


def find_mmproj(model_file: Path) -> Path | None:
    """The vision projector in a GGUF model's own folder, if there is one."""
    if is_mmproj(model_file.name):
        return None
    found = pick_mmproj(p.name for p in model_file.parent.iterdir() if p.is_file())
    return None if found is None else model_file.parent / found
