"""OpenAI's harmony format (gpt-oss): the reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer        (generation ends at <|return|>)
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}
                                                                     (generation ends at <|call|>)

The first header follows the prompt's `<|start|>assistant`. The analysis channel is reasoning,
final is content, a message to `functions.NAME` is a call of NAME with the body as its JSON
arguments (the recipient may sit in the role or after the channel), commentary to no one is content
(a preamble the user sees), and a message to a built-in tool (python, browser) is reasoning. The text
must keep special tokens (`SamplingParams(skip_special_tokens=False)`). Text that never becomes a
message (a model that does not write harmony) comes back as content."""

from __future__ import annotations

import re

from kvgen.replies.parts import Part, PartKind, held_tail

START, CHANNEL, MESSAGE, END, RETURN, CALL = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"
_BODY_ENDS = (END, START, RETURN, CALL)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."


class HarmonyParser:
    def __init__(self) -> None:
        self._state = "header"
        self._buffer = ""
        self._kind: PartKind = "content"  # the current body's
        self._said: set[str] = set()  # kinds some message has written, to separate the next one's

    def feed(self, text: str, final: bool = False) -> list[Part]:
        self._buffer += text
        parts: list[Part] = []
        while True:
            if self._state == "header":
                end = self._buffer.find(MESSAGE)
                if end < 0:
                    if final and CHANNEL not in self._buffer and self._buffer.strip():
                        parts.append(Part("content", self._buffer.replace(START, "")))
                    if final:
                        self._buffer = ""
                    return parts
                self._begin(self._buffer[:end], parts)
                self._buffer, self._state = self._buffer[end + len(MESSAGE) :], "body"
            elif self._state == "body":
                stops = [(i, m) for m in _BODY_ENDS if (i := self._buffer.find(m)) >= 0]
                if not stops:
                    keep = 0 if final else held_tail(self._buffer, _BODY_ENDS)
                    self._write(parts, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return parts
                at, marker = min(stops)
                self._write(parts, self._buffer[:at])
                self._buffer = self._buffer[at + len(marker) :]
                self._state = "header" if marker == START else "between"
            else:  # between messages: only <|start|> leads on
                at = self._buffer.find(START)
                if at < 0:
                    keep = 0 if final else held_tail(self._buffer, (START,))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return parts
                self._buffer, self._state = self._buffer[at + len(START) :], "header"

    def _begin(self, header: str, parts: list[Part]) -> None:
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        name = channel.group(1) if channel else None
        if recipient and recipient.group(1).startswith(FUNCTIONS):
            parts.append(Part("call", recipient.group(1)[len(FUNCTIONS) :]))
            self._kind = "arguments"
            return
        self._kind = "reasoning" if name == "analysis" or recipient else "content"
        if self._kind in self._said:
            parts.append(Part(self._kind, "\n\n"))

    def _write(self, parts: list[Part], text: str) -> None:
        if text:
            parts.append(Part(self._kind, text))
            self._said.add(self._kind)
