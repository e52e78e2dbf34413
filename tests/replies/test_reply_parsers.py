"""Reply parsers: reasoning, content and calls out of `<think>` blocks and harmony messages, the same
whether the text comes whole or a character at a time (as a stream hands it over)."""

from __future__ import annotations

import pytest

from kvgen.replies import ParsedReply, parse_reply, reply_parser
from kvgen.replies.formats import starts_in_reasoning
from kvgen.replies.harmony import HarmonyParser
from kvgen.replies.think import ThinkParser


def streamed(parser, text: str) -> ParsedReply:
    reply = ParsedReply()
    for char in text:
        for part in parser.feed(char):
            reply.add(part)
    for part in parser.feed("", final=True):
        reply.add(part)
    return reply


THINK_CASES = [
    # (text, prompt opened the block, reasoning, content)
    ("<think>\nThe user greets.\n</think>\n\nHello!", False, "\nThe user greets.\n", "Hello!"),
    ("\n<think>a < b and </thin k></think>Answer", False, "a < b and </thin k>", "Answer"),
    ("Hello, no thinking.", False, None, "Hello, no thinking."),
    ("  Indented answer <think> later", False, None, "  Indented answer <think> later"),
    ("The user greets.\n</think>\n\nHello!", True, "The user greets.\n", "Hello!"),
    ("cut off while thinking </thi", True, "cut off while thinking </thi", ""),
    ("<think>unclosed", False, "unclosed", ""),
    ("<thi", False, None, "<thi"),
]


@pytest.mark.parametrize("text,opened,reasoning,content", THINK_CASES)
def test_think_blocks_split_into_reasoning_and_content(text: str, opened: bool, reasoning: str | None, content: str) -> None:
    whole = parse_reply(ThinkParser(opened), text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    assert streamed(ThinkParser(opened), text) == whole


def test_a_generation_prompt_that_opens_the_block_starts_the_reply_inside_it() -> None:
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not starts_in_reasoning("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")


HARMONY_CASES = [
    # (text, reasoning, content, calls)
    ("<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
     "User says hi.", "Hello!", []),
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
     '<|constrain|>json<|message|>{"city":"Paris"}', "Need the weather.", "", [("get_weather", '{"city":"Paris"}')]),
    # the recipient in the role, as gpt-oss's template writes past calls
    ('<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q":"<|x|>"}', None, "", [("lookup", '{"q":"<|x|>"}')]),
    # a preamble to the user, then the answer; two analysis messages joined
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     "<|start|>assistant<|channel|>analysis<|message|>Two.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
     "One.\n\nTwo.", "Checking.\n\nDone.", []),
    # a built-in tool's call is the model's own business: reasoning
    ("<|channel|>analysis<|message|>Run it.<|end|><|start|>assistant to=python<|channel|>analysis<|message|>print(1)",
     "Run it.\n\nprint(1)", "", []),
    ("Plain text from a model that does not write harmony.", None, "Plain text from a model that does not write harmony.", []),
    ("<|channel|>final<|message|>cut off <|en", None, "cut off <|en", []),
    ("<|channel|>analysis<|message|>cut off in the hea<|end|><|start|>assistant<|channel|>fin", "cut off in the hea", "", []),
]  # fmt: skip


@pytest.mark.parametrize("text,reasoning,content,calls", HARMONY_CASES)
def test_harmony_messages_split_by_channel_and_recipient(text: str, reasoning: str | None, content: str, calls: list) -> None:
    whole = parse_reply(HarmonyParser(), text)
    assert (whole.reasoning, whole.content, whole.calls) == (reasoning, content, calls)
    assert streamed(HarmonyParser(), text) == whole


def test_a_stream_never_hands_out_part_of_a_marker() -> None:
    parser = HarmonyParser()
    parts = parser.feed("<|channel|>final<|message|>Hi <|e")
    assert "".join(p.text for p in parts) == "Hi "
    assert parser.feed("nd|>") == []
    think = ThinkParser(True)
    assert "".join(p.text for p in think.feed("x </th")) == "x "
    assert [p.kind for p in think.feed("ink>y")] == ["content"]


def test_plain_replies_are_content_and_unknown_formats_are_refused() -> None:
    assert parse_reply(reply_parser("plain"), "<think>x</think>y") == ParsedReply(None, "<think>x</think>y")
    with pytest.raises(ValueError, match="reply format 'json' is unknown"):
        reply_parser("json")  # type: ignore[arg-type]
