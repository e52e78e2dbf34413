"""TokenLogprob lists -> OpenAI's two logprobs shapes (chat's `content` list, completions' columns)."""

from __future__ import annotations

import torch

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


def prompt_logprobs(engine, ids: list[int], top: int, adapter: str | None = None) -> dict:
    """Completions' columns for the prompt itself (echo + logprobs): each token's log-probability
    given the ones before it (None for the first), by a forward pass over a fresh cache, under the
    LoRA `adapter` (None: the base model). Call it with the engine held (AsyncLLMEngine.run_locked):
    it uses the engine's model between steps."""
    if adapter is not None:  # held (and read again if it was evicted) while it scores
        engine.adapters.acquire(adapter, count=False)
        try:
            return _prompt_logprobs(engine, ids, top, {"adapter": adapter})
        finally:
            engine.adapters.release(adapter)
    return _prompt_logprobs(engine, ids, top, {})


def _prompt_logprobs(engine, ids: list[int], top: int, adapter: dict) -> dict:
    chunk_size = 256
    cache = engine.caches.new_cache(len(ids))
    values: list[float | None] = [None]
    tops: list[dict | None] = [None]
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk_size):
            chunk = ids[start : min(start + chunk_size, len(ids) - 1)]
            logits = engine.model(torch.tensor([chunk]), cache, logits_to_keep=len(chunk), **adapter)[0]  # [S, V]
            rows = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
            targets = torch.tensor(ids[start + 1 : start + 1 + len(chunk)])  # [S]
            values += rows.gather(1, targets[:, None])[:, 0].tolist()
            if top:
                best, best_ids = rows.topk(top, dim=-1)  # [S, top]
                tops += [{_text(engine.tokenizer, t): v for t, v in zip(i, b)} for i, b in zip(best_ids.tolist(), best.tolist())]
            else:
                tops += [{} for _ in chunk]
    tokens = [_text(engine.tokenizer, t) for t in ids]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
