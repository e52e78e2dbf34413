"""What a reply parser hands out as text arrives, and the whole reply those parts add up to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

PartKind = Literal["reasoning", "content", "call", "arguments"]


@dataclass(frozen=True)
class Part:
    """A piece of the reply: reasoning or content text, the start of a tool call (`text` is the
    function's name), or more of the current call's arguments."""

    kind: PartKind
    text: str


class ReplyParser(Protocol):
    def feed(self, text: str, final: bool = False) -> list[Part]:
        """The parts that `text` (the next generated text) completes; `final`: no text follows, so
        nothing is held back any longer."""
        ...


@dataclass
class ParsedReply:
    reasoning: str | None = None
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments as JSON text)

    def add(self, part: Part) -> None:
        if part.kind == "reasoning":
            self.reasoning = (self.reasoning or "") + part.text
        elif part.kind == "content":
            self.content += part.text
        elif part.kind == "call":
            self.calls.append((part.text, ""))
        else:
            name, arguments = self.calls[-1]
            self.calls[-1] = (name, arguments + part.text)


def parse_reply(parser: ReplyParser, text: str) -> ParsedReply:
    """The whole reply in `text` (a fresh parser's view of it)."""
    reply = ParsedReply()
    for part in parser.feed(text, final=True):
        reply.add(part)
    return reply


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that may be the start of one of `markers`: text a
    streaming parser holds back until the next piece says whether a marker begins there."""
    for size in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0
