"""The ingress's side of a forwarded request (imports Ray): send it to the engine deployment (the
router picks the replica), and turn the replica's stream back into an HTTP response.

A replica that dies before it sent any of the body costs nothing visible: the request is sent
again (the router no longer offers the dead replica). Once part of a stream has reached the client
it cannot be replayed, so the stream ends with an OpenAI-shaped error event instead. Either way the
request ends: nothing waits on a dead replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from kvgen.replicas.asgi_call import RoutedCall
from kvgen.server.errors import APIError

log = logging.getLogger(__name__)
REPLICA_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)
_DROPPED_HEADERS = {"content-length", "transfer-encoding"}  # the ingress's server frames the body itself


async def relay(handle, call: RoutedCall, retries: int) -> StreamingResponse:
    lost: BaseException | None = None
    for attempt in range(retries + 1):
        stream = handle.options(stream=True).handle.remote(call)
        try:
            start = await stream.__anext__()
            first = await _next_or_none(stream)
        except REPLICA_LOST as error:
            stream.cancel()
            lost = error
            log.warning("a replica died before answering (attempt %d of %d): %s", attempt + 1, retries + 1, error)
            await asyncio.sleep(0.25 * 2**attempt)  # the router hears of the death meanwhile
            continue
        except BaseException:
            stream.cancel()
            raise
        _, status, headers = start
        kept = {k: v for k, v in headers if k.lower() not in _DROPPED_HEADERS}
        sse = kept.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_rest(stream, first, sse), status_code=status, headers=kept)
    raise APIError(503, f"the replicas serving this request died ({retries + 1} tries); last: {str(lost)[:300]}",
                   kind="server_error", code="replica_unavailable")  # fmt: skip


async def _next_or_none(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def _rest(stream, first: bytes | None, sse: bool) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield first
        async for chunk in stream:
            yield chunk
    except REPLICA_LOST as error:
        log.warning("a replica died while streaming: %s", error)
        if sse:  # the openai client raises this as an APIError
            event = {"error": {"message": f"the replica serving this stream died: {str(error)[:300]}",
                               "type": "server_error", "param": None, "code": "replica_unavailable"}}  # fmt: skip
            yield f"data: {json.dumps(event)}\n\n".encode()
    finally:
        stream.cancel()  # the client went away: the replica's call (and its engine requests) ends too
