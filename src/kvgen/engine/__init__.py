"""Continuous batching: many requests, one batched forward per step over a shared paged cache."""

from kvgen.engine.config import EngineConfig
from kvgen.engine.engine import LLMEngine
from kvgen.engine.request import Request, RequestOutput, RequestStatus

__all__ = ["EngineConfig", "LLMEngine", "Request", "RequestOutput", "RequestStatus"]
