"""Tool calling: the tools in the prompt, the grammar the calls are generated under, and parsing the
generated text back into OpenAI `tool_calls` (whole, or as streaming deltas).

The model writes each call as

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

(the Hermes / Qwen format), calls back to back. An llguidance Lark grammar holds it to that format:
the name is one of the allowed tools and the arguments follow that tool's JSON schema, so they always
parse and validate. tool_choice "required" / a named function: the output is calls only; "auto":
either calls or text that does not start with `<tool_call>`; "none": no grammar, no tools shown.
A chat template that renders `tools` gets them (and the history's tool calls) in the
transformers form; for one that does not, the tools are described in the system message and history
calls / results are written in the same tagged format (tool results as a user turn).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvgen.replies.parts import held_tail
from kvgen.sampling.grammar import StructuredOutput
from kvgen.server.errors import APIError

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
_HEADER = re.compile(r'<tool_call>\n\{"name":"([a-zA-Z0-9_-]{1,64})","arguments":')
_END = "}" + CLOSE
FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai_form(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one request and how they may be called. `choice`: auto, required, none, or the
    name of the one function to call."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def structured(self) -> StructuredOutput | None:
        """The grammar of the output, or None when tools are off."""
        return compile_rules(["start: answer", *self.rules()], "tools", "a tool's parameters schema") if self.active else None

    def allowed(self) -> list[Tool]:
        """The tools the model may call under `choice`."""
        return [t for t in self.tools if self.choice in ("auto", "required") or t.name == self.choice]

    def rules(self) -> list[str]:
        """Lark rules whose top rule `answer` is the output when tools are on: calls in the tagged
        format (or, under "auto", text that does not start one)."""
        allowed = self.allowed()
        rules = [f"call_{i}: {_lark_string(_header(t.name))} {json_rule(t.parameters)} {_lark_string(_END)}"
                 for i, t in enumerate(allowed)]  # fmt: skip
        return ["answer: calls | TEXT" if self.choice == "auto" else "answer: calls", "calls: call+" if self.parallel else "calls: call",
                "call: " + " | ".join(f"call_{i}" for i in range(len(allowed))), *rules,
                r"TEXT: /(.|\n)+/ & ~(/<tool_call>(.|\n)*/)"]  # fmt: skip


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark expression for JSON text that follows `schema`, written without free whitespace."""
    return f"%json {json.dumps(_compact(schema))}"


def compile_rules(lines: list[str], param: str, what: str) -> StructuredOutput:
    """Lark rules -> the StructuredOutput; `what` llguidance cannot enforce is a 400 naming `param`."""
    try:
        return StructuredOutput.lark("\n".join(lines))
    except ValueError as error:
        raise APIError(400, f"{what} cannot be enforced: {error}", param=param) from error


def _header(name: str) -> str:
    return OPEN + '{"name":' + json.dumps(name) + ',"arguments":'


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema, with no free whitespace in the generated JSON (the arguments parse and stream
    exactly as written; a model given free whitespace can loop on it)."""
    schema = dict(schema)
    if not any(key in schema for key in ("type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")):
        schema["type"] = "object"  # OpenAI: the arguments are always an object
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def make_plan(tools: list[Tool] | None, tool_choice: str | None, parallel: bool | None) -> ToolPlan:
    """Check tool_choice against the tools (400s naming the field)."""
    tools = tools or []
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "two tools have the same name: give each function a unique name", param="tools")
    choice = tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice not in ("auto", "required", "none") and choice not in names:
        raise APIError(400, f"tool_choice names function {choice!r}, which is not among the tools", param="tool_choice")
    for tool in tools:
        if tool.parameters.get("type", "object") != "object":
            raise APIError(400, f"tool {tool.name!r}: parameters must be a JSON schema of type object", param="tools")
    return ToolPlan(tuple(tools), choice, True if parallel is None else parallel)


def render_conversation(messages: list[dict[str, Any]], plan: ToolPlan, template_renders_tools: bool) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages for the chat template, tools for it). `messages` are OpenAI-shaped dicts with
    `content` text, optional `tool_calls` (arguments as JSON text) and `tool_call_id`."""
    shown = list(plan.tools) if plan.active else []
    if template_renders_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                    "arguments": _arguments_value(c["function"]["arguments"])}} for c in m["tool_calls"]]  # fmt: skip
            out.append(m)
        return out, [t.openai_form() for t in shown] or None
    out = []
    for m in messages:
        if m["role"] == "tool":
            reply = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + reply
            else:
                out.append({"role": "user", "content": reply, "_tool_results": True})
        elif m["role"] == "user" and out and out[-1].get("_tool_results"):
            out[-1]["content"] += "\n\n" + m["content"]  # roles keep alternating for strict templates
        elif m.get("tool_calls"):
            calls = "".join(OPEN + json.dumps({"name": c["function"]["name"], "arguments": _arguments_value(c["function"]["arguments"])},
                                              separators=(",", ":")) + CLOSE for c in m["tool_calls"])  # fmt: skip
            out.append({"role": "assistant", "content": (m.get("content") or "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if shown:
        listing = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(t.openai_form()) for t in shown))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, None


def _arguments_value(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        raise APIError(400, f"a tool call's arguments are not JSON: {arguments[:80]!r}", param="messages") from None


@dataclass
class ParsedCall:
    name: str
    arguments: str
    complete: bool
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


def parse_calls(text: str, final: bool) -> tuple[bool | None, list[ParsedCall]]:
    """(whether the text is tool calls: True / False / None while undecided, the calls so far).
    While not final, arguments hold back a tail that may be the closing `}` + tag."""
    if not text.startswith(OPEN[: len(text)]) or (final and not text.startswith(OPEN)):
        return False, []
    if len(text) < len(OPEN):
        return None, []
    calls, position = [], 0
    while True:
        header = _HEADER.match(text, position)
        if header is None:
            return True, calls
        start = header.end()
        end = text.find(_END, start)
        if end < 0:
            rest = text[start:]
            if not final:
                rest = rest[: len(rest) - held_tail(rest, (_END,))]
            calls.append(ParsedCall(header.group(1), rest, False))
            return True, calls
        calls.append(ParsedCall(header.group(1), text[start:end], True))
        position = end + len(_END)


class ToolCallStream:
    """One choice's streamed text -> OpenAI chat deltas (content, or tool_calls: the first delta of a
    call carries its id and name with empty arguments, the next ones argument text)."""

    def __init__(self) -> None:
        self.text, self.sent_content, self.is_calls = "", 0, None
        self.calls: list[ParsedCall] = []
        self.sent_args: list[int] = []

    def feed(self, piece: str, final: bool) -> dict[str, Any]:
        self.text += piece
        is_calls, calls = parse_calls(self.text, final)
        if is_calls is False:
            delta = self.text[self.sent_content :]
            self.sent_content = len(self.text)
            return {"content": delta} if delta else {}
        if is_calls is None:
            return {}
        self.is_calls = True
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.calls):
                self.calls.append(call)
                self.sent_args.append(0)
                deltas.append({"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}})
            self.calls[index].arguments, self.calls[index].complete = call.arguments, call.complete
            new = call.arguments[self.sent_args[index] :]
            if new:
                self.sent_args[index] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": new}})
        return {"tool_calls": deltas} if deltas else {}


def tool_call_body(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
