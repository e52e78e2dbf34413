"""GGUF files of state-space models (llama.cpp's `mamba`: Mamba and Falcon-Mamba): the config from
their `{arch}.ssm.*` keys and their tensors under the Hugging Face names models/mamba.py reads.

llama.cpp's converter writes A itself (-exp(A_log)) as `ssm_a` and the conv weight as [I, K]; the
model takes A as it is and reshapes the conv weight, so no value is recomputed here.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from kvgen.config import MambaConfig

SSM_ARCHITECTURES = ("mamba",)

_GLOBAL_NAMES = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "norm",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_x": "mixer.x_proj",
    "ssm_dt": "mixer.dt_proj",
    "ssm_out": "mixer.out_proj",
}
_PARAMETERS = {"ssm_a": "mixer.A", "ssm_d": "mixer.D"}  # tensors of their own: no .weight in either name
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")


def mamba_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], get: Callable[[str], Any]) -> MambaConfig:
    """`get(key)`: the file's `mamba.{key}`, refusing a missing one. Falcon-Mamba's files say
    `ssm.dt_b_c_rms`; llama.cpp then norms dt, B and C with the layers' RMS epsilon, and so does kvgen."""
    vocab = len(metadata.get("tokenizer.ggml.tokens", []))
    eps = float(get("attention.layer_norm_rms_epsilon"))
    return MambaConfig(
        vocab_size=int(metadata.get("mamba.vocab_size", vocab)),
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("ssm.inner_size")),
        state_size=int(get("ssm.state_size")),
        conv_kernel=int(get("ssm.conv_kernel")),
        time_step_rank=int(get("ssm.time_step_rank")),
        num_layers=int(get("block_count")),
        rms_norm_eps=eps,
        tie_word_embeddings="output.weight" not in tensor_names,
        use_conv_bias="blk.0.ssm_conv1d.bias" in tensor_names,
        use_bias="blk.0.ssm_in.bias" in tensor_names,
        dt_b_c_rms_eps=eps if metadata.get("mamba.ssm.dt_b_c_rms", False) else None,
    )


def mamba_hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name models/mamba.py reads for a GGUF tensor (None: not one it uses)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _LAYER_PATTERN.match(gguf_name)
    if not match:
        return None
    layer, part, suffix = match.groups()
    if part in _PARAMETERS and suffix in (None, "weight"):
        return f"backbone.layers.{layer}.{_PARAMETERS[part]}"
    return f"backbone.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}" if part in _LAYER_NAMES and suffix else None
