"""Request body of the Responses API (POST /v1/responses), as pydantic models; fields refused with a
reason are in REFUSED_RESPONSES (see protocol.check_fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from kvgen.server.protocol import REFUSED_COMMON, Metadata, SpeculativeOptions, Strict, check_metadata


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str = Field(max_length=64)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier response's reasoning, handed back: it goes to the chat template with the
    assistant turn that follows it (the template decides whether the model sees it)."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[Any] | None = None
    id: str | None = None
    encrypted_content: None = None  # kvgen never encrypts reasoning
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class ReasoningConfig(Strict):
    effort: Literal["low", "medium", "high"] | None = None  # for chat templates that read it (gpt-oss)
    summary: None = None  # kvgen returns the reasoning itself, never a summary of it


class ResponseTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


OUTPUT_TEXT_LOGPROBS = "message.output_text.logprobs"  # the one value of `include` kvgen honours


class ResponsesRequest(Strict):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    previous_response_id: str | None = Field(default=None, max_length=256)
    store: bool | None = True
    metadata: Metadata | None = None
    text: TextConfig | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    truncation: Literal["disabled"] | None = None  # kvgen never drops input to fit: a too-long input is a 400
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # with include's "message.output_text.logprobs"
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)  # kvgen extension
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # kvgen extension
    speculative: SpeculativeOptions | None = None  # kvgen extension
    reasoning: ReasoningConfig | None = None
    # extensions (as vLLM's Responses takes them): top-k sampling and per-token logit biases
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: every token
    logit_bias: dict[str, float] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Metadata | None) -> Metadata | None:
        return check_metadata(value)

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if name != OUTPUT_TEXT_LOGPROBS:
                raise ValueError(f"kvgen can include {OUTPUT_TEXT_LOGPROBS!r} only, not {name[:64]!r}")
        return value

    @property
    def wants_logprobs(self) -> bool:
        """Whether the output text's parts carry each token's log-probability."""
        return OUTPUT_TEXT_LOGPROBS in (self.include or [])


REFUSED_RESPONSES = REFUSED_COMMON | {
    "conversation": "conversations are not stored by this server: use previous_response_id",
    "max_tool_calls": "a bound on built-in tool calls does not apply: this server has function tools only",
    "prompt": "stored prompt templates are not supported",
    "stream_options": "the Responses stream has no options here",
}
