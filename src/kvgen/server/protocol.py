"""The OpenAI request bodies kvgen accepts, as pydantic models. Every field of OpenAI's schemas is
either a field here (honoured) or listed in REFUSED_* with the reason (a 400 naming it); any other
field is unknown and also a 400 naming it (`check_fields`). Wrong types and out-of-range values are
400s from pydantic."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvgen.server.errors import APIError, describe_validation


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI pads deltas against side channels; kvgen sends none


class JsonSchemaFormat(Strict):
    name: str = Field(default="output", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """Extension (vLLM's `structured_outputs`): one constraint on the reply beyond response_format's
    JSON: a regular expression, one of some strings, a grammar (Lark, or llama.cpp's GBNF), or JSON."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(default=None, min_length=1, max_length=16384)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = Field(default=None, min_length=1, max_length=65536)


class SpeculativeOptions(Strict):
    """kvgen extension: this request decodes speculatively (output unchanged; see docs/speculative.md).
    lookup: n-gram drafts from the context; self: drafts from the model's first `draft_layers` layers;
    eagle: drafts from the EAGLE head over the model's features (the shipped head is SmolLM2's)."""

    method: Literal["lookup", "self", "eagle"] = "lookup"
    num_draft_tokens: int | None = Field(default=None, ge=1, le=16)  # None: 4; eagle: one-token drafts
    draft_layers: int | None = Field(default=None, ge=1)


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(Strict):
    type: Literal["text"]
    text: str


Metadata = dict[str, str]


def content_text(content: str | list[ContentPart] | None) -> str:
    """A message's or a prediction's content as one text (its text parts joined)."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class SamplingFields(Strict):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1, le=16)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default"] | None = None  # kvgen has one tier
    response_format: ResponseFormat | None = None
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)  # kvgen extension: lower runs first (server must allow it)
    ignore_eos: bool = False  # extension (as vLLM's): generate max_tokens even past an end-of-sequence token
    speculative: SpeculativeOptions | None = None  # kvgen extension: per-request speculative decoding
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # extension (as vLLM's)
    # extensions: vLLM's sampling parameters (unset: off)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: every token
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: int | None = Field(default=None, ge=0)  # no end of sequence before this many tokens
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Metadata | None) -> Metadata | None:
        return check_metadata(value)


def check_metadata(value: Metadata | None) -> Metadata | None:
    """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
    if value is not None:
        if len(value) > 16:
            raise ValueError(f"at most 16 pairs, got {len(value)}")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError(f"keys are at most 64 characters and values 512 ({key[:64]!r})")
    return value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1, le=16)
    skip_special_tokens: bool = True  # extension (as vLLM's): False keeps special tokens in the text


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)
    refusal: None = None
    # An earlier reply's reasoning, as this server returns it: handed to the chat template, which
    # decides whether the model sees it again (gpt-oss's shows it before a tool call, Qwen3's drops it).
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        return content_text(self.content)


class Prediction(Strict):
    """Predicted Outputs: what the reply is expected to be (the file being edited). Drafts for
    speculative decoding come from it; the reply is the one the request gets without it."""

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return content_text(self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: Literal[False] | None = None  # stored completions are OpenAI's dashboard feature
    modalities: list[Literal["text"]] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # for chat templates that read it (gpt-oss)
    # extension (as vLLM's): more variables for the chat template (Qwen3's enable_thinking); each must be one it reads
    chat_template_kwargs: dict[str, Any] | None = None
    prediction: Prediction | None = None
    # extensions (as vLLM's): the prompt ends with the assistant turn opened, or inside the last message
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# Known fields refused with a reason (a 400 naming the field when present and not null).
REFUSED_COMMON = {
    "prompt_cache_key": "kvgen's prefix cache needs no routing key; use cache_salt to isolate requests",
    "prompt_cache_retention": "kvgen's prefix cache keeps blocks until the pool needs them",
}
REFUSED_CHAT = REFUSED_COMMON | {
    "audio": "this server generates text only",
    "functions": "the deprecated functions field is not supported: use tools",
    "function_call": "the deprecated function_call field is not supported: use tool_choice",
    "verbosity": "the served model has no verbosity setting",
    "web_search_options": "this server has no web search",
}
REFUSED_COMPLETIONS = REFUSED_COMMON | {
    "suffix": "insertion (suffix) is not supported by the served model",
}


def check_fields(body: dict[str, Any], model: type[BaseModel], refused: dict[str, str]) -> None:
    """400 for a refused field (present, not null) or an unknown one, naming it."""
    for name, value in body.items():
        if name in refused:
            if value is not None:
                raise APIError(400, f"{name} is not supported: {refused[name]}", param=name, code="unsupported_parameter")
        elif name not in model.model_fields:
            raise APIError(400, f"unknown field {name!r}: this server does not know it (see docs/server.md)",
                           param=name, code="unknown_parameter")  # fmt: skip


def parse(model: type[BaseModel], body: dict[str, Any], refused: dict[str, str]):
    """The validated request, or a 400 naming the first bad field."""
    check_fields(body, model, refused)
    try:
        # strict: JSON types as declared (no true -> 1, no "2" -> 2)
        return model.model_validate({k: v for k, v in body.items() if k not in refused}, strict=True)
    except ValidationError as error:
        message, param = describe_validation(error.errors())
        raise APIError(400, message, param=param) from None
