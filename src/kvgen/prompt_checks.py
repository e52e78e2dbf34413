"""Checks every way of running a request shares (`Generator`, the engine, the server): a prompt is
encoded and validated once, and token ids in SamplingParams are checked against the vocabulary."""

from __future__ import annotations

from typing import Iterable, Sequence

from kvgen.errors import PromptTooLongError
from kvgen.loading.tokenizer import Tokenizer
from kvgen.sampling.params import SamplingParams


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int], vocab_size: int, max_context: int) -> list[int]:
    """Prompt ids; ValueError for an empty prompt or ids outside the vocabulary, PromptTooLongError
    when no room is left for output."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty: give some text or token ids")
    if bad := outside_vocabulary(ids, vocab_size):
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_context:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but the context holds {max_context} (prompt + output): "
            f"shorten it to at most {max_context - 1} tokens"
        )
    return ids


def outside_vocabulary(ids: Iterable[int], vocab_size: int) -> list[int]:
    """The ids that are no token of a vocabulary of `vocab_size` (negative, or too large)."""
    return [t for t in ids if not 0 <= t < vocab_size]


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: token ids against the model's vocabulary."""
    for name, ids in (("logit_bias", list(params.logit_bias)), ("stop_token_ids", params.stop_token_ids)):
        if bad := outside_vocabulary(ids, vocab_size):
            raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
