"""Tokenizing chat prompts that share their start: `Tokenizer.encode` against `encode_prompt` (the
prompt-id cache, ninfer_core/prompt_ids.py) on a model directory's own tokenizer and template.

chat   a conversation of TURNS turns whose history grows to ~30K tokens, one prompt per turn
agent  one ~20K-token context, then calls that differ in their last message

    python3 scripts/bench_prompt_ids.py MODEL_DIR [--json OUT.json]

(`scripts/make_bench_model.py qwen3.6-35b-a3b DIR` writes a directory with Qwen3.6's tokenizer and
template.) Reports the median ms per prompt of each, on one CPU thread of this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ninfer_core.chat.template import load_chat_template  # noqa: E402
from ninfer_core.tokenizer import Tokenizer  # noqa: E402

TURNS = 8


def conversations() -> dict[str, list[list[dict]]]:
    para = " ".join(f"Section {i} explains item {i * 7} and its limits in detail." for i in range(300))
    chat, messages = [], [{"role": "system", "content": "You are a careful assistant."}]
    for turn in range(TURNS):
        messages = [*messages, {"role": "user", "content": f"Question {turn}: {para}"}]
        chat.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"Answer {turn}: " + para[: len(para) // 3]}]
    context = {"role": "system", "content": " ".join([para] * 4)}
    agent = [[context, {"role": "user", "content": f"Call {i}: run tool {i} on file_{i}.py"}] for i in range(TURNS)]
    return {"chat": chat, "agent": agent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_model_dir(args.model_dir)
    template = load_chat_template(tokenizer)
    results = {}
    for name, series in conversations().items():
        prompts = [template.render(m, add_generation_prompt=True) for m in series]
        row = {"prompts": len(prompts), "last_prompt_tokens": len(tokenizer.encode(prompts[-1]))}
        for label, encode in (("encode_ms", tokenizer.encode), ("encode_prompt_ms", tokenizer.encode_prompt)):
            times = []
            for prompt in prompts:
                start = time.perf_counter()
                ids = encode(prompt)
                times.append((time.perf_counter() - start) * 1e3)
                assert ids == tokenizer.encode(prompt)
            row[label] = round(statistics.median(times[1:]), 2)  # past the first prompt: nothing to reuse yet
            row[label.replace("_ms", "_first_ms")] = round(times[0], 2)
        results[name] = row
        print(name, row)
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))


if __name__ == "__main__":
    main()
