"""The OpenAI request bodies kvgen accepts, as pydantic models (unknown fields are ignored, as
OpenAI's own server does; wrong types and out-of-range values are 400s)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = "output"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SpeculativeOptions(BaseModel):
    """kvgen extension: this request decodes speculatively (output unchanged; see docs/speculative.md).
    lookup: n-gram drafts from the context; self: drafts from the model's first `draft_layers` layers."""

    method: Literal["lookup", "self"] = "lookup"
    num_draft_tokens: int = Field(default=4, ge=1, le=16)
    draft_layers: int | None = Field(default=None, ge=1)


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    priority: int = 0  # kvgen extension: lower runs first
    ignore_eos: bool = False  # extension (as vLLM's): generate max_tokens even past an end-of-sequence token
    speculative: SpeculativeOptions | None = None  # kvgen extension: per-request speculative decoding


class CompletionRequest(SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
