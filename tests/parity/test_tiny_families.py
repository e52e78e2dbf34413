"""Qwen3 (also with YaRN), Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3, SmolLM3, Granite (-MoE), OLMo 2,
OLMoE, Phi-3 / Phi-4-mini, Gemma 2 and gpt-oss against transformers on the same weights.

No real checkpoint of these families installs offline, so these are small random-weight models
that transformers itself builds and saves (tests/support/tiny_hf.py): this is the evidence for
these families, loaded from the HF folder and from a GGUF written with llama.cpp's layout.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgen import LLM, CacheConfig, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine
from tests.support.models import PROMPTS, model_path
from tests.support.tiny_gguf import write_gguf_from_hf
from tests.support.tiny_hf import FAMILIES, save_tiny_decoder, tokenizer_folder

pytestmark = pytest.mark.slow
NAMES = sorted(FAMILIES)
TOLERANCE = 1e-3  # fp32 logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, LLM, Path]]:
    """name -> (transformers model, kvgen LLM from the HF folder, folder), built on first use."""
    return {}


def get(tiny: dict, name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LLM, Path]:
    if "tokenizer" not in tiny:
        tiny["tokenizer"] = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    if name not in tiny:
        folder = tmp_path_factory.mktemp(name)
        model = save_tiny_decoder(name, folder, tiny["tokenizer"])
        tiny[name] = (model, LLM.load(folder, progress=False, weights="fp32"), folder)
    return tiny[name]


def reference_steps(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers fed one token at a time over its own cache -> logits [S, V]."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=model.config), []
    with torch.inference_mode():
        for token in ids:
            rows.append(model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_decode_logits_match(name: str, tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    model, llm, _ = get(tiny, name, tmp_path_factory)
    prompt = llm.tokenizer.encode(PROMPTS[0])
    # 80 positions: past Gemma 2's window of 8 and past Phi-3's LongRoPE switch at 64.
    ids = prompt + torch.randint(0, 49152, (80 - len(prompt),), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected_prefill = model(torch.tensor([prompt])).logits[0, -1]
        cache = llm.generator.new_cache(len(ids))
        actual_prefill = llm.model(torch.tensor([prompt]), cache)[0, -1]
        steps = [llm.model(torch.tensor([[t]]), cache)[0, -1] for t in ids[len(prompt) :]]
    assert (actual_prefill - expected_prefill).abs().max().item() < TOLERANCE
    expected_steps = reference_steps(model, ids)[len(prompt) :]
    assert (torch.stack(steps) - expected_steps).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_on_four_prompts(name: str, tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    model, llm, _ = get(tiny, name, tmp_path_factory)
    for prompt in PROMPTS[:4]:
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            reference = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, pad_token_id=0)
        result = llm.generate(ids, SamplingParams(max_new_tokens=48, ignore_eos=True))
        assert result.token_ids == reference[0, len(ids) :].tolist(), (name, prompt)


@pytest.mark.parametrize("name", NAMES)
def test_gguf_loads_the_same_model(name: str, tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    model, llm, folder = get(tiny, name, tmp_path_factory)
    path = write_gguf_from_hf(folder / "model.gguf", model, model_path("smollm2"))
    from_gguf = LLM.load(path, progress=False, weights="fp32")
    # GGUF stores eps, gpt-oss's SwiGLU clamp, LongRoPE's attention factor, DeepSeek's YaRN scale
    # (its log multiplier) and Granite's scalars as float32; everything else must come out the same.
    float32s = ("swiglu_limit", "embedding_multiplier", "residual_multiplier", "logits_scaling")
    for field in float32s:
        assert math.isclose(getattr(from_gguf.config, field), getattr(llm.config, field), rel_tol=1e-6), field
    assert math.isclose(from_gguf.config.attention_scale, llm.config.attention_scale, rel_tol=1e-6)
    config = dataclasses.replace(from_gguf.config, rms_norm_eps=llm.config.rms_norm_eps, query_pre_attn_scalar=llm.config.query_pre_attn_scalar,
                                 **{field: getattr(llm.config, field) for field in float32s})
    if config.rope_scaling is not None and config.rope_scaling.kind == "longrope":
        assert math.isclose(config.rope_scaling.attention_factor, llm.config.rope_scaling.attention_factor, rel_tol=1e-6)
        config = dataclasses.replace(config, rope_scaling=llm.config.rope_scaling)
    assert config == llm.config
    ids = from_gguf.tokenizer.encode(PROMPTS[1])
    assert ids == llm.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0, -1]
        actual = from_gguf.model(torch.tensor([ids]), from_gguf.generator.new_cache(len(ids)))[0, -1]
    assert (actual - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name,layout", [("mixtral", {"stacked_experts": False}), ("gpt-oss", {"fused_gate_up": True}),
                                         ("deepseek-v2", {"split_kv_b": False})])
def test_other_expert_layouts_load_the_same_model(name: str, layout: dict, tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Older Mixtral files with a tensor per expert; gpt-oss files with each layer's expert gate and
    up fused in one ffn_gate_up_exps (weights and biases); DeepSeek-V2 files converted before MLA's
    absorption (one attn_kv_b, key and value lengths per head)."""
    model, llm, folder = get(tiny, name, tmp_path_factory)
    path = write_gguf_from_hf(folder / "model-layout.gguf", model, model_path("smollm2"), **layout)
    from_gguf = LLM.load(path, progress=False, weights="fp32")
    config = from_gguf.config
    assert dataclasses.replace(config, rms_norm_eps=llm.config.rms_norm_eps, swiglu_limit=llm.config.swiglu_limit) == llm.config
    ids = from_gguf.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0, -1]
        actual = from_gguf.model(torch.tensor([ids]), from_gguf.generator.new_cache(len(ids)))[0, -1]
    assert (actual - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name,file_type,kind", [("qwen2-moe", "Q8_0", "q8s"), ("qwen3-moe", "Q8_0", "q8s"), ("mixtral", "Q8_0", "q8s"),
                                                 ("deepseek-v2", "Q8_0", "q8s"), ("gpt-oss", "MXFP4", "mx4")])
def test_quantized_gguf_experts_keep_their_values(name: str, file_type: str, kind: str, tiny: dict,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:  # fmt: skip
    """A GGUF whose projections are Q8_0 (gpt-oss: MXFP4, as OpenAI ships it), the experts stacked
    [E, rows, columns] per layer as llama.cpp writes them: each expert's rows load into its own
    blocks (the default weights: 8-bit, or MXFP4's own codes in mx4) with the file's values, and the
    mixture's logits are the fp32 values' up to the int8 rounding of the activations."""
    import gguf

    model, _, folder = get(tiny, name, tmp_path_factory)
    path = write_gguf_from_hf(folder / f"model-{file_type.lower()}.gguf", model, model_path("smollm2"),
                              gguf.GGMLQuantizationType[file_type])  # fmt: skip
    exact, quantized = LLM.load(path, progress=False, weights="fp32"), LLM.load(path, progress=False)
    layer = exact.config.moe_layers[0]  # DeepSeek's first layer is dense
    experts = quantized.model.layers[layer].mlp.experts
    assert len(experts) == exact.config.num_experts and {e.gate_up.kind for e in experts} == {kind}
    for ours, reference in zip(experts, exact.model.layers[layer].mlp.experts):
        for part in ("gate_up", "down"):
            torch.testing.assert_close(getattr(ours, part).dequantized(), getattr(reference, part).weight, rtol=0, atol=1e-6)
    ids = exact.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        logits = [llm.model(torch.tensor([ids]), llm.generator.new_cache(len(ids)), logits_to_keep=len(ids))[0] for llm in (exact, quantized)]
    # The 8-bit blocks round each activation row to int8 (measured: at most 0.03 apart, the logits'
    # spread 0.3-0.4); an expert given the wrong rows or weights moves them by the whole spread.
    assert (logits[0] - logits[1]).abs().max().item() < 0.1
    # The C steps over these blocks. Qwen2-MoE's shared expert runs for every token: one more int8
    # rounding per layer for a last-bit difference to flip (measured: 5 of 48 tokens 4e-3 to 1.2e-2
    # apart, the 38 before them within 3e-7).
    assert_c_step_matches_the_torch_path(quantized, ids, agree=0.85 if name == "qwen2-moe" else 0.9)


# Every cache kind, set up so it keeps every position exactly over a short sequence: each must give
# the contiguous cache's greedy tokens (the plumbing: windows, pre-RoPE keys, paged batches).
EXACT_CACHES = {
    "paged": CacheConfig(kind="paged", block_size=4),
    "window": CacheConfig(kind="window"),
    "sinks": CacheConfig(kind="sinks", window=256),
    "chunked": CacheConfig(kind="chunked", chunk=256),
    "quantized": CacheConfig(kind="quantized", k_dtype="fp32", v_dtype="fp32"),
    "tiered": CacheConfig(kind="tiered", block_size=4, hot_tokens=8, warm_tokens=8, warm_dtype="fp32"),
    "compressed": CacheConfig(kind="compressed", exact_window=256),
}

REFUSED = {(name, kind): reason for name in ("gemma2", "gpt-oss")  # sliding layers
           for kind, reason in (("compressed", "for full-attention models"), ("sinks", "own sliding window"))}


@pytest.mark.parametrize("name", NAMES)
def test_every_cache_kind_and_the_engine_decode_like_contiguous(name: str, tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    _, llm, _ = get(tiny, name, tmp_path_factory)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    llm.generator.cache_config = CacheConfig()
    expected = llm.generate(PROMPTS[2], params).token_ids
    try:
        for kind, config in EXACT_CACHES.items():
            llm.generator.cache_config = config
            if (name, kind) in REFUSED:  # Gemma 2's sliding layers: refused with a clear error
                with pytest.raises(ValueError, match=REFUSED[name, kind]):
                    llm.generate(PROMPTS[2], params)
                continue
            assert llm.generate(PROMPTS[2], params).token_ids == expected, kind
        llm.generator.cache_config = CacheConfig()
        engine = LLMEngine(llm, EngineConfig(num_blocks=64, max_tokens_per_step=12))  # chunked prefill, paged rows
        requests = engine.generate(PROMPTS[:3], params)
        assert [r.output_ids for r in requests] == [llm.generate(p, params).token_ids for p in PROMPTS[:3]]
    finally:
        llm.generator.cache_config = CacheConfig()


@pytest.mark.parametrize("name", NAMES)
def test_c_decode_path_with_quantized_weights(name: str, tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """int8 weights: every family decodes in C (decode.c) and matches the torch path on the same
    weights: Qwen3, Phi-3, Phi-4-mini (partial RoPE), Gemma 2 (soft-capped attention scores), the
    mixtures of experts and gpt-oss (sink logits, a biased router, clamped SwiGLU experts)."""
    from kvgen.kernels import load

    _, _, folder = get(tiny, name, tmp_path_factory)
    llm = LLM.load(folder, progress=False, weights="int8")
    if load() is None:
        pytest.skip("the C decode path needs a C compiler")
    if name.startswith("deepseek"):  # the latent's per-head expansions are linears over int8 blocks too
        assert all(layer.attn.uk_heads is not None and layer.attn.uv_heads is not None for layer in llm.model.layers)
    if name == "deepseek-v2-yarn":  # latent attention with a query latent (V2) runs the torch path
        assert llm.model.fast_decoder() is None
        return
    assert llm.model.fast_decoder() is not None
    assert_c_step_matches_the_torch_path(llm, llm.tokenizer.encode(PROMPTS[0]))
    if name.startswith("phi"):  # LongRoPE keys cannot be moved (context shift): a clear error
        with pytest.raises(ValueError, match="LongRoPE"):
            llm.model.rerotate(0, torch.zeros(1, 2, 1, 16), 1)


def assert_c_step_matches_the_torch_path(llm: LLM, ids: list[int], tolerance: float = TOLERANCE, agree: float = 0.9) -> None:
    """Greedy tokens of the C step equal the torch path's on llm's cache, and so do the logits of
    each decoded token, up to float rounding (`tolerance`) for at least `agree` of them."""
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    fast = llm.generate(ids, params).token_ids
    llm.model.use_fast_decode = False
    try:
        assert llm.generate(ids, params).token_ids == fast
        with torch.inference_mode():
            logits = []
            for use_fast in (True, False):
                llm.model.use_fast_decode = use_fast
                cache = llm.generator.new_cache(len(ids) + len(fast))
                llm.model(torch.tensor([ids]), cache)
                logits.append(torch.stack([llm.model(torch.tensor([[t]]), cache)[0, -1] for t in fast]))
    finally:
        llm.model.use_fast_decode = True
    # Per decoded token, C vs torch: float rounding apart, except where a last-bit difference flips
    # one int8 activation rounding inside a linear (measured: one of 48 Phi-3 tokens at 5e-3).
    per_token = (logits[0] - logits[1]).abs().amax(-1)
    assert (per_token < tolerance).float().mean() >= agree and per_token.max() < 0.05, per_token.tolist()


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss", "deepseek-v2"])
def test_c_steps_over_kv_codes_as_the_torch_path(name: str, tiny: dict, tmp_path_factory: pytest.TempPathFactory,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """int8 weights over K/V codes: the C steps soft-cap (Gemma 2) the scores they compute from the
    codes, fold in the sink logits (gpt-oss) and attend over the latent (DeepSeek-V2) as the torch
    path does over the decoded values: one
    sequence's int8 codes (kvgen_decode_layers_over_codes), and the engine's pool (its rows step over
    codes, rows of different lengths) holding fp32 codes, where nothing but the summation order differs."""
    from kvgen.kernels import load
    from kvgen.kv.paged_codes_batch import StorageDescriptors

    if load() is None:
        pytest.skip("the C decode path needs a C compiler")
    _, _, folder = get(tiny, name, tmp_path_factory)
    llm = LLM.load(folder, progress=False, weights="int8")
    llm.generator.cache_config = CacheConfig("quantized", k_dtype="int8", v_dtype="int8")
    # The kernel scores int8 keys against the query rounded to int16 codes, the torch path the keys'
    # values. DeepSeek's per-head expansions then quantize each head's attention output to int8
    # blocks, where a last-bit difference can flip one rounding (measured: from the 37th of 48
    # tokens on, the logits 1e-2 apart, the tokens the same).
    agree = 0.7 if name.startswith("deepseek") else 0.9
    assert_c_step_matches_the_torch_path(llm, llm.tokenizer.encode(PROMPTS[1]), tolerance=2e-3, agree=agree)
    codes = CacheConfig("quantized", k_dtype="fp32", v_dtype="fp32")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]

    def pool_logits(fed: list[list[int]]) -> torch.Tensor:
        """Each prompt prefilled, then the tokens `fed` (or the greedy ones) decoded side by side."""
        engine = LLMEngine(llm, EngineConfig(num_blocks=64), codes)
        caches = [engine.scheduler.new_cache() for _ in prompts]
        logits, rows = [], [list(p) for p in prompts]
        with torch.inference_mode():
            for step in range(8):
                logits.append(llm.model.forward_batch(rows, caches))  # [B, V]
                rows = [[int(t)] for t in (logits[-1].argmax(-1) if not fed else torch.tensor(fed[step]))]
        for cache in caches:
            cache.release()
        return torch.stack(logits)

    kernel = pool_logits([])
    llm.model.use_fast_decode = False
    monkeypatch.setattr(StorageDescriptors, "for_storage", staticmethod(lambda storage: None))
    reference = pool_logits(kernel.argmax(-1).tolist())
    llm.model.use_fast_decode = True
    assert (kernel - reference).abs().max() < 1e-4, (kernel - reference).abs().amax(-1).tolist()


@pytest.mark.parametrize("name", ["qwen2-moe", "qwen3-moe", "mixtral", "granitemoe", "deepseek-v2", "deepseek-v3", "olmo2", "olmoe", "phi4-mini", "gemma2",
                                  "gpt-oss"])
def test_c_steps_decode_the_same_tokens_alone_in_a_batch_and_verifying_drafts(name: str, tiny: dict,
                                                                              tmp_path_factory: pytest.TempPathFactory) -> None:  # fmt: skip
    """int8 weights: the batch-1 C step, the engine's batched rows step (a mixture: each expert once
    over the rows routed to it) and a speculative verify (several rows of one sequence) give a row
    the same bits (routing, partial RoPE, soft-capped scores, sink logits), so greedy tokens are
    equal all three ways."""
    from kvgen.kernels import load
    from kvgen.speculative import SpeculativeConfig

    if load() is None:
        pytest.skip("the C decode path needs a C compiler")
    _, _, folder = get(tiny, name, tmp_path_factory)
    llm = LLM.load(folder, progress=False, weights="int8")
    assert llm.model.fast_decoder() is not None
    params, prompts = SamplingParams(max_new_tokens=24, ignore_eos=True), PROMPTS[:4]
    alone = [llm.generate(p, params).token_ids for p in prompts]
    engine = LLMEngine(llm, EngineConfig(num_blocks=64, max_tokens_per_step=12))  # chunked prefill, batched rows
    assert [r.output_ids for r in engine.generate(prompts, params)] == alone
    repeated = "the cat sat on the mat " * 4
    assert llm.generate(repeated, params, speculative=SpeculativeConfig("lookup")).token_ids == llm.generate(repeated, params).token_ids
    # Logits bit for bit: decode steps, verify-sized forwards and the prompt, with 1, 2 or 3 threads.
    from tests.support.step_invariance import assert_steps_give_the_prompts_bits

    assert_steps_give_the_prompts_bits(llm, llm.tokenizer.encode(" ".join(PROMPTS))[:40])


def test_latent_attention_caches_hold_one_copy_of_the_latent(tiny: dict, tmp_path_factory: pytest.TempPathFactory,
                                                             tmp_path: Path) -> None:  # fmt: skip
    """DeepSeek's cache holds the latent once (its values are its keys): half the bytes of keys
    and values apart, twice the engine pool's positions for one budget, block files of the keys
    alone; the tokens equal a window cache's, which stores both, and a restarted engine's that reads
    the blocks back from disk."""
    from kvgen.kv import ContiguousCache, PagedStorage

    _, llm, _ = get(tiny, "deepseek-v2", tmp_path_factory)
    spec = llm.generator.caches.spec
    apart = dataclasses.replace(spec, values_are_keys=False)
    assert spec.values_are_keys and spec.bytes_per_token * 2 == apart.bytes_per_token
    assert ContiguousCache(spec, 64).memory_bytes() * 2 == ContiguousCache(apart, 64).memory_bytes()
    assert PagedStorage.create(spec, 4.0, 16).pool.num_blocks // 2 == PagedStorage.create(apart, 4.0, 16).pool.num_blocks
    params, prompt = SamplingParams(max_new_tokens=12, ignore_eos=True), " ".join(PROMPTS)
    tokens = llm.generate(prompt, params).token_ids
    window = LLM.load(get(tiny, "deepseek-v2", tmp_path_factory)[2], progress=False, weights="fp32",
                      cache=CacheConfig(kind="window", window=4096))  # fmt: skip
    assert window.generate(prompt, params).token_ids == tokens
    first = LLMEngine(llm, EngineConfig(num_blocks=64, kv_cache_dir=str(tmp_path)))
    assert [r.output_ids for r in first.generate([prompt], params)] == [tokens]
    assert first.scheduler.storage.format_key.startswith("fp32/keys/")
    first.close()  # every indexed block to a file: a safetensors file of the block's tensors
    from safetensors import safe_open

    from kvgen.kv.block_file import SUFFIX

    files = list(tmp_path.glob("*" + SUFFIX))
    assert files and all(set(safe_open(str(f), "pt").keys()) == {"keys"} for f in files)
    restarted = LLMEngine(llm, EngineConfig(num_blocks=64, kv_cache_dir=str(tmp_path)))
    (request,) = restarted.generate([prompt], params)
    assert request.output_ids == tokens and request.cached_tokens > 0
    restarted.close()


def test_moving_a_yarn_key_turns_it_without_the_attention_factor(tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A context shift moves cached keys, which already carry YaRN's attention factor: a key placed
    at position 5 and moved by 7 must equal the key placed at 12 (scaled once, not twice); the
    caches that store keys before RoPE turn them with the bare rotation too."""
    from kvgen.models.rotary import apply_rotary

    _, llm, _ = get(tiny, "qwen3-yarn", tmp_path_factory)
    rope = llm.model.rope_for(0)
    assert rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    key = torch.randn(1, 2, 1, 32, generator=torch.Generator().manual_seed(0))

    def placed(position: int) -> torch.Tensor:
        return apply_rotary(key, *rope(torch.tensor([[position]]), torch.float32))

    assert torch.allclose(llm.model.rerotate(0, placed(5), 7), placed(12), atol=1e-5)
    # Caches that store keys before RoPE turn them back and forth with these tables: a bare rotation
    # each way, so a key comes back as it went in.
    from kvgen.kv.rotation import turn
    from kvgen.kvquant_calibration import key_rope_of

    cos, sin = key_rope_of(llm.model)(0, torch.arange(40))  # [40, 32]
    keys = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(turn(turn(keys, cos, sin, inverse=True), cos, sin), keys, atol=1e-5)


def test_gpt_oss_folders_with_mxfp4_experts_load_their_decoded_values(tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """OpenAI ships gpt-oss's experts in MXFP4 (`*_blocks`: two e2m1 codes a byte, `*_scales`: a
    power of two per 32 values, nn.Linear's [out, in] layout): a folder packed so loads with the
    decoded values and gives transformers' logits on those values."""
    import copy
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    model, _, folder = get(tiny, "gpt-oss", tmp_path_factory)
    packed_folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    for file in folder.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, packed_folder / file.name)
    reference = copy.deepcopy(model)
    tensors = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor
            continue
        linear = tensor.transpose(1, 2).contiguous()  # [E, out, in]
        rows = gguf.quants.quantize(linear.reshape(-1, linear.shape[-1]).numpy(), gguf.GGMLQuantizationType.MXFP4)
        rows = torch.from_numpy(rows).view(*linear.shape[:2], -1, 17)
        codes = torch.cat((rows[..., 1:] & 0x0F, rows[..., 1:] >> 4), dim=-1)  # llama.cpp's order: 16 low nibbles, 16 high
        tensors[f"{name}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()  # the checkpoints': pairs
        tensors[f"{name}_scales"] = rows[..., 0].contiguous()
        decoded = torch.from_numpy(gguf.quants.dequantize(rows.reshape(-1, rows.shape[-2] * 17).numpy(), gguf.GGMLQuantizationType.MXFP4))
        reference.get_parameter(name).data = decoded.view(linear.shape).transpose(1, 2).contiguous()
    save_file(tensors, packed_folder / "model.safetensors", metadata={"format": "pt"})
    llm = LLM.load(packed_folder, progress=False, weights="fp32")
    ids = llm.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
        actual = llm.model(torch.tensor([ids]), llm.generator.new_cache(len(ids)), logits_to_keep=len(ids))[0]
        unpacked = model(torch.tensor([ids])).logits[0]
    assert (actual - expected).abs().max().item() < TOLERANCE
    assert (unpacked - expected).abs().max().item() > 10 * TOLERANCE  # MXFP4 moved the logits: the test can tell
    # By default such a folder loads quantized, as a GGUF does: the experts keep MXFP4's codes (mx4).
    quantized = LLM.load(packed_folder, progress=False)
    ours, exact = quantized.model.layers[1].mlp.experts[3], llm.model.layers[1].mlp.experts[3]
    assert quantized.weights == "q4" and ours.gate_up.kind == ours.down.kind == "mx4"
    for part in ("gate_up", "down"):
        torch.testing.assert_close(getattr(ours, part).dequantized(), getattr(exact, part).weight, rtol=0, atol=0)
        torch.testing.assert_close(getattr(ours, part).bias, getattr(exact, part).bias, rtol=0, atol=0)
