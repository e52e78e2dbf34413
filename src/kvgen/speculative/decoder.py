"""The speculative step: draft k tokens, verify them in one target forward, roll back the rest.

`SpeculativeDecoder.step()` replaces one plain decode step of the generation loop and returns one or
more tokens. Invariant between steps (the same as plain decoding): the target's cache holds every
committed id but the last, so the last id is the next forward's first input.

A draft with alternatives to its first token (EAGLE, greedy) is verified as a token tree in the
same forward: the chain's rows, then each alternative as a leaf after the last id.

The request's sampler does all the choosing (its processors: penalties, logit bias, the grammar),
so speculative output is plain decoding's; proposers draft under the sampler's grammar, if any.
"""

from __future__ import annotations

import time

import torch

from kvgen.kv.interface import KVCache
from kvgen.models.base import DecoderLM
from kvgen.sampling.sampler import Sampler
from kvgen.speculative.adaptive import SpeculativeStats
from kvgen.speculative.config import MAX_DRAFT_TOKENS, SpeculativeConfig
from kvgen.speculative.proposer import DraftPolicy, Proposer
from kvgen.speculative.verify import verify, verify_each


class SpeculativeDecoder:
    def __init__(
        self, model: DecoderLM, cache: KVCache, proposer: Proposer, sampler: Sampler, config: SpeculativeConfig,
        max_context: int, adapter: str | None = None,
    ):  # fmt: skip
        """adapter: the LoRA adapter the target runs under (its verify too; the proposer drafts from
        the text: SpeculativeConfig.check_adapter refused the others)."""
        self.model, self.cache, self.proposer, self.sampler = model, cache, proposer, sampler
        self.adapter = adapter
        self.max_context, self.constraint = max_context, sampler.constraint
        self.policy = DraftPolicy(sampler.params, config.alternatives_for(sampler.params, model, cache))
        proposer.attach(cache)  # a layer-skip draft reads the target's first layers' keys and values
        self.controller = config.new_controller()
        self.controller.start_with_probe()  # the steps are timed: a proposer proves itself on one token first
        self.stats = SpeculativeStats()
        self.ids: list[int] = []  # every committed id; all but the last are in the cache

    def start(self, ids: list[int]) -> None:
        """ids: the prompt and the first generated token (the cache holds the prompt)."""
        assert self.cache.seq_len == len(ids) - 1, f"cache holds {self.cache.seq_len} of {len(ids)} ids"
        self.ids = list(ids)

    def step(self, max_tokens: int) -> list[int]:
        """Between 1 and about `max_tokens` new tokens (more are never drafted than that budget)."""
        room = self.max_context - self.cache.seq_len - 1  # positions left after the last id's own
        k = min(self.controller.draft_length(), max_tokens - 1, room)
        if self.proposer.needs_target_features and not self._has_features:
            k = 0  # the first step gives the proposer the features it starts from
        started = time.perf_counter()  # the controller weighs a draft's time against plain steps
        draft = self.proposer.propose(self.ids, k, self.policy, self.constraint) if k > 0 else None
        if draft is None or not draft.tokens:
            tokens = [self._plain_step()]
            self.controller.record_plain(time.perf_counter() - started)
        elif self.controller.probing:
            tokens = self._probe_step(draft, started)
        else:
            tokens = self._verify_step(draft, started)
        self.ids.extend(tokens)
        return tokens

    _has_features = False

    def _verify_tree(self, chain: list[int], alternatives: list[int]) -> torch.Tensor | None:
        """The chain and the alternatives to its first draft in one forward: logits [k+1+n, V], the
        alternatives' rows last; None where the target verifies no trees (the proposer then drafts
        none: nothing was run)."""
        logits = self._target(chain + alternatives, parents=[-1, *range(len(chain) - 1), *[0] * len(alternatives)])
        if logits is None:
            self.policy.alternatives = 0
        return logits

    def _target(self, input_ids: list[int], parents: list[int] | None = None) -> torch.Tensor | None:
        """Run the target over input_ids -> logits [S, V] (and features to the proposer if it wants).
        parents: the rows form a token tree (FastDecoder.step_tree); None where the target cannot
        verify one (nothing run)."""
        if parents is not None:
            h = self.model.tree_hidden_states(torch.tensor([input_ids]), self.cache, parents)
            if h is None:
                return None
            h = h[0]
        elif not self.proposer.needs_target_features:
            return self.model(torch.tensor([input_ids]), self.cache, logits_to_keep=None, adapter=self.adapter)[0]
        else:
            h = self.model.hidden_states(torch.tensor([input_ids]), self.cache)[0]  # [S, H]
        self._features = h
        return self.model.logits_from_hidden(h)

    def _verify_chain(self, chain: list[int]) -> torch.Tensor:
        """The target over the last id and the drafts -> logits [k+1, V]. A model that keeps its own
        state (Mamba, the hybrids) keeps it after every position of this pass, so truncate can roll
        the rejected drafts back (kv/ssm.py's keep_positions); a KV cache drops their keys."""
        keeps_state = hasattr(self.cache, "keep_positions")
        if keeps_state:
            self.cache.keep_positions = True  # type: ignore[attr-defined]
        try:
            return self._target(chain)
        finally:
            if keeps_state:
                self.cache.keep_positions = False  # type: ignore[attr-defined]

    def _plain_step(self) -> int:
        logits = self._target([self.ids[-1]])[-1]
        token = self.sampler(logits)
        if self.proposer.needs_target_features:
            self.proposer.observe_features(self._features)
            self._has_features = True
        self.stats.plain_steps += 1
        return token

    def _probe_step(self, draft, started: float) -> list[int]:
        """A probe's draft, verified by plain one-token steps: the target runs over the last id,
        then over each draft only once the one before it was accepted. A batched forward over two
        tokens costs well over one plain step, so a probe that fails, as probes do where drafts
        keep failing, would cost that much more than plain decoding; this way it costs its draft.
        The logits are the same (the one-token C step is the verify rows' own computation). The
        proposer's catch-up on the tokens decoded during the pause is left out of the probe's time:
        EAGLE's head runs a position for each of them, which after a long pause outweighed the
        draft itself, judged every probe too slow and doubled each pause on its own."""
        started += self.proposer.catch_up_seconds
        drafted = time.perf_counter() - started
        inputs = [self.ids[-1]] + draft.tokens
        forwards = 0

        def logits_at(i: int) -> torch.Tensor:
            nonlocal forwards
            forwards += 1
            logits = self._target([inputs[i]])[-1]
            if self.proposer.needs_target_features:  # every input run here is committed
                self.proposer.observe_features(self._features)
            return logits

        tokens = verify_each(logits_at, draft, self.sampler)
        accepted = len(tokens) - 1
        self.controller.record(len(draft.tokens), accepted, time.perf_counter() - started, draft_seconds=drafted)
        self.stats.record_probe(len(draft.tokens), accepted, forwards)
        return tokens

    def _verify_step(self, draft, started: float) -> list[int]:
        start, chain = self.cache.seq_len, [self.ids[-1]] + draft.tokens
        # At most MAX_DRAFT_TOKENS + 1 rows (a tile of the rows step's linears: config.py), within the context
        rows = min(MAX_DRAFT_TOKENS + 1, self.max_context - start)
        draft.alternatives = draft.alternatives[: max(0, rows - len(chain))]
        logits = self._verify_tree(chain, draft.alternatives) if draft.alternatives else None
        if logits is None:
            logits = self._verify_chain(chain)  # [k+1, V]
        tokens = verify(logits[: len(chain)], draft, self.sampler)
        accepted = len(tokens) - 1
        kept = list(range(accepted + 1))  # the verified rows whose keys and values stay
        alternative = accepted == 0 and len(logits) > len(chain) and tokens[0] in draft.alternatives
        if alternative:
            # The target chose one of the alternatives: its row holds the target's next token, and
            # its key and value move to the position after the last id.
            row = len(chain) + draft.alternatives.index(tokens[0])
            tokens.append(self.sampler.choose(logits[row], self.sampler.pick))
            self.cache.kernel_layout(self.cache.seq_len).copy_position(start + row, start + 1, self.cache.spec)
            accepted, kept = 1, [0, row]
        self.cache.truncate(start + 1 + accepted)  # the rejected drafts' keys and values go
        if self.proposer.needs_target_features:
            self.proposer.observe_features(self._features[kept])
        self.controller.record(len(draft.tokens), accepted, seconds=time.perf_counter() - started)
        self.stats.record_verify(len(draft.tokens), accepted, alternative)
        return tokens

