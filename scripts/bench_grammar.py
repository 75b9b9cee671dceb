"""The grammar's cost per decode step (issue 16): constrained rows against free ones, batch 1 and 8.

    python3 scripts/make_bench_model.py qwen3.6-35b-a3b .bench/qwen3.6-35b-a3b    # config + real tokenizer
    NINFER_REQUIRE_KERNELS=1 python3 scripts/bench_grammar.py .bench/qwen3.6-35b-a3b [--batches 1,8]
        [--steps 64] [--json OUT]

Random weights (exact shapes), the default recipe, CUDA graphs. Per batch size B:
- `step_ms`: a plain decode step of B free requests through the engine loop (overlapped steps);
- `constrained_step_ms`: the same with every row under a JSON-schema grammar (steps run one at a
  time: the mask needs the previous token; the bitmask is filled while the forward runs);
- `mask_ms`: the mask alone on the step's logits [B, V]: xgrammar fills B bitmask rows on the
  host, the UTF-8 filter, the copy to the device, the masking kernel (engine/grammar.constrain);
- `mask_ratio` = mask_ms / step_ms (the issue's target: <= 0.05), and `cost_ratio` =
  constrained_step_ms / step_ms - 1 (the whole price, with the lost overlap).
The grammar is an object with one free string; a logit_bias of -100 on every token holding a '"'
keeps the random model inside the string, so each row stays constrained and the mask dense
(almost every token allowed: the most work for the mask, the least for xgrammar's cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.chat.constraints import JsonOutput  # noqa: E402
from ninfer_core.engine.grammar import constrain  # noqa: E402
from ninfer_core.engine.request import GenerationRequest  # noqa: E402
from ninfer_core.engine.sampling import SamplingParams  # noqa: E402
from ninfer_core.llm import LLM, EngineOptions  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
PROMPT_TOKENS = 512


def decode_step_ms(llm: LLM, batch: int, steps: int, constrained: bool) -> float:
    """Median wall time of a decode step of `batch` rows in the engine loop, after their prefill."""
    engine, vocab = llm.engine, llm.loaded.config.vocab_size
    grammar = llm.compile_constraint(JsonOutput(SCHEMA), reasoning=False) if constrained else None
    quotes = {t: -100.0 for t in range(vocab) if b'"' in llm.tokenizer.token_bytes(t)}
    generator = torch.Generator().manual_seed(batch)
    requests = [GenerationRequest(torch.randint(0, vocab, (PROMPT_TOKENS,), generator=generator).tolist(),
                                  SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 8, ignore_eos=True,
                                                 logit_bias=quotes if constrained else {}), grammar=grammar)
                for i in range(batch)]
    for request in requests:
        engine.add_request(request)
    while any(s.in_prefill or not s.output_ids for s in engine.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    for request in requests:
        engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    return 1e3 * statistics.median(times)


def mask_ms(llm: LLM, batch: int, repeats: int) -> float:
    """Median wall time of constrain() on [batch, V] logits, rows mid-string, synchronised."""
    grammar = llm.compile_constraint(JsonOutput(SCHEMA), reasoning=False)
    matchers = [grammar.matcher() for _ in range(batch)]
    for matcher in matchers:
        for token in llm.tokenizer.encode('{"text": "abc'):
            assert matcher.accept(token)
    logits = torch.randn(batch, llm.loaded.config.vocab_size, device=llm.loaded.device)
    times = []
    for _ in range(repeats + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        constrain(logits, matchers)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="checkpoint directory (weights are random: --random-weights)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM.load(args.model, EngineOptions(device="cuda", random_weights=True, max_seqs=max(batches),
                                             max_context=PROMPT_TOKENS + args.steps + 64))
    runs = []
    for batch in batches:
        free = decode_step_ms(llm, batch, args.steps, constrained=False)
        forced = decode_step_ms(llm, batch, args.steps, constrained=True)
        mask = mask_ms(llm, batch, args.steps)
        runs.append({"batch": batch, "step_ms": free, "constrained_step_ms": forced, "mask_ms": mask,
                     "mask_ratio": mask / free, "cost_ratio": forced / free - 1})
        print(f"batch {batch}: step {free:.3f} ms, constrained step {forced:.3f} ms, mask {mask:.3f} ms "
              f"({100 * mask / free:.1f}% of a step; constrained steps +{100 * (forced / free - 1):.1f}%)")
    report = {"model": args.model, "gpu": torch.cuda.get_device_name(), "weights": llm.stats().weights,
              "prompt_tokens": PROMPT_TOKENS, "runs": runs}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
