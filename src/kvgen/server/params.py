"""OpenAI request fields -> kvgen SamplingParams (one per choice), with 400s for what cannot run."""

from __future__ import annotations

import dataclasses

from kvgen.sampling.params import SamplingParams
from kvgen.speculative.config import SpeculativeConfig
from kvgen.server.errors import APIError
from kvgen.server.protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_TOKENS = {"chat": 512, "completions": 16}  # OpenAI's completions default is 16
_SUPPORTED = {f.name for f in dataclasses.fields(SamplingParams)}


def _not_supported(field: str) -> APIError:
    return APIError(400, f"{field} is not supported yet by this server: leave it out", param=field, code="unsupported_parameter")


def build_params(body: CompletionRequest | ChatCompletionRequest, chat: bool, max_tokens_limit: int, engine) -> list[SamplingParams]:
    default = min(DEFAULT_MAX_TOKENS["chat" if chat else "completions"], max_tokens_limit)
    max_tokens = body.max_completion_tokens or body.max_tokens or default
    if max_tokens > max_tokens_limit:
        raise APIError(400, f"max_tokens is {max_tokens}; this server allows at most {max_tokens_limit}", param="max_tokens")
    fields: dict = {"max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}
    if body.stop:
        fields["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    if body.ignore_eos:
        fields["ignore_eos"] = True
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            fields[name] = getattr(body, name)
    if chat and body.logprobs or not chat and body.logprobs is not None:
        fields["logprobs"] = True
        fields["top_logprobs"] = (body.top_logprobs or 0) if chat else body.logprobs
    if chat and body.response_format is not None and body.response_format.type != "text":
        fields["structured"] = _structured(body)
    for name in fields:
        if name not in _SUPPORTED or name not in engine.supported_params:
            raise _not_supported({"max_new_tokens": "max_tokens", "structured": "response_format"}.get(name, name))
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        return [dataclasses.replace(SamplingParams(**fields), seed=None if body.seed is None else body.seed + i) for i in range(body.n)]
    except ValueError as error:
        raise APIError(400, str(error)) from error


def build_speculative(body: CompletionRequest | ChatCompletionRequest) -> SpeculativeConfig | None:
    """The request's `speculative` extension field -> a SpeculativeConfig (400 when it cannot run)."""
    options = body.speculative
    if options is None:
        return None
    try:
        return SpeculativeConfig(options.method, num_draft_tokens=options.num_draft_tokens,
                                 max_draft_tokens=max(8, options.num_draft_tokens), draft_layers=options.draft_layers)  # fmt: skip
    except ValueError as error:
        raise APIError(400, str(error), param="speculative") from error


def _structured(body: ChatCompletionRequest):
    try:
        from kvgen.sampling.grammar import StructuredOutput
    except ImportError:
        raise _not_supported("response_format") from None
    fmt = body.response_format
    if fmt.type == "json_object":
        return StructuredOutput.json_object()
    if fmt.json_schema is None:
        raise APIError(400, "response_format json_schema needs a json_schema object with a 'schema'", param="response_format")
    try:
        return StructuredOutput.json_schema(fmt.json_schema.schema_)
    except ValueError as error:
        raise APIError(400, f"invalid JSON schema: {error}", param="response_format") from error
