"""OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn)."""

from kvgen.server.app import create_app
from kvgen.server.config import ServerConfig
from kvgen.server.limits import ServerLimits

__all__ = ["ServerConfig", "ServerLimits", "create_app"]
