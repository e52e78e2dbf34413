"""kvgen: a language-model inference engine built around the KV cache."""

from kvgen.config import CacheConfig
from kvgen.errors import KvgenError, ModelLoadError, PromptTooLongError, UnsupportedModelError
from kvgen.generate import Chunk, Generator
from kvgen.result import GenerationResult, Usage
from kvgen.kv import CacheSpec, ContiguousCache, KVCache
from kvgen.llm import LLM, load_model
from kvgen.sampling import SamplingParams, StructuredOutput
from kvgen.session import Session
from kvgen.speculative import SpeculativeConfig

__all__ = [
    "LLM", "CacheConfig", "CacheSpec", "Chunk", "ContiguousCache", "GenerationResult", "Generator", "KVCache", "KvgenError",
    "ModelLoadError", "PromptTooLongError", "SamplingParams", "Session", "SpeculativeConfig", "StructuredOutput",
    "UnsupportedModelError", "Usage",
    "load_model",
]  # fmt: skip
__version__ = "0.1.0"
