"""One chat choice's generated text -> OpenAI chat fields, as deltas while it streams and as one
message at the end (the same path, so both say the same): `reasoning_content` (vLLM's and
DeepSeek's field) from the reply format's reasoning, `content`, and `tool_calls`, either written in
the content as tagged calls (tools.py) or as the format's own calls (harmony's messages to
functions)."""

from __future__ import annotations

from typing import Any

from kvgen.replies import ReplyParser
from kvgen.server.tools import ParsedCall, ToolCallStream, ToolPlan, tool_call_body


class ReplyStream:
    def __init__(self, parser: ReplyParser, plan: ToolPlan | None) -> None:
        self.parser = parser
        self.tagged = ToolCallStream() if plan is not None and plan.active else None
        self.native: list[ParsedCall] = []  # calls the reply format writes itself

    @property
    def calls(self) -> list[ParsedCall]:
        return self.native + (self.tagged.calls if self.tagged is not None and self.tagged.is_calls else [])

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        """The delta that `text` makes (keys only for what it adds); `final`: the reply is complete."""
        delta: dict[str, Any] = {}
        content = ""
        for part in self.parser.feed(text, final):
            if part.kind == "reasoning":
                delta["reasoning_content"] = delta.get("reasoning_content", "") + part.text
            elif part.kind == "content":
                content += part.text
            elif part.kind == "call":
                self.native.append(ParsedCall(part.text, "", True))
                delta.setdefault("tool_calls", []).append({"index": len(self.native) - 1, "id": self.native[-1].id, "type": "function",
                                                           "function": {"name": part.text, "arguments": ""}})  # fmt: skip
            else:
                self.native[-1].arguments += part.text
                delta.setdefault("tool_calls", []).append({"index": len(self.native) - 1, "function": {"arguments": part.text}})
        if self.tagged is None:
            if content:
                delta["content"] = content
        elif content or final:
            tagged = self.tagged.feed(content, final)
            if "content" in tagged:
                delta["content"] = tagged["content"]
            for call in tagged.get("tool_calls", []):
                delta.setdefault("tool_calls", []).append(call | {"index": call["index"] + len(self.native)})
        return delta

    def message(self, text: str) -> dict[str, Any]:
        """The whole message for a finished choice's `text` (a fresh stream)."""
        delta = self.feed(text, final=True)
        fields: dict[str, Any] = {"content": delta.get("content", "")}
        if "reasoning_content" in delta:
            fields["reasoning_content"] = delta["reasoning_content"]
        if self.calls:
            fields["content"] = fields["content"] or None
            fields["tool_calls"] = [tool_call_body(c) for c in self.calls]
        return fields


def reasoning_tokens(tokenizer, reply: ReplyStream, token_ids: list[int], skip_special_tokens: bool) -> int:
    """How many of the generated tokens came before the answer (content or a call) began: all of
    them for a reply cut off while reasoning, none for one that did not reason (`reply`: fresh)."""
    detokenizer = tokenizer.detokenizer(skip_special_tokens)
    reasoned = False
    for index, token in enumerate(token_ids):
        delta = reply.feed(detokenizer.add(token), final=False)
        if delta.get("content") or "tool_calls" in delta:
            return index if reasoned else 0
        reasoned = reasoned or "reasoning_content" in delta
    return len(token_ids) if reasoned else 0
