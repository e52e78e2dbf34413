"""Predicted Outputs (`SpeculativeConfig("lookup", prediction=...)`): drafts from the expected
output first, then from the context. On the default 4-bit SmolLM2 the tokens are plain greedy
decoding's whatever the prediction says, and a prediction that matches the output gets its drafts
kept, alone and in the engine."""

from __future__ import annotations

import pytest

from kvgen import SamplingParams, SpeculativeConfig
from kvgen.engine import EngineConfig, LLMEngine
from kvgen.engine.request import RequestStatus
from tests.engine.test_engine import assert_nothing_leaked

PROMPT = "Once upon a time, there was a little girl who"
PARAMS = SamplingParams(max_new_tokens=48)


def edited(text: str) -> str:
    """The text with its middle words replaced: where the prediction is wrong, the output must
    leave it and find its place again after."""
    words = text.split(" ")
    middle = len(words) // 2
    return " ".join(words[:middle] + ["suddenly", "purple", "giraffes"] + words[middle + 3 :])


@pytest.fixture(scope="module")
def plain(smollm2_q4):
    return smollm2_q4.generate(PROMPT, PARAMS)


def test_predicted_text_gives_the_plain_greedy_tokens_and_keeps_its_drafts(smollm2_q4, plain) -> None:
    lookup = smollm2_q4.generate(PROMPT, PARAMS, speculative=SpeculativeConfig("lookup"))
    exact = smollm2_q4.generate(PROMPT, PARAMS, speculative=SpeculativeConfig("lookup", prediction=plain.text))
    wrong_middle = smollm2_q4.generate(PROMPT, PARAMS, speculative=SpeculativeConfig("lookup", prediction=edited(plain.text)))
    unrelated = smollm2_q4.generate(PROMPT, PARAMS, speculative=SpeculativeConfig("lookup", prediction="def f(x):\n    return x"))
    for result in (lookup, exact, wrong_middle, unrelated):
        assert result.token_ids == plain.token_ids
    # The output's own text as the prediction: nearly every step keeps its drafts.
    assert exact.speculative.accepted_tokens >= len(plain.token_ids) // 2
    assert exact.speculative.verify_steps < len(plain.token_ids) // 2
    # With its middle wrong, drafts are kept on both sides of the edit: more than the context alone gives.
    assert wrong_middle.speculative.accepted_tokens > lookup.speculative.accepted_tokens
    assert wrong_middle.speculative.accepted_tokens > exact.speculative.accepted_tokens // 2


def test_a_prediction_as_token_ids_drafts_like_its_text(smollm2_q4, plain) -> None:
    by_ids = smollm2_q4.generate(PROMPT, PARAMS, speculative=SpeculativeConfig("lookup", prediction=plain.token_ids))
    assert by_ids.token_ids == plain.token_ids
    assert by_ids.speculative.accepted_tokens >= len(plain.token_ids) // 2


def test_bad_predictions_are_refused_naming_what_to_change(smollm2_q4) -> None:
    with pytest.raises(ValueError, match="prediction is searched for drafts by method 'lookup', not 'eagle'"):
        SpeculativeConfig("eagle", prediction="x")
    with pytest.raises(ValueError, match="prediction must be text or a sequence of token ids"):
        SpeculativeConfig("lookup", prediction=["a"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="prediction token id 99999999 is not in this model's vocabulary"):
        smollm2_q4.generate(PROMPT, PARAMS, speculative=SpeculativeConfig("lookup", prediction=[1, 99999999]))


def test_predicted_requests_in_the_engine_equal_each_alone_and_report_their_drafts(smollm2_q4, plain) -> None:
    engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=64, block_size=4))
    predicted = engine.add_request("predicted", PROMPT, PARAMS, speculative=SpeculativeConfig("lookup", prediction=plain.text))
    edited_request = engine.add_request("edited", PROMPT, PARAMS,
                                        speculative=SpeculativeConfig("lookup", prediction=edited(plain.text)))  # fmt: skip
    beside = engine.add_request("plain", PROMPT, PARAMS)
    results = {}
    while any(r.status is not RequestStatus.FINISHED for r in (predicted, edited_request, beside)):
        results |= {output.request_id: output.result for output in engine.step() if output.finished}
    for request in (predicted, edited_request, beside):
        assert request.output_ids == plain.token_ids, request.request_id
    # The finished result carries the request's draft counts (the server's usage reads them).
    assert results["predicted"].speculative.accepted_tokens >= len(plain.token_ids) // 2
    assert results["edited"].speculative.accepted_tokens > 0
    assert results["plain"].speculative is None
    assert_nothing_leaked(engine)
