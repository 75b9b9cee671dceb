"""The grammar's cost per decode step (issue 16), at batch 1 and 8, with the real Qwen3.6 tokenizer.

    python3 scripts/make_bench_model.py qwen3.6-35b-a3b .bench/qwen3.6-35b-a3b    # config + real tokenizer
    NINFER_REQUIRE_KERNELS=1 python3 scripts/bench_grammar.py .bench/qwen3.6-35b-a3b [--batches 1,8]
        [--steps 64] [--host-steps 600] [--host-only] [--json OUT]

Two realistic constraints: `json` (response_format json_schema: an order with nested objects, an
array of objects, enums, numbers, a pattern, free text) and `tool_call` (tool_choice "required"
over two tools: Qwen's XML call with raw, enum, pattern and JSON parameters; `tool_call_unbounded`:
the same without the one maxLength, to show what xgrammar's bounded strings cost). Per constraint and
batch size B:
- host (any machine): B matchers walk a valid answer of the constraint, tokenized by the real
  tokenizer (row i starts i/B of the way in; a finished row starts again). Per step `fill_us`:
  engine/grammar.fill_bitmask (xgrammar's batched fill of B rows + the UTF-8 filter: what
  `constrain` does on the host), `accept_us`: each row's matcher accepting its token (what the
  engine does when it reads a step's tokens): medians, and `host_mean_us`, the mean of their sum
  (it holds the slow steps). `host_ratio`: median fill + accept over the H200's decode step of the
  35B-A3B shape (3.95 ms at batch 1, 8.04 ms at batch 8: docs/performance.md, issue 13). The
  engine runs this host work while the GPU runs the step's forward (llm_engine.py), so it costs
  GPU time only where it outlasts the forward.
- device (CUDA; skipped with --host-only or without a GPU): `copy_us` + `apply_us`, the mask's copy
  to the device and xgrammar's masking kernel on [B, V] float32 logits (CUDA events); the part of
  the mask that is on the step's path. Then, through the engine loop on random weights (default
  recipe, CUDA graphs, overlapped steps): `step_ms`, a decode step of B free rows, and
  `constrained_step_ms`, the same with every row under the constraint (sampled at temperature 1,
  timed until a row's answer ends); `cost_ratio` = constrained_step_ms / step_ms - 1 (the target:
  <= 0.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.chat.constraints import JsonOutput, OutputConstraint, ToolCallOutput, structural_tag  # noqa: E402
from ninfer_core.chat.tool_calls import (  # noqa: E402
    FUNCTION_CLOSE, FUNCTION_OPEN, PARAM_CLOSE, PARAM_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,
)
from ninfer_core.config import GenerationDefaults, load_config  # noqa: E402
from ninfer_core.engine.grammar import Grammar, GrammarCompiler, GrammarMatcher, fill_bitmask  # noqa: E402
from ninfer_core.engine.request import GenerationRequest  # noqa: E402
from ninfer_core.engine.sampling import SamplingParams  # noqa: E402
from ninfer_core.ops.token_mask import apply_token_mask  # noqa: E402
from ninfer_core.tokenizer import Tokenizer  # noqa: E402

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 64},
            "email": {"type": "string"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "postcode": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
                "country": {"enum": ["DE", "FR", "GB", "US", "JP"]}},
                "required": ["street", "city", "country"]}},
            "required": ["name", "address"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {"type": "object", "properties": {
            "sku": {"type": "string"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "unit_price": {"type": "number", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["gift", "fragile", "express"]}}},
            "required": ["sku", "quantity", "unit_price"]}},
        "total": {"type": "number", "minimum": 0},
        "express": {"type": "boolean"},
        "notes": {"type": "string"},
    },
    "required": ["order_id", "status", "customer", "items", "total", "express"],
}
ORDER_ANSWER = {
    "order_id": "ORD-104729", "status": "shipped",
    "customer": {"name": "Dr. Ingrid Müller-Lüdenscheidt", "email": "ingrid.mueller@example.org",
                 "address": {"street": "Königsallee 27, 3. OG", "city": "Düsseldorf", "postcode": "40212",
                             "country": "DE"}},
    "items": [{"sku": "KB-ERGO-DE-105", "quantity": 1, "unit_price": 149.9, "tags": ["fragile"]},
              {"sku": "USB-C-HUB-7P", "quantity": 2, "unit_price": 39.95, "tags": []},
              {"sku": "GIFT-WRAP", "quantity": 1, "unit_price": 4.5, "tags": ["gift", "express"]}],
    "total": 234.3, "express": True,
    "notes": "Please leave the parcel with the concierge if nobody answers; the keyboard is a birthday "
             "present, so no invoice in the box. Danke schön! 🎁",
}
FLIGHTS = {"type": "function", "function": {"name": "search_flights", "description": "Find flights", "parameters": {
    "type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "passengers": {"type": "object", "properties": {
            "adults": {"type": "integer", "minimum": 1, "maximum": 9},
            "children": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["adults"]},
        "cabin": {"enum": ["economy", "premium", "business", "first"]},
        "flexible_days": {"type": "integer", "minimum": 0, "maximum": 3},
        "note": {"type": "string"}},
    "required": ["origin", "destination", "date", "passengers"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
FLIGHTS_CALL = {"origin": "FRA", "destination": "NRT", "date": "2026-12-24", "passengers": {"adults": 2, "children": 1},
                "cabin": "business", "flexible_days": 2,
                "note": "Window seats together if possible; one passenger needs a vegetarian meal."}
# the same tools without maxLength: xgrammar fills masks inside a length-bounded string slowly
# (10-30 ms for some states: xgrammar issue #852), which random-weight answers wander into
UNBOUNDED_WEATHER = json.loads(json.dumps(WEATHER).replace(', "maxLength": 40', ""))
CONSTRAINTS: dict[str, OutputConstraint] = {"json": JsonOutput(ORDER), "tool_call": ToolCallOutput([FLIGHTS, WEATHER]),
                                            "tool_call_unbounded": ToolCallOutput([FLIGHTS, UNBOUNDED_WEATHER])}
STEP_MS = {1: 3.95, 8: 8.04}  # H200 decode step of the 35B-A3B shape (docs/performance.md, issue 13)
PROMPT_TOKENS = 512


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call in Qwen's XML as the templates write it: strings raw, other values as JSON."""
    params = "".join(f"{PARAM_OPEN}{key}>\n{value if isinstance(value, str) else json.dumps(value)}\n{PARAM_CLOSE}\n"
                     for key, value in arguments.items())
    return f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n{params}{FUNCTION_CLOSE}\n{TOOL_CALL_CLOSE}"


ANSWERS = {"json": json.dumps(ORDER_ANSWER, ensure_ascii=False, indent=1),
           "tool_call": tool_call_text("search_flights", FLIGHTS_CALL),
           "tool_call_unbounded": tool_call_text("search_flights", FLIGHTS_CALL)}


def median_us(seconds: list[float]) -> float:
    return 1e6 * statistics.median(seconds)


def walkers(grammar: Grammar, answer: list[int], batch: int) -> tuple[list[GrammarMatcher], list[int]]:
    """`batch` matchers along `answer`, row i advanced i/batch of the way (rows in different states)."""
    matchers, positions = [], []
    for row in range(batch):
        matcher, start = grammar.matcher(), row * len(answer) // batch
        for token in answer[:start]:
            assert matcher.accept(token)
        matchers.append(matcher)
        positions.append(start)
    return matchers, positions


def host_costs(grammar: Grammar, answer: list[int], vocab: int, batch: int, steps: int, pin: bool) -> dict[str, float]:
    """Per step: the batched fill of `batch` rows, then each row accepting its token."""
    matchers, positions = walkers(grammar, answer, batch)
    fills, accepts = [], []
    for _ in range(steps + 10):
        t0 = time.perf_counter()
        bitmask, _ = fill_bitmask(matchers, vocab, pin=pin)
        t1 = time.perf_counter()
        accepted = [m.accept(answer[p]) for m, p in zip(matchers, positions)]
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
        for row, (ok, p) in enumerate(zip(accepted, positions)):  # the answer is valid: its token was allowed
            assert ok and bitmask[row, answer[p] // 32] >> (answer[p] % 32) & 1, (row, p)
            positions[row] = p + 1
            if positions[row] == len(answer):
                assert matchers[row].terminated
                matchers[row], positions[row] = grammar.matcher(), 0
    fill, accept = median_us(fills[10:]), median_us(accepts[10:])
    mean = 1e6 * statistics.fmean(f + a for f, a in zip(fills[10:], accepts[10:]))
    return {"fill_us": fill, "accept_us": accept, "host_us": fill + accept, "host_mean_us": mean}


def device_costs(grammar: Grammar, answer: list[int], vocab: int, batch: int, repeats: int) -> dict[str, float]:
    """CUDA-event times of the mask's copy to the device and of the masking kernel on [B, V] logits."""
    bitmask, rows = fill_bitmask(walkers(grammar, answer, batch)[0], vocab, pin=True)
    logits = torch.randn(batch, vocab, device="cuda")
    copies, kernels = [], []
    for _ in range(repeats + 3):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        on_device = bitmask.to("cuda", non_blocking=True)
        events[1].record()
        apply_token_mask(logits, on_device, rows)
        events[2].record()
        torch.cuda.synchronize()
        copies.append(events[0].elapsed_time(events[1]) / 1e3)
        kernels.append(events[1].elapsed_time(events[2]) / 1e3)
    return {"copy_us": median_us(copies[3:]), "apply_us": median_us(kernels[3:])}


def decode_step_ms(llm: Any, batch: int, steps: int, grammar: Grammar | None) -> tuple[float, int]:
    """Mean wall time of a decode step of `batch` rows in the engine loop (overlapped steps), after
    their prefill, over `steps` steps or until an answer ends; and the steps timed."""
    engine, vocab = llm.engine, llm.loaded.config.vocab_size
    generator = torch.Generator().manual_seed(batch)
    requests = [GenerationRequest(torch.randint(0, vocab, (PROMPT_TOKENS,), generator=generator).tolist(),
                                  SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 8, ignore_eos=True),
                                  grammar=grammar)
                for i in range(batch)]
    for request in requests:
        engine.add_request(request)
    while any(s.in_prefill or not s.output_ids for s in engine.running) or engine.scheduler.waiting:
        engine.step()
    torch.cuda.synchronize()
    start, timed = time.perf_counter(), 0
    while timed < steps:
        outputs = engine.step()
        timed += 1
        if any(out.finished for out in outputs):
            break
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    for request in requests:
        engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    return 1e3 * elapsed / timed, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model directory (config + tokenizer; weights are random on the GPU)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=64, help="engine decode steps per run (GPU)")
    parser.add_argument("--host-steps", type=int, default=600, help="host steps per constraint and batch")
    parser.add_argument("--host-only", action="store_true", help="only the host part (any machine)")
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    gpu = torch.cuda.is_available() and not args.host_only
    config, defaults = load_config(args.model), GenerationDefaults.from_model_dir(args.model)
    tokenizer, vocab = Tokenizer.from_model_dir(args.model), config.vocab_size
    llm = None
    if gpu:
        from ninfer_core.llm import LLM, EngineOptions

        llm = LLM.load(args.model, EngineOptions(device="cuda", random_weights=True, max_seqs=max(batches),
                                                 max_context=PROMPT_TOKENS + args.steps + 64))
    compiler = llm.grammars if llm is not None else \
        GrammarCompiler(tokenizer, vocab, defaults.eos_token_ids or config.eos_token_ids)
    stop = compiler.stop_token_ids[0]
    runs = []
    for name, constraint in CONSTRAINTS.items():
        grammar = compiler.compile(structural_tag(constraint, reasoning=False))
        answer = tokenizer.encode(ANSWERS[name]) + [stop]
        for batch in batches:
            run: dict[str, Any] = {"constraint": name, "batch": batch, "answer_tokens": len(answer)}
            run.update(host_costs(grammar, answer, vocab, batch, args.host_steps, pin=gpu))
            reference = STEP_MS.get(batch)
            run["host_ratio"] = run["host_us"] / (1e3 * reference) if reference else None
            line = (f"{name:9s} batch {batch}: host {run['host_us']:6.1f} us/step (fill {run['fill_us']:.1f} + "
                    f"accept {run['accept_us']:.1f}; mean {run['host_mean_us']:.1f})")
            if reference:
                line += f" = {100 * run['host_ratio']:.2f}% of a {reference} ms H200 step"
            if llm is not None:
                run.update(device_costs(grammar, answer, vocab, batch, repeats=50))
                for warm_up in (None, grammar):  # first-use costs (kernels at this batch size) off the clock
                    decode_step_ms(llm, batch, 8, warm_up)
                free, _ = decode_step_ms(llm, batch, args.steps, None)
                forced, timed = decode_step_ms(llm, batch, args.steps, grammar)
                run.update(step_ms=free, constrained_step_ms=forced, constrained_steps=timed,
                           device_ratio=(run["copy_us"] + run["apply_us"]) / (1e3 * free),
                           cost_ratio=forced / free - 1)
                line += (f"; copy {run['copy_us']:.1f} + apply {run['apply_us']:.1f} us; step {free:.3f} ms, "
                         f"constrained {forced:.3f} ms over {timed} steps ({100 * run['cost_ratio']:+.1f}%)")
            print(line, flush=True)
            runs.append(run)
    report: dict[str, Any] = {"model": args.model, "vocab": vocab, "host_steps": args.host_steps, "runs": runs,
                              "device": torch.cuda.get_device_name() if gpu else "cpu (host part only)"}
    if llm is not None:
        report["weights"] = llm.stats().weights
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
