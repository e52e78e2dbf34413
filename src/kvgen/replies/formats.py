"""Which reply format a model writes, found from its vocabulary and chat template, and the parser
for one reply."""

from __future__ import annotations

from typing import Literal

from kvgen.loading.tokenizer import HARMONY_MARKERS, Tokenizer
from kvgen.replies.harmony import HarmonyParser
from kvgen.replies.parts import Part, ReplyParser
from kvgen.replies.think import CLOSE, OPEN, ThinkParser

ReplyFormat = Literal["plain", "think", "harmony"]
REPLY_FORMATS: tuple[str, ...] = ("auto", "plain", "think", "harmony")


def detect_reply_format(tokenizer: Tokenizer) -> ReplyFormat:
    """harmony where the vocabulary has harmony's special tokens (gpt-oss), think where the chat
    template writes `</think>` (it strips or closes reasoning blocks), else plain."""
    if all(_special_id(tokenizer, marker) is not None for marker in HARMONY_MARKERS):
        return "harmony"
    if CLOSE in (tokenizer.chat_template or ""):
        return "think"
    return "plain"


def skips_special_tokens(reply_format: ReplyFormat) -> bool:
    """Whether a reply in this format decodes without its special tokens: harmony's channels are
    special tokens its parser reads, so harmony replies keep them."""
    return reply_format != "harmony"


def starts_in_reasoning(prompt: str) -> bool:
    """Whether the prompt ends inside an open `<think>` block (the generation prompt opened it)."""
    opened = prompt.rfind(OPEN)
    return opened > prompt.rfind(CLOSE) and not prompt[opened + len(OPEN) :].strip()


def reply_parser(reply_format: ReplyFormat, prompt: str = "") -> ReplyParser:
    """A fresh parser for one reply to `prompt` (the rendered chat prompt, text)."""
    if reply_format == "harmony":
        return HarmonyParser()
    if reply_format == "think":
        return ThinkParser(starts_in_reasoning(prompt))
    if reply_format == "plain":
        return PlainParser()
    raise ValueError(f"reply format {reply_format!r} is unknown; choose one of {', '.join(REPLY_FORMATS[1:])}")


class PlainParser:
    """All text is content."""

    def feed(self, text: str, final: bool = False) -> list[Part]:
        return [Part("content", text)] if text else []


def _special_id(tokenizer: Tokenizer, text: str) -> int | None:
    token_id = tokenizer.backend.token_to_id(text)
    return token_id if token_id is not None and tokenizer.is_special(token_id) else None
