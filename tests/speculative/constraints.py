"""Small stateful constraints with the sampling TokenConstraint interface (allowed_mask, advance,
rollback, is_finished, fork), for checking that speculation masks drafts and rewinds exactly."""

from __future__ import annotations

import copy

import torch


class ForbidSet:
    """Never allows the tokens in `forbidden`; records what it consumed."""

    def __init__(self, forbidden: set[int]):
        self.forbidden, self.consumed = forbidden, []

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[[t for t in self.forbidden if t < vocab_size]] = False
        return mask

    def advance(self, token: int) -> bool:
        if token in self.forbidden:
            return False
        self.consumed.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= len(self.consumed)
        del self.consumed[len(self.consumed) - num_tokens :]

    def is_finished(self) -> bool:
        return False

    def fork(self) -> "ForbidSet":
        return copy.deepcopy(self)


class NoRepeatFromSet(ForbidSet):
    """Allows only `tokens`, never the token just consumed: the mask depends on the state, so a wrong
    rollback changes later masks."""

    def __init__(self, tokens: set[int]):
        super().__init__(set())
        self.tokens = tokens

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[[t for t in self.tokens if t < vocab_size]] = True
        if self.consumed and self.consumed[-1] < vocab_size:
            mask[self.consumed[-1]] = False
        return mask

    def advance(self, token: int) -> bool:
        if token not in self.tokens or (self.consumed and self.consumed[-1] == token):
            return False
        self.consumed.append(token)
        return True
