"""ModelRunner: a scheduled batch -> one forward_batch -> a sampled token for each row that is due.

A row is due when its request has no pending tokens left after this step (a decode, or the last
chunk of a prompt); a row that ran an earlier chunk of a prompt samples nothing.
"""

from __future__ import annotations

import torch

from kvgen.engine.scheduler import ScheduledRow
from kvgen.models.base import DecoderLM


class ModelRunner:
    def __init__(self, model: DecoderLM):
        self.model = model
        self.num_forwards = 0
        self.num_tokens = 0

    @torch.inference_mode()
    def run(self, rows: list[ScheduledRow]) -> list[int | None]:
        """One forward over every row; per row the sampled token, or None for a prompt chunk."""
        token_ids, caches = [], []
        for row in rows:
            request, start = row.request, row.request.num_computed
            assert request.cache is not None
            token_ids.append(request.all_ids[start : start + row.num_tokens])
            caches.append(request.cache)
        logits = self.model.forward_batch(token_ids, caches)  # [B, V]
        self.num_forwards += 1
        self.num_tokens += sum(len(ids) for ids in token_ids)
        return [row.request.sampler(logits[i]) if row.request.num_pending == 0 else None for i, row in enumerate(rows)]
