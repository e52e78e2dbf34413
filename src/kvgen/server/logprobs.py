"""TokenLogprob lists -> OpenAI's two logprobs shapes (chat's `content` list, completions' columns)."""

from __future__ import annotations

from kvgen.loading.tokenizer import Tokenizer
from kvgen.sampling.sampler import TokenLogprob


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], offset: int = 0) -> dict:
    tokens = [_text(tokenizer, lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }
