"""Request bodies of the four APIs, as pydantic models: one schema per endpoint, types checked down
to every nested field the server reads (messages, content parts, tool definitions and calls,
Responses input items, Anthropic content blocks), so a malformed field is one 400 naming it
before any handler code runs.

Unknown top-level fields are accepted and ignored (`extra="ignore"`), like vLLM and llama.cpp
and unlike OpenAI (which answers 400 "Unrecognized request argument"): editors send vendor
extras and every new OpenAI release adds parameters (`prompt_cache_key`, `safety_identifier`,
`verbosity`, ...), and refusing them would break clients for no gain. Known parameters we
cannot honour are refused with a clear 400 instead of being silently dropped when ignoring
them would change the answer (n > 1, an echo / suffix that is not plain, prompt logprobs).
Nested objects keep their extra keys (`extra="allow"`: templates may read them).

Ranges of the sampling knobs are checked by the engine's SamplingParams (one place for every
caller); the integers checked here are the ones that go nowhere near it (token counts, ids).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..engine.logprobs import MAX_TOP_LOGPROBS
from .body import BadJson, parse_json
from .keep_alive import parse_keep_alive

TokenCount = Annotated[int, Field(ge=1, le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
MAX_CHOICES = 128  # OpenAI's bound on `n`
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES)]
JsonSchema = dict[str, Any] | bool


def _json_object_text(text: str) -> str:
    """Parsed here with the body's limits (depth, surrogates): the chat template parses it again."""
    try:
        value = parse_json(text) if text.strip() else {}
    except BadJson as e:
        raise ValueError(f"must be a JSON object as text, but it {e}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object as text")
    return text


JsonObjectText = Annotated[str, AfterValidator(_json_object_text)]  # tool-call arguments (OpenAI's wire form)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # strict: "0.5" is not a number, 1 not a bool


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


def plain(value: Any) -> Any:
    """A validated field as plain JSON data again (models -> dicts without their unset fields), for
    the code that hands messages to the chat template or echoes a request back."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_none=True, by_alias=True)
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


class SamplingFields(_Body):
    """Knobs shared by every endpoint (names as in OpenAI, plus vLLM's extras)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text, OpenAI's form) -> bias


class StreamOptions(_Body):
    include_usage: bool = False


# -- content (OpenAI chat parts, Responses parts, reasoning summaries) --------------------------

class MediaUrl(_Open):
    url: str


class ContentPart(_Open):
    """One part of a message's content: text, an image or video (several spellings, see
    media/sources.py), or a kind the server refuses by name (audio, files)."""

    type: str | None = None
    text: str | None = None
    image_url: str | MediaUrl | None = None
    video_url: str | MediaUrl | None = None
    image: str | MediaUrl | None = None
    video: str | MediaUrl | None = None
    url: str | None = None
    path: str | None = None
    file_id: str | None = None


Content = str | list[ContentPart]


# -- OpenAI chat --------------------------------------------------------------------------------

class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(_Open):
    name: str
    arguments: JsonObjectText


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Open):
    """Chat Completions' response_format.json_schema (`schema` is a pydantic name: aliased)."""

    name: str | None = None
    description: str | None = None
    json_schema: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: one of these constrains the answer."""

    json_: JsonSchema | str | None = Field(None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF, rule `root`


class GuidedFields(_Body):
    """vLLM's structured-output fields (the older guided_* names and `structured_outputs`), read by
    chat and completions."""

    guided_json: JsonSchema | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingFields, GuidedFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Choices | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    continue_final_message: bool = False  # vLLM's: the answer continues the final (assistant) message


# -- OpenAI completions -------------------------------------------------------------------------

class CompletionRequest(SamplingFields, GuidedFields):
    model: str | None = None
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16  # OpenAI's default for this legacy endpoint
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    suffix: str | None = None
    n: Choices | None = None
    best_of: Choices | None = None
    logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: TokenCount | None = None
    user: str | None = None


# -- OpenAI Responses ---------------------------------------------------------------------------

class InputItem(_Open):
    """A Responses input item; which fields matter depends on `type` (responses.py)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: str | None = None
    content: Content | None = None  # message: its content; reasoning: reasoning_text parts
    name: str | None = None
    call_id: str | None = None
    arguments: JsonObjectText | None = None
    output: Content | None = None
    summary: list[ContentPart] | None = None


class ResponsesTool(_Open):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesToolChoice(_Open):
    type: str
    name: str | None = None


class Reasoning(_Open):
    effort: str | None = None


class TextFormat(_Open):
    """Responses' text.format: the json_schema fields sit beside `type`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Open):
    format: TextFormat | None = None


class ResponsesRequest(SamplingFields):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: TokenCount | None = None
    stream: bool = False
    store: bool = True
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- Anthropic Messages -------------------------------------------------------------------------

class ImageSource(_Open):
    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class AnthropicBlock(_Open):
    """A content block; which fields matter depends on `type` (anthropic.py)."""

    type: str
    text: str | None = None
    source: ImageSource | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[AnthropicBlock] | None = None  # tool_result


class AnthropicTool(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class AnthropicToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"] = "auto"
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Open):
    type: Literal["enabled", "adaptive", "disabled"] = "disabled"


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    thinking: Thinking | None = None


class MessagesRequest(SamplingFields, CountTokensRequest):
    max_tokens: TokenCount | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- tokenizer endpoints (vLLM's and llama.cpp's shapes) -----------------------------------------

class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None  # raw text (vLLM)
    content: str | None = None  # raw text (llama.cpp's name)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # a chat, rendered as for an answer
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # vLLM: default true for text, false for a chat
    add_special: bool | None = None  # llama.cpp's name
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(min_length=1)


# -- Ollama's native API (/api/chat, /api/generate) ----------------------------------------------

class OllamaFunctionCall(_Open):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(_Open):
    function: OllamaFunctionCall


class OllamaMessage(_Open):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # base64 image files
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class OllamaOptions(_Open):
    """The sampling options read (others, such as num_ctx or num_gpu, are accepted and ignored)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    num_predict: int | None = None  # -1 / -2: until the context is full
    stop: list[str] | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class OllamaModelBody(_Body):
    """What every Ollama request that runs the model has: the model and how long it stays loaded."""

    model: str = Field(min_length=1)  # required, as Ollama requires it
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None  # seconds once read; None: the pool's own keep-alive applies

    @field_validator("keep_alive")
    @classmethod
    def _seconds(cls, value: str | float | None) -> float | None:
        return None if value is None else parse_keep_alive(value)  # a ValueError is the request's 400


class OllamaBody(OllamaModelBody):
    format: Literal["", "json"] | dict[str, Any] | None = None  # JSON mode, or a JSON Schema
    stream: bool = True
    think: bool | Literal["high", "medium", "low"] | None = None  # a level (gpt-oss's) means on: Qwen has none

    @field_validator("think")
    @classmethod
    def _thinking(cls, value: bool | str | None) -> bool | None:
        return True if isinstance(value, str) else value


class OllamaEmbedRequest(OllamaModelBody):
    input: str | list[str]
    truncate: bool = True  # an input past the context keeps its first tokens (false: refused)
    dimensions: TokenCount | None = None


class OllamaEmbeddingsRequest(OllamaModelBody):  # the older /api/embeddings
    prompt: str


class OllamaModelRequest(_Body):
    model: str | None = None
    name: str | None = None  # older clients' spelling of model


class OllamaPullRequest(OllamaModelRequest):
    insecure: bool = False  # accepted, meaningless here: the hub is always HTTPS
    stream: bool = True


class OllamaCopyRequest(_Body):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class OllamaChatRequest(OllamaBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ChatTool] | None = None


class OllamaGenerateRequest(OllamaBody):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False  # the prompt as it is, no chat template
    suffix: str | None = None
