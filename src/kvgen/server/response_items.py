"""A response's output items, whole and as stream events: a reasoning item (where the model
reasoned), then a message, then function calls, in the order the reply wrote them."""

from __future__ import annotations

import uuid
from typing import Any, Callable

from kvgen.server.replies import ReplyStream
from kvgen.server.tools import ParsedCall

_TEXT_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}


def output_items(reply: ReplyStream, text: str, logprobs: list[dict] | None = None) -> list[dict[str, Any]]:
    """The items of a finished response's `text` (`reply`: a fresh stream); `logprobs`: the message's
    output_text tokens (chat's logprob entries), where the request included them."""
    fields = reply.message(text)
    items = []
    if fields.get("reasoning_content"):
        items.append(_text_item("reasoning", _item_id("reasoning"), fields["reasoning_content"], "completed"))
    if fields.get("content") or not (items or reply.calls):  # an empty reply is still an (empty) message
        items.append(_text_item("message", _item_id("message"), fields.get("content") or "", "completed", logprobs))
    return items + [call_item(c, "completed" if c.complete else "incomplete") for c in reply.calls]


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as one assistant turn of chat history (for previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(_texts(output, "message"))}
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]  # fmt: skip
    if calls:
        message["tool_calls"] = calls
    reasoning = "".join(_texts(output, "reasoning"))
    if reasoning:
        message["reasoning_content"] = message["thinking"] = reasoning
    return [message]


def _texts(output: list[dict[str, Any]], kind: str) -> list[str]:
    return [p["text"] for i in output if i["type"] == kind for p in i["content"]]


def _item_id(kind: str) -> str:
    return ("rs_" if kind == "reasoning" else "msg_") + uuid.uuid4().hex


def _text_item(kind: str, item_id: str, text: str, status: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    part_type = "reasoning_text" if kind == "reasoning" else "output_text"
    content = [] if status == "in_progress" else [_part(part_type, text, logprobs)]
    if kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _part(part_type: str, text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    extra = {"annotations": [], "logprobs": logprobs or []} if part_type == "output_text" else {}
    return {"type": part_type, "text": text, **extra}


def call_item(call: ParsedCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status != "in_progress" else "", "status": status}  # fmt: skip


class ItemStream:
    """Generated text -> the output items' events: each item is added, gets its deltas and is done
    before the next one starts. Token logprobs fed with the text (plain replies only: every token is
    the message's) ride on the message's next delta, and its part carries them all."""

    def __init__(self, event: Callable[..., str], reply: ReplyStream) -> None:
        self.event, self.reply = event, reply
        self.output: list[dict[str, Any]] = []  # the items done
        self._open: dict[str, Any] | None = None  # the item being written: kind, id, text / call
        self._logprobs: list[dict] = []  # fed, not yet on a delta (a token whose text is held back)

    def feed(self, piece: str, final: bool, logprobs: list[dict] | None = None) -> list[str]:
        self._logprobs += logprobs or []
        delta = self.reply.feed(piece, final)
        out = []
        if "reasoning_content" in delta:
            out += self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            out += self._text("message", delta["content"])
        for part in delta.get("tool_calls", []):
            if "id" in part:
                out += self._close()
                self._open = {"kind": "call", "call": self.reply.calls[part["index"]]}
                out.append(self.event("response.output_item.added", output_index=len(self.output),
                                      item=call_item(self._open["call"], "in_progress")))  # fmt: skip
            elif part["function"]["arguments"]:
                out.append(self.event("response.function_call_arguments.delta", item_id=call_item(self._open["call"], "in_progress")["id"],
                                      output_index=len(self.output), delta=part["function"]["arguments"]))  # fmt: skip
        return out

    def close(self) -> list[str]:
        """The last item's done events (an empty message when nothing was written)."""
        out = [] if self.output or self._open else self._text("message", "")
        return out + self._close()

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self._open is None or self._open["kind"] != kind:
            out += self._close()
            self._open = {"kind": kind, "id": _item_id(kind), "text": "", "logprobs": []}
            index, item_id = len(self.output), self._open["id"]
            out.append(self.event("response.output_item.added", output_index=index, item=_text_item(kind, item_id, "", "in_progress")))
            if kind == "message":
                out.append(self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []}))  # fmt: skip
        self._open["text"] += text
        if text:
            extra = {"logprobs": self._take_logprobs(self._open)} if kind == "message" else {}
            out.append(self.event(_TEXT_EVENTS[kind] + ".delta", item_id=self._open["id"], output_index=len(self.output),
                                  content_index=0, delta=text, **extra))  # fmt: skip
        return out

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        current, self._open, index = self._open, None, len(self.output)
        if current["kind"] == "call":
            call = current["call"]
            item = call_item(call, "completed" if call.complete else "incomplete")
            self.output.append(item)
            return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"],
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
        kind, item_id, text = current["kind"], current["id"], current["text"]
        if kind == "message":
            self._take_logprobs(current)  # any left (tokens with no text of their own) belong to the part
        item = _text_item(kind, item_id, text, "completed", current["logprobs"])
        self.output.append(item)
        extra = {"logprobs": current["logprobs"]} if kind == "message" else {}
        out = [self.event(_TEXT_EVENTS[kind] + ".done", item_id=item_id, output_index=index, content_index=0, text=text, **extra)]
        if kind == "message":
            out.append(self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                  part=item["content"][0]))  # fmt: skip
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def _take_logprobs(self, message: dict[str, Any]) -> list[dict]:
        """The logprobs fed since the last message delta, now `message`'s."""
        taken, self._logprobs = self._logprobs, []
        message["logprobs"] += taken
        return taken
