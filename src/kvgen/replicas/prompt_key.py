"""What the prefix-aware router compares: a request's prompt as the engine will see it, cut into the
engine's blocks and keyed by the block-hash chain (kv/block_hash.py), and the same keys for every
block a replica's prefix index holds. A request and a replica share a prefix of k blocks exactly
when the request's first k keys are all in the replica's set.

Keys are the chain's first 8 bytes as ints: small to report and to compare, and a collision only
costs one routing choice, never a wrong answer (the engine matches token ids, not keys).
"""

from __future__ import annotations

from typing import Any, Sequence

from kvgen.kv.block_hash import block_chain, chain_key, namespace_key
from kvgen.kv.prefix import PrefixIndex, PrefixNode
from kvgen.server.config import ServerConfig, tenant_salt
from kvgen.server.errors import APIError
from kvgen.server.limits import parse_json
from kvgen.server.prepare import chat_tools, message_dict, render_chat_prompt, template_variables
from kvgen.server.protocol import REFUSED_CHAT, ChatCompletionRequest, parse

_NO_LIMIT = 1 << 30  # the replica enforces the prompt limit; routing only reads the prompt


def short_key(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def prompt_keys(prompt_ids: Sequence[int], block_size: int, salt: str) -> tuple[int, ...]:
    """The keys of the blocks the engine could reuse for this prompt: its full blocks, all but the
    last token (which is always computed, as the scheduler's match does)."""
    usable = prompt_ids[: len(prompt_ids) - 1]
    return tuple(short_key(k) for k in block_chain(usable, block_size, namespace_key(salt)))


def index_keys(index: PrefixIndex) -> list[int]:
    """The keys of every block the index holds, by walking its tree (call between engine steps)."""
    keys: list[int] = []
    for salt, root in index.roots.items():
        stack: list[tuple[PrefixNode, bytes]] = [(root, namespace_key(salt))]
        while stack:  # a loop, not recursion: paths can be thousands of blocks deep
            node, key = stack.pop()
            for child in node.children.values():
                child_key = chain_key(key, child.tokens)
                keys.append(short_key(child_key))
                stack.append((child, child_key))
    return keys


def request_prompt_ids(tokenizer, path: str, body: dict[str, Any], config: ServerConfig) -> list[int] | None:
    """The prompt ids a chat or completions request will run with (the first prompt of several), or
    None for any other route or a request the replica will refuse anyway."""
    try:
        if path.endswith("/chat/completions"):
            request = parse(ChatCompletionRequest, body, REFUSED_CHAT)
            plan = chat_tools(request.tools, request.tool_choice, request.parallel_tool_calls, config.limits)
            variables = template_variables(tokenizer, request.chat_template_kwargs, request.reasoning_effort)
            return render_chat_prompt(tokenizer, [message_dict(m) for m in request.messages], plan, _NO_LIMIT,
                                      template_kwargs=variables)[0]  # fmt: skip
        if path.endswith("/completions"):
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
                prompt = prompt[0]  # the choices of every prompt run on one replica: route by the first
            if isinstance(prompt, str):
                return tokenizer.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return list(prompt)
    except (APIError, ValueError, TypeError):
        return None
    return None


def request_keys(tokenizer, block_size: int, config: ServerConfig, path: str, raw: bytes,
                 authorization: str | None) -> tuple[int, ...]:  # fmt: skip
    """The routing keys of a raw request body; () when it has no prompt to route by."""
    try:
        body = parse_json(raw, config.limits)
    except APIError:
        return ()
    ids = request_prompt_ids(tokenizer, path, body, config)
    if not ids:
        return ()
    salt = tenant_salt(_api_key(authorization, config), body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None)
    return prompt_keys(ids, block_size, salt)


def _api_key(authorization: str | None, config: ServerConfig) -> str | None:
    """The tenant key the replica will find (app.authorize): the bearer token, when the server has keys."""
    if not config.keys or not authorization or not authorization.startswith("Bearer "):
        return None
    token = authorization.removeprefix("Bearer ")
    return token if token in config.keys else None


