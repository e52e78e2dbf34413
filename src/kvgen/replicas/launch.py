"""`kvgen serve --replicas N` (imports Ray): join or start a Ray cluster, start Ray Serve's HTTP proxy
on --host/--port, deploy the application (replicas/deployment.py) and serve until interrupted."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import ray
from ray import serve

import kvgen
from kvgen.replicas.board import board
from kvgen.replicas.deployment import build_application
from kvgen.replicas.options import ReplicaOptions, ReplicaSpec

APP_NAME = "kvgen"


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` ('auto': the one `ray start` runs here), or start a local one.
    Workers find kvgen where this process does, when it runs from a source tree."""
    if ray.is_initialized():
        return
    source = str(Path(kvgen.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address=address, num_cpus=None if address else num_cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)  # fmt: skip


def deploy(spec: ReplicaSpec, options: ReplicaOptions, host: str, port: int, app_name: str = APP_NAME) -> str:
    """Start Serve's proxy (once per cluster) and (re)deploy the application; its base URL."""
    serve.start(http_options={"host": host, "port": port})
    ray.get(board(app_name).reset.remote())
    serve.run(build_application(spec, options), name=app_name, route_prefix="/")
    return f"http://{host}:{port}"


def serve_replicas(spec: ReplicaSpec, options: ReplicaOptions, host: str, port: int, address: str | None) -> int:
    connect(address)
    url = deploy(spec, options, host, port)
    count = f"{options.replicas} replicas" + (" (autoscaling)" if options.autoscaling else "")
    print(f"kvgen: serving {spec.server.model_name!r} on {url}/v1 with {count}, {options.router} routing", file=sys.stderr)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
    return 0
