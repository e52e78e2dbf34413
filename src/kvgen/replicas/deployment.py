"""The Ray Serve application (imports Ray): an engine deployment of N replicas, each one kvgen engine
serving the unmodified kvgen FastAPI app, behind a light ingress deployment that Ray Serve's HTTP
proxy calls. The ingress reads a request's body, hashes its prompt into block keys (it loads only
the tokenizer) and forwards it through a handle, whose request router (replicas/router.py) picks
the replica; the replica's response streams back through the ingress unchanged.

The ingress is needed because Ray Serve's HTTP proxy hands a deployment the request's ASGI scope,
not its body: a router on the proxy's side never sees the prompt.
"""

# No `from __future__ import annotations` here: Ray Serve rebuilds the ingress methods and FastAPI must
# see real types (Request) in their signatures.
import asyncio
import logging
import time
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig

from kvgen.replicas.aggregate import render
from kvgen.replicas.asgi_call import Message, RoutedCall, asgi_call
from kvgen.replicas.board import board
from kvgen.replicas.options import PREFIX_ROUTER, ReplicaOptions, ReplicaSpec
from kvgen.replicas.prompt_key import request_keys
from kvgen.replicas.relay import relay
from kvgen.replicas.replica_stats import engine_stats, metric_totals
from kvgen.server.errors import install_error_handlers
from kvgen.server.limits import read_body

log = logging.getLogger(__name__)
ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT = "KvgenEngine", "KvgenIngress"
_FORWARDED_METHODS = ["GET", "POST", "DELETE"]


class EngineReplica:
    """One replica: a kvgen engine and its FastAPI app, with torch threads = the CPUs Ray gave it."""

    def __init__(self, spec: ReplicaSpec):
        import torch

        from kvgen.llm import LLM
        from kvgen.server.launch import build

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(cpus)))
        llm = LLM.load(spec.model, progress=False, **spec.load_options)
        self.app, self.engine = build(llm, spec.engine, spec.server)
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.board = board(context.app_name)

    async def handle(self, call: RoutedCall) -> AsyncIterator[Message]:
        async for message in asgi_call(self.app, call):
            yield message

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Ray Serve every stats period: the block keys for the router; the metrics
        summary goes to the board on the way."""
        stats = await asyncio.to_thread(self.engine.run_locked, engine_stats)
        keys = sorted(stats.pop("keys"))
        self.board.report.remote(self.name, stats | metric_totals(self.app.state.metrics.registry))
        # Unchanged keys give an unchanged report: Ray Serve re-broadcasts replica info only on change.
        return {"keys": keys, "version": hash(tuple(keys))}

    def check_health(self) -> None:
        if not self.engine.is_running():
            raise RuntimeError("the engine thread stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _ingress_class(spec: ReplicaSpec, options: ReplicaOptions):
    app = FastAPI(title="kvgen replicas", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @serve.ingress(app)
    class Ingress:
        def __init__(self, engine_handle) -> None:
            from kvgen.llm import load_tokenizer

            self.handle, self.tokenizer = engine_handle, load_tokenizer(spec.model)
            self.board = board(serve.get_replica_context().app_name)

        @app.get("/health")
        async def health(self) -> JSONResponse:
            reports = await self.board.read.remote()
            up = sum(time.time() - r.get("reported_at", 0) <= 10 for r in reports.values())
            return JSONResponse({"status": "ok", "model": spec.server.model_name, "replicas_up": up})

        @app.get("/metrics")
        async def metrics(self) -> Response:
            text = render(await self.board.read.remote(), time.time())
            return Response(text, media_type="text/plain; version=0.0.4")

        @app.api_route("/{path:path}", methods=_FORWARDED_METHODS)
        async def forward(self, path: str, request: Request) -> Response:
            raw = await read_body(request, spec.server.limits)
            keys: tuple[int, ...] = ()
            if request.method == "POST" and options.router == "prefix":
                keys = await asyncio.to_thread(request_keys, self.tokenizer, spec.engine.block_size, spec.server,
                                               request.url.path, raw, request.headers.get("authorization"))  # fmt: skip
            call = RoutedCall(request.method, request.url.path, request.url.query.encode(),
                              tuple(request.headers.raw), raw, keys)  # fmt: skip
            return await relay(self.handle, call, options.retries)

    return Ingress


def build_application(spec: ReplicaSpec, options: ReplicaOptions):
    """The bound Ray Serve application: `serve.run(build_application(...))`."""
    router = RequestRouterConfig(
        request_routing_stats_period_s=options.stats_period_s, request_routing_stats_timeout_s=30.0,
        **({"request_router_class": PREFIX_ROUTER, "request_router_kwargs": {"imbalance": options.imbalance}}
           if options.router == "prefix" else {}),
    )  # fmt: skip
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT, request_router_config=router,
                              **options.deployment_options())  # fmt: skip
    ingress = serve.deployment(_ingress_class(spec, options), name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)  # fmt: skip
    return ingress.bind(engine.bind(spec))
