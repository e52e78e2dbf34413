"""ModelRunner: a scheduled batch -> batched forwards -> the new tokens of each row that is due.

A row is due when its request has no pending tokens left after this step (a decode, or the last
chunk of a prompt); a row that ran an earlier chunk of a prompt produces nothing. A speculative row
(engine/speculation.py) runs its last token and its drafts, and produces the verified tokens: its
cache is then cut back to what was accepted.
"""

from __future__ import annotations

import torch

from kvgen.engine.scheduler import ScheduledRow
from kvgen.kv.ssm import SSMStateCache
from kvgen.models.base import DecoderLM


# Prompt chunks of at most this many tokens are batched apart from longer ones (less padding).
SHORT_ROW_TOKENS = 17


class ModelRunner:
    def __init__(self, model: DecoderLM):
        self.model = model
        self.num_forwards = 0
        self.num_tokens = 0

    @torch.inference_mode()
    def run(self, rows: list[ScheduledRow]) -> list[list[int]]:
        """Per row its new tokens ([] for a prompt chunk). Decodes and speculative verifies share
        one forward, and prompt chunks run apart from them, short and long ones apart too, because
        a ragged batch is padded to its longest row: 60 decodes beside a 450-token chunk would
        compute 60 x 450 positions (measured: 64 concurrent requests ran at 19 tok/s that way).
        Chunks stay together: each forward of many rows reads every weight once (and, where
        prefill runs a dequantized GEMM, dequantizes it once). Decodes and verifies want the logits of every token they run, so they take the C step
        over every layer whenever it applies, whatever else is scheduled: that step computes each
        token as a lone decode would (batch- and speculation-invariant greedy output)."""
        steps = [i for i, row in enumerate(rows) if row.request.is_decoding]  # the last sampled token (+ drafts)
        chunks = [i for i in range(len(rows)) if not rows[i].request.is_decoding]
        short = [i for i in chunks if rows[i].num_tokens <= SHORT_ROW_TOKENS]
        long = [i for i in chunks if rows[i].num_tokens > SHORT_ROW_TOKENS]
        # Decodes under LoRA adapters share the C step with the base model's: it adds each row's
        # delta by its adapter slot.
        if self._has_c_step():
            groups = [steps, short, long]
        else:  # the torch path pads: one-token decodes apart from verifies
            groups = [[i for i in steps if rows[i].num_tokens == 1], [i for i in steps if rows[i].num_tokens > 1], short, long]
        groups = [group for group in groups if group]
        new_tokens: list[list[int]] = [[] for _ in rows]
        for group in groups:
            for i, tokens in zip(group, self._run_group([rows[i] for i in group])):
                new_tokens[i] = tokens
        return new_tokens

    def _has_c_step(self) -> bool:
        return bool(getattr(self.model, "use_fast_decode", False)) and hasattr(self.model, "fast_decoder") and self.model.fast_decoder() is not None

    def _run_group(self, rows: list[ScheduledRow]) -> list[list[int]]:
        """One forward over `rows`; per row its new tokens."""
        token_ids, caches, num_logits, starts = [], [], [], []
        for row in rows:
            request = row.request
            assert request.cache is not None
            start = request.num_computed
            draft = request.speculation.draft if request.speculation is not None else []
            token_ids.append(request.all_ids[start : start + row.num_tokens - len(draft)] + draft)
            caches.append(request.cache)
            num_logits.append(1 + len(draft))
            starts.append(start)
        adapters = [row.request.params.adapter for row in rows]
        # EAGLE rows read the target's features at their tokens: the forward returns them too.
        with_hidden = any(row.request.speculation is not None and row.request.speculation.needs_features for row in rows)
        # A state model's verify keeps the state after each draft, so truncate can roll the rejected ones back.
        verifying = [cache for cache, n in zip(caches, num_logits) if n > 1 and isinstance(cache, SSMStateCache)]
        for cache in verifying:
            cache.keep_positions = True
        try:
            if with_hidden:
                logits, hidden = self.model.forward_batch(token_ids, caches, num_logits, adapters, with_hidden=True)
            else:
                logits, hidden = self.model.forward_batch(token_ids, caches, num_logits, adapters), None
        finally:
            for cache in verifying:
                cache.keep_positions = False
        self.num_forwards += 1
        self.num_tokens += sum(len(ids) for ids in token_ids)
        new_tokens: list[list[int]] = []
        offset = 0
        for row, start, n in zip(rows, starts, num_logits):
            request, row_logits = row.request, logits[offset : offset + n]
            # A row's features are a proposer's where its last id is a generated token (a decode, a
            # verify, or the recompute of a preempted request), not a prompt's last token.
            features = hidden[offset : offset + n] if hidden is not None and request.output_ids else None
            offset += n
            if n > 1:  # drafts to verify: keep the accepted ones' keys and values only
                tokens = request.speculation.verify(row_logits, features)
                request.cache.truncate(start + len(tokens))  # the last id and the accepted drafts
                new_tokens.append(tokens)
            elif request.num_pending == 0:
                speculation = request.speculation
                new_tokens.append(speculation.verify(row_logits, features) if speculation else [request.sampler(row_logits[-1])])
            else:
                new_tokens.append([])
        return new_tokens
