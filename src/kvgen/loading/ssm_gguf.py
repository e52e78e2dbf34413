"""GGUF files of state-space models (llama.cpp's `mamba`: Mamba and Falcon-Mamba; `mamba2`:
Mamba-2, Mamba-Codestral): the config from their `{arch}.ssm.*` keys and their tensors under the
Hugging Face names models/mamba.py and models/mamba2.py read.

llama.cpp's converter writes A itself (-exp(A_log)) as `ssm_a`, the conv weight as [C, K], and for
Mamba-2 A and D as [H, 1], the norm as [groups, I / groups] and dt_bias as `ssm_dt.bias`; the models
take A as it is and reshape the rest, so no value is recomputed here.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from kvgen.config import Mamba2Config, MambaConfig

SSM_ARCHITECTURES = ("mamba", "mamba2")

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
_MAMBA2_NAMES = {("ssm_norm", "weight"): "mixer.norm.weight", ("ssm_dt", "bias"): "mixer.dt_bias"}  # its gated norm; dt_bias alone
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


def mamba2_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], get: Callable[[str], Any]) -> Mamba2Config:
    """llama.cpp's `mamba2` keys: heads = ssm.time_step_rank (one dt per head), head_dim = inner / heads.
    The file has no chunk size: it only bounds the prefill scan's segments."""
    inner, heads = int(get("ssm.inner_size")), int(get("ssm.time_step_rank"))
    return Mamba2Config(
        vocab_size=int(metadata.get("mamba2.vocab_size", len(metadata.get("tokenizer.ggml.tokens", [])))),
        hidden_size=int(get("embedding_length")), num_heads=heads, head_dim=inner // heads, n_groups=int(get("ssm.group_count")),
        state_size=int(get("ssm.state_size")), conv_kernel=int(get("ssm.conv_kernel")), num_layers=int(get("block_count")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")), tie_word_embeddings="output.weight" not in tensor_names,
        use_conv_bias="blk.0.ssm_conv1d.bias" in tensor_names, use_bias="blk.0.ssm_in.bias" in tensor_names,
    )  # fmt: skip


def mamba_hf_name(gguf_name: str, arch: str = "mamba") -> str | None:
    """The Hugging Face name models/mamba.py (models/mamba2.py for `mamba2`) reads for a GGUF tensor
    (None: not one it uses)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _LAYER_PATTERN.match(gguf_name)
    if not match:
        return None
    layer, part, suffix = match.groups()
    if arch == "mamba2" and (part, suffix) in _MAMBA2_NAMES:
        return f"backbone.layers.{layer}.{_MAMBA2_NAMES[part, suffix]}"
    if part in _PARAMETERS and suffix in (None, "weight"):
        return f"backbone.layers.{layer}.{_PARAMETERS[part]}"
    return f"backbone.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}" if part in _LAYER_NAMES and suffix else None
