"""Stop strings: the incremental matcher on any split of the text, and on the real SmolLM2."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen import SamplingParams
from kvgen.sampling.stops import StopStringMatcher


def run_matcher(pieces: list[str], stops: tuple[str, ...], keep_stop: bool = False) -> tuple[list[str], str | None]:
    matcher, emitted = StopStringMatcher(stops, keep_stop), []
    for piece in pieces:
        check = matcher.feed(piece)
        emitted.append(check.text)
        if check.stop is not None:
            return emitted, check.stop
    emitted.append(matcher.flush())
    return emitted, None


def expected(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Generation ends with the first piece that completes a stop; the text is cut at the earliest
    match in what was seen up to then."""
    seen = ""
    for piece in pieces:
        seen += piece
        hits = sorted((seen.find(s), s) for s in stops if s in seen)
        if hits:
            return seen[: hits[0][0]], hits[0][1]
    return seen, None


def test_partial_match_is_held_back_and_never_emitted() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("abc ST").text == "abc "
    check = matcher.feed("OP and more")
    assert check == type(check)("", "STOP")


def test_a_false_alarm_is_released() -> None:
    matcher = StopStringMatcher(("STOP",))
    assert matcher.feed("x ST").text == "x "
    assert matcher.feed("ART").text == "START"
    assert matcher.feed("S").text == ""
    assert matcher.flush() == "S"


def test_multibyte_stop_split_across_pieces() -> None:
    emitted, stop = run_matcher(["Grüß ", "Gott 日", "本語 und", " mehr"], ("日本語", "zzz"))
    assert "".join(emitted) == "Grüß Gott " and stop == "日本語"


def test_earliest_of_several_stops_wins() -> None:
    emitted, stop = run_matcher(["the end. ", "The End"], ("End", "end."))
    assert "".join(emitted) == "the " and stop == "end."


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab日\u00e9 ", max_size=30),
    stops=st.lists(st.text(alphabet="ab日\u00e9 ", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_any_split_gives_the_text_before_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, stop = run_matcher(pieces, tuple(stops))
    want_text, want_stop = expected(pieces, tuple(stops))
    assert "".join(emitted) == want_text
    if want_stop is None:
        assert stop is None
    else:  # several stops may match at the same place; the text before it is what matters
        assert stop is not None and len(want_text) == "".join(pieces).find(stop)
    kept, kept_stop = run_matcher(pieces, tuple(stops), keep_stop=True)  # include_stop_str_in_output
    assert kept_stop == stop and "".join(kept) == want_text + (stop or "")


def test_stop_string_split_across_tokens_on_the_model(smollm2) -> None:
    prompt = "Once upon a time"
    full = smollm2.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))
    pieces = [smollm2.tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop made of the last 2 characters of token 4's text and the first 2 of token 5's.
    boundary = len(pieces[3])
    assert len(pieces[4]) - boundary >= 2 and boundary >= 2, "pick tokens with enough text"
    stop = full.text[boundary - 2 : boundary + 2]
    stream = smollm2.stream(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True, stop=[stop]))
    chunks = [c.text for c in stream]
    result = stream.result
    assert result.text == full.text[: full.text.find(stop)]
    assert "".join(chunks) == result.text and stop not in result.text
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert result.token_ids == full.token_ids[:5]  # the token that completed the match ends generation
    assert len(chunks) == 5 and chunks[3] == pieces[3][len(pieces[2]) : boundary - 2]  # "xy" held back, never sent


def test_include_stop_str_in_output_ends_the_text_with_it(smollm2) -> None:
    full = smollm2.generate("Once upon a time", SamplingParams(max_new_tokens=16, ignore_eos=True))
    stop = full.text[10:13]
    kept = smollm2.generate("Once upon a time", SamplingParams(max_new_tokens=16, ignore_eos=True, stop=[stop],
                                                                 include_stop_str_in_output=True))  # fmt: skip
    assert kept.text == full.text[: full.text.find(stop) + len(stop)] and kept.stop_reason == stop


def test_no_stop_match_returns_everything(smollm2) -> None:
    full = smollm2.generate("Once upon a time", SamplingParams(max_new_tokens=8, ignore_eos=True))
    other = smollm2.generate("Once upon a time", SamplingParams(max_new_tokens=8, ignore_eos=True, stop=["\u2603\u2603"]))
    assert other.text == full.text and other.finish_reason == "length" and other.stop_reason is None
