"""Mamba-2 against transformers' Mamba2ForCausalLM (its torch path) on the same weights, and its state cache.

No Mamba-2 checkpoint installs offline: this is a small random-weight model that transformers itself
builds and saves (tests/support/tiny_hf.py), the only evidence for this family. Its chunks are 16
positions, so every prompt here spans several; zeroing D or dropping the gate moves these logits by
more than 2, the norm over one group instead of two by 0.6 (checked once, by hand), against a
tolerance of 1e-3.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from kvgen import LLM, CacheConfig, SamplingParams
from kvgen.errors import ModelLoadError
from kvgen.loading.mamba2 import mamba2_config, name_mamba2_weights
from kvgen.models import mamba2 as mamba2_module
from kvgen.models.recurrent import capture_points
from kvgen.speculative.config import SpeculativeConfig
from tests.support.models import PROMPTS, model_path
from tests.support.recurrent import (assert_prefill_is_chunk_invariant, assert_batched_rows_equal_each_row_alone, assert_c_rows_equal_each_row_alone,
                                     assert_c_step_follows_torch, assert_session_resumes_from_a_checkpoint,
                                     random_ids)  # fmt: skip
from tests.support.tiny_gguf import write_mamba_gguf
from tests.support.tiny_hf import save_tiny_mamba2, tokenizer_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LLM]:
    folder = tmp_path_factory.mktemp("mamba2")
    model = save_tiny_mamba2(folder, tokenizer_folder(tmp_path_factory.mktemp("tokenizer")))
    return model, LLM.load(folder, progress=False, weights="fp32")


def test_prefill_and_decode_logits_match(mamba2: tuple[Any, LLM]) -> None:
    """Every position of a 5-chunk prefill (its scan also split at checkpoints every 24 tokens) and
    8 decode steps against transformers' full forward over the same tokens."""
    model, llm = mamba2
    prompt, more = random_ids(75, 1), random_ids(8, 2)
    with torch.inference_mode():
        cache = llm.model.new_state_cache(checkpoint_every=24)
        actual_prefill = llm.model(torch.tensor([prompt]), cache, logits_to_keep=len(prompt))[0]
        actual_steps = torch.stack([llm.model(torch.tensor([[t]]), cache)[0, -1] for t in more])
        expected = model(torch.tensor([prompt + more])).logits[0]  # [S, V]
    assert cache.checkpoints[:4] == [0, 24, 48, 72]
    assert (actual_prefill - expected[: len(prompt)]).abs().max().item() < TOLERANCE
    assert (actual_steps - expected[len(prompt) :]).abs().max().item() < TOLERANCE


def test_c_scan_follows_the_chunked_torch_scan(mamba2: tuple[Any, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill's scan runs in C one position at a time, as the decode step takes it
    (kernels/mamba_step.c's kvgen_ssd_scan); without a C compiler, the chunked SSD form in torch
    (models/ssd.py). Both give the same logits at every position, checkpoint states and final
    states, up to the order of float sums."""
    _, llm = mamba2
    prompt = random_ids(75, 30)

    def prefill() -> tuple[torch.Tensor, dict, list]:
        cache = llm.model.new_state_cache(checkpoint_every=24)
        logits = llm.model(torch.tensor([prompt]), cache, logits_to_keep=len(prompt))[0]
        return logits, cache.take_checkpoints(), [cache.recurrent_state(layer) for layer in range(llm.config.num_layers)]

    with torch.inference_mode():
        c_logits, c_checkpoints, c_states = prefill()
        with monkeypatch.context() as patch:
            patch.setattr(mamba2_module, "load", lambda: None)
            torch_logits, torch_checkpoints, torch_states = prefill()
    assert (c_logits - torch_logits).abs().max().item() < 1e-5  # measured 6e-7 (logits up to 1.8)
    assert sorted(c_checkpoints) == sorted(torch_checkpoints) == [24, 48, 72]
    for length in c_checkpoints:
        for (c_conv, c_ssm), (t_conv, t_ssm) in zip(c_checkpoints[length], torch_checkpoints[length]):
            assert (c_conv - t_conv).abs().max().item() < 1e-5
            assert (c_ssm - t_ssm).abs().max().item() < 1e-6  # measured 7e-9 (states up to 0.06)
    assert max((c - t).abs().max().item() for c, t in zip(c_states, torch_states)) < 1e-6


def test_greedy_tokens_match_transformers_generate(mamba2: tuple[Any, LLM]) -> None:
    model, llm = mamba2
    for prompt in PROMPTS[:2]:
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            reference = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert llm.generate(ids, SamplingParams(max_new_tokens=32, ignore_eos=True)).token_ids == reference[0, len(ids) :].tolist()


def test_batched_rows_equal_each_row_alone(mamba2: tuple[Any, LLM]) -> None:
    """Ragged rows with histories of different lengths (one empty) in one pass, each capturing its
    own checkpoints: the same logits, states and checkpoints as each row run alone."""
    histories, news = [random_ids(40, 8), [], random_ids(5, 9)], [random_ids(21, 10), random_ids(3, 11), [42]]
    assert_batched_rows_equal_each_row_alone(mamba2[1], histories, news, state_tolerance=1e-5)


def test_session_resumes_from_a_checkpoint_of_the_shared_prefix(mamba2: tuple[Any, LLM]) -> None:
    _, llm = mamba2
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert_session_resumes_from_a_checkpoint(llm, params, random_ids(150, 3), random_ids(20, 4), random_ids(30, 5))


def test_a_long_prefill_holds_only_the_checkpoints_it_keeps(mamba2: tuple[Any, LLM]) -> None:
    _, llm = mamba2
    cache = llm.model.new_state_cache(checkpoint_every=16, max_checkpoints=2)
    assert capture_points(cache, 300) == [271, 287, 299]  # not the 18 multiples of 16 the commit would drop
    with torch.inference_mode():
        llm.model(torch.tensor([random_ids(300, 6)]), cache)
    assert cache.checkpoints == [0, 272, 288] and llm.model.new_state_cache().max_checkpoints == 32


def test_paths_mamba2_does_not_run_refuse_clearly(mamba2: tuple[Any, LLM]) -> None:
    _, llm = mamba2
    llm.generator.cache_config = CacheConfig(kind="paged")
    try:
        with pytest.raises(ValueError, match="does not apply to mamba2 models"):
            llm.generate("hello", SamplingParams(max_new_tokens=2))
    finally:
        llm.generator.cache_config = CacheConfig()
    with pytest.raises(ValueError, match="speculative method 'self' reads the target's KV cache"):  # lookup runs: tests/speculative
        llm.generate("hello", SamplingParams(max_new_tokens=2), speculative=SpeculativeConfig(method="self"))


def test_gguf_loads_the_same_model(mamba2: tuple[Any, LLM], tmp_path: Path) -> None:
    """An all-F32 `mamba2` file as llama.cpp's converter writes it (A and D as [H, 1], the norm as
    [groups, I / groups], dt_bias as ssm_dt.bias, no chunk size): the same config, transformers' logits."""
    model, llm = mamba2
    from_gguf = LLM.load(write_mamba_gguf(tmp_path / "model.gguf", model, model_path("smollm2")), progress=False, weights="fp32")
    assert math.isclose(from_gguf.config.rms_norm_eps, llm.config.rms_norm_eps, rel_tol=1e-6)
    same = {"rms_norm_eps": llm.config.rms_norm_eps, "chunk_size": llm.config.chunk_size}
    assert dataclasses.replace(from_gguf.config, **same) == llm.config
    prompt = random_ids(40, 20)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
        actual = from_gguf.model(torch.tensor([prompt]), from_gguf.generator.new_cache(0), logits_to_keep=len(prompt))[0]
    assert (actual - expected).abs().max().item() < TOLERANCE


def test_quantized_weights_read_the_files_blocks_and_follow_fp32(mamba2: tuple[Any, LLM], tmp_path: Path) -> None:
    """A Q8_0 file's in_proj / out_proj keep their blocks (dequantized, the fp32 load's weights
    exactly); int8 weights with int8 activations stay near the fp32 model."""
    model, llm = mamba2
    path = write_mamba_gguf(tmp_path / "model-q8_0.gguf", model, model_path("smollm2"), gguf.GGMLQuantizationType.Q8_0)
    exact, quantized = LLM.load(path, progress=False, weights="fp32"), LLM.load(path, progress=False, weights="int8")
    for ours, reference in zip(quantized.model.layers, exact.model.layers):
        for part in ("in_proj", "out_proj"):
            assert torch.equal(getattr(ours.mixer, part).dequantized(), getattr(reference.mixer, part).weight)
    int8 = LLM.load(llm.path, progress=False, weights="int8")
    prompt = random_ids(60, 21)
    with torch.inference_mode():
        actual = int8.model(torch.tensor([prompt]), int8.generator.new_cache(0), logits_to_keep=len(prompt))[0]
        expected = llm.model(torch.tensor([prompt]), llm.generator.new_cache(0), logits_to_keep=len(prompt))[0]
    assert (actual - expected).abs().max().item() < 0.1
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.9


def test_c_decode_step_follows_the_torch_step(mamba2: tuple[Any, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized projections decode in one C call per token (kernels/mamba_step.c's
    kvgen_mamba2_step_from): the torch step (the chunked scan for one position) over the same int8
    linears gives the same logits up to the order of float sums and the same greedy tokens."""
    _, llm = mamba2
    assert_c_step_follows_torch(LLM.load(llm.path, progress=False, weights="int8"), random_ids(20, 22), random_ids(24, 23), monkeypatch)


def test_prefill_gives_the_same_bits_however_the_prompt_is_split(mamba2: tuple[Any, LLM]) -> None:
    """int8 projections: the scan runs in C with its steps' softplus there too (torch's rounds an
    element by where it falls in the call's vectors), the rest is row-invariant: a prompt's logits
    do not depend on how it is split."""
    _, llm = mamba2
    int8 = LLM.load(llm.path, progress=False, weights="int8")
    assert_prefill_is_chunk_invariant(int8, random_ids(70, 31), [[66, 4], [31, 39], [1, 69], [17, 17, 36]])


def test_c_decode_rows_equal_each_row_alone(mamba2: tuple[Any, LLM]) -> None:
    """The engine's one-token rows of several sequences run in one C call, each weight read once
    for them all; each row's logits and states are the bits it gets alone."""
    _, llm = mamba2
    int8 = LLM.load(llm.path, progress=False, weights="int8")
    assert_c_rows_equal_each_row_alone(int8, [random_ids(30, 24), random_ids(7, 25), random_ids(65, 26)], [11, 12, 13])



def test_config_settings_transformers_does_not_run_are_refused(mamba2: tuple[Any, LLM]) -> None:
    _, llm = mamba2
    raw = json.loads((llm.path / "config.json").read_text())
    assert mamba2_config(raw).chunk_size == 16
    assert mamba2_config({**raw, "time_step_limit": [0.0, math.inf], "norm_before_gate": True}).n_groups == 2  # Codestral's
    for change, named in [({"time_step_limit": [0.001, 0.1]}, "time_step_limit"), ({"rms_norm": False}, "rms_norm"),
                          ({"hidden_act": "gelu"}, "hidden_act"), ({"expand": 3}, "num_heads x head_dim")]:  # fmt: skip
        with pytest.raises(ModelLoadError, match=named):
            mamba2_config({**raw, **change})
    tensors = {"model.backbone.embedding.weight": torch.zeros(1), "model.backbone.norm_f.weight": torch.zeros(1),
               "lm_head.weight": torch.zeros(1)}  # fmt: skip
    name_mamba2_weights(tensors)  # Mamba-Codestral's and mamba_ssm's names
    assert sorted(tensors) == ["backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"]
