"""Model families. `build_model` picks the class for a checkpoint's architecture."""

from __future__ import annotations

from kvgen.loading.checkpoint import Checkpoint
from kvgen.models.base import DecoderLM
from kvgen.models.deepseek import DeepseekModel
from kvgen.models.gemma2 import Gemma2Model
from kvgen.models.gemma3 import Gemma3Model
from kvgen.models.granite_hybrid import GraniteHybridModel
from kvgen.models.llama import LlamaModel
from kvgen.models.mamba import MambaModel
from kvgen.models.mamba2 import Mamba2Model
from kvgen.models.olmo2 import Olmo2Model
from kvgen.models.phi3 import Phi3Model
from kvgen.models.qwen3 import Qwen3Model
from kvgen.models.recurrent import RecurrentLM
from kvgen.models.t5 import T5Model
from kvgen.models.weights import WeightSource

FAMILIES: dict[str, type[DecoderLM] | type[RecurrentLM] | type[T5Model]] = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": Qwen3Model,
    "qwen2_moe": LlamaModel,  # Qwen2 blocks (QKV biases) with routed and shared experts
    "qwen3_moe": Qwen3Model,
    "mixtral": LlamaModel,
    "gpt_oss": LlamaModel,  # Llama blocks: biased projections, sink logits, clamped-SwiGLU experts
    "deepseek_v2": DeepseekModel,  # latent attention, routed and shared experts
    "olmo2": Olmo2Model,  # blocks normed after each sublayer, QK-norm over all heads
    "olmoe": Qwen3Model,  # Qwen3's blocks (their QK-norm over all heads at once: its weights' width) with experts
    "phi3": Phi3Model,
    "gemma2": Gemma2Model,
    "gemma3": Gemma3Model,
    "mamba": MambaModel,
    "mamba2": Mamba2Model,  # heads with scalar decays, grouped B/C, chunked SSD prefill
    "granitemoehybrid": GraniteHybridModel,  # Granite 4.0-H: Mamba-2 and attention layers
    "lfm2": GraniteHybridModel,  # LFM2: gated short convolutions and attention layers, the same stack
    "nemotron_h": GraniteHybridModel,  # Nemotron-H: Mamba-2, attention and MLP layers, one sublayer each
    "falcon_h1": GraniteHybridModel,  # Falcon-H1: attention and Mamba-2 side by side in every layer
    "t5": T5Model,
}


def build_model(checkpoint: Checkpoint) -> DecoderLM | RecurrentLM | T5Model:
    model = FAMILIES[checkpoint.config.architecture](checkpoint.config, WeightSource(checkpoint.tensors))  # type: ignore[arg-type]
    model.fast_decoder()  # build the C decode path now, not inside the first timed decode step
    return model.eval()


__all__ = ["DecoderLM", "FAMILIES", "build_model"]
