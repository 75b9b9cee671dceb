"""Media inside a prompt: placeholder expansion, 3-D mRoPE positions, and the embeddings the
language model reads in place of the placeholder tokens.

Prompt. The chat template leaves one `<|image_pad|>` per image and one `<|video_pad|>` per video.
An image's pad becomes one pad per merged patch ((h/2)(w/2) of them); a video's pad becomes, for
each frame pair, `<t.t seconds>` (tokenized text) + `<|vision_start|>` + pads + `<|vision_end|>`.

Positions (mRoPE, axes t / h / w). Text advances all three axes together. A group of pads (one
image, or one frame pair of a video) that starts at position p gets (p, p + row, p + col) on its
merged grid, and the text after it continues at p + max(rows, cols). The prompt therefore ends
at a position `rope_delta` away from its token count; generated tokens (text) sit at
`index + rope_delta` on all three axes.

Embeddings. Each pad's embedding is replaced by its row of the vision tower's output (items in
the order of `media`, each item's rows in prompt order).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from ..media.limits import MediaError
from ..media.prepared import PreparedMedia
from ..tokenizer import Tokenizer
from .vision import VisionTower, read_config_json


TOKEN_TEXTS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")  # the fields' order


@dataclass(frozen=True)
class VisionTokenIds:
    image_pad: int = 248056
    video_pad: int = 248057
    vision_start: int = 248053
    vision_end: int = 248054

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "VisionTokenIds":
        raw = read_config_json(Path(model_dir) / "config.json")
        defaults = cls()
        return cls(
            image_pad=int(raw.get("image_token_id", defaults.image_pad)),
            video_pad=int(raw.get("video_token_id", defaults.video_pad)),
            vision_start=int(raw.get("vision_start_token_id", defaults.vision_start)),
            vision_end=int(raw.get("vision_end_token_id", defaults.vision_end)),
        )

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, where: str) -> "VisionTokenIds":
        """By the tokens' text (a GGUF model: its config has no vision ids)."""
        ids = {}
        for name, text in zip(cls.__dataclass_fields__, TOKEN_TEXTS):
            ids[name] = tokenizer.token_to_id(text)
            if ids[name] is None:
                raise ModelLoadError(f"{where}: the vocabulary has no {text} token, so the model cannot take media")
        return cls(**ids)

    def kind_of(self, token: int) -> str | None:
        return "image" if token == self.image_pad else "video" if token == self.video_pad else None


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


def _check_counts(prompt_ids: Sequence[int], media: Sequence[PreparedMedia], tokens: VisionTokenIds) -> None:
    for kind, pad in (("image", tokens.image_pad), ("video", tokens.video_pad)):
        placeholders = sum(1 for t in prompt_ids if t == pad)
        given = sum(1 for m in media if m.kind == kind)
        if placeholders != given:
            raise MediaError(f"the prompt has {placeholders} {kind} placeholder(s) but {given} {kind}(s) were given")


def expand_placeholders(
    prompt_ids: Sequence[int],
    media: Sequence[PreparedMedia],
    tokens: VisionTokenIds,
    encode: Callable[[str], list[int]],
) -> list[int]:
    """One pad per image / video (the template's output) -> the full token layout of each item."""
    _check_counts(prompt_ids, media, tokens)
    queues = {kind: deque(m for m in media if m.kind == kind) for kind in ("image", "video")}
    out: list[int] = []
    for token in prompt_ids:
        kind = tokens.kind_of(token)
        if kind is None:
            out.append(token)
            continue
        item = queues[kind].popleft()
        if kind == "image":
            out += [token] * item.num_tokens
            continue
        for seconds in item.timestamps:
            out += encode(timestamp_text(seconds))
            out += [tokens.vision_start] + [token] * item.tokens_per_frame + [tokens.vision_end]
    return out


@dataclass
class MultimodalPrompt:
    """What a request with media needs beyond its (expanded) token ids."""

    media: list[PreparedMedia]
    positions: torch.Tensor  # [3, T] int64 (t, h, w) per prompt token
    rope_delta: int  # generated token i sits at i + rope_delta
    vision_rows: torch.Tensor  # [T] int64: row of the vision embeddings replacing the token, -1 for text
    embeddings: torch.Tensor | None = None  # [sum num_tokens, hidden] once encoded
    _keys: list[object] | None = field(default=None, repr=False)  # token_keys of the prompt, once

    @classmethod
    def build(
        cls, prompt_ids: Sequence[int], media: Sequence[PreparedMedia], tokens: VisionTokenIds
    ) -> "MultimodalPrompt":
        """Positions and embedding rows for an expanded prompt (see `expand_placeholders`)."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        groups: dict[str, deque[tuple[int, int, int]]] = {"image": deque(), "video": deque()}
        offset = 0
        for item in media:
            _, h, w = item.grid_thw
            gh, gw = h // item.merge_size, w // item.merge_size
            for frame in range(item.grid_thw[0]):
                groups[item.kind].append((gh, gw, offset + frame * item.tokens_per_frame))
            offset += item.num_tokens
        positions = np.empty((3, len(ids)), dtype=np.int64)
        rows = np.full(len(ids), -1, dtype=np.int64)
        pads = np.flatnonzero((ids == tokens.image_pad) | (ids == tokens.video_pad))
        i = pos = 0
        while i < len(ids):
            k = np.searchsorted(pads, i)
            j = int(pads[k]) if k < len(pads) else len(ids)
            positions[:, i:j] = pos + np.arange(j - i)  # text
            pos += j - i
            if j == len(ids):
                break
            kind = tokens.kind_of(int(ids[j]))
            if not groups[kind]:
                raise MediaError(f"the prompt has more {kind} placeholder tokens than the {kind}s given fill")
            gh, gw, row0 = groups[kind].popleft()
            n = gh * gw
            if j + n > len(ids) or not (ids[j : j + n] == ids[j]).all():
                raise MediaError(f"a run of {kind} placeholder tokens is not the {n} tokens its {kind} needs")
            grid_rows, grid_cols = np.divmod(np.arange(n), gw)
            positions[0, j : j + n] = pos
            positions[1, j : j + n] = pos + grid_rows
            positions[2, j : j + n] = pos + grid_cols
            rows[j : j + n] = row0 + np.arange(n)
            pos += max(gh, gw)
            i = j + n
        left = [kind for kind, queue in groups.items() if queue]
        if left:
            raise MediaError(f"the prompt has fewer {left[0]} placeholder tokens than the {left[0]}s given need")
        return cls(
            media=list(media),
            positions=torch.from_numpy(positions),
            rope_delta=pos - len(ids),
            vision_rows=torch.from_numpy(rows),
        )

    def token_keys(self, n: int) -> list[object]:
        """What identifies each of the first n tokens beyond its id, for the prefix cache: a vision
        row is (its item's content digest, the row within the item), so the same picture hits
        and another one of the same size does not; text (and answer tokens past the prompt): None."""
        if self._keys is None:
            digests = [hashlib.blake2b(m.pixel_values.contiguous().numpy().tobytes(), digest_size=16).digest()
                       + repr(m.grid_thw).encode() for m in self.media]
            starts = np.cumsum([0] + [m.num_tokens for m in self.media])
            rows = self.vision_rows.tolist()
            items = np.searchsorted(starts, rows, side="right") - 1
            self._keys = [None if r < 0 else (digests[i], r - int(starts[i])) for r, i in zip(rows, items.tolist())]
        return self._keys[:n] + [None] * max(0, n - len(self._keys))

    @property
    def encoded(self) -> bool:
        return self.embeddings is not None

    def encode(self, tower: VisionTower) -> None:
        """Run the vision tower over every item once (kept until `release`)."""
        if self.embeddings is None:
            pixels = torch.cat([m.pixel_values for m in self.media])
            with torch.inference_mode():
                self.embeddings = tower(pixels, [m.grid_thw for m in self.media])

    def chunk_embeddings(self, embed_tokens: nn.Embedding, input_ids: torch.Tensor, start: int) -> torch.Tensor:
        """[1, t, hidden] inputs for tokens start .. start + t (input_ids [1, t]); tokens past the
        prompt (a preempted request reading its answer again) are text."""
        if self.embeddings is None:
            raise RuntimeError("MultimodalPrompt.encode must run before its embeddings are read")
        x = embed_tokens(input_ids)
        rows = self.vision_rows[start : start + input_ids.shape[1]].to(x.device)
        rows = torch.cat([rows, rows.new_full((input_ids.shape[1] - len(rows),), -1)])
        mask = rows >= 0
        if bool(mask.any()):
            x[0, mask] = self.embeddings[rows[mask]].to(x.device, x.dtype)
        return x

    def chunk_positions(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """[3, 1, t] mRoPE positions of tokens start .. end; generated token i (past the prompt)
        sits at i + rope_delta on every axis."""
        prompt = self.positions[:, start:end]
        n = self.positions.shape[1]
        answer = torch.arange(max(start, n), max(end, n)) + self.rope_delta
        return torch.cat([prompt, answer.expand(3, -1)], dim=1)[:, None].to(device)

    def release(self) -> None:
        """Drop the vision embeddings once the prompt is in the cache (positions stay: they are small)."""
        self.embeddings = None
