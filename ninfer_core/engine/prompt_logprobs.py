"""The logprobs of a prompt's own tokens (SamplingParams.prompt_logprobs; OpenAI's `echo` with
`logprobs`, what evaluation harnesses score answers by).

Row r of a prompt chunk that starts at token s predicts token s + r + 1, so a scored request's chunks
ask for logits at every token (ForwardBatch.logits "all"), are read whole from the model (the
scheduler skips the prefix cache for them) and are cut short enough that their logits stay small
(`scored_chunk`). The log-softmax, the target's logprob and the top alternatives are taken on the
device after the forward, like a sampled token's (engine/logprobs.py), and copied to the host with
the step's tokens; the engine hands them out with the first generated token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ..models.base import ForwardOutput
from ..ops.dispatch import upload
from .logprobs import LogprobRows, log_softmax_rows
from .scheduler import PrefillChunk
from .sequence import Sequence

# the logits a scored chunk may hold, float32: 256 MiB is ~270 tokens of a 248K vocabulary
SCORED_LOGITS_BYTES = 256 << 20


def scored_chunk(vocab_size: int) -> int:
    """The longest prompt chunk a scored request reads in one forward."""
    return max(16, SCORED_LOGITS_BYTES // (4 * vocab_size))


@dataclass
class ChunkScores:
    """The logprobs of prompt tokens start + 1 .. start + len(targets) of one sequence."""

    seq: Sequence
    start: int
    targets: list[int]
    rows: LogprobRows  # on the device, or being copied to the host

    def fill(self) -> None:
        """Into the sequence's prompt_logprobs (read the host copy only after the step's event)."""
        if self.seq.prompt_logprobs is None:  # failed or aborted meanwhile
            return
        entries = self.rows.entries(self.targets)
        self.seq.prompt_logprobs[self.start : self.start + len(self.targets)] = [
            entries[r] for r in range(len(self.targets))]


def score_chunks(chunks: Seq[PrefillChunk], outs: Seq[ForwardOutput], to_host: bool) -> list[ChunkScores]:
    """Queue the scores of the prompt tokens each scored chunk's logits predict."""
    scored = []
    for chunk, out in zip(chunks, outs):
        seq = chunk.seq
        if not seq.scores_prompt:
            continue
        prompt = seq.prompt_ids
        rows = min(chunk.end, len(prompt) - 1) - chunk.start  # the prompt's last row predicts the answer
        if rows <= 0:
            continue
        assert out.logits is not None and out.logits.shape[1] == chunk.num_tokens, "a scored chunk has every logit"
        logits = out.logits[0, :rows]
        targets = prompt[chunk.start + 1 : chunk.start + 1 + rows]
        scores = log_softmax_rows(logits, [seq.request.sampling.prompt_logprobs] * rows)
        assert scores is not None
        picked = scores.pick(upload(targets, torch.long, logits.device))
        scored.append(ChunkScores(seq, chunk.start, targets, picked.to_host() if to_host else picked))
    return scored
