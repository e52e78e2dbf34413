"""Draft length control: draft more when the target keeps agreeing, less when it does not, and stop
drafting for a while when even the shortest drafts are mostly rejected (verification then costs more
than it saves)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class SpeculativeStats:
    """What speculation did for one request (a metric: `acceptance_rate`)."""

    verify_steps: int = 0  # target forwards over drafted tokens
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    plain_steps: int = 0  # one-token target forwards (no draft, or fallback)

    def record_verify(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens produced per verify forward (accepted drafts + the target's own token)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class DraftLengthController:
    """Rolling acceptance over the last `window` verify steps: above `grow_above` the draft grows by
    one token (up to `max_length`), below `shrink_below` it shrinks by one (down to `min_length`).
    Below `shrink_below` at the minimum length for a whole window, drafting pauses for `cooldown`
    tokens of plain decoding, then starts again at the minimum length with a fresh window. Each pause
    that follows another with no good verify step in between is twice as long (up to `max_cooldown`):
    on text where drafts keep failing, the probing verifies become rare and the cost nears plain
    decoding's. One verify step at or above `shrink_below` resets the pause length."""

    def __init__(
        self, initial: int = 4, min_length: int = 1, max_length: int = 8, adaptive: bool = True,
        window: int = 8, grow_above: float = 0.8, shrink_below: float = 0.4, cooldown: int = 16,
        max_cooldown: int = 256,
    ):  # fmt: skip
        if not 1 <= min_length <= initial <= max_length:
            raise ValueError(f"need 1 <= min_length <= initial <= max_length, got {min_length}, {initial}, {max_length}")
        self.length, self.min_length, self.max_length = initial, min_length, max_length
        self.adaptive, self.grow_above, self.shrink_below, self.cooldown = adaptive, grow_above, shrink_below, cooldown
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)  # (proposed, accepted) per verify step
        self._low_at_min = 0  # consecutive verify steps at min length with a low rolling rate
        self._paused = 0  # plain tokens left before drafting again
        self._next_cooldown = cooldown  # the next pause's length: doubles while drafts keep failing
        self.max_cooldown = max(max_cooldown, cooldown)

    @property
    def rolling_acceptance(self) -> float:
        proposed = sum(p for p, _ in self._recent)
        return sum(a for _, a in self._recent) / proposed if proposed else 1.0

    def draft_length(self) -> int:
        """Tokens to draft now; 0 means decode plainly this step."""
        if self._paused:
            self._paused -= 1
            return 0
        return self.length

    def record(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        self._recent.append((proposed, accepted))
        if accepted >= self.shrink_below * proposed:
            self._next_cooldown = self.cooldown  # drafting paid at least once since the last pause
        rate = self.rolling_acceptance
        if rate > self.grow_above:
            self.length = min(self.length + 1, self.max_length)
        elif rate < self.shrink_below:
            if self.length == self.min_length:
                self._low_at_min += 1
                if self._low_at_min >= (self._recent.maxlen or 1):
                    self._paused, self._low_at_min = self._next_cooldown, 0
                    self._next_cooldown = min(2 * self._next_cooldown, self.max_cooldown)
                    self._recent.clear()
            self.length = max(self.length - 1, self.min_length)
            return
        self._low_at_min = 0
