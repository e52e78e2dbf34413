"""SamplingParams: validated when built, so a bad value fails before any work starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from kvgen.sampling.grammar import StructuredOutput

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    The processing order per step (sampling/processors.py): penalties, logit_bias, min_new_tokens
    (EOS / stop ids banned), grammar mask, then temperature, top_k, top_p, min_p and the draw.
    temperature 0 (or top_k 1) is greedy: an argmax, no sort. top_k 0, top_p 1 and min_p 0 are off.
    Penalties follow vLLM / OpenAI: repetition_penalty (> 1 discourages) divides a positive logit and
    multiplies a negative one for every token seen in the prompt or the output; presence_penalty is
    subtracted once for every token already generated, frequency_penalty once per occurrence.
    A seed makes sampling repeat exactly; without one each request draws fresh randomness.
    stop strings end generation when the text contains one; the stop string itself is not returned
    unless include_stop_str_in_output (then the text ends with it).
    logprobs: each generated token's log-probability under the raw model (log-softmax of the logits
    before any processing, vLLM's default), plus the top_logprobs most likely alternatives.
    n samples share the prompt: it is prefilled once and each sample forks the cache.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # the matched stop string ends the text (by default it is cut)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    structured: StructuredOutput | None = None
    # When the context is full: drop the older half of what follows the first `context_keep` tokens
    # (re-rotating the keys that move) and go on, instead of stopping with finish_reason "length".
    context_shift: bool = False
    context_keep: int = 4
    # The loaded LoRA adapter to run with (LLM.load_adapter's name); None: the base model.
    adapter: str | None = None
    # Whether the text leaves out special tokens (<|im_end|>, <|channel|>); the token ids keep them.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
               f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")  # fmt: skip
        _check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
               f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens!r}")  # fmt: skip
        _check(_is_finite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        _check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be > 0 (1 = off, > 1 discourages repeats), got {self.repetition_penalty!r}")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_finite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}")
        _check(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")  # fmt: skip
        _check(self.top_logprobs == 0 or self.logprobs, "top_logprobs needs logprobs=True")
        _check(_is_int(self.n) and self.n >= 1, f"n (samples per prompt) must be an integer >= 1, got {self.n!r}")
        _check(self.context_keep >= 0, f"context_keep must be >= 0, got {self.context_keep!r}")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput),
               f"structured must be a StructuredOutput (e.g. StructuredOutput.json_schema(schema)), got {type(self.structured).__name__}")  # fmt: skip
        _check(self.adapter is None or (isinstance(self.adapter, str) and self.adapter != ""),
               f"adapter must be a loaded adapter's name or None, got {self.adapter!r}")  # fmt: skip
        _check(isinstance(self.skip_special_tokens, bool), f"skip_special_tokens must be True or False, got {self.skip_special_tokens!r}")
        _check(isinstance(self.include_stop_str_in_output, bool),
               f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}")  # fmt: skip
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_ids(ids: object, name: str) -> tuple[int, ...]:
    values = (ids,) if _is_int(ids) else ids
    _check(isinstance(values, (list, tuple, set, frozenset)) and all(_is_int(t) and t >= 0 for t in values),
           f"{name} must be non-negative integer token ids, got {ids!r}")  # fmt: skip
    return tuple(values)  # type: ignore[arg-type]


def _stop_strings(stop: object) -> tuple[str, ...]:
    values = (stop,) if isinstance(stop, str) else stop
    _check(isinstance(values, (list, tuple)) and all(isinstance(s, str) and s for s in values),
           f"stop must be a string or a list of non-empty strings, got {stop!r}")  # fmt: skip
    return tuple(values)  # type: ignore[arg-type]


def _logit_bias(bias: object) -> dict[int, float]:
    _check(isinstance(bias, Mapping), f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    result: dict[int, float] = {}
    for token, value in bias.items():  # type: ignore[union-attr]
        # JSON (the server) gives ids as strings: accept "123" as 123.
        token_id = int(token) if isinstance(token, str) and token.isdigit() else token
        _check(_is_int(token_id) and token_id >= 0, f"logit_bias key {token!r} is not a token id (a non-negative integer)")
        _check(isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
               and (value == float("-inf") or math.isfinite(value)),
               f"logit_bias[{token!r}] must be a finite number or -inf (to ban the token), got {value!r}")  # fmt: skip
        result[token_id] = float(value)
    return result
