"""LoRA adapters over HTTP: /v1/models lists the base model and every loaded adapter (`parent` = the
base, as vLLM does); POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names) change
them at run time, behind the API key. A request picks an adapter by naming it in `model`.

Unloading an adapter that requests are using is deferred (202): new requests for it get 404 at once,
the running ones finish with it, and its weights go when the last one ends."""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from kvgen.lora.adapter import AdapterError, UnknownAdapterError
from kvgen.server.errors import APIError
from kvgen.server.limits import read_json
from kvgen.server.protocol import Strict, parse


class LoadAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=256)


def model_cards(base: str, adapters) -> list[dict]:  # adapters: AdapterRegistry | None
    """The base model's card, then one per adapter accepting requests (in load order)."""
    card = {"object": "model", "created": 0, "owned_by": "kvgen"}
    names = adapters.names() if adapters is not None else []
    return [{"id": base, **card, "parent": None}] + [{"id": n, **card, "parent": base} for n in names]


def install(app: FastAPI, serving, authorize: Callable) -> None:
    """The adapter routes on `app` (serving: the app's Serving; authorize: its API-key dependency)."""
    base = serving.config.model_name

    def registry():
        if not serving.config.allow_runtime_lora:
            raise APIError(403, "loading and unloading adapters at run time is off: start the server with "
                                "--allow-runtime-lora (and an --api-key)", code="runtime_lora_disabled")  # fmt: skip
        if serving.adapters is None:
            raise APIError(400, f"{base!r} cannot serve LoRA adapters", code="unsupported_model")
        return serving.adapters

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorize)])
    async def load_adapter(http: Request) -> PlainTextResponse:
        registry()  # refuses first when run-time loading is off
        body = parse(LoadAdapterRequest, await read_json(http, serving.limits), {})
        name = body.lora_name
        if name == base:
            raise APIError(400, f"{name!r} is the base model's name: pick another name for the adapter", param="lora_name")
        adapters = registry()
        if name in adapters.info():
            state = "being unloaded (its last requests are running)" if name not in adapters.names() else "loaded already"
            raise APIError(400, f"an adapter named {name!r} is {state}: unload it first or pick another name",
                           param="lora_name", code="adapter_exists")  # fmt: skip
        try:  # reading and checking the file runs off the event loop
            await asyncio.to_thread(adapters.load, name, body.lora_path)
        except AdapterError as error:
            raise APIError(400, str(error), param="lora_path", code="invalid_adapter") from None
        serving.metrics.track_adapter(name)
        return PlainTextResponse(f"Success: LoRA adapter {name!r} added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorize)])
    async def unload_adapter(http: Request) -> PlainTextResponse:
        registry()
        body = parse(UnloadAdapterRequest, await read_json(http, serving.limits), {})
        name = body.lora_name
        try:
            gone = registry().unload(name)
        except UnknownAdapterError:
            raise APIError(404, f"no LoRA adapter named {name[:100]!r} is loaded (see /v1/models)",
                           param="lora_name", code="adapter_not_found") from None  # fmt: skip
        if gone:
            return PlainTextResponse(f"Success: LoRA adapter {name!r} removed successfully.")
        return PlainTextResponse(f"LoRA adapter {name!r} is in use: it takes no new requests, and is removed when "
                                 "the running ones finish.", status_code=202)  # fmt: skip
