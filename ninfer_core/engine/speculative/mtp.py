"""MTP drafts: the checkpoint's own multi-token-prediction layer (`models/mtp.py`), K = 1..5.

Entry i of the MTP cache combines the target's normed hidden state h_i with the embedding of
token i+1 and predicts token i+2. Observing target rows (a prompt chunk, or the accepted rows of
a verify) runs the layer over them: that writes their MTP KV entries and leaves, per sequence,
the logits and normed output of its last entry c, which predict the first draft (the token after
the sequence's last one). Drafts 2..K feed the layer its own output: step s writes entry c + s
from (draft s, output of entry c + s - 1). The next observation rewrites those entries with the
target's hidden states, so speculative entries never outlive their round.

On the GPU both calls of a round replay CUDA graphs (`MTPGraphs`): the catch-up over the verify's
kept rows, and the whole draft chain (argmax, then K-1 layer steps each followed by lm_head and
argmax, all on the device; with sampled rows, a draw from q in place of the argmax), with no host
sync: the drafts stay on the device until the judge reads them with its verdict. Greedy drafts are
the raw argmax of the MTP logits on both paths (the target's acceptance applies penalties); sampled
requests draw from their sampling distribution, penalties included, by the sampling chain graph (its
penalties read the engine's device tables of each sequence's history); a batch with a sampled row's
logit bias drafts eagerly. The logits come from `draft_head.py`'s lm_head: an int4 copy of an int8
one (half its bytes, read once a draft step), else the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...cache import CacheManager, ModelCache
from ...cache.kv_pool import kv_bytes_per_token
from ...config import ModelConfig
from ...layers.attention import AttentionMetadata
from ...models.decoder import DecoderModel, StepContext
from ...models.mtp import MTPHead, mtp_layer_config
from ...ops import sampling as sampling_ops
from ...ops.penalties import penalise, record_tokens
from ...ops.dispatch import upload
from ...ops.gdn import MAX_STEP_TOKENS
from ..graph_capture import capture
from ..penalties import PenaltyTables, penalty_columns
from ..sampling import Sampler, SamplingParams, TokenHistory, row_params
from ..sequence import Sequence
from .base import Draft, Drafter, Observation, choose_drafts, uniform

if TYPE_CHECKING:
    from ..cuda_graph import DecodeGraphs

log = logging.getLogger(__name__)


@dataclass
class _Last:
    """A sequence's newest MTP entry: its cache index, normed output and logits."""

    index: int
    hidden: torch.Tensor  # [H]
    logits: torch.Tensor  # [V]


class MTPDrafter(Drafter):
    method = "mtp"
    max_draft_tokens = 5

    @staticmethod
    def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """What the cache `__init__` allocates takes a target token: the MTP layer's KV in the model dtype."""
        return kv_bytes_per_token(mtp_layer_config(config), None, dtype)

    def __init__(self, target: DecoderModel, head: MTPHead, cache: CacheManager, sampler: Sampler,
                 graphs: DecodeGraphs | None = None, lm_head: torch.nn.Module | None = None):
        """`lm_head`: the drafts' (draft_head.py's int4 copy), None: the target's."""
        config: ModelConfig = target.config
        self.target, self.head, self.cache, self.sampler = target, head, cache, sampler
        self.lm_head = target.lm_head if lm_head is None else lm_head
        dtype = target.dtype
        # the target's pages + its scratch page (graph rows with no sequence write there)
        pages = cache.num_pages + (cache.scratch_page is not None)
        self.kv = ModelCache.allocate(mtp_layer_config(config), pages, cache.page_size, 1, dtype, cache.device)
        self.cache_bytes = self.kv.kv.nbytes
        self._last: dict[str, _Last] = {}
        self._caught: tuple[torch.Tensor, torch.Tensor] | None = None  # the last observation's, until settled
        self.graphs = MTPGraphs(self, graphs) if graphs is not None else None

    @torch.inference_mode()
    def observe(self, obs: Observation) -> None:
        batch = obs.batch
        ids, rows, last = obs.device_rows()
        positions = batch.mrope_positions[:, rows] if batch.mrope_positions is not None else batch.positions[rows]
        inputs = (ids, obs.out.hidden_states[rows], positions, batch.cache_lens[rows], batch.block_table[rows], last)
        caught = self.graphs.catch_up(*inputs) if self.graphs is not None else None
        self._caught = caught if caught is not None else self.catch_up(*inputs)
        if obs.counts is not None:
            self.settle(obs, obs.counts)

    def settle(self, obs: Observation, counts: list[int]) -> None:
        assert self._caught is not None, "settle follows its observe"
        tail, logits = self._caught
        for i, seq in enumerate(obs.seqs):
            self._last[seq.request_id] = _Last(index=obs.start(i) + counts[i] - 1, hidden=tail[i], logits=logits[i])

    def catch_up(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache_lens: torch.Tensor,
                 block_table: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over target rows [B, T] (hidden: the target's last layer, before its final norm)
        -> the normed output and logits of each row's entry `last` ([B, H], [B, V] fp32)."""
        out = self.run_layer(ids, self.target.norm(hidden), positions, cache_lens, block_table)
        tail = out[torch.arange(out.shape[0], device=out.device), last]
        return tail, self.lm_head(tail).float()

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], counts: list[int], penalties: PenaltyTables | None = None) -> list[Draft]:
        lasts = [self._last[s.request_id] for s in seqs]
        # greedy drafts are the raw argmax (penalties or not); a sampled row's logit bias drafts eagerly
        params = [s.request.sampling for s in seqs]
        penalised = any(map(_penalised, params))
        if self.graphs is not None and not any(map(_biased, params)) and (penalties is not None or not penalised):
            drafted = self.graphs.draft(lasts, [s.rope_delta for s in seqs], params, [s.generator for s in seqs],
                                        self.cache.block_table([s.cache for s in seqs]), counts,
                                        penalties if penalised else None, [s.cache.slot for s in seqs])
            if drafted is not None:
                return drafted
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        logits = torch.stack([last.logits for last in lasts])
        hidden = torch.stack([last.hidden for last in lasts])
        # a sampled row's uniforms, one a draft, drawn at once as the chain graphs draw them
        draws = [None if s.request.sampling.is_greedy else uniform(s.generator, c) for s, c in zip(seqs, counts)]
        for step in range(max(counts)):
            histories = [TokenHistory(seqs[i].prompt_ids, seqs[i].output_ids + tokens[i]) for i in active]
            u = [draws[i][step] for i in active if draws[i] is not None]
            chosen, q = choose_drafts(self.sampler, logits, [seqs[i] for i in active], histories,
                                      torch.stack(u).to(logits.device) if u else None)
            for j, i in enumerate(active):
                tokens[i].append(chosen[j])
                if q[j] is not None:
                    probs[i].append(q[j])
            keep = [j for j, i in enumerate(active) if len(tokens[i]) < counts[i]]
            if not keep:
                break
            active = [active[j] for j in keep]
            device = hidden.device
            index = torch.tensor([lasts[i].index + step + 1 for i in active], device=device)
            deltas = torch.tensor([seqs[i].rope_delta for i in active], device=device)
            ids = torch.tensor([[chosen[j]] for j in keep], device=device)
            table = self.cache.block_table([seqs[i].cache for i in active])
            hidden = self.run_layer(ids, hidden[keep, None], (index + deltas)[:, None], index, table)[:, 0]
            logits = self.lm_head(hidden).float()
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def release(self, seq: Sequence) -> None:
        self._last.pop(seq.request_id, None)

    def run_layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache_lens: torch.Tensor,
             block_table: torch.Tensor) -> torch.Tensor:
        """The MTP layer over rows [B, T] at MTP cache indices cache_lens[b] + t -> normed outputs."""
        embeds = self.target.embed_tokens(ids)
        cos, sin = self.target.rotary_emb(positions, embeds.dtype)
        attn = AttentionMetadata.build(block_table, cache_lens, ids.shape[1], self.kv.page_size, self.kv.kv.num_pages)
        step = StepContext(cos=cos, sin=sin, attn=attn, slots=cache_lens, cache=self.kv)
        return self.head(embeds, hidden, step)


def _penalised(params: SamplingParams) -> bool:
    """A sampled row whose q reads its token history (greedy drafts are the raw argmax)."""
    return not params.is_greedy and params.has_penalties


def _row_key(params: SamplingParams) -> tuple:
    """What of a row's sampling the sampled chains' inputs hold (`MTPGraphs._row_inputs`)."""
    return (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty,
            params.presence_penalty, params.frequency_penalty)


def _biased(params: SamplingParams) -> bool:
    """A sampled row whose q adds a logit bias, which the chain graphs do not hold."""
    return not params.is_greedy and bool(params.logit_bias)


@dataclass
class _Captured:
    """One captured MTP call: its static inputs (by name), the graph, its static outputs."""

    inputs: dict[str, torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, ...] = ()
    held: object = None  # what the inputs that outlive a replay hold (MTPGraphs.draft)


class MTPGraphs:
    """The MTP drafter's two calls per round as CUDA graphs, on the target's decode-graph buckets,
    pool and scratch page (spare rows: zeros at index 0 of the scratch page, outputs discarded):
      draft     greedy K-token chains per (bucket, K): argmax, then K-1 layer steps each followed
                by lm_head and argmax. Rows run to K even when they asked fewer drafts (the extra
                entries lie inside the pages the engine reserved for the round).
      sampled   the same chain for a batch with sampled rows, each step's token drawn from q (the
                row's temperature / top-k / top-p / min-p over the drafter's logits, on the device;
                one-hot at the argmax for greedy rows) with a uniform its generator gave before the
                replay: the draws and the order of eager drafting, so the same drafts and q.
      penalised that, with a sampled row's repetition / presence / frequency penalties on its logits
                first: its history is its row of the engine's penalty tables (indexed by the rows'
                slots) plus the drafts drawn so far, as eager drafting sees it.
      catch_up  the layer over a verify's rows per (bucket, width <= 16) and the logits of each
                row's last kept entry (`MTPDrafter.catch_up`); prompt chunks stay eager.
    A capture failure turns both off with a warning (drafting eagerly gives the same drafts)."""

    def __init__(self, drafter: MTPDrafter, graphs: DecodeGraphs):
        self.drafter, self.graphs = drafter, graphs
        self.captured: dict[tuple[str, int, int], _Captured] = {}
        self.penalties: PenaltyTables | None = None  # the engine's tables, which the penalised chains read
        self.enabled = True

    def draft(self, lasts: list[_Last], deltas: list[int], params: list[SamplingParams],
              generators: list[torch.Generator | None], table: torch.Tensor, counts: list[int],
              penalties: PenaltyTables | None = None, slots: list[int] | None = None) -> list[Draft] | None:
        """counts[b] drafts for row b (a sequence's newest entry, rope delta, sampling, generator, block
        table row), or None when no graph serves the batch. `penalties`: where a sampled row has
        penalties, the tables holding each row's history at slots[b] (one tables object for the
        graphs' lifetime: they read its tensors); sampled rows with a logit bias are the caller's to
        keep away."""
        device, k = lasts[0].logits.device, max(counts)
        inputs = {"logits": torch.stack([last.logits for last in lasts]),
                  "hidden": torch.stack([last.hidden for last in lasts]),
                  "table": table}
        inputs["index"], inputs["deltas"] = upload([[last.index for last in lasts], deltas], torch.long, device)
        if all(p.is_greedy for p in params):
            out = self._replay(("draft", len(lasts), k), inputs, lambda x: (self._chain(x, k),))
            if out is None:
                return None
            tokens = out[0].clone()  # the graph's buffer is the next round's too: the judge reads these later
            return [Draft(pending=tokens[b, :c]) for b, c in enumerate(counts)]
        kind = "sampled" if penalties is None else "penalised"
        if penalties is not None:
            assert self.penalties in (None, penalties) and slots is not None, "the graphs read one tables object"
            self.penalties = penalties
        slots = slots if penalties is not None else None
        vocab = inputs["logits"].shape[-1]

        def like() -> dict[str, torch.Tensor]:  # the uniforms are drawn into the graph's input itself
            u = torch.zeros(len(lasts), k, dtype=torch.float64, device=device)
            return inputs | self._row_inputs(params, slots, vocab, device) | {"u": u}

        captured = self._graph((kind, len(lasts), k), table, like, lambda x: self._sampled_chain(x, k))
        if captured is None:  # before the generators draw
            return None
        # the rows' sampling parameters (and slots) stay in the graph's inputs while its batch keeps them
        held = (tuple(map(_row_key, params)), tuple(slots or ()))
        if captured.held != held:
            inputs |= self._row_inputs(params, slots, vocab, device)
            captured.held = held
        u = captured.inputs["u"]  # one uniform a draft, as eager drafting draws them, into the graph's input
        for b, (generator, c) in enumerate(zip(generators, counts)):
            if not params[b].is_greedy:
                uniform(generator, c, out=u[b, :c])
        tokens, probs = self._run(captured, inputs, len(lasts))
        tokens = tokens.clone()  # the graph's buffer is the next round's too: read by the judge with its tokens
        return [Draft(pending=tokens[b, :c], probs=None if p.is_greedy else probs[b, :c].clone())
                for b, (c, p) in enumerate(zip(counts, params))]

    @staticmethod
    def _row_inputs(params: list[SamplingParams], slots: list[int] | None, vocab: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
        """The sampled chains' per-row inputs: the sampling columns and, with `slots`, the rows of the
        penalty tables and the penalties (greedy rows': neutral, their drafts are the raw argmax)."""
        temperature, top_k, top_p, min_p = row_params(params)
        # top_k past the vocabulary means no cap (and a 2**63 - 1 stays exact in float64)
        temperature, top_k, top_p, min_p = sampling_ops.columns_on_device(
            [temperature, top_k.clamp(-1, vocab), top_p, min_p], device)
        out = dict(temperature=temperature, top_k=top_k.long(), top_p=top_p, min_p=min_p)
        if slots is not None:
            neutral = SamplingParams()
            out["slots"] = upload(slots, torch.long, device)
            out.update(zip(("repetition", "presence", "frequency"), penalty_columns(
                [neutral if p.is_greedy else p for p in params], torch.float32, device)))
        return out

    def catch_up(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache_lens: torch.Tensor,
                 block_table: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`MTPDrafter.catch_up` by graph replay (outputs copied out), or None when none serves."""
        width = ids.shape[1]
        if width > MAX_STEP_TOKENS or positions.dim() != 2:
            return None
        inputs = {"ids": ids, "hidden": hidden, "positions": positions, "cache_lens": cache_lens,
                  "table": block_table, "last": last}
        out = self._replay(("catch_up", ids.shape[0], width), inputs,
                           lambda x: self.drafter.catch_up(x["ids"], x["hidden"], x["positions"], x["cache_lens"],
                                                           x["table"], x["last"]))
        return None if out is None else (out[0].clone(), out[1].clone())

    def _chain(self, x: dict[str, torch.Tensor], k: int) -> torch.Tensor:
        token = x["logits"].argmax(-1)
        tokens, hidden = [token], x["hidden"]
        for step in range(1, k):
            hidden, logits = self._step(x, step, token, hidden)
            token = logits.argmax(-1)
            tokens.append(token)
        return torch.stack(tokens, dim=1)

    def _sampled_chain(self, x: dict[str, torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_chain` with each token drawn from its q: (tokens [B, K], q [B, K, V] fp32). With `slots`
        in x, each row's logits penalised first by its history, each draft joining it."""
        rows = (x["temperature"], x["top_k"], x["top_p"], x["min_p"])
        logits, hidden = x["logits"], x["hidden"]
        penalised = "slots" in x
        if penalised:
            tables = self.penalties
            assert tables is not None
            seen, counts = tables.seen.index_select(0, x["slots"]), tables.counts.index_select(0, x["slots"])
            row_ids = torch.arange(seen.shape[0], device=seen.device)  # row b of the copies: sequence b
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for step in range(k):
            if step:
                hidden, logits = self._step(x, step, tokens[-1], hidden)
            if penalised:
                logits = penalise(logits, seen, counts, x["repetition"], x["presence"], x["frequency"])
            token, q = sampling_ops.sample_and_probs(logits, *rows, x["u"][:, step])
            tokens.append(token)
            probs.append(q)
            if penalised and step + 1 < k:
                record_tokens(seen, counts, row_ids, tokens[-1])
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def _step(self, x: dict[str, torch.Tensor], step: int, token: torch.Tensor,
              hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain step `step`: the layer over (token, the previous normed output) -> (its normed output,
        its logits, fp32)."""
        index = x["index"] + step
        hidden = self.drafter.run_layer(token[:, None], hidden[:, None], (index + x["deltas"])[:, None], index,
                                        x["table"])[:, 0]
        return hidden, self.drafter.lm_head(hidden).float()

    def _replay(self, key: tuple[str, int, int], inputs: dict[str, torch.Tensor],
                fn: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...] | None:
        """Load `inputs` (B rows) into the graph of (kind, bucket, size), capturing it first."""
        captured = self._graph(key, inputs["table"], lambda: inputs, fn)
        return None if captured is None else self._run(captured, inputs, key[1])

    def _graph(self, key: tuple[str, int, int], table: torch.Tensor, like: Callable[[], dict[str, torch.Tensor]],
               fn: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]) -> _Captured | None:
        """The graph of (kind, bucket, size) serving B = key[1] rows of this block table, captured on
        first use over inputs shaped like `like()` (all it reads), or None when none serves."""
        kind, rows, size = key
        bucket = self._bucket(kind, rows, size, table)
        if bucket is None:
            return None
        captured = self.captured.get((kind, bucket, size)) or self._capture((kind, bucket, size), like(), fn)
        return None if captured is None or captured.graph is None else captured

    def _run(self, captured: _Captured, inputs: dict[str, torch.Tensor], rows: int) -> tuple[torch.Tensor, ...]:
        """Load `inputs` into their graph inputs' first `rows` rows (the inputs not named keep what
        they hold), replay, and return the outputs' first `rows` rows."""
        for name, value in inputs.items():
            static = captured.inputs[name][:rows]
            (static[:, : value.shape[1]] if name == "table" else static).copy_(value)
        self._park({name: captured.inputs[name] for name in inputs}, rows)
        captured.graph.replay()
        return tuple(t[:rows] for t in captured.outputs)

    def _bucket(self, kind: str, rows: int, size: int, table: torch.Tensor) -> int | None:
        """The bucket whose graph of `kind` serves `rows` rows, None when none does."""
        bucket = self.graphs.bucket(rows, size if kind == "catch_up" else 1)
        if not self.enabled or bucket is None or table.shape[1] > self.graphs.max_pages:
            return None
        return bucket

    def _park(self, inputs: dict[str, torch.Tensor], start: int) -> None:
        if not inputs or start == next(iter(inputs.values())).shape[0]:  # a full bucket: no spare rows
            return
        for name, static in inputs.items():
            if name == "table":
                static[start:].fill_(self.graphs.scratch_page)
            elif name == "repetition":  # neutral (a 0 would divide by it)
                static[start:].fill_(1)
            elif name == "positions":
                static[start:].copy_(torch.arange(static.shape[1], device=static.device).expand_as(static[start:]))
            else:
                static[start:].zero_()

    def _capture(self, key: tuple[str, int, int], like: dict[str, torch.Tensor],
                 fn: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]) -> _Captured | None:
        bucket = key[1]
        inputs = {name: torch.zeros((bucket, *value.shape[1:]), dtype=value.dtype, device=value.device)
                  for name, value in like.items()}
        inputs["table"] = torch.zeros((bucket, self.graphs.max_pages), dtype=torch.int32, device=like["table"].device)
        self._park(inputs, 0)
        try:
            graph, outputs = capture(lambda: fn(inputs), self.graphs.pool)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: draft eagerly
            log.warning("CUDA graph capture of the MTP drafter failed (%s); drafting eagerly", exc)
            self.enabled = False
            return None
        captured = self.captured[key] = _Captured(inputs, graph, outputs)
        return captured
