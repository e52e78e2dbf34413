"""Where drafts fail, speculative decoding costs what plain decoding costs: every target forward is
the one-token C step plain decoding runs (no batched verify forward, no torch path), probes are
verified by that step too, and they back off. Counted, not timed, on the 4-bit SmolLM2."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kvgen import LLM, SamplingParams, SpeculativeConfig
from kvgen.speculative import decoder as decoder_module

PASSAGE = (
    "The lighthouse stood on a rock at the mouth of the harbour. Every evening the keeper climbed the "
    "hundred and twelve steps, trimmed the wick, polished the great lens and lit the lamp, and every "
    "morning he put it out again and wrote in his log the weather, the ships that had passed and the "
    "oil he had burned. He did this for forty years, and in all that time the light never failed."
)
QUOTING = f"Passage: {PASSAGE}\n\nQuote the passage exactly.\nQuote: The lighthouse stood on a rock"
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
NEW_TOKENS = 128


def count_forwards(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts of what runs the model: one-token C steps over every layer ('step') or the first few
    ('draft step'), batched C rows ('rows': a token tree's too), and the torch path ('torch')."""
    model, counts = llm.model, Counter()
    decoder = model.fast_decoder()
    assert decoder is not None, "the 4-bit SmolLM2 decodes with the C step"

    def spy(name, fn, kind=None):
        def wrapped(*args, **kwargs):
            counts[kind(*args, **kwargs) if kind else name] += 1
            return fn(*args, **kwargs)

        return wrapped

    def step_kind(h, rope, cache, slot=-1, num_layers=None):
        return "step" if num_layers in (None, model.config.num_layers) else "draft step"

    monkeypatch.setattr(decoder, "step", spy("step", decoder.step, step_kind))
    monkeypatch.setattr(decoder, "step_tokens", spy("rows", decoder.step_tokens))
    monkeypatch.setattr(decoder, "step_rows", spy("rows", decoder.step_rows))
    monkeypatch.setattr(decoder, "step_tree", spy("rows", decoder.step_tree))
    monkeypatch.setattr(model, "_hidden_states", spy("torch", model._hidden_states))
    return counts


@pytest.mark.parametrize("method, prompt, drafts_fail", [("self", QUOTING, True), ("lookup", STORY, True),
                                                         ("eagle", STORY, False)])  # fmt: skip
def test_plain_steps_under_speculation_are_plain_decodings_and_failing_probes_back_off(
    smollm2_q4, monkeypatch, method, prompt, drafts_fail
):  # fmt: skip
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    # A still clock: every step takes no time, so the pauses are the controller's own schedule
    # (16, 32, 64 tokens), not stretched by how long this machine's steps took.
    monkeypatch.setattr(decoder_module, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    counts = count_forwards(smollm2_q4, monkeypatch)
    plain = smollm2_q4.generate(prompt, params)
    plain_counts = counts.copy()
    counts.clear()
    result = smollm2_q4.generate(prompt, params, speculative=SpeculativeConfig(method))
    assert result.token_ids == plain.token_ids
    stats = result.speculative
    # Plain decoding: the prompt's rows, then one one-token C step over all layers per token.
    assert plain_counts["step"] == NEW_TOKENS - 1 and plain_counts["torch"] == 0, plain_counts
    # Under speculation every plain step (a probe's too) is that same C step, and the only other
    # target forwards are the batched verifies; nothing runs on the torch path.
    assert counts["step"] == stats.plain_steps and counts["torch"] == 0, (counts, stats)
    assert counts["rows"] == plain_counts["rows"] + stats.verify_steps, (counts, plain_counts, stats)
    if drafts_fail:
        assert stats.accepted_tokens == 0, f"{method}: a draft was accepted; this case needs text where drafts fail"
        assert stats.verify_steps == 0 and stats.plain_steps == NEW_TOKENS - 1, stats
        # Probes back off: two at once (on the still clock every draft is cheap, and a cheap probe
        # gets a second try), then two after pauses of 16, 32 and 64 plain tokens (tokens 1-2, 19-20,
        # 53-54, 119; a fixed pause of 16 would probe 14 times). Each drafts one token; lookup
        # drafts only where the context holds a match, so it may skip one.
        assert stats.proposed_tokens == stats.probe_steps, stats
        assert stats.probe_steps == 7 if method == "self" else 5 <= stats.probe_steps <= 7, stats
        assert counts["draft step"] == (7 if method == "self" else 0), counts


@torch.inference_mode()
def test_a_probe_verified_by_plain_steps_gives_the_batched_verify_tokens(smollm2_q4):
    """Accepted probes too: lookup on quoted text, where the probe's draft is accepted, equals plain
    greedy, and the drafts after the probe are verified batched."""
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = smollm2_q4.generate(QUOTING, params)
    result = smollm2_q4.generate(QUOTING, params, speculative=SpeculativeConfig("lookup"))
    assert result.token_ids == plain.token_ids
    stats = result.speculative
    assert stats.probe_steps >= 1 and stats.probe_accepted_tokens >= 1 and stats.verify_steps > 0, stats


def test_a_probe_is_timed_without_the_proposers_catch_up(smollm2_q4, monkeypatch):
    """The proposer's catch-up on the tokens decoded during a pause (`catch_up_seconds`: the EAGLE
    head's positions for them) is left out of the probe's draft time, so a long pause does not make
    the next probe look slow. A lookup that spends 50 ms catching up before each draft passes its
    probe; timed with the catch-up, the probe would have cost ~20 plain steps and failed."""
    from kvgen.speculative import adaptive
    from kvgen.speculative.prompt_lookup import PromptLookupProposer

    lookup_propose = PromptLookupProposer.propose

    def slow_catch_up(self, *args, **kwargs):
        started = decoder_module.time.perf_counter()
        while decoder_module.time.perf_counter() - started < 0.05:
            pass
        self.catch_up_seconds = decoder_module.time.perf_counter() - started
        return lookup_propose(self, *args, **kwargs)

    probes: list[float] = []
    record = adaptive.DraftLengthController.record

    def spy(self, proposed, accepted, seconds=None, draft_seconds=None):
        if draft_seconds is not None:
            probes.append(draft_seconds)
        return record(self, proposed, accepted, seconds, draft_seconds)

    monkeypatch.setattr(PromptLookupProposer, "propose", slow_catch_up)
    monkeypatch.setattr(adaptive.DraftLengthController, "record", spy)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = smollm2_q4.generate(QUOTING, params)
    result = smollm2_q4.generate(QUOTING, params, speculative=SpeculativeConfig("lookup"))
    assert result.token_ids == plain.token_ids
    assert probes and all(seconds < 0.04 for seconds in probes), probes  # the 50 ms are not the draft's
    assert result.speculative.verify_steps > 0, result.speculative  # the probe passed: drafting went on
