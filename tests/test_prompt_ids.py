"""PromptIdCache: a prompt's ids reuse a cached prompt's start, and equal a full encode exactly.

Checked with the real Qwen3.6 tokenizer on the prompts that share starts in practice (the turns of
a chat, an agent's calls with one long context) and on texts built to break a naive cut: special
token strings inside user text, combining marks and whitespace right after a shared token, prompts
that part ways inside a token, the same prompt twice.
"""

from __future__ import annotations

import threading

from qwen_assets import qwen_reference, qwen_tokenizer, qwen_tokenizer_dir  # noqa: F401  (fixtures)

from ninfer_core.prompt_ids import PromptIdCache
from ninfer_core.tokenizer import Tokenizer


def chatml(messages: list[tuple[str, str]], generation: bool = True) -> str:
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return text + ("<|im_start|>assistant\n<think>\n" if generation else "")


class Spy:
    """The tokenizers backend, recording the length of every text it is asked to encode."""

    def __init__(self, backend):
        self.backend, self.lengths = backend, []

    def encode(self, text, add_special_tokens=False):
        self.lengths.append(len(text))
        return self.backend.encode(text, add_special_tokens=add_special_tokens)

    def get_added_tokens_decoder(self):
        return self.backend.get_added_tokens_decoder()


SYSTEM = "You are a careful assistant. " + " ".join(f"rule {i}: answer in full sentences." for i in range(60))
TURNS = [
    ("user", "Write a haiku about rain."),
    ("assistant", "Soft rain on the roof,\nthe gutters hum a low song —\nsleep comes like a tide."),
    ("user", "Now one with <|im_start|> and <|im_end|> typed as text, and e\u0301 combining marks."),
    ("assistant", "\u0301\u0308 starts with combining marks;   trailing spaces   "),
    ("user", "   \n\n  leading whitespace, emoji 👩‍👩‍👧‍👦 and 你好，世界"),
    ("assistant", "<think>\nplanning\n</think>\n\nDone."),
]


def test_chat_turns_reuse_the_history_and_match_a_full_encode(qwen_tokenizer: Tokenizer) -> None:
    spy = Spy(qwen_tokenizer.backend)
    cache = PromptIdCache(spy, min_chars=0)
    reference = qwen_reference()
    for turn in range(1, len(TURNS) + 1, 2):
        prompt = chatml([("system", SYSTEM), *TURNS[:turn]])
        ids = cache.encode(prompt)
        assert ids == qwen_tokenizer.encode(prompt)
        assert ids == reference.encode(prompt, allowed_special="all")
        if turn > 1:  # only the text after the last shared <|im_start|> was encoded
            assert spy.lengths[-1] < len(prompt) - len(SYSTEM)
    assert cache.hits == 2 and cache.reused_ids > 3 * len(qwen_tokenizer.encode(SYSTEM)) // 2


def test_prompts_that_part_ways_inside_a_token_or_repeat(qwen_tokenizer: Tokenizer) -> None:
    cache = PromptIdCache(qwen_tokenizer.backend, min_chars=0)
    base = chatml([("system", SYSTEM), ("user", "internationalization")], generation=False)
    variants = [
        base,
        base,  # the same prompt again: all but the text after its last cut is reused
        base[:-20] + "ization of everything<|im_end|>\n",  # parts ways inside a word
        base + "<|im_start|>user\n\u0301 a combining mark first<|im_end|>\n",
        base + "<|im_start|>user\nno end token",
        base.replace("<|im_start|>user", "<|im_start|>usr"),  # parts ways right after a shared token
        "<|im_start|>" + base,  # shares no start at all
        base[: len(base) // 2],  # a prefix of a cached prompt that ends mid-text
    ]
    for text in variants:
        assert cache.encode(text) == qwen_tokenizer.encode(text), text[-60:]
    # a cut right after a word, then the same text where the word goes on: no cut there
    fresh = PromptIdCache(qwen_tokenizer.backend, min_chars=0)
    for text in (base.replace("internationalization", "inter"), base):
        assert fresh.encode(text) == qwen_tokenizer.encode(text)


def test_the_longest_cached_start_is_found_among_many(qwen_tokenizer: Tokenizer) -> None:
    """Hundreds of cached chats whose system prompts differ only at their end (the lookup tries the
    cached texts next to the prompt in sorted order, not every entry): a later turn of any of them
    reuses its own chat's history, up to the last shared <|im_start|>."""
    spy = Spy(qwen_tokenizer.backend)
    cache = PromptIdCache(spy, min_chars=0)
    systems = [f"{SYSTEM} You are persona {i:03d}." for i in range(300)]
    for i in (*range(1, 300, 2), *range(0, 300, 2)):  # not in sorted order
        cache.encode(chatml([("system", systems[i]), ("user", "hello")]))
    cache.encode(chatml([("system", SYSTEM)]))  # a shorter start, shared by all of them
    hits = cache.hits
    for k in (0, 1, 150, 299):
        prompt = chatml([("system", systems[k]), ("user", "hello"), ("assistant", "Hi."), ("user", "And now?")])
        assert cache.encode(prompt) == qwen_tokenizer.encode(prompt)
        assert spy.lengths[-1] == len(prompt) - prompt.index("<|im_start|>assistant")
    assert cache.hits == hits + 4


def test_eviction_and_threads_keep_results_exact(qwen_tokenizer: Tokenizer) -> None:
    budget = len(qwen_tokenizer.encode(SYSTEM)) * 3
    cache = PromptIdCache(qwen_tokenizer.backend, max_tokens=budget, min_chars=0)
    prompts = [chatml([("system", SYSTEM), ("user", f"question {i} " * (i + 1))]) for i in range(12)]
    want = {p: qwen_tokenizer.encode(p) for p in prompts}
    errors: list[str] = []

    def work(offset: int) -> None:
        for k in range(len(prompts)):
            p = prompts[(k + offset) % len(prompts)]
            if cache.encode(p) != want[p]:
                errors.append(p)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache._tokens <= budget or len(cache._entries) == 1
    assert cache.hits > 0


def test_short_prompts_skip_the_cache_and_the_tokenizer_uses_it(qwen_tokenizer: Tokenizer) -> None:
    cache = PromptIdCache(qwen_tokenizer.backend)  # default: prompts under 256 characters skip it
    short = chatml([("user", "hi")])
    assert cache.encode(short) == qwen_tokenizer.encode(short) and not cache._entries
    long = chatml([("system", SYSTEM), ("user", "hi")])
    before = qwen_tokenizer.prompt_ids.hits
    assert qwen_tokenizer.encode_prompt(long) == qwen_tokenizer.encode(long)
    assert qwen_tokenizer.encode_prompt(long + "x") == qwen_tokenizer.encode(long + "x")
    assert qwen_tokenizer.prompt_ids.hits == before + 1
