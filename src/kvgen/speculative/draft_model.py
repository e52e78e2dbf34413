"""A separate, smaller (or cheaper) model with the same vocabulary drafts for the target.

Any kvgen `DecoderLM` works, e.g. the q4-weights SmolLM2 drafting for the fp32 one (same tokenizer,
different weights); its one-token steps take the C decode path when its weights are quantized.
"""

from __future__ import annotations

import torch

from kvgen.cache_factory import CacheFactory
from kvgen.config import CacheConfig
from kvgen.loading.tokenizer import Tokenizer
from kvgen.models.base import DecoderLM
from kvgen.speculative.proposer import CachedDrafter

INITIAL_CAPACITY = 256  # positions; the draft cache doubles as the sequence grows


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """A draft's token ids must mean the same strings as the target's, or its guesses are noise."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    step = max(1, target.vocab_size // 512)
    for token_id in range(0, target.vocab_size, step):  # a spread sample: full comparison costs seconds
        if target.id_to_token(token_id) != draft.id_to_token(token_id):
            raise ValueError(
                f"token {token_id} is {target.id_to_token(token_id)!r} for the target but "
                f"{draft.id_to_token(token_id)!r} for the draft: a draft model must share the target's tokenizer"
            )


class DraftModelProposer(CachedDrafter):
    def __init__(self, draft: DecoderLM, max_context: int):
        context = min(max_context, draft.config.max_position_embeddings)
        super().__init__(CacheFactory(CacheConfig(), draft, None, context).new_cache(INITIAL_CAPACITY))  # contiguous: exact rewinds
        self.draft = draft

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.draft(input_ids, self.cache)[0, -1]  # [V]
