"""Where a prompt chunk's checkpoints can be kept by the fused GDN steps alone (`StateFork.steps`):
the chunked rule runs once, through the first checkpoint, and the tokens from there to the chunk's
end go through at most TAIL_WINDOWS windows of the fused steps, each window starting at a
checkpoint or continuing the one before. The alternative, for checkpoints further from the end, is
the chunked rule twice over the whole chunk (layers/gdn.py `_forked_chunked`): on an H100 a chat-
shaped 37-token prompt (checkpoints 27 and 3 tokens before its end) took 19.0 ms against 14.7 for
the same prompt without checkpoints (forty-ninth session)."""

from __future__ import annotations

from ..ops.gdn import MAX_STEP_TOKENS

# windows of a prompt graph's tail kind: its static buffers; fewer are padded with empty windows
TAIL_WINDOWS = 3


def step_windows(forks: list[int], fork_slots: list[int], end: int, own_slot: int
                 ) -> tuple[list[int], list[int], list[int]] | None:
    """(offsets, counts, fork_slots), TAIL_WINDOWS each, of the fused steps from the first of `forks`
    (token positions in the chunk, ascending, each with its checkpoint slot) to `end`: each fork's
    stretch to the next (or to the end) in windows of up to MAX_STEP_TOKENS, the first copying the
    state to the fork's slot and the others to `own_slot` (the row's: a copy onto itself), then
    empty windows at the end. None where one window does (a single fork within MAX_STEP_TOKENS of
    the end: `StateFork`'s plain tail) or more than TAIL_WINDOWS would be needed."""
    if len(forks) == 1 and end - forks[0] <= MAX_STEP_TOKENS:
        return None
    windows = []
    for fork, slot, stop in zip(forks, fork_slots, [*forks[1:], end]):
        starts = range(fork, stop, MAX_STEP_TOKENS) if stop > fork else [fork]  # a fork at its end: copy only
        windows += [(start, min(MAX_STEP_TOKENS, stop - start), slot if start == fork else own_slot)
                    for start in starts]
    if len(windows) > TAIL_WINDOWS:
        return None
    windows += [(end, 0, own_slot)] * (TAIL_WINDOWS - len(windows))
    offsets, counts, slots = (list(column) for column in zip(*windows))
    return offsets, counts, slots
