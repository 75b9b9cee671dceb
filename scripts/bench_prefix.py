"""What the prefix cache saves a user: time to first token with the cache on and off, same engine.

- chat: a long first message (a document), then short turns; every turn's TTFT, prompt length
  and cached tokens (issue 14: turn 8 of a chat reaching 32K tokens);
- agent: one long shared prefix (system prompt + tools + context) and a short new message per
  call (issue 14: 20K-token prefix + 200 new tokens, 10 calls), TTFT p50.
Prompts are random words through the chat template (the real path: template, tokenizer,
checkpoint hints), answers greedy. The checkpoint memory is reported. `--profile` runs one more
agent call under torch.profiler (CUDA): its TTFT against GPU busy time, the largest kernels and
the host ops with the most self time.
    python3 scripts/bench_prefix.py .bench/qwen3.6-35b-a3b --random-weights --device cuda [--profile] --json OUT
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ninfer_core.cache.prefix_cache import PrefixCache  # noqa: E402
from ninfer_core.engine.sampling import SamplingParams  # noqa: E402
from ninfer_core.llm import LLM, ChatRequest, EngineOptions  # noqa: E402

WORDS = "alpha beta gamma delta kernel cache token layer state graph page model answer query".split()


def text(rng: random.Random, llm: LLM, tokens: int) -> str:
    """About `tokens` tokens of random words."""
    words = []
    while len(llm.tokenizer.encode(" ".join(words))) < tokens:
        words += rng.choices(WORDS, k=max(8, (tokens - len(words)) // 2))
    return " ".join(words)


def ask(llm: LLM, messages: list[dict[str, str]], answer_tokens: int) -> tuple[float, int, int, str]:
    """(TTFT ms, prompt tokens, cached tokens, answer text) of one chat request."""
    result = llm.chat_result(ChatRequest(messages, sampling=SamplingParams(temperature=0, max_tokens=answer_tokens,
                                                                          ignore_eos=True), enable_thinking=False))
    t = result.timings
    return t.prefill_s * 1e3, len(result.prompt_token_ids), t.cached_tokens, result.text


def chat(llm: LLM, first: int, turns: int, turn_tokens: int, answer_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    messages = [{"role": "user", "content": text(rng, llm, first)}]
    rows = []
    for turn in range(1, turns + 1):
        ttft, prompt, cached, answer = ask(llm, messages, answer_tokens)
        rows.append(dict(turn=turn, prompt_tokens=prompt, cached_tokens=cached, ttft_ms=ttft))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": text(rng, llm, turn_tokens)}]
    return rows


def agent(llm: LLM, prefix: int, new: int, calls: int, answer_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = {"role": "system", "content": text(rng, llm, prefix)}
    rows = []
    for call in range(calls):
        ttft, prompt, cached, _ = ask(llm, [system, {"role": "user", "content": text(rng, llm, new)}], answer_tokens)
        rows.append(dict(call=call, prompt_tokens=prompt, cached_tokens=cached, ttft_ms=ttft))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-context", type=int, default=40960)
    parser.add_argument("--first", type=int, default=28000, help="tokens of the chat's first message")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--agent-prefix", type=int, default=20000)
    parser.add_argument("--agent-new", type=int, default=200)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="profile one more agent call (CUDA)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLM.load(args.model, EngineOptions(device=args.device, max_context=args.max_context,
                                             random_weights=args.random_weights))
    cache = llm.engine.cache
    prefix: PrefixCache = cache.prefix
    report = {"model": llm.name, "checkpoint_budget_bytes": prefix.capacity * cache.cache.state.bytes_per_slot,
              "checkpoint_bytes_each": cache.cache.state.bytes_per_slot}
    for mode in ("off", "on"):
        cache.forget_prefixes()
        cache.prefix = prefix if mode == "on" else None
        report[f"chat_{mode}"] = chat(llm, args.first, args.turns, args.turn_tokens, args.answer_tokens, 1)
        report[f"agent_{mode}"] = agent(llm, args.agent_prefix, args.agent_new, args.calls, args.answer_tokens, 2)
        report[f"cached_bytes_{mode}"] = cache.prefix_cached_bytes
    cache.prefix = prefix
    for mode in ("off", "on"):
        chat_rows, agent_rows = report[f"chat_{mode}"], report[f"agent_{mode}"]
        print(f"cache {mode}: chat turns TTFT ms " + ", ".join(f"{r['ttft_ms']:.0f}" for r in chat_rows)
              + f" (turn {chat_rows[-1]['turn']}: {chat_rows[-1]['prompt_tokens']} tokens, "
              f"{chat_rows[-1]['cached_tokens']} cached); agent TTFT p50 "
              f"{statistics.median(r['ttft_ms'] for r in agent_rows[1:]):.0f} ms")
    print(f"checkpoints: {report['checkpoint_budget_bytes'] / 2**30:.2f} GiB budget, "
          f"{report['checkpoint_bytes_each'] / 2**20:.1f} MiB each; cache held {report['cached_bytes_on'] / 2**30:.2f} GiB")
    if args.profile:
        report["agent_profile"] = profile_agent_call(llm, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def profile_agent_call(llm: LLM, args: argparse.Namespace) -> dict:
    """One more agent call (cache on, its prefix cached by the calls before; a new message, a
    one-token answer) under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from profile_decode import kernel_rows, print_rows
    from profile_prefill import cpu_rows

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        system = {"role": "system", "content": text(random.Random(2), llm, args.agent_prefix)}  # agent()'s
        message = {"role": "user", "content": text(random.Random(99), llm, args.agent_new)}
        ttft, prompt, cached, _ = ask(llm, [system, message], 1)
        torch.cuda.synchronize()
    row = dict(prompt_tokens=prompt, cached_tokens=cached, ttft_ms=ttft)
    rows = kernel_rows(prof, 1)
    busy = sum(r[0] for r in rows) / 1e3
    print(f"== profiled agent call: TTFT {row['ttft_ms']:.1f} ms ({row['cached_tokens']} of {row['prompt_tokens']} "
          f"cached), GPU busy {busy:.1f} ms in {sum(r[1] for r in rows):.0f} kernels")
    print_rows(rows, top=15)
    print("   host ops by self CPU time:")
    for us, calls, name in cpu_rows(prof, top=12):
        print(f"   {us / 1e3:8.2f} ms {calls:6d}x  {name[:90]}")
    return dict(row, gpu_busy_ms=busy, top=[dict(us=u, calls=c, name=n) for u, c, n in rows[:20]])


if __name__ == "__main__":
    main()
