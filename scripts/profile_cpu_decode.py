"""CPU decode speed of a real model at a thread count, and (--profile) where a token's time goes.

Greedy decode of `--tokens` tokens (eos ignored) after one warm-up answer; prints decode tok/s and,
with --profile, torch.profiler's ops by self CPU time. Used for docs/performance.md (issue 17):
    python3 scripts/profile_cpu_decode.py --threads 1 [--model PATH_OR_NAME] [--tokens 64] [--profile]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ninfer_core.engine.sampling import SamplingParams  # noqa: E402
from ninfer_core.llm import LLM, ChatRequest, EngineOptions  # noqa: E402
from ninfer_core.threads import apply_threads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(f"threads {apply_threads(args.threads)}")
    llm = LLM.load(args.model, EngineOptions(device="cpu"))
    request = ChatRequest(messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                          sampling=SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    llm.chat_result(request)  # warm-up
    result = llm.chat_result(request)
    print(f"decode {result.timings.decode_tok_s:.1f} tok/s over {len(result.token_ids)} tokens")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = llm.chat_result(request)
        print(f"profiled: decode {result.timings.decode_tok_s:.1f} tok/s")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
