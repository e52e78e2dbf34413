"""One HTTP request run on an in-process ASGI app (a replica's own kvgen FastAPI app), its response
yielded as it is sent: first ("start", status, headers), then body chunks. This is how a replica
serves what the ingress forwards, so every route, error and stream is the unmodified server's.

Leaving the iteration early (the ingress's client went away, the call was cancelled) tells the app
the client disconnected and then cancels it, which cancels its engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Union

Start = tuple[str, int, list[tuple[str, str]]]
Message = Union[Start, bytes]


@dataclass(frozen=True)
class RoutedCall:
    """A forwarded HTTP request, with its prompt's block keys for the router (replicas/prompt_key.py)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    block_keys: tuple[int, ...] = ()


async def asgi_call(app, call: RoutedCall) -> AsyncIterator[Message]:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method, "scheme": "http",
        "path": call.path, "raw_path": call.path.encode(), "query_string": call.query, "root_path": "",
        "headers": list(call.headers), "client": ("127.0.0.1", 0), "server": ("kvgen-replica", 80),
    }  # fmt: skip
    sent: asyncio.Queue[dict] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    app_task = asyncio.ensure_future(app(scope, receive, sent.put))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, app_task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the app returned (or failed) without sending more
                getter.cancel()
                app_task.result()
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield ("start", int(message["status"]), headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not app_task.done():
            await asyncio.wait({app_task}, timeout=1.0)  # the app sees the disconnect and cleans up
            app_task.cancel()
            with contextlib.suppress(BaseException):
                await app_task
