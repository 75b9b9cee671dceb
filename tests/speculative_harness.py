"""Shared pieces of the speculative-decoding tests: tiny target + drafter checkpoints, a runner,
and two test drafters.

- `ScriptedDrafter` proposes the true (plain-decode) continuation with some tokens corrupted,
  so rounds keep every number of accepted tokens 0..K: the rollback is exercised at every length.
- `Spy` lets a real drafter (MTP, DFlash) compute its own proposal every round, records it for a
  reference check, and hands the target the scripted proposal instead, so the real drafter sees
  realistic acceptance patterns (multi-row catch-ups) that random weights would never produce.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ninfer_core.engine.penalties import PenaltyTables
from ninfer_core.engine.request import GenerationRequest
from ninfer_core.engine.sampling import SamplingParams
from ninfer_core.engine.sequence import Sequence
from ninfer_core.engine.speculative import Draft, Drafter, Observation
from ninfer_core.engine.speculative.adaptive import AdaptiveDraft, RoundCosts
from ninfer_core.llm import LLM, EngineOptions
from tiny_dflash import write_tiny_dflash
from tiny_model_dir import write_tiny_model_dir

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], list(range(20, 61))]
DFLASH_LAYERS = [0, 2]  # tiny target: layers 0-2 GDN, 3 attention


def write_target(tmp_path_factory: Any, moe: bool = True, overrides: dict | None = None) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("spec_target_moe" if moe else "spec_target_dense")
    hf_model, _ = write_tiny_model_dir(directory, moe=moe, max_positions=1024, overrides=overrides)
    return directory, hf_model.eval()


def write_drafter(tmp_path_factory: Any, target_dir: Path, **kwargs: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("spec_dflash")
    config = load(target_dir).loaded.config
    tensors = write_tiny_dflash(directory, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                                target_layer_ids=DFLASH_LAYERS, mask_token_id=config.vocab_size - 1, **kwargs)
    return directory, tensors


def load(directory: Path, **options: Any) -> LLM:
    # the exact fp32 path, its KV cache too (the CPU default is fp16): the tests compare with transformers
    base = dict(device="cpu", dtype="float32", kv_dtype="fp32", max_seqs=4, max_context=512)
    return LLM.load(str(directory), EngineOptions(**{**base, **options}))


def probes_only(every: int = 3) -> AdaptiveDraft:
    """An adaptive policy that drafts only when it probes (one draft every `every` rounds without a
    tested draft): a draft costs more than any round can yield, whatever the acceptance and
    whatever the engine's measured costs (LOOP_COST) say."""
    never_pays = (1.0, 3.0)  # K = 1 costs 3 plain steps and yields at most 2 tokens
    costs = RoundCosts({(False, 1): never_pays, (True, 1): never_pays})
    return AdaptiveDraft(cost=costs, prior=0.0, probe_every=every)


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def run(llm: LLM, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for out in llm.engine.generate(requests):
        tokens[out.request_id] += out.new_token_ids
    return tokens


# Seeded sampled requests (temperature with top-k / top-p, min-p) beside a greedy one
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, ignore_eos=True),
           SamplingParams(temperature=0.0, ignore_eos=True),
           SamplingParams(temperature=1.2, min_p=0.05, seed=7, ignore_eos=True)]


def run_with(llm_engine: Any, params: list[SamplingParams]) -> list[list[int]]:
    """PROMPTS[i] under params[i] on an LLMEngine: the tokens of each."""
    requests = [GenerationRequest(p, sampling) for p, sampling in zip(PROMPTS, params)]
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for step in llm_engine.generate(requests):
        out[step.request_id] += step.new_token_ids
    return [out[r.request_id] for r in requests]


def run_sampled(llm_engine: Any, lengths: list[int]) -> list[list[int]]:
    """`run_with` SAMPLED, lengths[i] tokens each."""
    return run_with(llm_engine, [replace(params, max_tokens=n) for params, n in zip(SAMPLED, lengths)])


def eager_then_graph(drafter: Any, rounds: list[tuple[list[Draft], list[Draft]]]):
    """A stand-in for drafter.propose that drafts each round eagerly, then by its graphs from the same
    state (the generators' states put back between the two: both draw the same uniforms), records
    (graph, eager) in `rounds` and hands the target the graph's drafts."""
    graphs, propose = drafter.graphs, drafter.propose

    def both(seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        states = [None if s.generator is None else s.generator.get_state() for s in seqs]  # greedy: None
        drafter.graphs = None
        eager = propose(seqs, counts, penalties)
        for s, state in zip(seqs, states):
            if state is not None:
                s.generator.set_state(state)
        drafter.graphs = graphs
        graph = propose(seqs, counts, penalties)
        rounds.append((graph, eager))
        return graph

    return both


def assert_same_drafts(rounds: list[tuple[list[Draft], list[Draft]]]) -> None:
    """Every round's graph drafts are the eager ones: the tokens, and q where the row sampled."""
    assert rounds
    for graph, eager in rounds:
        assert [d.tokens for d in graph] == [d.tokens for d in eager]
        for g, e in zip(graph, eager):
            assert (g.probs is None) == (e.probs is None)
            if e.probs is not None:
                torch.testing.assert_close(g.probs, e.probs, atol=1e-6, rtol=1e-6)


class ScriptedDrafter(Drafter):
    """Drafts = script[request id][len(output):][:k] with one token corrupted: in a request's r-th
    round the token at index r mod (k + 1) (none when that is k), so the accepted counts cycle
    through 0..k."""

    method = "scripted"
    max_draft_tokens = 15

    def __init__(self, script: dict[str, list[int]], vocab: int):
        self.script, self.vocab = script, vocab
        self.rounds: Counter[str] = Counter()

    def propose(self, seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, counts):
            done = len(seq.output_ids)
            tokens = list(self.script[seq.request_id][done : done + k])
            wrong = self.rounds[seq.request_id] % (k + 1)
            self.rounds[seq.request_id] += 1
            if wrong < len(tokens):
                tokens[wrong] = (tokens[wrong] + 1) % self.vocab
            drafts.append(Draft(tokens))
        return drafts


class Spy(Drafter):
    """Runs `inner` (observe + propose) and logs (sequence ids, inner draft) each round; the target
    verifies `outer`'s drafts instead when one is given."""

    def __init__(self, inner: Drafter, outer: Drafter | None = None):
        self.inner, self.outer = inner, outer
        self.method, self.max_draft_tokens = inner.method, inner.max_draft_tokens
        self.capture_layers = inner.capture_layers
        self.log: list[tuple[list[int], Draft]] = []

    def observe(self, obs: Observation) -> None:
        self.inner.observe(obs)

    def settle(self, obs: Observation, counts: list[int]) -> None:
        self.inner.settle(obs, counts)

    def propose(self, seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        own = self.inner.propose(seqs, counts, penalties)
        self.log += [(s.prompt_ids + s.output_ids, d) for s, d in zip(seqs, own)]
        return own if self.outer is None else self.outer.propose(seqs, counts, penalties)

    def release(self, seq: Sequence) -> None:
        self.inner.release(seq)
