"""OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn)."""

from kvgen.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
