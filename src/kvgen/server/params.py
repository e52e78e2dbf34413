"""OpenAI request fields -> kvgen SamplingParams (one per choice), with 400s for what cannot run."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from kvgen.prompt_checks import outside_vocabulary
from kvgen.sampling.params import SamplingParams
from kvgen.speculative.config import SpeculativeConfig
from kvgen.server.errors import APIError
from kvgen.server.limits import ServerLimits, check_count
from kvgen.server.protocol import ResponseFormat, StructuredOutputs

DEFAULT_MAX_TOKENS = {"chat": 512, "completions": 16, "responses": 512}  # OpenAI's completions default is 16
_SUPPORTED = {f.name for f in dataclasses.fields(SamplingParams)}
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "structured": "response_format", "min_new_tokens": "min_tokens"}


@dataclass(frozen=True)
class Sampling:
    """The endpoint-independent sampling fields of one request (chat, completions and responses map
    their own field names onto it)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    adapter: str | None = None  # the LoRA adapter the request's `model` names (None: the base model)
    top_k: int | None = None  # vLLM's extensions (chat and completions; top_k on Responses too); -1 or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # False: the text keeps special tokens (harmony's channels)


def _not_supported(field: str) -> APIError:
    return APIError(400, f"{field} is not supported yet by this server: leave it out", param=field, code="unsupported_parameter")


def build_params(sampling: Sampling, endpoint: str, max_tokens_limit: int, engine, limits: ServerLimits,
                 structured=None) -> list[SamplingParams]:  # fmt: skip
    """One SamplingParams per choice (seeds seed + i); `structured` is a StructuredOutput or None."""
    default = min(DEFAULT_MAX_TOKENS[endpoint], max_tokens_limit)
    max_tokens = sampling.max_tokens or default
    if max_tokens > max_tokens_limit:
        raise APIError(400, f"max_tokens is {max_tokens}; this server allows at most {max_tokens_limit}", param="max_tokens")
    fields: dict = {"max_new_tokens": max_tokens, "seed": sampling.seed}
    for name, default_value in (("temperature", 1.0), ("top_p", 1.0)):
        fields[name] = default_value if getattr(sampling, name) is None else getattr(sampling, name)
    if sampling.stop:
        stops = (sampling.stop,) if isinstance(sampling.stop, str) else tuple(sampling.stop)
        check_count("stop", len(stops), limits.max_stop)
        if any(not s or len(s) > limits.max_stop_chars for s in stops):
            raise APIError(400, f"each stop string must have 1 to {limits.max_stop_chars} characters", param="stop")
        fields["stop"] = stops
    if sampling.ignore_eos:
        fields["ignore_eos"] = True
    fields |= _vllm_fields(sampling, max_tokens, engine.model.config.vocab_size, limits)
    if sampling.adapter is not None:
        fields["adapter"] = sampling.adapter
    if not sampling.skip_special_tokens:
        fields["skip_special_tokens"] = False
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(sampling, name):
            fields[name] = getattr(sampling, name)
    if sampling.logit_bias:
        fields["logit_bias"] = _logit_bias(sampling.logit_bias, engine.model.config.vocab_size, limits)
    if sampling.logprobs:
        if sampling.top_logprobs > limits.max_top_logprobs:
            raise APIError(400, f"top_logprobs is {sampling.top_logprobs}; this server allows at most {limits.max_top_logprobs}",
                           param="top_logprobs")  # fmt: skip
        fields["logprobs"] = True
        fields["top_logprobs"] = sampling.top_logprobs
    if structured is not None:
        fields["structured"] = structured
    for name in fields:
        if name not in _SUPPORTED or name not in engine.supported_params:
            raise _not_supported(_OPENAI_NAMES.get(name, name))
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        return [dataclasses.replace(SamplingParams(**fields), seed=None if sampling.seed is None else sampling.seed + i)
                for i in range(sampling.n)]  # fmt: skip
    except ValueError as error:
        raise APIError(400, str(error)) from error


def _vllm_fields(sampling: Sampling, max_tokens: int, vocab_size: int, limits: ServerLimits) -> dict:
    """vLLM's sampling extensions -> SamplingParams fields (only those set to something other than off)."""
    fields: dict = {}
    if sampling.top_k not in (None, -1, 0):
        fields["top_k"] = sampling.top_k
    if sampling.min_p:
        fields["min_p"] = sampling.min_p
    if sampling.repetition_penalty not in (None, 1.0):
        fields["repetition_penalty"] = sampling.repetition_penalty
    if sampling.min_tokens:
        if sampling.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens is {sampling.min_tokens}, more than max_tokens ({max_tokens})", param="min_tokens")
        fields["min_new_tokens"] = sampling.min_tokens
    if sampling.stop_token_ids:
        check_count("stop_token_ids", len(sampling.stop_token_ids), limits.max_stop_token_ids)
        if bad := outside_vocabulary(sampling.stop_token_ids, vocab_size):
            raise APIError(400, f"stop_token_ids holds {bad[0]}, not a token id of this model (0..{vocab_size - 1})",
                           param="stop_token_ids")  # fmt: skip
        fields["stop_token_ids"] = tuple(sampling.stop_token_ids)
    if sampling.include_stop_str_in_output:
        fields["include_stop_str_in_output"] = True
    return fields


def _logit_bias(bias: dict[str, float], vocab_size: int, limits: ServerLimits) -> dict[int, float]:
    """OpenAI's form (token id strings -> -100..100) -> kvgen's (ids -> bias)."""
    check_count("logit_bias", len(bias), limits.max_logit_bias)
    result = {}
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias key {key[:32]!r} is not a token id of this model (0..{vocab_size - 1})", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias[{key}] is {value}; biases are between -100 and 100", param="logit_bias")
        result[int(key)] = float(value)
    return result


def build_speculative(options, prediction: str | None = None) -> SpeculativeConfig | None:
    """The request's `speculative` extension field and chat's `prediction` (Predicted Outputs:
    prompt lookup that searches the predicted text first) -> a SpeculativeConfig, or a 400 naming
    the field when it cannot run."""
    if options is None and prediction is None:
        return None
    if options is not None and prediction is not None and options.method != "lookup":
        raise APIError(400, f"prediction drafts by prompt lookup, which speculative method {options.method!r} "
                            "replaces: leave speculative out or use method 'lookup'", param="prediction")  # fmt: skip
    if options is None:
        return SpeculativeConfig("lookup", prediction=prediction)
    try:
        return SpeculativeConfig(options.method, num_draft_tokens=options.num_draft_tokens, draft_layers=options.draft_layers,
                                 prediction=prediction)  # fmt: skip
    except ValueError as error:
        raise APIError(400, str(error), param="speculative") from error


def structured_output(fmt: ResponseFormat | None, param: str = "response_format"):
    """A response_format (chat, completions) -> StructuredOutput, or None for text."""
    if fmt is None or fmt.type == "text":
        return None
    from kvgen.sampling.grammar import StructuredOutput

    if fmt.type == "json_object":
        return StructuredOutput.json_object()
    if fmt.json_schema is None:
        raise APIError(400, "response_format json_schema needs a json_schema object with a 'schema'", param=param)
    return json_schema_output(fmt.json_schema.schema_, param)


def requested_structure(body) -> object | None:
    """A chat or completions request's constraint on the reply: response_format's, or the
    structured_outputs extension's (both at once is a 400)."""
    if body.structured_outputs is None:
        return structured_output(body.response_format)
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    return _extension_structure(body.structured_outputs)


def _extension_structure(options: StructuredOutputs):
    from kvgen.sampling.grammar import StructuredOutput

    given = [name for name in ("json_", "json_object", "regex", "choice", "grammar") if getattr(options, name) not in (None, False)]
    if len(given) != 1:
        raise APIError(400, "structured_outputs takes exactly one of json, json_object, regex, choice, grammar", param="structured_outputs")
    kind = given[0]
    param = f"structured_outputs.{kind.rstrip('_')}"
    if kind == "json_":
        return json_schema_output(options.json_, param)
    try:
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "regex":
            return StructuredOutput.regex(options.regex)
        if kind == "choice":  # one of the strings, exactly: a Lark rule of JSON-quoted literals
            return StructuredOutput.lark("start: " + " | ".join(json.dumps(c) for c in options.choice))
        # llama.cpp's GBNF defines rules with "::=", Lark with ":".
        grammar = options.grammar
        return StructuredOutput.gbnf(grammar) if "::=" in grammar else StructuredOutput.lark(grammar)
    except ValueError as error:
        raise APIError(400, f"{param}: {error}", param=param) from error


def json_schema_output(schema: dict | str, param: str):
    from kvgen.sampling.grammar import StructuredOutput

    try:
        return StructuredOutput.json_schema(schema)
    except ValueError as error:
        raise APIError(400, f"invalid JSON schema: {error}", param=param) from error
