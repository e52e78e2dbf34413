"""TII's Falcon-H1 (HF `falcon_h1`: Falcon-H1 0.5B to 34B; llama.cpp's `falcon-h1`): config.json or
GGUF metadata -> HybridConfig, and the checkpoint's names and µP multipliers -> the plain weights
models/granite_hybrid.py reads.

Every layer is "parallel": one RMSNorm (`input_layernorm`), then grouped-query attention with RoPE
and a Mamba-2 mixer (`mamba.*`, `mamba_d_ssm` channels; its gated RMSNorm only where
`mamba_rms_norm`, otherwise y SiLU(z) straight to out_proj) on that same input, both added to the
residual; then a SwiGLU (`feed_forward`) after `pre_ff_layernorm`; `final_layernorm` last.

Falcon-H1 trains with µP multipliers on nearly every projection. They are linear, so kvgen folds
them into the weights once at load, as llama.cpp's converter folds them into a GGUF: attention's
input multiplier into q, k and v (k also by key_multiplier), its output multiplier into o_proj,
ssm_in_multiplier and the five ssm_multipliers into in_proj's rows (z, x, B, C, dt), ssm_out into
out_proj, the MLP's two into gate_proj and down_proj. The embedding and head multipliers stay
scalars (a tied head shares the embedding's matrix): embedding_multiplier, and logits divided by
1 / lm_head_multiplier. A bias would need its own folding: projection biases are refused.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from kvgen.config import HybridConfig, Mamba2Config, ModelConfig
from kvgen.errors import ModelLoadError, UnsupportedModelError
from kvgen.kernels.formats import QuantizedWeight
from kvgen.loading.granite_hybrid import mamba2_config_from_gguf
from kvgen.loading.mamba2 import refuse_unhonoured

_NAMES = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r"^(model\.layers\.\d+)\.pre_ff_layernorm\.", r"\1.post_attention_layernorm."),
    (r"^(model\.layers\.\d+)\.feed_forward\.", r"\1.mlp."),
    (r"^model\.final_layernorm\.", "model.norm."),
))  # fmt: skip


def _refuse_unhonoured(raw: dict[str, Any]) -> None:
    refuse_unhonoured(raw)  # Mamba-2's time_step_limit and activation
    for key in ("attention_bias", "projectors_bias", "mamba_proj_bias", "mlp_bias"):
        if raw.get(key):
            raise UnsupportedModelError(f"{key}: true is not supported for falcon_h1: kvgen folds the µP multipliers into the "
                                        "weights, and runs its projections without biases")  # fmt: skip
    if raw.get("mamba_rms_norm") and raw.get("mamba_norm_before_gate", True):
        raise UnsupportedModelError("mamba_rms_norm with mamba_norm_before_gate: true (the norm before the SiLU gate) is not "
                                    "supported; kvgen's Mamba-2 norm takes the gated output (mamba_norm_before_gate: false)")  # fmt: skip


def falcon_h1_config(raw: dict[str, Any], decoder_config: Callable[[dict[str, Any]], ModelConfig]) -> HybridConfig:
    """`decoder_config`: hf.py's reader of a decoder's config.json, which reads the attention and the
    SwiGLU as Llama's (RoPE from rope_parameters or rope_theta)."""
    _refuse_unhonoured(raw)
    try:
        hidden, layers, heads = int(raw["hidden_size"]), int(raw["num_hidden_layers"]), int(raw["mamba_n_heads"])
        inner = int(raw.get("mamba_d_ssm") or int(raw.get("mamba_expand", 2)) * hidden)
        head_dim = raw.get("mamba_d_head", "auto")
        mamba = Mamba2Config(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_heads=heads,
            head_dim=inner // heads if head_dim in (None, "auto") else int(head_dim), n_groups=int(raw.get("mamba_n_groups", 1)),
            state_size=int(raw["mamba_d_state"]), conv_kernel=int(raw.get("mamba_d_conv", 4)), num_layers=layers,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), chunk_size=int(raw.get("mamba_chunk_size", 256)),
            use_conv_bias=bool(raw.get("mamba_conv_bias", True)), gated_norm=bool(raw.get("mamba_rms_norm", False)),
        )  # fmt: skip
        decoder = dataclasses.replace(decoder_config({**raw, "model_type": "llama"}),
                                      embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                                      logits_scaling=1.0 / float(raw.get("lm_head_multiplier", 1.0)))  # fmt: skip
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error}; it is not a complete falcon_h1 config") from error
    if mamba.intermediate_size != inner:
        raise ModelLoadError(f"config.json's mamba_n_heads x mamba_d_head ({mamba.intermediate_size}) must equal mamba_d_ssm "
                             f"({inner}); it is not a consistent falcon_h1 config")  # fmt: skip
    return HybridConfig(decoder, mamba, ("parallel",) * layers, rope=True, architecture="falcon_h1",
                        folded_multipliers=_multipliers(raw))


def _multipliers(raw: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """config.json's µP multipliers on the projections, by name (1 where it gives none)."""
    z, x, b, c, dt = (float(m) for m in raw.get("ssm_multipliers") or (1.0,) * 5)
    gate, down = (float(m) for m in raw.get("mlp_multipliers") or (1.0, 1.0))
    scalars = {key: float(raw.get(f"{key}_multiplier", 1.0)) for key in ("attention_in", "key", "attention_out", "ssm_in", "ssm_out")}
    return tuple(scalars.items()) + (("ssm_z", z), ("ssm_x", x), ("ssm_b", b), ("ssm_c", c), ("ssm_dt", dt),
                                     ("mlp_gate", gate), ("mlp_down", down))  # fmt: skip


def projection_row_scales(config: HybridConfig) -> dict[str, torch.Tensor]:
    """Per projection (q, k, v, o, gate, down, mixer_in, mixer_out), the factor on each of its
    output rows that folds config.folded_multipliers into it: attention's input multiplier on q, k
    and v (k also by key_multiplier), its output multiplier on o, the MLP's two on gate and down,
    ssm_in times the z / x / B / C / dt part's multiplier on in_proj's rows, ssm_out on out_proj.
    An input multiplier folds into the rows as well: W (m x) = (m W) x."""
    m, mamba = dict(config.folded_multipliers), config.mixer
    assert isinstance(mamba, Mamba2Config)
    inner, grouped = mamba.intermediate_size, mamba.n_groups * mamba.state_size
    parts = [(m["ssm_z"], inner), (m["ssm_x"], inner), (m["ssm_b"], grouped), (m["ssm_c"], grouped), (m["ssm_dt"], mamba.num_heads)]
    scalars = {"q": m["attention_in"], "k": m["attention_in"] * m["key"], "v": m["attention_in"], "o": m["attention_out"],
               "gate": m["mlp_gate"], "down": m["mlp_down"], "mixer_out": m["ssm_out"]}  # fmt: skip
    scales = {proj: torch.tensor(value) for proj, value in scalars.items()}
    scales["mixer_in"] = torch.cat([torch.full((width,), value) for value, width in parts]) * m["ssm_in"]
    return scales


def falcon_h1_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str], get: Callable[[str], Any],
                               decoder_config: Callable[[dict[str, Any], set[str]], ModelConfig]) -> HybridConfig:  # fmt: skip
    """llama.cpp's `falcon-h1` keys (`get`: config_from_gguf's reader of them): every layer attention
    and Mamba-2 side by side, the multipliers already in the weights; the attention and SwiGLU read
    as a `llama` file by `decoder_config` (gguf.py's config_from_gguf), the mixer by the ssm.* keys,
    its gated norm where the file has ssm_norm tensors."""
    arch = "falcon-h1"
    renamed = {(f"llama.{k[len(arch) + 1 :]}" if k.startswith(f"{arch}.") else k): v for k, v in metadata.items()}
    decoder = decoder_config({**renamed, "general.architecture": "llama"}, tensor_names)
    layer_types = ("parallel",) * decoder.num_layers
    mamba = mamba2_config_from_gguf(get, decoder, layer_types, tensor_names)
    mamba = dataclasses.replace(mamba, gated_norm=any(n.endswith("ssm_norm.weight") for n in tensor_names))
    return HybridConfig(decoder, mamba, layer_types, rope=True, architecture="falcon_h1")


_WEIGHTS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "down": "mlp.down_proj", "mixer_in": "mamba.in_proj", "mixer_out": "mamba.out_proj"}  # fmt: skip


def name_falcon_h1_weights(tensors: dict[str, torch.Tensor | QuantizedWeight], config: HybridConfig) -> None:
    """In place: Falcon-H1's names -> the hybrid's (pre_ff_layernorm, feed_forward, final_layernorm),
    and its µP multipliers folded into the projections (float weights, before any quantization)."""
    for name in list(tensors):
        for pattern, replacement in _NAMES:
            if pattern.match(name):
                tensors[pattern.sub(replacement, name)] = tensors.pop(name)
                break
    scales = projection_row_scales(config)
    for layer in range(config.num_layers):
        for proj, scale in scales.items():
            if scale.dim() or scale.item() != 1.0:
                name = f"model.layers.{layer}.{_WEIGHTS[proj]}.weight"
                tensors[name] = _float(tensors, name) * (scale[:, None] if scale.dim() else scale)


def _float(tensors: dict[str, torch.Tensor | QuantizedWeight], name: str) -> torch.Tensor:
    tensor = tensors.get(name)
    if not isinstance(tensor, torch.Tensor):
        raise ModelLoadError(f"{name} is missing or not a float tensor; the checkpoint is not a complete falcon_h1 model")
    return tensor
