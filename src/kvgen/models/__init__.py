"""Model families. `build_model` picks the class for a checkpoint's architecture."""

from __future__ import annotations

from kvgen.loading.checkpoint import Checkpoint
from kvgen.models.base import DecoderLM
from kvgen.models.gemma3 import Gemma3Model
from kvgen.models.llama import LlamaModel
from kvgen.models.weights import WeightSource

FAMILIES: dict[str, type[DecoderLM]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "gemma3": Gemma3Model,
}


def build_model(checkpoint: Checkpoint) -> DecoderLM:
    model = FAMILIES[checkpoint.config.architecture](checkpoint.config, WeightSource(checkpoint.tensors))
    model.fast_decoder()  # build the C decode path now, not inside the first timed decode step
    return model.eval()


__all__ = ["DecoderLM", "FAMILIES", "build_model"]
