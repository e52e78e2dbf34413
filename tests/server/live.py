"""A live kvgen server on a free localhost port, in a background thread (real uvicorn, real engine)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from kvgen.engine.config import EngineConfig
from kvgen.server.app import ServerConfig
from kvgen.server.launch import build

MODEL_NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app, engine, port: int):
        self.app, self.engine, self.port = app, engine, port
        self.base_url = f"http://127.0.0.1:{port}"

    def wait_idle(self, timeout: float = 60) -> None:
        """Until the engine holds no request (cancellations travel through the engine thread)."""
        deadline = time.monotonic() + timeout
        while self.engine.run_locked(lambda e: e.has_unfinished()):
            assert time.monotonic() < deadline, "the engine still holds requests"
            time.sleep(0.05)

    def assert_no_leaks(self) -> None:
        """Invariants hold, nothing runs, and every block in use belongs to the prefix index."""
        self.wait_idle()

        def check(engine) -> tuple[int, int]:
            engine.check_invariants()
            prefix = engine.scheduler.prefix
            return engine.scheduler.num_blocks_in_use(), prefix.num_held if prefix else 0

        in_use, indexed = self.engine.run_locked(check)
        assert in_use == indexed, f"{in_use} blocks in use but only {indexed} held by the prefix index"


@contextmanager
def live_server(llm, engine_config: EngineConfig | None = None, **server_options) -> Iterator[LiveServer]:
    app, engine = build(llm, engine_config or EngineConfig(num_blocks=256), ServerConfig(MODEL_NAME, **server_options))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield LiveServer(app, engine, port)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
