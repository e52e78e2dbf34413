"""Draft length control: draft more when the target keeps agreeing, less when it does not, and stop
drafting for a while when even the shortest drafts are mostly rejected (verification then costs more
than it saves)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class SpeculativeStats:
    """What speculation did for one request (a metric: `acceptance_rate`)."""

    verify_steps: int = 0  # batched target forwards over drafted tokens
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    plain_steps: int = 0  # one-token target forwards (no draft, a fallback, or a probe's)
    probe_steps: int = 0  # drafts verified by one-token target forwards (counted in plain_steps)
    probe_accepted_tokens: int = 0  # of accepted_tokens, those of probes
    alternative_tokens: int = 0  # of accepted_tokens, alternatives to a rejected first draft (draft trees)

    def record_verify(self, proposed: int, accepted: int, alternative: bool = False) -> None:
        """A verify forward over `proposed` chained drafts; `alternative`: the one accepted token was
        an alternative to the first (the chain's drafts count as proposed, the alternatives do not)."""
        self.verify_steps += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.alternative_tokens += alternative

    def record_probe(self, proposed: int, accepted: int, forwards: int) -> None:
        """A draft verified by `forwards` one-token target forwards."""
        self.probe_steps += 1
        self.plain_steps += forwards
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.probe_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens produced per batched verify forward (accepted drafts + the target's own token)."""
        accepted = self.accepted_tokens - self.probe_accepted_tokens
        return (accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


GROWTH_EVIDENCE = 4  # timed steps at a length, paying together, before the draft grows past it
CHEAP_STEP = 1.35  # timed steps at most this many plain steps' time each ...
PAUSE_EVIDENCE = 16  # ... pause only once this many at the length, together, cost more than plain steps
CLEAR_PAY_RATIO = 0.7  # ... unless the step took at most this share of its tokens' plain time
CHEAP_PROBE = 0.25  # a probe whose draft took at most this share of a plain step may fail `patience` times


class DraftLengthController:
    """Rolling acceptance over the last `window` verify steps. The draft grows by one token (up to
    `max_length`) when one more draft would add at least `grow_gain` accepted tokens a step
    (`growth_gain`): EAGLE's head on chat, whose first draft is accepted ~0.6 of the time and the
    second ~0.5 after it, grows to two drafts (a second adds ~0.3 tokens a step for ~0.1 of a plain
    step's time) and not to three (~0.15). Below
    `shrink_below`, or when the step did not pay its time and neither did the window's steps at its
    length, it shrinks to one more than the last step accepted (at least one less, down to
    `min_length`), so a run of rejected drafts reaches the minimum in one step instead of one token
    at a time. Below `shrink_below` at the minimum length for
    a whole window, drafting pauses for `cooldown` tokens of plain decoding, then probes again at the
    minimum length. A probe that fails pauses again at once, for twice as long (up to
    `max_cooldown`): on text where drafts keep failing, probes become rare and the cost nears plain
    decoding's. (A probe verified by plain steps whose draft cost at most `CHEAP_PROBE` of a plain
    step pauses only after `patience` such failures in a row.) Drafting stays on probation after a
    pause until a verify step pays: that step halves the next pause's length (down to `cooldown`).

    Where the caller times its steps (`record_plain`, `record(..., seconds=)`), a verify step pays only
    if it also made its tokens at least `1 / pay_ratio` times faster than plain steps do (draft +
    verify time against `pay_ratio` x (accepted + 1) plain steps): a draft that is accepted but costs
    more than it saves (a slow proposer), or about what it saves, counts as a failure. At the minimum
    length a timed caller's drafting pauses only after `patience` failed steps in a row while the
    steps at that length among the last `pay_window`, together, did not pay either: a one-token draft accepted half the time
    fails every other step on its own, yet pays over the window (EAGLE's head on chat); and the
    pause is as many times longer as the step overran. Such a caller may verify each probe by plain one-token steps
    (`probing`, `record(..., draft_seconds=)`), so that a failed probe costs only its draft; a probe
    whose drafts are accepted lets the next drafts be verified batched, at the length drafting had."""

    def __init__(
        self, initial: int = 4, min_length: int = 1, max_length: int = 8, adaptive: bool = True,
        window: int = 8, grow_gain: float = 0.25, shrink_below: float = 0.4, cooldown: int = 16,
        max_cooldown: int = 256, patience: int = 2, pay_ratio: float = 0.9, pay_window: int = 32,
    ):  # fmt: skip
        if not 1 <= min_length <= initial <= max_length:
            raise ValueError(f"need 1 <= min_length <= initial <= max_length, got {min_length}, {initial}, {max_length}")
        self.length, self.min_length, self.max_length = initial, min_length, max_length
        self.adaptive, self.grow_gain, self.shrink_below, self.cooldown = adaptive, grow_gain, shrink_below, cooldown
        self._recent: deque[tuple[int, int]] = deque(maxlen=window)  # (proposed, accepted) per verify step
        # (length, seconds, tokens) per timed step, over a longer window than the rates': whether
        # one-token steps accepted half the time pay is a thin margin, which eight steps misjudge
        # about one time in three (a pause by chance every few dozen steps).
        self._timed: deque[tuple[int, float, int]] = deque(maxlen=pay_window)
        self._untimed: deque[tuple[int, int]] = deque(maxlen=pay_window)  # (proposed, accepted), untimed steps
        self._low_at_min = 0  # consecutive failed steps at min length (timed: their window unpaid too)
        self._paused = 0  # plain tokens left before drafting again
        self._next_cooldown = cooldown  # the next pause's length: doubles while drafts keep failing
        self._probing = False  # drafting again after a pause, no verify step has paid yet
        self._probe_next = False  # the next draft is a probe (the first since the pause)
        self._failed_probes = 0  # cheap probes failed in a row since the pause
        self._has_paid = False  # a batched verify step has paid in this request
        self._resume_length = min_length  # the length a paying probe returns to
        self.patience = max(1, min(patience, window))  # failed steps at the minimum length before a pause
        self._plain_seconds: float | None = None  # moving average of one plain step's time
        self.max_cooldown = max(max_cooldown, cooldown)
        # A timed step that only breaks even is not worth drafting: the draft's side costs fall
        # outside its time (a drafting head's weights evict the target's from the caches for the
        # plain steps after it), and drafting near break-even only adds variance. In-process turns
        # (10 rounds, quiet) at 0.9 against 1.0: EAGLE on chat 0.985x against 0.966x of plain
        # decoding, on open-ended text 0.971x against 0.955x, the layer-skip draft there 0.964x
        # against 0.952x; prompt lookup unchanged (1.02x open-ended, 2.23x against 2.21x on quoting).
        self.pay_ratio = pay_ratio

    @property
    def rolling_acceptance(self) -> float:
        proposed = sum(p for p, _ in self._recent)
        return sum(a for _, a in self._recent) / proposed if proposed else 1.0

    @property
    def growth_gain(self) -> float:
        """Accepted tokens one more draft would add a step, from the recent steps: the chance that
        every draft of the current length is accepted (the product of each depth's acceptance given
        the drafts before it) times the last depth's acceptance (the next one's, unseen)."""
        reach, rate = 1.0, 0.0
        for depth in range(1, self.length + 1):
            reached = sum(p >= depth and a >= depth - 1 for p, a in self._recent)
            if not reached:
                return 0.0
            rate = sum(a >= depth for _, a in self._recent) / reached
            reach *= rate
        return reach * rate

    def draft_length(self) -> int:
        """Tokens to draft now; 0 means decode plainly this step."""
        if self._paused:
            self._paused -= 1
            return 0
        return self.length

    def record_plain(self, seconds: float) -> None:
        """The time of one plain (undrafted) step: what a verify step must beat per token."""
        previous = self._plain_seconds
        self._plain_seconds = seconds if previous is None else 0.7 * previous + 0.3 * seconds

    @property
    def probing(self) -> bool:
        """Whether a draft now is a probe: the first after a pause (or of a request that
        `start_with_probe`), asking whether the proposer agrees with the target again. A caller
        may verify it by plain steps and record it with `draft_seconds`."""
        return self._probe_next and not self._paused

    def record(
        self, proposed: int, accepted: int, seconds: float | None = None, draft_seconds: float | None = None
    ) -> None:
        """One verify step: `proposed` drafted tokens, `accepted` of them kept; `seconds` the draft and
        verify's time, where the caller measures it. `draft_seconds`: a probe verified by plain
        one-token steps, `draft_seconds` of it drafting; it passes if its drafts were accepted and
        drafting cost at most `pay_ratio` of the plain steps they save (the plain steps cost what
        plain decoding does), and then the next draft is verified batched."""
        if not self.adaptive or proposed == 0:
            return
        self._recent.append((proposed, accepted))
        plain = self._plain_seconds
        grows_in_time = True
        if seconds is None or plain is None:
            in_time = True
            # Untimed, the rates alone decide, over the window's steps at this length: a one-token
            # draft accepted half the time fails every other step, yet yields 1.5 tokens a verify
            # (EAGLE's head in the engine), and longer drafts before a shrink say nothing of it.
            self._untimed.append((proposed, accepted))
            steps = [(p, a) for p, a in self._untimed if p == proposed]
            window_pays = sum(a for _, a in steps) >= self.shrink_below * sum(p for p, _ in steps)
        elif draft_seconds is not None:
            in_time = draft_seconds <= accepted * plain * self.pay_ratio
        else:
            in_time = seconds <= (accepted + 1) * plain * self.pay_ratio
            # Over the window's steps at this length: longer drafts before a shrink say nothing of it.
            self._timed.append((proposed, seconds, accepted + 1))
            steps = [(s, n) for length, s, n in self._timed if length == proposed]
            spent, plain_time = sum(s for s, _ in steps), sum(n for _, n in steps) * plain  # the window's
            window_pays = spent <= plain_time * self.pay_ratio
            if spent <= len(steps) * plain * CHEAP_STEP:
                # Cheap steps (EAGLE's one-token drafts: ~1.2 plain steps) pause only on a full
                # window that costs more than plain decoding would. Their failures come in streaks
                # that do not last, and pausing on two of them cost EAGLE's default a tenth of its
                # speed against fixed one-token drafts (benchmarks/eagle_trees.py: open-ended text
                # 1.12x against 1.26x, quoted text 1.01x against 1.08x; with this rule 1.23x and 1.09x).
                window_pays = len(steps) < PAUSE_EVIDENCE or spent <= plain_time
            # Growing takes a step that pays by a wide margin, or a few steps' evidence that this
            # length pays: a break-even proposer's first two or three steps pay by chance about as
            # often as not (and growing then kept it from ever pausing).
            clearly = seconds <= (accepted + 1) * plain * CLEAR_PAY_RATIO
            grows_in_time = window_pays and (clearly or len(steps) >= GROWTH_EVIDENCE)
        paid = accepted >= self.shrink_below * proposed and in_time
        # How many times its tokens' plain time the step took (1 where untimed): a slow proposer's
        # failures pause it for that much longer.
        overrun = 1.0 if in_time or seconds is None or plain is None else seconds / ((accepted + 1) * plain)
        if draft_seconds is not None and self._probing:
            if not paid:
                # A cheap probe gets `patience` tries: a head right half the time fails half its
                # probes, and one failure paused it for most of a request (EAGLE on open-ended text:
                # adaptive 1.06x, fixed two-token drafts 1.25x), the request's first probe too (a
                # 16-token pause at the start of every other request). A costly one pauses at once.
                self._failed_probes += 1
                cheap = plain is not None and draft_seconds <= CHEAP_PROBE * plain
                if not cheap or self._failed_probes >= self.patience:
                    self._pause(overrun)  # pause again, longer
                return
            # Still on probation: only a batched step that pays shortens the next pause, so a slow
            # proposer whose drafts are accepted keeps backing off. A probe that passed only on its
            # second try is weaker evidence: drafting resumes at the minimum length and grows from
            # there (EAGLE on quoted text, drafts right ~0.1 of the time, had resumed at four
            # drafts, and three failing six-row verifies cost ~1-2% of a request).
            if self._failed_probes:
                self._resume_length, self._failed_probes = self.min_length, 0
            self._probe_next = False
            self._resume()
            return
        was_probe, self._probe_next = self._probe_next, False
        if paid:
            if self._probing:
                self._failed_probes = 0
                self._resume()
            # Halved, not reset: on text where drafts keep failing, one lucky acceptance would
            # otherwise undo the whole back-off (a run of short pauses, each with a failing probe).
            self._next_cooldown = max(self.cooldown, self._next_cooldown // 2)
            self._probing, self._has_paid = False, True
        elif was_probe:
            # The probe failed. An untimed caller verified it batched, at the cost of one more row;
            # a proposer that has paid in this request gets `patience` tries, as a timed caller's
            # cheap probes do (EAGLE's head in the engine fails half its one-token probes).
            self._failed_probes += 1
            if seconds is not None or not self._has_paid or self._failed_probes >= self.patience:
                self._pause(overrun)  # pause again, longer
            else:
                self._probe_next = True
            return
        # Steps after a passed probe that fail shrink the draft as any step does: where a probe passes
        # at one token and the resumed length is too long (EAGLE's later drafts rarely pass), pausing
        # at once lost the whole resumption (EAGLE on chat: one batched verify per request).
        rate = self.rolling_acceptance
        if self.growth_gain >= self.grow_gain and in_time and grows_in_time:
            self.length = min(self.length + 1, self.max_length)
        elif rate < self.shrink_below or not (in_time or window_pays):
            if self.length == self.min_length:
                self._low_at_min = 0 if window_pays else self._low_at_min + 1
                if self._low_at_min >= self.patience:
                    self._pause(overrun)
            self.length = max(min(self.length - 1, accepted + 1), self.min_length)
            return
        self._low_at_min = 0

    def start_with_probe(self) -> None:
        """Draft one minimum-length probe first and go to the full length only once one pays: a
        caller that times its steps need not pay for a long draft from a proposer it has not timed.
        A fixed length (not adaptive) stays fixed, and one-token drafts need no probe: verified
        batched, a failed one costs one more row, and probing first only delayed the gain (EAGLE's
        head, whose first drafts of a reply fail more often, began most requests paused)."""
        if not self.adaptive or self.max_length == 1:
            return
        self._probing = self._probe_next = True
        self._resume_length, self.length = self.length, self.min_length

    def _resume(self) -> None:
        """Back to the length drafting had before the pause, once: a shorter step that pays later
        keeps its length."""
        self.length, self._resume_length = max(self.length, self._resume_length), self.min_length

    def _pause(self, overrun: float = 1.0) -> None:
        self._failed_probes = 0
        pause = min(int(self._next_cooldown * max(1.0, overrun)), self.max_cooldown)
        self._paused, self._low_at_min, self._probing, self._probe_next = pause, 0, True, True
        self._next_cooldown = min(2 * self._next_cooldown, self.max_cooldown)
        self.length = self._resume_length = self.min_length
        self._recent.clear()
        self._timed.clear()
        self._untimed.clear()
