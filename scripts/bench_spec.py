"""Speculative decoding benchmarks: verify cost, GDN rollback options, real acceptance.

    python3 scripts/bench_spec.py verify     [--preset qwen3.6-35b-a3b] [--max-k 7] [--json OUT]
    python3 scripts/bench_spec.py rollback   [--preset tiny-qwen3.6-moe --device cpu] [--json OUT]
    python3 scripts/bench_spec.py profile    [--max-k 3] [--json OUT]
    python3 scripts/bench_spec.py acceptance [--model DIR] [--spec ngram] [--draft-tokens 1,..,8]
                                             [--adaptive 8] [--json OUT]
    python3 scripts/bench_spec.py engine     [--model .bench/qwen3.6-35b-a3b] [--batches 1,8] [--k 1,2,3]
                                             [--acceptance 0.72] [--profile TOKENS] [--json OUT]

verify: on the synthetic model (exact shapes, random weights; the engine's own forward, eager),
after a `--context`-token prefill, the time of one verify round of K+1 tokens per sequence
(logits for all rows, GDN state deferred + commit of K+1 tokens) relative to a plain 1-token
decode step, K = 1..max-k; the MTP drafter's cost for K drafts (catch-up over K+1 rows + K-1
single-row steps, lm_head each); one DFlash pass (MODEL-FACTS' 35B-A3B drafter shape) over a
block of K+1. Projected speedup of MTP-K at a per-draft acceptance rate a (accepted / drafted,
the reference engine's definition: 72% for MTP3 = 3.16 tokens per round):

    tokens per round  E = 1 + K * a
    speedup           S = E / (verify(K) / decode + draft(K) / decode)

profile: the kernels of one eager decode step and one eager verify round of K+1 by GPU time.

rollback: per round, record + commit (ours) vs snapshot + plain verify + restore + replay
forward of the kept tokens (option b), for 1 and K+1 kept tokens.

acceptance: a real model (default: the embedded SmolLM2-135M) on a few prompts (code, prose,
repetition), plain greedy vs speculative greedy at fixed K and adaptive K (`--adaptive-draft`):
identical output, acceptance, tokens per round, rounds, and the projected speed against plain
decode on the GPU of the cost table (engine/speculative/adaptive.py: H200, 35B-A3B int4):

    speedup = tokens of the rounds / sum over rounds of cost(drafts in the round)

engine: what the projections leave out, the engine loop's own time (`LLMEngine.step`: the host's
work between the syncs of a round, the judge, the commit, the catch-up), on a random-weight model
directory (scripts/make_bench_model.py). Per batch, greedy and at Qwen3.6's suggested sampling with
presence penalty 1.0 (as the reference engine benchmarks MTP): plain decode, then MTP K = 3 rounds
whose judge runs as usual but whose kept drafts are a seeded draw putting accepted / drafted at
`--acceptance` (random weights would reject nearly everything), and at 0 (the round's cost alone).
K = 0 times `--adaptive-draft`'s rounds without drafts: the speculative step, not the plain one.
The tokens are not the model's (forced drafts); the work and time of each round are the engine's.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_decode's kernel table
from ninfer_core.bench import cuda_median_ms  # noqa: E402
from ninfer_core.cache import CacheManager, KVPool  # noqa: E402
from ninfer_core.config import ModelConfig  # noqa: E402
from ninfer_core.engine.cuda_graph import DecodeGraphs  # noqa: E402
from ninfer_core.engine.penalties import PenaltyTables  # noqa: E402
from ninfer_core.engine.request import GenerationRequest, SpecStats  # noqa: E402
from ninfer_core.engine.sampling import Sampler, SamplingParams  # noqa: E402
from ninfer_core.engine.sequence import Sequence  # noqa: E402
from ninfer_core.engine.speculative.adaptive import AdaptiveDraft  # noqa: E402
from ninfer_core.engine.speculative import Draft  # noqa: E402
from ninfer_core.engine.speculative import mtp_head  # noqa: E402
from ninfer_core.engine.speculative.draft_head import draft_lm_head  # noqa: E402
from ninfer_core.engine.speculative.base import draft_matrix  # noqa: E402
from ninfer_core.engine.speculative.mtp import MTPDrafter, _Last  # noqa: E402
from ninfer_core.engine.speculative.rollback import commit_gdn  # noqa: E402
from ninfer_core.engine.speculative.verify import Verdict  # noqa: E402
from ninfer_core.layers.attention import AttentionMetadata  # noqa: E402
from ninfer_core.models.base import ForwardBatch  # noqa: E402
from ninfer_core.models.dflash import BlockInputs, DFlashConfig, DFlashModel  # noqa: E402
from ninfer_core.models.loader import init_random_, random_model, resolve_device, resolve_dtype  # noqa: E402
from ninfer_core.hub.fit import count_params  # noqa: E402
from ninfer_core.models.quantize import resolve_recipe  # noqa: E402
from ninfer_core.models.presets import preset  # noqa: E402
from ninfer_core.ops.dispatch import upload  # noqa: E402

PROMPTS = {
    "code": "Write a Python class LinkedList with methods append, prepend, remove and __len__, each with a docstring.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "repetition": "List the days of the week, one per line. Then list them again. Then list them a third time.",
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Synthetic:
    """A random-weight model of a preset's shape with one prefilled sequence."""

    def __init__(self, name: str, device: str, dtype: str, context: int, max_k: int, weights: str = "bf16"):
        self.config: ModelConfig = preset(name)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.recipe = resolve_recipe(weights, self.device, self.dtype, count_params(self.config))
        self.model = random_model(self.config, self.device, self.dtype, self.recipe)
        self.cache = CacheManager(self.config, max_tokens=context + 2 * max_k + 32, max_seqs=2, dtype=self.dtype,
                                  device=self.device, scratch=self.device.type == "cuda")
        self.graphs = (DecodeGraphs(self.model, self.cache, 1, context + 2 * max_k + 32)
                       if self.device.type == "cuda" else None)
        self.seq = self.cache.allocate()
        self.cache.reserve(self.seq, context + 2 * max_k + 16)
        self.context = context
        self._penalties: PenaltyTables | None = None
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, self.config.vocab_size, (1, context + 2 * max_k + 16), generator=gen)
        with torch.inference_mode():
            for start in range(0, context, 1024):
                end = min(context, start + 1024)
                self.forward(self.tokens[:, start:end].to(self.device), start, "none")

    def penalties(self) -> PenaltyTables:
        """Penalty tables holding the context as the sequence's history: one object for the model's
        life, as in the engine (the drafter's penalised graphs read its tensors)."""
        if self._penalties is None:
            self._penalties = PenaltyTables(self.cache.max_seqs, self.config.vocab_size, self.device)
            self._penalties.reset(self.seq.slot, self.tokens[0, :self.context].tolist(), [])
        return self._penalties

    def forward(self, ids: torch.Tensor, start: int, logits: str = "last", verify: bool = False,
                capture: tuple[int, ...] = ()):
        return self.model.forward(self.batch(ids, start, logits, verify, capture), self.cache.cache)

    def batch(self, ids: torch.Tensor, start: int, logits: str = "last", verify: bool = False,
              capture: tuple[int, ...] = ()) -> ForwardBatch:
        t = ids.shape[1]
        return ForwardBatch(
            input_ids=ids, positions=torch.arange(start, start + t, device=self.device)[None],
            cache_lens=torch.tensor([start], device=self.device), slots=torch.tensor([self.seq.slot], device=self.device),
            block_table=self.cache.block_table([self.seq]), logits=logits, verify=verify, capture_layers=capture,
        )

    def verify_round(self, k: int, kept: int, graph: bool) -> None:
        """One verify of K+1 tokens after the context (logits to the host, as the engine's
        acceptance needs them), then the commit of `kept` tokens: graph replays or eager."""
        n = self.context
        batch = self.batch(self.ids(n, k + 1), n, "all", verify=True)
        counts = torch.tensor([kept], device=self.device)
        if graph:
            assert self.graphs is not None and self.graphs.supports(batch)
            out = self.graphs.forward(batch)
            assert out is not None
            out.logits.argmax(-1).cpu()
            self.graphs.commit(batch, counts)
        else:
            out = self.model.forward(batch, self.cache.cache)
            out.logits.argmax(-1).cpu()
            commit_gdn(self.model, self.cache.cache.state, out.gdn_records, batch.slots, counts)

    def decode_step(self, graph: bool) -> None:
        batch = self.batch(self.ids(self.context, 1), self.context)
        out = self.graphs.forward(batch) if graph and self.graphs is not None else self.model.forward(batch, self.cache.cache)
        assert out is not None
        out.logits.argmax(-1).cpu()

    def replay_ms(self, width: int, replays: int = 20) -> float:
        """GPU milliseconds of one batch-1 round by graph replay alone, back to back (no batch to
        build, no logits to the host): the decode graph (width 0), or a verify graph of `width`
        tokens and its commit graph. The graph must have run once (`decode_step` / `verify_round`)."""
        assert self.graphs is not None
        g = self.graphs.graphs[(1, width, ())]
        step = (lambda: g.graph.replay()) if width == 0 else (lambda: (g.graph.replay(), g.commit.replay()))
        return cuda_median_ms(lambda: [step() for _ in range(replays)]) / replays

    def ids(self, start: int, t: int) -> torch.Tensor:
        return self.tokens[:, start : start + t].to(self.device)

    def random_module(self, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        with torch.device("meta"):
            module = build()
        module = module.to(self.dtype).to_empty(device=self.device).eval()
        init_random_(module)
        return module

    @cached_property
    def draft_lm_head(self) -> torch.nn.Module:
        """The drafters' lm_head, as the engine gives them (draft_head.py)."""
        return draft_lm_head(self.model.lm_head)

    @cached_property
    def mtp(self) -> MTPDrafter:
        """The engine's MTP drafter over a random MTP head (its chain graphs on the GPU)."""
        head = mtp_head(self.config, self.device, self.dtype, self.recipe, None)  # quantized as the engine's
        return MTPDrafter(self.model, head, self.cache, Sampler(), self.graphs,  # type: ignore[arg-type]
                          self.draft_lm_head)

    @cached_property
    def dflash(self) -> tuple[DFlashModel, KVPool]:
        config = DFlashConfig.from_dict(dflash_shape(self.config), Path("<bench>"))
        kv = KVPool(list(range(config.num_layers)), self.cache.num_pages, self.cache.page_size, config.num_kv_heads,
                    config.head_dim, self.dtype, self.device)
        return self.random_module(lambda: DFlashModel(config)), kv


DFLASH_35B = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  intermediate_size=6144, vocab_size=248320, rms_norm_eps=1e-6, rope_theta=1e7,
                  dflash_config=dict(block_size=16, mask_token_id=248070, target_layer_ids=[1, 10, 19, 28, 37]))


def dflash_shape(config: ModelConfig) -> dict:
    """The z-lab drafter of Qwen3.6-35B-A3B (MODEL-FACTS 5) for that shape, else a small one."""
    if (config.hidden_size, config.num_layers) == (2048, 40):
        return DFLASH_35B
    return dict(DFLASH_35B, hidden_size=config.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, intermediate_size=2 * config.hidden_size,
                vocab_size=config.vocab_size, dflash_config=dict(block_size=16, mask_token_id=config.vocab_size - 1,
                                                                 target_layer_ids=[0, config.num_layers // 2]))


def mtp_draft_cost(s: Synthetic, k: int, repeats: int, graph: bool, sampling: str = "greedy") -> float:
    """K drafts as the engine's MTP drafter makes them: the catch-up (its layer over the verify's
    K+1 rows, lm_head on the last), then the chain of K-1 single-row steps: eagerly (a host sync
    per draft, as the engine's eager path takes each token) or by replaying the drafter's graphs
    (`sampling` "sampled": the sampling chain of a request at Qwen3.6's suggested temperature 0.7,
    top-p 0.8, top-k 20, instead of the argmax chain; "penalised": that with its suggested presence
    penalty 1.5 over a history of `context` tokens in penalty tables as the engine keeps them)."""
    drafter, n, dev = s.mtp, s.context, s.device
    table = s.cache.block_table([s.seq])
    hidden = torch.randn(1, k + 1, s.config.hidden_size, device=dev, dtype=s.dtype)
    start = n - k - 1
    catch_up = (s.ids(n - k, k + 1), hidden, torch.arange(start, n, device=dev)[None],
                torch.tensor([start], device=dev), table, torch.tensor([k], device=dev))
    sampled = sampling != "greedy"
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20,
                            presence_penalty=1.5 if sampling == "penalised" else None) if sampled else SamplingParams(
        temperature=0)
    generator = params.make_generator(dev) if sampled else None
    penalties = s.penalties() if sampling == "penalised" else None

    def draft() -> None:
        if graph:
            assert drafter.graphs is not None
            caught = drafter.graphs.catch_up(*catch_up)
            assert caught is not None
            last = _Last(n - 1, caught[0][0], caught[1][0])
            assert drafter.graphs.draft([last], [0], [params], [generator], table, [k], penalties,
                                        [s.seq.slot]) is not None
            return
        h, logits = drafter.catch_up(*catch_up)
        token = logits.argmax(-1, keepdim=True)
        token.tolist()
        for step in range(1, k):
            index = torch.tensor([n + step - 1], device=dev)
            h = drafter.run_layer(token, h[:, None], index[:, None], index, table)[:, 0]
            token = drafter.lm_head(h).float().argmax(-1, keepdim=True)
            token.tolist()

    with torch.inference_mode():
        return timed(draft, dev, repeats)


def dflash_draft_cost(s: Synthetic, k: int, repeats: int) -> float:
    """One DFlash pass over a block of K+1 with `context` cached entries (+ writing K+1 new ones)."""
    (m, kv), n, dev = s.dflash, s.context, s.device
    caches = ([kv.k[i] for i in kv.layers], [kv.v[i] for i in kv.layers])
    table = s.cache.block_table([s.seq])
    features = torch.randn(1, k + 1, m.fc.in_features, device=dev, dtype=s.dtype)
    lens = torch.tensor([n - k - 1], device=dev)
    meta = AttentionMetadata.build(table, lens, k + 1, s.cache.page_size, s.cache.num_pages)
    where = BlockInputs(positions=torch.arange(n, n + k + 1, device=dev)[None], block_lens=torch.tensor([k + 1], device=dev),
                        ctx_lens=torch.tensor([n], device=dev), block_table=table)

    def draft() -> None:
        m.write_context(features, lens[:, None] + torch.arange(k + 1, device=dev), meta.slot_mapping, *caches)
        hidden = m(s.model.embed_tokens(s.ids(n, k + 1)), where, *caches)
        m.logits(hidden[:, 1:], s.draft_lm_head).argmax(-1)

    with torch.inference_mode():
        return timed(draft, dev, repeats)


def bench_verify(args: argparse.Namespace) -> dict:
    s = Synthetic(args.preset, args.device, args.dtype, args.context, args.max_k, args.weights)
    n = s.context
    modes = (False, True) if s.graphs is not None else (False,)
    with torch.inference_mode():
        decode = {g: timed(lambda: s.decode_step(g), s.device, args.repeats) for g in modes}
        decode_replay = s.replay_ms(0) if s.graphs is not None else None
        rows = []
        for k in range(1, args.max_k + 1):
            row: dict = {"k": k}
            for g in modes:
                t = timed(lambda: s.verify_round(k, k + 1, g), s.device, args.repeats)
                name = "graph" if g else "eager"
                row[f"verify_{name}_ms"], row[f"verify_{name}_ratio"] = t * 1e3, t / decode[g]
            if decode_replay is not None:  # the GPU's share alone: steady where host speeds differ
                replay = s.replay_ms(k + 1)
                row["verify_replay_ms"], row["verify_replay_ratio"] = replay, replay / decode_replay
            best = modes[-1]
            mtp = {g: mtp_draft_cost(s, k, args.repeats, g) for g in modes} if k <= 5 else {}
            for g, t in mtp.items():
                row[f"mtp_draft_{'graph' if g else 'eager'}_ms"] = t * 1e3
            if mtp and best:  # a sampled request's drafts: the sampling chain graph, without / with penalties
                for sampling in ("sampled", "penalised"):
                    row[f"mtp_draft_{sampling}_graph_ms"] = mtp_draft_cost(s, k, args.repeats, True, sampling) * 1e3
            row["dflash_draft_ms"] = dflash_draft_cost(s, k, args.repeats) * 1e3
            ratio = row[f"verify_{'graph' if best else 'eager'}_ratio"]
            tokens = 1 + k * args.acceptance
            row["speedup_verify_only"] = tokens / ratio  # a drafter that costs nothing
            if mtp:
                row["mtp_speedup_at_acceptance"] = tokens / (ratio + mtp[best] / decode[best])
            rows.append(row)
    result = {"bench": "verify", "preset": args.preset, "weights": s.recipe.key, **env(s.device, s.dtype), "context": n,
              "decode_eager_ms": decode[False] * 1e3, "decode_graph_ms": decode[True] * 1e3 if True in decode else None,
              "decode_replay_ms": decode_replay,
              "acceptance": args.acceptance,
              "formula": "speedup = (1 + K*a) / (verify(K) / decode + mtp_draft(K) / decode), graphs where available "
                         "(verify, decode and the MTP chain)",
              "rows": rows}
    print(f"{args.preset} on {result['device']} ({result['dtype']}, {s.recipe.key}), context {n}: decode step "
          + ", ".join(f"{'graph' if g else 'eager'} {decode[g] * 1e3:.2f} ms" for g in modes)
          + (f", replays alone {decode_replay:.3f} ms" if decode_replay is not None else ""))
    print(f"{'K':>2} {'eager ms':>9} {'x eager':>8} {'graph ms':>9} {'x graph':>8} {'replay ms':>9} {'x replay':>8} "
          f"{'MTP eager':>10} {'MTP graph':>10} {'MTP sampled':>12} {'MTP penalised':>14} {'DFlash ms':>10} "
          f"{'S verify-only':>14} "
          f"{'S MTP @' + format(args.acceptance, '.0%'):>10}")
    for r in rows:
        print(f"{r['k']:>2} {r['verify_eager_ms']:>9.2f} {r['verify_eager_ratio']:>8.3f} "
              f"{fmt(r.get('verify_graph_ms')):>9} {fmt(r.get('verify_graph_ratio')):>8} "
              f"{fmt(r.get('verify_replay_ms')):>9} {fmt(r.get('verify_replay_ratio')):>8} "
              f"{fmt(r.get('mtp_draft_eager_ms')):>10} {fmt(r.get('mtp_draft_graph_ms')):>10} "
              f"{fmt(r.get('mtp_draft_sampled_graph_ms')):>12} {fmt(r.get('mtp_draft_penalised_graph_ms')):>14} "
              f"{fmt(r['dflash_draft_ms']):>10} {fmt(r['speedup_verify_only'], 'x'):>14} "
              f"{fmt(r.get('mtp_speedup_at_acceptance'), 'x'):>10}")
    return result


def bench_profile(args: argparse.Namespace) -> dict:
    """Kernels of one eager decode step and one eager verify round of K+1 (what the graphs replay)."""
    from torch.profiler import ProfilerActivity, profile

    from profile_decode import kernel_rows, print_rows

    s = Synthetic(args.preset, args.device, args.dtype, args.context, args.max_k, args.weights)
    result: dict = {"bench": "profile", "preset": args.preset, "weights": s.recipe.key, **env(s.device, s.dtype),
                    "k": args.max_k}
    runs = {"decode": lambda: s.decode_step(False), "verify": lambda: s.verify_round(args.max_k, args.max_k + 1, False)}
    with torch.inference_mode():
        for name, fn in runs.items():
            fn()
            sync(s.device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.repeats):
                    fn()
                sync(s.device)
            rows = kernel_rows(prof, args.repeats)
            busy = sum(r[0] for r in rows)
            print(f"== {name} (K = {args.max_k}): GPU busy {busy / 1e3:.3f} ms in {sum(r[1] for r in rows):.0f} kernels")
            print_rows(rows, 25)
            result[name] = {"gpu_busy_ms": busy / 1e3, "kernels": [dict(us=u, calls=c, name=n) for u, c, n in rows]}
        if s.graphs is not None:
            result["step_tables"] = step_tables(s, args.max_k)
    return result


def step_tables(s: Synthetic, k: int) -> dict[str, list[dict]]:
    """The decode graph's replay and a verify round's (verify + commit graphs) by kernel kind, each
    kind's bytes beside its share (ninfer_core/bench_step.py): which kinds a round of K + 1 tokens
    makes cost more than their bytes do."""
    from profile_decode import replay_kernels

    from ninfer_core.bench_step import compare, kind_bytes, markdown, projection_bytes, step_table

    s.decode_step(True)
    s.verify_round(k, k + 1, True)  # both graphs captured
    decode = s.graphs.graphs[(1, 0, ())]
    verify = s.graphs.graphs[(1, k + 1, ())]
    projections = projection_bytes(s.model, s.config)
    runs = {"decode step": (decode.graph.replay, 1, 2),
            f"K = {k} verify + commit": (lambda: (verify.graph.replay(), verify.commit.replay()), k + 1, 3)}
    tables = {}
    for name, (replay, tokens, passes) in runs.items():
        tables[name] = step_table(replay_kernels(replay), projections,
                                  kind_bytes(s.model, s.config, s.cache, 1, s.context, tokens, passes))
        print(f"== {name}, by kernel kind\n{markdown(tables[name])}")
    print(f"== the two side by side (us of the round)\n{compare({n: [t] for n, t in tables.items()})}")
    return {name: [vars(r) for r in table] for name, table in tables.items()}


def bench_rollback(args: argparse.Namespace) -> dict:
    """Per round of K drafts: ours (record + commit), (a)/(c) per-position states (emulated: the
    verify forward plus writing K+1 states per GDN layer and copying the kept one back), and (b)
    snapshot + plain verify forward + restore + replay forward of the kept tokens."""
    s = Synthetic(args.preset, args.device, args.dtype, args.context, args.max_k, args.weights)
    n, k = s.context, args.max_k
    state, slot = s.cache.cache.state, s.seq.slot
    scratch = {i: torch.empty((k + 1, *state.recurrent[i].shape[1:]), dtype=state.recurrent[i].dtype,
                              device=s.device) for i in state.layers}
    rows = []
    with torch.inference_mode():
        for kept in (1, k + 1):
            def ours() -> None:
                s.verify_round(k, kept, graph=False)

            def per_position() -> None:
                s.forward(s.ids(n, k + 1), n, "all", verify=True).logits.argmax(-1).cpu()
                for i in state.layers:
                    for t in range(k + 1):
                        scratch[i][t].copy_(state.recurrent[i][slot])
                    state.recurrent[i][slot].copy_(scratch[i][kept - 1])

            def option_b() -> None:
                snap = s.cache.snapshot(slot)
                s.forward(s.ids(n, k + 1), n, "all").logits.argmax(-1).cpu()
                if kept < k + 1:
                    s.cache.restore(slot, snap)
                    s.forward(s.ids(n, kept), n, "none")

            rows.append({"k": k, "kept": kept, "record_commit_ms": timed(ours, s.device, args.repeats) * 1e3,
                         "per_position_states_ms": timed(per_position, s.device, args.repeats) * 1e3,
                         "snapshot_replay_ms": timed(option_b, s.device, args.repeats) * 1e3})
    result = {"bench": "rollback", "preset": args.preset, **env(s.device, s.dtype), "context": n, "rows": rows}
    print(f"{args.preset} on {result['device']} ({result['dtype']}), context {n}, K = {k}, ms per round")
    print(f"{'kept':>4} {'record+commit':>14} {'per-position states':>20} {'snapshot+replay':>16}")
    for r in rows:
        print(f"{r['kept']:>4} {r['record_commit_ms']:>14.2f} {r['per_position_states_ms']:>20.2f} "
              f"{r['snapshot_replay_ms']:>16.2f}")
    return result


def bench_acceptance(args: argparse.Namespace) -> dict:
    """Each configuration (fixed K, adaptive K <= limit) on every prompt: the same greedy tokens as
    plain decode, and what its rounds would cost on the GPU the cost table was measured on."""
    from ninfer_core.engine.speculative import CostModel
    from ninfer_core.llm import LLM, ChatRequest, EngineOptions

    options = EngineOptions(device=args.device, dtype=args.dtype, max_context=args.max_context)
    plain = LLM.load(args.model, options)
    sampling = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = {name: plain.prepare_chat(ChatRequest(messages=[{"role": "user", "content": text}])).prompt_token_ids
               for name, text in PROMPTS.items()}
    reference = {name: [t for out in plain.complete(ids, sampling) for t in out.new_token_ids]
                 for name, ids in prompts.items()}
    cost = CostModel()  # the H200 verify table; drafting free (n-gram; MTP / DFlash drafting is not costed)
    configs = [(k, False) for k in int_list(args.draft_tokens)] + [(k, True) for k in int_list(args.adaptive)]
    runs = []
    for k, adaptive in configs:
        spec = LLM(plain.loaded, replace(options, spec=args.spec, draft_tokens=k, draft_model=args.draft_model,
                                         adaptive_draft=adaptive))
        rows = []
        for name, ids in prompts.items():
            outs = list(spec.complete(ids, sampling))
            rounds, st = outs[1:], outs[-1].spec  # outs[0]: the token of the prefill
            assert st is not None and st.rounds == len(rounds)
            tokens = sum(len(o.new_token_ids) for o in rounds)
            steps = sum(cost(o.drafted) for o in rounds)
            rows.append({"prompt": name, "tokens": len(reference[name]),
                         "identical": [t for o in outs for t in o.new_token_ids] == reference[name],
                         "rounds": st.rounds, "rounds_without_drafts": sum(not o.drafted for o in rounds),
                         "drafted": st.drafted, "accepted": st.accepted,
                         "acceptance_rate": st.acceptance_rate, "tokens_per_round": st.tokens_per_round,
                         "round_tokens": tokens, "cost_steps": steps, "projected_speedup": tokens / steps})
        total = sum(r["round_tokens"] for r in rows) / sum(r["cost_steps"] for r in rows)
        runs.append({"config": f"adaptive K<={k}" if adaptive else f"K={k}", "k": k, "adaptive": adaptive,
                     "projected_speedup": total, "rows": rows})
    result = {"bench": "acceptance", "model": plain.name, "spec": args.spec, "max_tokens": args.max_tokens,
              "cost_table": list(cost.verify), "draft_cost": cost.draft,
              "formula": "projected speedup = tokens of the rounds / sum over rounds of cost(drafts of the round)",
              **env(plain.loaded.device, plain.loaded.dtype), "runs": runs}
    print(f"{plain.name}, --spec {args.spec}, greedy, {args.max_tokens} tokens max, {result['device']}; "
          f"projected speed vs plain decode with verify cost {list(cost.verify)} (past the table: its last slope)")
    print(f"{'':<16}" + "".join(f"| {name:<29}" for name in prompts) + "| all")
    print(f"{'config':<16}" + f"| {'acc':>6} {'tok/rd':>6} {'rounds':>6} {'proj':>6} " * len(prompts) + "| proj")
    for run in runs:
        cells = "".join(f"| {r['acceptance_rate']:>6.1%} {r['tokens_per_round']:>6.2f} {r['rounds']:>6} "
                        f"{r['projected_speedup']:>5.2f}x " for r in run["rows"])
        same = "" if all(r["identical"] for r in run["rows"]) else "  NOT IDENTICAL TO PLAIN"
        print(f"{run['config']:<16}{cells}| {run['projected_speedup']:.2f}x{same}")
    return result


def force_acceptance(speculator: Any, keep: float) -> Callable:
    """Make `speculator.judge` run as the engine runs it (its time, its read), then keep each
    sequence's first n drafts, n a seeded draw (each draft kept with probability `keep` once the
    ones before were), and the judge's last token after them: the round's work (commit, catch-up,
    next drafts) at a set acceptance, whatever the random weights say. The forced verdict is made
    on the device as the judge's is (the engine commits and catches up from it before the read).
    Returns the judge to put back."""
    judge, rng = speculator.judge, random.Random(0)

    def forced(seqs: list[Sequence], drafts: list[Draft], logits: torch.Tensor,
               penalties: PenaltyTables | None = None) -> Verdict:
        verdict = judge(seqs, drafts, logits, penalties)
        ns = [next((j for j in range(d.count) if rng.random() >= keep), d.count) for d in drafts]
        device, width = verdict.following.device, verdict.following.shape[1]
        n = upload(ns, torch.long, device)
        own = verdict.following.gather(1, verdict.counts[:, None] - 1)  # the judge's last token
        accepted = draft_matrix(drafts, width, device)  # the drafts, then zeros
        following = torch.where(torch.arange(width, device=device) < n[:, None], accepted, own)

        def kept() -> list[list[int]]:
            return [d.tokens[:k] + own_kept[-1:] for d, k, own_kept in zip(drafts, ns, verdict.kept())]

        return Verdict(n + 1, following, kept)

    speculator.judge = forced
    return judge


def keep_probability(acceptance: float, k: int) -> float:
    """c with (c + c^2 + ... + c^k) / k = acceptance: a prefix of drafts kept one by one with
    probability c averages acceptance * k accepted of k drafted."""
    low, high = 0.0, 1.0
    for _ in range(60):
        c = (low + high) / 2
        low, high = (c, high) if sum(c ** j for j in range(1, k + 1)) / k < acceptance else (low, c)
    return (low + high) / 2


def engine_decode(llm: Any, prompts: list[list[int]], params: SamplingParams, draft_tokens: int | None = None) -> dict:
    """Every prompt decoded at once by the engine loop (`draft_tokens`: each request's K), the decode
    phase timed from the step that gave every sequence its first token to the last: tok/s aggregate,
    steps (rounds) a sequence and their time, the speculative rounds' acceptance and tokens a round."""
    engine = llm.engine
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(GenerationRequest(prompt, params, request_id=rid, draft_tokens=draft_tokens))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    outputs: Counter[str] = Counter()
    stats: dict[str, SpecStats | None] = {}
    start = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            outputs[out.request_id] += 1
            stats[out.request_id] = out.spec
        if start is None and all(tokens.values()):
            start, base, first = time.perf_counter(), sum(map(len, tokens.values())), outputs.copy()
    seconds = time.perf_counter() - start
    generated = sum(map(len, tokens.values())) - base
    rounds = sum(outputs.values()) - sum(first.values())
    result = {"tok_s": generated / seconds, "ms_per_step": seconds / (rounds / len(prompts)) * 1e3,
              "steps": rounds / len(prompts)}
    spec = [st for st in stats.values() if st is not None]
    if spec:
        drafted, accepted = sum(st.drafted for st in spec), sum(st.accepted for st in spec)
        result.update(acceptance=accepted / drafted if drafted else 0.0,
                      tokens_per_round=sum(st.round_tokens for st in spec) / sum(st.rounds for st in spec))
    return result


def no_draft_rounds(llm: Any, prompts: list[list[int]], params: SamplingParams) -> dict:
    """`engine_decode` with every round an adaptive policy's K = 0 round: the sequences may draft
    (their limit is 1), a policy that has seen nothing accepted never asks (and never probes), so
    each round is the speculative step without drafts (a sync, the judge, the drafter's catch-up)
    where `--adaptive-draft`'s cost model counts one plain step."""
    speculator = llm.engine.speculator
    policy, speculator.adaptive = speculator.adaptive, AdaptiveDraft(prior=0.0, probe_every=sys.maxsize)
    try:
        return engine_decode(llm, prompts, params, 1)
    finally:
        speculator.adaptive = policy


def bench_engine(args: argparse.Namespace) -> dict:
    from ninfer_core.llm import LLM, EngineOptions

    batches, ks = int_list(args.batches), int_list(args.k)
    length = args.context + args.tokens + 64
    options = EngineOptions(device=args.device, dtype=args.dtype, weights=args.weights, random_weights=True,
                            max_context=length, max_seqs=max(batches), kv_capacity=max(batches) * length,
                            prefix_cache=False)
    plain = LLM.load(args.model, options)
    top = max(*ks, 1)  # the engine's K (K = 0 runs need a limit too)
    spec = LLM(plain.loaded, replace(options, spec="mtp", draft_tokens=top))
    speculator = spec.engine.speculator
    gen = torch.Generator().manual_seed(0)
    params = {"greedy": SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
              "sampled": SamplingParams(temperature=0.6, top_p=0.95, top_k=20, presence_penalty=1.0, seed=1,
                                        max_tokens=args.tokens, ignore_eos=True)}
    for llm in (plain, spec):  # first-use costs out of the way
        engine_decode(llm, [[1, 2, 3]], replace(params["sampled"], max_tokens=8))
    rows = []
    for batch in batches:
        prompts = [torch.randint(0, plain.loaded.config.vocab_size, (args.context,), generator=gen).tolist()
                   for _ in range(batch)]
        row: dict = {"batch": batch}
        for kind, sampling in params.items():
            row[f"plain_{kind}"] = engine_decode(plain, prompts, sampling)
            for k in ks:
                if k == 0:
                    row[f"mtp_{kind}_k0"] = no_draft_rounds(spec, prompts, sampling)
                    continue
                for acceptance in (args.acceptance, 0.0):
                    judge = force_acceptance(speculator, keep_probability(acceptance, k))
                    row[f"mtp_{kind}_k{k}_at_{acceptance:g}"] = engine_decode(spec, prompts, sampling, k)
                    speculator.judge = judge
        rows.append(row)
    profiles = {}
    if args.profile:  # batch 1 at the set acceptance, greedy and sampled, under the profiler
        prompt = [torch.randint(0, plain.loaded.config.vocab_size, (args.context,), generator=gen).tolist()]
        for kind, sampling in params.items():
            judge = force_acceptance(speculator, keep_probability(args.acceptance, top))
            profiles[f"mtp_{kind}"] = profile_rounds(spec, prompt, replace(sampling, max_tokens=args.profile),
                                                     trace_path(args, f"mtp_{kind}"))
            speculator.judge = judge
            profiles[f"plain_{kind}"] = profile_rounds(plain, prompt, replace(sampling, max_tokens=args.profile))
    result = {"bench": "engine", "model": str(args.model), "weights": plain.loaded.recipe.key, "k": ks,
              "context": args.context, "tokens": args.tokens, "acceptance": args.acceptance,
              **env(plain.loaded.device, plain.loaded.dtype), "rows": rows, "profiles": profiles}
    print(f"engine loop, {args.model}, {result['device']}: plain decode vs MTP rounds of K = {args.k}, context "
          f"{args.context}, {args.tokens} tokens a sequence (ms/step: decode time / steps or rounds; steps: a "
          f"round's time in plain steps, what engine/speculative/adaptive.py's cost model holds)")
    print(f"{'batch':>5} {'run':<25} {'tok/s':>9} {'ms/step':>9} {'steps':>6} {'acc':>6} {'tok/rd':>7} {'x plain':>8}")
    for row in rows:
        for name, run in row.items():
            if name == "batch":
                continue
            plain_run = row["plain_sampled" if "sampled" in name else "plain_greedy"]
            run["plain_steps"] = run["ms_per_step"] / plain_run["ms_per_step"]
            print(f"{row['batch']:>5} {name:<25} {run['tok_s']:>9.1f} {run['ms_per_step']:>9.3f} "
                  f"{run['plain_steps']:>6.2f} {fmt(run.get('acceptance')):>6} {fmt(run.get('tokens_per_round')):>7} "
                  f"{run['tok_s'] / plain_run['tok_s']:>7.2f}x")
    return result


def trace_path(args: argparse.Namespace, name: str) -> Path | None:
    """Where `--trace` puts MTP run `name`'s profiler trace: beside the --json file."""
    if not args.trace or args.json is None:
        return None
    return args.json.with_name(f"{args.json.stem}_{name}.trace.json.gz")


def gpu_idle_us(prof: Any) -> float:
    """The time between the first kernel's start and the last one's end when no kernel ran: where
    the GPU waited for the host."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    idle, latest = 0.0, spans[0][1] if spans else 0.0
    for start, end in spans:
        idle += max(0.0, start - latest)
        latest = max(latest, end)
    return idle


def profile_rounds(llm: Any, prompts: list[list[int]], params: SamplingParams, trace: Path | None = None) -> dict:
    """`engine_decode` under the profiler (its decode phase and the prefill before it): per step
    (round) the wall time, the GPU's busy and idle time and kernels, the host's device syncs; the
    host ops and the kernels that take the most time. `trace`: the profiler's chrome trace (with
    Python stacks), gzipped, there."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from profile_decode import kernel_rows, print_rows
    from profile_prefill import cpu_rows

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=trace is not None) as prof:
        run = engine_decode(llm, prompts, params)
    if trace is not None:
        with tempfile.NamedTemporaryFile(suffix=".json") as raw:
            prof.export_chrome_trace(raw.name)
            trace.write_bytes(gzip.compress(Path(raw.name).read_bytes()))
    steps = run["steps"]
    kernels = kernel_rows(prof, steps)
    host = cpu_rows(prof, top=400)
    syncs = sum(c for _, c, name in host if name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaEventSynchronize", "aten::_local_scalar_dense"))
    out = {"steps": steps, "wall_ms_per_step": run["ms_per_step"],
           "gpu_busy_ms_per_step": sum(k[0] for k in kernels) / 1e3,
           "gpu_idle_ms_per_step": gpu_idle_us(prof) / 1e3 / steps,
           "kernels_per_step": sum(k[1] for k in kernels), "syncs_per_step": syncs / steps,
           "host_ops": [dict(us_per_step=us / steps, calls_per_step=c / steps, name=n) for us, c, n in host[:25]],
           "kernels": [dict(us=u, calls=c, name=n) for u, c, n in kernels]}
    print(f"== profiled {params.temperature and 'sampled' or 'greedy'} {steps:.0f} steps: wall "
          f"{run['ms_per_step']:.3f} ms a step (the profiler's overhead in it), GPU busy "
          f"{out['gpu_busy_ms_per_step']:.3f} ms in {out['kernels_per_step']:.0f} kernels (idle "
          f"{out['gpu_idle_ms_per_step']:.3f} ms), "
          f"{out['syncs_per_step']:.1f} host syncs a step")
    print_rows(kernels, 12)
    print("   host ops by self CPU time a step:")
    for us, calls, name in host[:14]:
        print(f"   {us / steps:8.1f} us {calls / steps:6.1f}x  {name[:90]}")
    return out


def int_list(value: str) -> list[int]:
    """`1,2,8` -> [1, 2, 8]; empty -> []."""
    return [int(v) for v in value.split(",") if v.strip()]


def env(device: torch.device, dtype: torch.dtype) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}


def fmt(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    for name in ("verify", "rollback", "profile"):
        p = sub.add_parser(name)
        p.add_argument("--preset", default="qwen3.6-35b-a3b")
        p.add_argument("--context", type=int, default=512, help="tokens prefilled before the timed rounds")
        p.add_argument("--max-k", type=int, default=7 if name == "verify" else 3)
        p.add_argument("--repeats", type=int, default=20)
        p.add_argument("--acceptance", type=float, default=0.72, help="per-draft acceptance for the projection")
    eng = sub.add_parser("engine")
    eng.add_argument("--model", type=Path, default=Path(".bench/qwen3.6-35b-a3b"),
                     help="a model directory (scripts/make_bench_model.py); its weights are random")
    eng.add_argument("--batches", default="1,8")
    eng.add_argument("--k", default="3", help="drafts a round (comma list: one run each; 0: the adaptive "
                     "policy's rounds without drafts)")
    eng.add_argument("--context", type=int, default=512)
    eng.add_argument("--tokens", type=int, default=256)
    eng.add_argument("--acceptance", type=float, default=0.72)
    eng.add_argument("--profile", type=int, default=0, help="then profile batch 1 over this many tokens (0: no)")
    eng.add_argument("--trace", action="store_true", help="with --profile and --json: the profiled MTP runs' "
                     "chrome traces, Python stacks included, beside the JSON (NAME_RUN.trace.json.gz)")
    acc = sub.add_parser("acceptance")
    acc.add_argument("--model", default=None, help="checkpoint dir / .gguf (default: embedded SmolLM2-135M)")
    acc.add_argument("--spec", default="ngram", choices=["ngram", "mtp", "dflash"])
    acc.add_argument("--draft-tokens", default="1,2,3,4,5,6,7,8", help="fixed K runs (comma list; empty: none)")
    acc.add_argument("--adaptive", default="8", help="adaptive runs: their K limits (comma list; empty: none)")
    acc.add_argument("--draft-model", default=None)
    acc.add_argument("--max-tokens", type=int, default=200)
    acc.add_argument("--max-context", type=int, default=2048)
    for p in sub.choices.values():
        p.add_argument("--device", default="auto")
        p.add_argument("--weights", default="bf16", help="recipe: bf16, int8, int4 (models/quantize.py)")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = parser.parse_args()
    benches = {"verify": bench_verify, "rollback": bench_rollback, "profile": bench_profile,
               "acceptance": bench_acceptance, "engine": bench_engine}
    result = benches[args.bench](args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
