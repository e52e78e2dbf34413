"""Mamba against transformers' MambaForCausalLM on the same weights, and its state cache.

No Mamba checkpoint installs offline: this is a small random-weight model that transformers itself
builds and saves (tests/support/tiny_hf.py), the only evidence for this family.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from kvgen import LLM, CacheConfig, SamplingParams
from kvgen.speculative.config import SpeculativeConfig
from kvgen.models.mamba import SCAN_CHUNK
from tests.support.models import PROMPTS, model_path
from tests.support.recurrent import (assert_batched_rows_equal_each_row_alone, assert_c_rows_equal_each_row_alone,
                                     assert_c_step_follows_torch, assert_session_resumes_from_a_checkpoint,
                                     prefill_and_steps, random_ids)  # fmt: skip
from tests.support.tiny_gguf import write_mamba_gguf
from tests.support.tiny_hf import save_tiny_mamba, tokenizer_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LLM]:
    folder = tmp_path_factory.mktemp("mamba")
    model = save_tiny_mamba(folder, tokenizer_folder(tmp_path_factory.mktemp("tokenizer")))
    return model, LLM.load(folder, progress=False, weights="fp32")


def test_prefill_and_decode_logits_match(mamba: tuple[Any, LLM]) -> None:
    """Every prefill position and 16 recurrent decode steps against transformers' full forward over
    the same tokens (its greedy generate, with its own cache, is checked below)."""
    model, llm = mamba
    prompt, more = random_ids(SCAN_CHUNK * 2 + 10, 1), random_ids(16, 2)  # prefill crosses scan chunks
    with torch.inference_mode():
        cache = llm.generator.new_cache(0)
        actual_prefill = llm.model(torch.tensor([prompt]), cache, logits_to_keep=len(prompt))[0]
        actual_steps = torch.stack([llm.model(torch.tensor([[t]]), cache)[0, -1] for t in more])
        expected = model(torch.tensor([prompt + more])).logits[0]  # [S, V]
    assert (actual_prefill - expected[: len(prompt)]).abs().max().item() < TOLERANCE
    assert (actual_steps - expected[len(prompt) :]).abs().max().item() < TOLERANCE


def test_greedy_tokens_match_on_four_prompts(mamba: tuple[Any, LLM]) -> None:
    model, llm = mamba
    for prompt in PROMPTS[:4]:
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            reference = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, pad_token_id=0)
        assert llm.generate(ids, SamplingParams(max_new_tokens=48, ignore_eos=True)).token_ids == reference[0, len(ids) :].tolist()


def test_session_resumes_from_a_checkpoint_of_the_shared_prefix(mamba: tuple[Any, LLM]) -> None:
    _, llm = mamba
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert_session_resumes_from_a_checkpoint(llm, params, random_ids(150, 3), random_ids(20, 4), random_ids(30, 5))


def test_state_memory_is_constant_in_sequence_length(mamba: tuple[Any, LLM]) -> None:
    _, llm = mamba
    sizes = {}
    with torch.inference_mode():
        for length in (128, 4096):
            cache = llm.model.new_state_cache(checkpoint_every=64, max_checkpoints=2)
            llm.model(torch.tensor([random_ids(length - 1, 6)]), cache)
            llm.model(torch.tensor([[7]]), cache)  # one decode step at this length
            assert cache.seq_len == length
            sizes[length] = cache.memory_bytes()
    snapshot = llm.model.new_state_cache().spec.bytes_per_snapshot
    assert sizes[128] == sizes[4096] == 3 * snapshot  # the live state + 2 checkpoints, at any length


def test_batched_rows_equal_each_row_alone(mamba: tuple[Any, LLM]) -> None:
    """Ragged rows with histories of different lengths (one empty) in one pass, each capturing its
    own checkpoints: the same logits, states and checkpoints as each row run alone."""
    histories, news = [random_ids(70, 8), [], random_ids(5, 9)], [random_ids(12, 10), random_ids(3, 11), [42]]
    assert_batched_rows_equal_each_row_alone(mamba[1], histories, news, state_tolerance=1e-6)


def test_paths_mamba_does_not_run_refuse_clearly(mamba: tuple[Any, LLM]) -> None:
    _, llm = mamba
    llm.generator.cache_config = CacheConfig(kind="paged")
    try:
        with pytest.raises(ValueError, match="does not apply to mamba models"):
            llm.generate("hello", SamplingParams(max_new_tokens=2))
    finally:
        llm.generator.cache_config = CacheConfig()
    with pytest.raises(ValueError, match="speculative method 'self' reads the target's KV cache"):  # lookup runs: tests/speculative
        llm.generate("hello", SamplingParams(max_new_tokens=2), speculative=SpeculativeConfig(method="self"))


@pytest.fixture(scope="module")
def falcon_mamba(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LLM]:
    folder = tmp_path_factory.mktemp("falcon-mamba")
    model = save_tiny_mamba(folder, tokenizer_folder(tmp_path_factory.mktemp("tokenizer")), falcon=True)
    return model, LLM.load(folder, progress=False, weights="fp32")


def test_falcon_mamba_normed_dt_b_c_match_transformers(falcon_mamba: tuple[Any, LLM]) -> None:
    """FalconMambaForCausalLM: dt, B and C pass a weightless RMS norm; without it the logits part."""
    model, llm = falcon_mamba
    prompt, more = random_ids(SCAN_CHUNK + 20, 12), random_ids(8, 13)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt + more])).logits[0]
    assert llm.config.dt_b_c_rms_eps == model.config.mixer_rms_eps
    assert (prefill_and_steps(llm, prompt, more) - expected).abs().max().item() < TOLERANCE
    for block in llm.model.layers:
        block.mixer.dt_b_c_rms_eps = None
    try:
        assert (prefill_and_steps(llm, prompt, more) - expected).abs().max().item() > 100 * TOLERANCE
    finally:
        for block in llm.model.layers:
            block.mixer.dt_b_c_rms_eps = model.config.mixer_rms_eps


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_gguf_loads_the_same_model(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """An all-F32 file as llama.cpp's converter writes it (A as -exp(A_log), the conv weight [I, K],
    dt_b_c_rms): the same config (eps stored as float32) and transformers' logits."""
    model, llm = request.getfixturevalue(family)
    from_gguf = LLM.load(write_mamba_gguf(tmp_path / "model.gguf", model, model_path("smollm2")), progress=False, weights="fp32")
    eps = {"rms_norm_eps": llm.config.rms_norm_eps, "dt_b_c_rms_eps": llm.config.dt_b_c_rms_eps}
    assert math.isclose(from_gguf.config.rms_norm_eps, eps["rms_norm_eps"], rel_tol=1e-6)
    assert dataclasses.replace(from_gguf.config, **eps, max_position_embeddings=llm.config.max_position_embeddings) == llm.config
    prompt, more = random_ids(40, 14), random_ids(4, 15)
    with torch.inference_mode():
        expected = model(torch.tensor([prompt + more])).logits[0]
    assert (prefill_and_steps(from_gguf, prompt, more) - expected).abs().max().item() < TOLERANCE


def test_quantized_weights_read_the_files_blocks_and_follow_fp32(mamba: tuple[Any, LLM], tmp_path: Path) -> None:
    """A Q4_0 file's projections keep their blocks (dequantized, the fp32 load's weights exactly);
    int8 weights with int8 activations stay near the fp32 model over a 150-token prompt."""
    model, llm = mamba
    path = write_mamba_gguf(tmp_path / "model-q4_0.gguf", model, model_path("smollm2"), gguf.GGMLQuantizationType.Q4_0)
    exact, quantized = LLM.load(path, progress=False, weights="fp32"), LLM.load(path, progress=False)
    for ours, reference in zip(quantized.model.layers, exact.model.layers):
        for part in ("in_proj", "x_proj", "out_proj"):
            linear = getattr(ours.mixer, part)
            assert linear.kind == "q4h" and torch.equal(linear.dequantized(), getattr(reference.mixer, part).weight)
    int8 = LLM.load(llm.path, progress=False, weights="int8")
    prompt = random_ids(150, 16)
    actual, expected = prefill_and_steps(int8, prompt, []), prefill_and_steps(llm, prompt, [])
    assert (actual - expected).abs().max().item() < 0.1  # measured 0.023
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.9  # measured 0.97


def test_c_decode_step_follows_the_torch_step(mamba: tuple[Any, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized projections decode in one C call per token (kernels/mamba_step.c): the torch step
    over the same int8 linears gives the same logits up to the order of float sums (measured 4e-7)
    and the same greedy tokens."""
    _, llm = mamba
    assert_c_step_follows_torch(LLM.load(llm.path, progress=False, weights="int8"), random_ids(20, 17), random_ids(24, 18), monkeypatch)


def test_c_decode_rows_equal_each_row_alone(mamba: tuple[Any, LLM]) -> None:
    """The engine's one-token rows of several sequences run in one C call, each weight read once
    for them all; each row's logits and states are the bits it gets alone."""
    _, llm = mamba
    int8 = LLM.load(llm.path, progress=False, weights="int8")
    assert_c_rows_equal_each_row_alone(int8, [random_ids(30, 24), random_ids(7, 25), random_ids(65, 26)], [11, 12, 13])
