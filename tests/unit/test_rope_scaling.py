"""RoPE scaling read from config.json and GGUF metadata, against transformers' own frequencies."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvgen.errors import UnsupportedModelError
from kvgen.loading import gguf as gguf_loading
from kvgen.loading import hf as hf_loading
from kvgen.models.rotary import inverse_frequencies

YARN_SETTINGS = {
    "qwen-defaults": {"factor": 4.0, "original_max_position_embeddings": 32768},
    "betas": {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    "untruncated": {"factor": 2.0, "original_max_position_embeddings": 8192, "truncate": False},
    "attention-factor": {"factor": 4.0, "original_max_position_embeddings": 32768, "attention_factor": 1.25},
    "deepseek-mscales": {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(YARN_SETTINGS))
def test_yarn_frequencies_and_attention_factor_equal_transformers(name: str) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "yarn", "rope_theta": 1000000.0, **YARN_SETTINGS[name]}
    config = transformers.Qwen3Config(head_dim=128, hidden_size=1024, num_attention_heads=8, rope_parameters=parameters,
                                      max_position_embeddings=int(parameters["factor"] * parameters["original_max_position_embeddings"]))  # fmt: skip
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    raw: dict[str, Any] = config.to_dict()
    scaling = hf_loading._rope_scaling(hf_loading._rope_parameters(raw), raw)
    assert scaling is not None and scaling.kind == "yarn"
    assert torch.equal(inverse_frequencies(128, 1000000.0, scaling), expected_freq)
    assert scaling.attention_factor == pytest.approx(expected_factor, rel=1e-12)


def test_gguf_yarn_keys_and_what_is_refused() -> None:
    metadata = {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0,
                "qwen3.rope.scaling.original_context_length": 32768}  # fmt: skip
    scaling = gguf_loading._rope_scaling(metadata, "qwen3")
    assert scaling is not None and (scaling.kind, scaling.factor, scaling.original_max_position) == ("yarn", 4.0, 32768)
    assert scaling.attention_factor == pytest.approx(1.0 + 0.1 * torch.log(torch.tensor(4.0)).item())
    given = gguf_loading._rope_scaling({**metadata, "qwen3.rope.scaling.yarn_attn_factor": 1.25}, "qwen3")
    assert given is not None and given.attention_factor == 1.25
    with pytest.raises(UnsupportedModelError, match="yarn_log_multiplier"):
        gguf_loading._rope_scaling({**metadata, "qwen3.rope.scaling.yarn_log_multiplier": 0.1}, "qwen3")
    with pytest.raises(Exception, match="original_context_length"):
        gguf_loading._rope_scaling({k: v for k, v in metadata.items() if "original" not in k}, "qwen3")
    with pytest.raises(UnsupportedModelError, match="'dynamic' is not supported"):
        gguf_loading._rope_scaling({**metadata, "qwen3.rope.scaling.type": "dynamic"}, "qwen3")
