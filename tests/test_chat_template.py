"""Chat template rendering: our Qwen3.5-style fallback, template sources, and the Jinja environment.

Expected prompts are written out by hand from the Qwen3.5 chat format (ChatML turns, tools in the
system turn, XML tool calls, <tool_response> in user turns, thinking generation prompts). The
renderer itself is checked against transformers' `render_jinja_template` on the same template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qwen_assets import IM_START, THINK, qwen_tokenizer, qwen_tokenizer_dir  # noqa: F401  (fixtures)
from transformers.utils.chat_template_utils import render_jinja_template

from ninfer_core.chat.template import (
    FALLBACK_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    normalize_messages,
    open_final_message,
)
from ninfer_core.resources import asset_path
from ninfer_core.tokenizer import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
            "required": ["city"],
        },
    },
}
TOOLS_SYSTEM = (
    "<|im_start|>system\n# Tools\n\nThese functions are available to you:\n\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False)
    + "\n</tools>\n\nTo call a function, answer with this format and nothing after it:\n\n"
    "<tool_call>\n<function=function_name>\n<parameter=first_parameter>\nvalue\n</parameter>\n"
    "<parameter=second_parameter>\na value may\nspan several lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nRules:\n"
    "- Every <function=...></function> block goes inside its own <tool_call></tool_call> tags\n"
    "- Give every required parameter\n"
    "- Any explanation comes BEFORE the function call, never after it\n"
    "- When no function fits, answer normally and do not mention the functions\n</IMPORTANT>"
)
THINK_ON = "<|im_start|>assistant\n<think>\n"
THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def fallback() -> ChatTemplate:
    return load_chat_template()


def test_generation_prompt_thinking_on_and_off(fallback: ChatTemplate) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prefix = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert fallback.render(messages) == prefix + THINK_ON
    assert fallback.render(messages, enable_thinking=False) == prefix + THINK_OFF
    assert fallback.render(messages, add_generation_prompt=False) == prefix


def test_tools_in_system_turn(fallback: ChatTemplate) -> None:
    rendered = fallback.render(
        [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL]
    )
    assert rendered == TOOLS_SYSTEM + "\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n" + THINK_ON
    # no system message: the tools turn stands alone
    rendered = fallback.render([{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL])
    assert rendered.startswith(TOOLS_SYSTEM + "<|im_end|>\n<|im_start|>user\n")


def test_tool_call_loop_keeps_reasoning_after_last_query(fallback: ChatTemplate) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "reasoning": "Two cities.",  # the vLLM / Ollama field name
            "content": "Checking.",
            "tool_calls": [
                {"id": "a", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "b", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Oslo", "opts": {"unit": "C"}}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "snow"}]},
    ]
    expected = (
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        '<parameter=opts>\n{"unit": "C"}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nsnow\n</tool_response><|im_end|>\n"
        + THINK_ON
    )
    assert fallback.render(messages) == expected


def test_earlier_reasoning_dropped_unless_preserved(fallback: ChatTemplate) -> None:
    messages = [
        {"role": "user", "content": "First"},
        {"role": "assistant", "reasoning_content": "old trace", "content": "Old answer"},
        {"role": "user", "content": "Second"},
        {"role": "assistant", "content": "<think>\nnew trace\n</think>\n\nNew answer"},
    ]
    dropped = (
        "<|im_start|>user\nFirst<|im_end|>\n<|im_start|>assistant\nOld answer<|im_end|>\n"
        "<|im_start|>user\nSecond<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew trace\n</think>\n\nNew answer<|im_end|>\n"
    )
    assert fallback.render(messages, add_generation_prompt=False) == dropped
    preserved = fallback.render(messages, add_generation_prompt=False, preserve_thinking=True)
    assert preserved == dropped.replace("assistant\nOld", "assistant\n<think>\nold trace\n</think>\n\nOld")


def test_content_parts_and_images(fallback: ChatTemplate) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Sys"}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Look: "},
            {"type": "image_url", "image_url": {"url": "data:..."}},
            {"type": "text", "text": " ok?"},
        ]},
    ]
    assert fallback.render(messages, enable_thinking=False) == (
        "<|im_start|>system\nSys<|im_end|>\n"
        "<|im_start|>user\nLook: <|vision_start|><|image_pad|><|vision_end|> ok?<|im_end|>\n" + THINK_OFF
    )


def test_template_rejects_bad_conversations(fallback: ChatTemplate) -> None:
    with pytest.raises(ChatTemplateError, match="Unknown message role: robot"):
        fallback.render([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no messages"):
        fallback.render([])
    with pytest.raises(ChatTemplateError, match=r"message 1: tool_calls\[0\].function.arguments is not valid JSON"):
        fallback.render([
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
        ])
    with pytest.raises(ChatTemplateError, match="message 0: expected an object"):
        fallback.render([{"content": "no role"}])


def test_normalize_messages_does_not_touch_input() -> None:
    original = {"role": "assistant", "content": None, "thinking": "t",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}
    snapshot = json.dumps(original)
    (normalized,) = normalize_messages([original])
    assert normalized == {"role": "assistant", "thinking": "t", "reasoning_content": "t",
                          "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    assert json.dumps(original) == snapshot


CONVERSATIONS = [
    ([{"role": "user", "content": "Héllo 世界"}], None, {}),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"}], [WEATHER_TOOL],
     {"enable_thinking": False}),
    ([{"role": "user", "content": "Q"},
      {"role": "assistant", "reasoning_content": "r", "content": "",
       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}}]},
      {"role": "tool", "content": "{\"temp\": 3}"}], [WEATHER_TOOL], {"preserve_thinking": True}),
]


@pytest.mark.parametrize("messages, tools, kwargs", CONVERSATIONS)
def test_renderer_matches_transformers(messages: list, tools: list | None, kwargs: dict) -> None:
    source = asset_path(FALLBACK_TEMPLATE).read_text()
    ours = ChatTemplate(source, "test").render(messages, tools=tools, **kwargs)
    (theirs,), _ = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=source, add_generation_prompt=True,
        **{"enable_thinking": True, "preserve_thinking": False, **kwargs},
    )
    assert ours == theirs


def test_environment_helpers() -> None:
    source = (
        "{% generation %}{{ messages[0].content | tojson }}{% endgeneration %}|{{ {'k': 'ü'} | tojson(indent=1) }}"
        "|{{ strftime_now('%Y') | length }}|{{ bos_token }}{{ eos_token }}|{{ custom }}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    rendered = ChatTemplate(source, "t", "<s>", "</s>").render([{"role": "user", "content": "日本"}], custom="C")
    assert rendered == '"日本"|{\n "k": "ü"\n}|4|<s></s>|C01'
    with pytest.raises(ChatTemplateError, match=r"chat template \(t\): custom failure"):
        ChatTemplate("{{ raise_exception('custom failure') }}", "t").render([])
    with pytest.raises(ChatTemplateError):  # the sandbox blocks attribute escapes
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "t").render([])
    with pytest.raises(ChatTemplateError, match=r"bad.jinja: chat template line 2"):
        ChatTemplate("ok\n{% if %}", "bad.jinja").render([])


def test_template_sources(tmp_path: Path, qwen_tokenizer: Tokenizer) -> None:
    # Tokenizer without a template -> our fallback, with the tokenizer's special tokens.
    template = load_chat_template(qwen_tokenizer)
    assert template.origin == str(asset_path(FALLBACK_TEMPLATE)) and template.eos_token == "<|im_end|>"
    # Named templates: tool_use is picked when tools are given.
    named = Tokenizer(qwen_tokenizer.backend, chat_template={"default": "D", "tool_use": "T{{ tools|length }}"},
                      source="ckpt")
    template = load_chat_template(named)
    assert template.render([]) == "D" and template.render([], tools=[WEATHER_TOOL]) == "T1"
    assert "ckpt" in template.origin
    # A user file overrides the checkpoint's template.
    override = tmp_path / "mine.jinja"
    override.write_text("{{ messages|length }}:{{ enable_thinking }}")
    rendered = load_chat_template(named, override).render([{"role": "user", "content": "x"}], enable_thinking=False)
    assert rendered == "1:False"
    with pytest.raises(ChatTemplateError, match="missing.jinja: cannot read"):
        load_chat_template(named, tmp_path / "missing.jinja")
    with pytest.raises(ChatTemplateError, match="no 'default' chat template"):
        ChatTemplate({"tool_use": "T"}, "ckpt").render([])


def test_rendered_prompt_tokenizes_with_single_special_ids(qwen_tokenizer: Tokenizer) -> None:
    prompt = load_chat_template(qwen_tokenizer).render([{"role": "user", "content": "Hi"}])
    ids = qwen_tokenizer.encode(prompt)
    assert ids.count(IM_START) == 2 and ids[-2:] == [THINK, qwen_tokenizer.encode("\n")[0]]
    assert qwen_tokenizer.decode(ids) == prompt


def test_tools_a_template_cannot_render_are_refused_and_thinking_is_detected():
    """Issue 17 item 5: a template without tools must not drop them silently."""
    from ninfer_core.chat.template import ChatTemplate, ToolsNotSupportedError

    plain = ChatTemplate("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "plain")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert not plain.supports_tools and not plain.supports_thinking
    with pytest.raises(ToolsNotSupportedError, match="no place for tools"):
        plain.render(messages, tools=[tool])
    assert plain.render(messages) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    fallback = load_chat_template()
    assert fallback.supports_tools and fallback.supports_thinking
    assert "get_weather" in fallback.render(messages, tools=[tool])


@pytest.mark.parametrize("which", ["fallback", "qwen3.6"])
def test_a_final_assistant_message_is_continued(fallback: ChatTemplate, qwen_tokenizer: Tokenizer, which: str) -> None:
    """The prefilled answer ends the prompt where the generation prompt (thinking off: an empty
    reasoning block) plus that text would; with reasoning, after its closed block."""
    template = fallback if which == "fallback" else load_chat_template(qwen_tokenizer)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prefill = {"role": "assistant", "content": "My favourite colour is"}
    prompt = open_final_message(template.render([*history, prefill], add_generation_prompt=False), prefill)
    assert prompt == template.render(history, enable_thinking=False) + "My favourite colour is"
    reasoned = {"role": "assistant", "reasoning_content": "Pick one.", "content": [{"type": "text", "text": "Blue"}]}
    prompt = open_final_message(template.render([*history, reasoned], add_generation_prompt=False), reasoned)
    assert prompt == template.render(history, add_generation_prompt=False) + THINK_ON + "Pick one.\n</think>\n\nBlue"


def test_a_final_message_of_parts_is_continued_after_its_last_text(fallback: ChatTemplate) -> None:
    """As transformers reads content parts: the last text part ends the prompt (a picture between
    two texts: their joined text is nowhere in the prompt)."""
    history = [{"role": "user", "content": "Describe it."}]
    prefill = {"role": "assistant", "content": [{"type": "text", "text": "It shows"}, {"type": "image"},
                                                {"type": "text", "text": "a cat and"}]}
    prompt = open_final_message(fallback.render([*history, prefill], add_generation_prompt=False), prefill)
    assert prompt.endswith("It shows<|vision_start|><|image_pad|><|vision_end|>a cat and")


def test_a_final_message_without_text_cannot_be_continued() -> None:
    for message in ({"role": "assistant", "content": ""}, {"role": "assistant", "content": "not there"}):
        with pytest.raises(ChatTemplateError, match="cannot be continued"):
            open_final_message("<|im_start|>assistant\n", message)
