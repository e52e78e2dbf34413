"""Layer-skip self-draft: the target's first L blocks, then its own final norm and head.

No extra weights. The draft keeps its own cache of L layers: it never writes the target's cache, so a
rejected draft cannot leave stale keys there, whatever kind of cache the target uses. (Sharing the
target's first L layers would save the draft's prefill, but every draft step would then write
positions the target has not verified, and caches that round or drop positions on write — quantized,
sliding-window — could not take those writes back exactly.)
"""

from __future__ import annotations

import torch

from kvgen.cache_factory import CacheFactory
from kvgen.config import CacheConfig
from kvgen.models.base import DecoderLM
from kvgen.speculative.proposer import CachedDrafter

INITIAL_CAPACITY = 256


class SelfDraftProposer(CachedDrafter):
    def __init__(self, model: DecoderLM, num_layers: int, max_context: int):
        if not 1 <= num_layers < model.config.num_layers:
            raise ValueError(
                f"a self-draft uses the first L (draft_layers) of the target's {model.config.num_layers} layers: "
                f"L must be in [1, {model.config.num_layers - 1}], got {num_layers}"
            )
        caches = CacheFactory(CacheConfig(), model, None, max_context, num_layers=num_layers)
        super().__init__(caches.new_cache(INITIAL_CAPACITY))  # contiguous: exact rewinds
        self.model, self.num_layers = model, num_layers

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.hidden_states(input_ids, self.cache, self.num_layers)  # [1, S, H]
        return self.model.logits_from_hidden(h[0, -1])  # [V]
