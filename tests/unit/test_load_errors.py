"""Bad model input gives one clear error that names the problem and what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvgen import LLM, ModelLoadError, PromptTooLongError, UnsupportedModelError
from kvgen.loading.gguf_file import GGUFFile
from tests.support.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", weight_type=gguf.GGMLQuantizationType.Q8_0)


def copy_bytes(source: Path, target: Path, length: int | None = None) -> Path:
    data = source.read_bytes()
    target.write_bytes(data if length is None else data[:length])
    return target


def test_missing_path_names_the_path_and_the_choices() -> None:
    with pytest.raises(ModelLoadError, match=r"no model at '/no/such/model.gguf'.*short name"):
        LLM.load("/no/such/model.gguf", progress=False)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        LLM.load(path, progress=False)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="is empty"):
        LLM.load(path, progress=False)


@pytest.mark.parametrize("keep", [10, 200, 2000])
def test_file_truncated_inside_header(tiny_path: Path, tmp_path: Path, keep: int) -> None:
    with pytest.raises(ModelLoadError, match="truncated"):
        LLM.load(copy_bytes(tiny_path, tmp_path / "cut.gguf", keep), progress=False)


@pytest.mark.parametrize("into", [-4, 3])  # inside the last token's length, inside its text
def test_file_truncated_inside_the_vocabulary(tiny_path: Path, tmp_path: Path, into: int) -> None:
    last_token = tiny_path.read_bytes().index(b"<|endoftext|>")
    with pytest.raises(ModelLoadError, match=r"ends at byte \d+ inside its header.*truncated"):
        LLM.load(copy_bytes(tiny_path, tmp_path / "cut.gguf", last_token + into), progress=False)


def test_vocabulary_that_is_not_utf8(tiny_path: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_path.read_bytes())
    data[data.index(b"<|endoftext|>")] = 0xFF
    (path := tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="holds a string that is not UTF-8: the file is corrupted"):
        LLM.load(path, progress=False)


def test_file_truncated_inside_tensor_data(tiny_path: Path, tmp_path: Path) -> None:
    size = tiny_path.stat().st_size
    with pytest.raises(ModelLoadError, match=r"truncated: tensor '.*' needs bytes up to \d+ but the file has"):
        LLM.load(copy_bytes(tiny_path, tmp_path / "cut.gguf", size - 100), progress=False)


def test_corrupted_scales_are_caught_not_turned_into_garbage(tiny_path: Path, tmp_path: Path) -> None:
    path = copy_bytes(tiny_path, tmp_path / "bad.gguf")
    info = GGUFFile(path).tensors["blk.0.attn_q.weight"]
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + 2] = np.array([np.nan], dtype=np.float16).tobytes()  # first Q8_0 block's scale
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'blk.0.attn_q.weight'.*NaN or infinite.*corrupted"):
        LLM.load(path, progress=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "bert.gguf", architecture="bert")
    with pytest.raises(UnsupportedModelError, match=r"architecture 'bert' is not supported; kvgen runs llama"):
        LLM.load(path, progress=False)


def test_unsupported_quantization_type(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tq2_0.gguf", weight_type=gguf.GGMLQuantizationType.TQ2_0, hidden=256)
    with pytest.raises(UnsupportedModelError, match=r"uses quantization TQ2_0.*supported: F32.*llama-quantize"):
        LLM.load(path, progress=False)


def test_unsupported_tokenizer_is_the_error_even_where_the_tensors_fail_too(tmp_path: Path) -> None:
    # The vocabulary is read before the tensors: its error is the one reported.
    unusable = write_tiny_gguf(tmp_path / "wordpiece.gguf", tokenizer_model="bert")
    with pytest.raises(UnsupportedModelError, match=r"tokenizer.ggml.model is 'bert'.*supported: gpt2, llama"):
        LLM.load(unusable, progress=False)
    both = write_tiny_gguf(tmp_path / "both.gguf", tokenizer_model="bert", weight_type=gguf.GGMLQuantizationType.TQ2_0, hidden=256)
    with pytest.raises(UnsupportedModelError, match=r"tokenizer.ggml.model is 'bert'"):
        LLM.load(both, progress=False)


def test_prompt_longer_than_context(tiny_path: Path) -> None:
    llm = LLM.load(tiny_path, progress=False)  # context_length 128
    with pytest.raises(PromptTooLongError, match=r"the prompt has 200 tokens but the context holds 128.*at most 127"):
        llm.generate("x" * 200)
    assert llm.generate("x" * 100).token_ids  # a prompt that fits still runs


def test_hf_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM.load(tmp_path, progress=False)


def test_hf_folder_with_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'bert' is not supported"):
        LLM.load(tmp_path, progress=False)


def test_hf_folder_with_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM.load(tmp_path, progress=False)


def test_folder_with_single_gguf_loads_it(tiny_path: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_path, tmp_path / "only.gguf")
    assert LLM.load(tmp_path, progress=False).path.name == "only.gguf"


def test_hf_folder_with_quantized_weights_is_refused(tmp_path: Path) -> None:
    """FP8, AWQ, GPTQ... checkpoints hold codes whose scales kvgen would not apply: refused by name."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(UnsupportedModelError, match="quantized with 'fp8'.*bf16/fp16 release or a GGUF"):
        LLM.load(tmp_path, progress=False)


@pytest.mark.parametrize("model_type", ["llama", "bamba"])
def test_hf_config_with_mlp_biases_is_refused(model_type: str, tmp_path: Path) -> None:
    """Biases on the MLP's projections would be left unread: refused by name."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "mlp_bias": True}))
    with pytest.raises(UnsupportedModelError, match=f"mlp_bias: true .* not supported for {model_type}"):
        LLM.load(tmp_path, progress=False)


_DEEPSEEK = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128,
             "kv_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 16,
             "moe_intermediate_size": 32, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2}  # fmt: skip


@pytest.mark.parametrize("raw,routing", [
    ({"model_type": "deepseek_v3"}, ("sigmoid", 4, 2)),  # noaux_tc
    ({"model_type": "deepseek_v2", "topk_method": "group_limited_greedy"}, ("softmax", 4, 2)),
    ({"model_type": "deepseek_v2", "topk_method": "greedy"}, ("softmax", 1, 1)),  # n_group unused
])  # fmt: skip
def test_deepseek_expert_routing_from_config(raw: dict, routing: tuple) -> None:
    from kvgen.loading.hf import config_from_hf

    config = config_from_hf({**_DEEPSEEK, **raw})
    assert (config.expert_scoring, config.expert_groups, config.expert_groups_used) == routing


@pytest.mark.parametrize("raw,message", [
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, "topk_method='noaux_tc', scoring_func='softmax' is not supported"),
    ({"model_type": "deepseek_v3", "scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"model_type": "deepseek_v3", "rope_interleave": False}, "rope_interleave=false is not supported"),
])  # fmt: skip
def test_deepseek_routing_or_rope_kvgen_cannot_run_is_refused(raw: dict, message: str) -> None:
    from kvgen.loading.hf import config_from_hf

    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf({**_DEEPSEEK, **raw})
