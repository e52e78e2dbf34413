"""The C decode step (kernels/decode.c) computes what the torch blocks compute, block by block."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvgen import LLM
from kvgen.kernels import load
from kvgen.models.layers import AttentionMask
from kvgen.quality import kl_divergence, score
from tests.support.models import model_path
from tests.support.shakespeare import play_text

pytestmark = pytest.mark.skipif(load() is None, reason="the C decode path needs a C compiler")


@pytest.fixture(scope="module")
def quantized() -> dict[str, LLM]:
    return {}


def get(quantized: dict[str, LLM], name: str) -> LLM:
    if name not in quantized:
        quantized[name] = LLM.load(model_path(name), progress=False, weights="q4")
    return quantized[name]


def compare_block(llm: LLM, layer: int, position: int) -> float:
    """Max |difference| of one block's output, torch vs C, for a token at `position`."""
    model, decoder = llm.model, llm.model.fast_decoder()
    assert decoder is not None
    torch.manual_seed(position)
    cache = llm.generator.new_cache(position + 1)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, position)), cache)  # fill the cache (torch prefill)
        h = torch.randn(model.config.hidden_size) * 2
        cos, sin = model.rope_for(layer)(torch.tensor([[position]]), torch.float32)
        window = model.config.window_for(layer)
        mask = AttentionMask.build(position, 1, 0, position + 1, window)
        reference_cache = cache.fork()
        expected = model.layers[layer](h[None, None].clone(), (cos, sin), reference_cache, mask)[0, 0]
        actual = h.clone()
        block, lib = decoder.blocks[layer], decoder.library
        lib.kvgen_block_pre(ctypes.byref(block), actual.data_ptr(), cos.reshape(-1).data_ptr(),
                            sin.reshape(-1).data_ptr(), decoder.k_new.data_ptr(), decoder.v_new.data_ptr(), None, -1)  # fmt: skip
        keys, values = cache.update(layer, decoder.k_new, decoder.v_new)
        start = max(0, position - window + 1) if window else 0
        lib.kvgen_block_post(ctypes.byref(block), actual.data_ptr(), keys.data_ptr(), keys.stride(1), keys.stride(2),
                             values.data_ptr(), values.stride(1), values.stride(2), start, keys.shape[2], None, -1)  # fmt: skip
    return (actual - expected).abs().max().item() / expected.abs().max().item()


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_llama_block_matches_torch(quantized: dict, layer: int) -> None:
    assert compare_block(get(quantized, "smollm2"), layer, position=40) < 1e-5


@pytest.mark.parametrize("layer", [0, 5])  # 0: sliding window (512) layer, 5: global layer
def test_gemma_block_matches_torch_past_the_window(quantized: dict, layer: int) -> None:
    """Past the window, at four positions: C and torch agree to float rounding (~1e-7), except
    where a last-bit difference flips one int8 activation rounding in a linear (~1e-4, measured at
    one of these eight cases); a wrong window, position or RoPE is off by far more than 1e-3."""
    llm = get(quantized, "gemma3-270m")
    assert llm.model.config.layer_types[layer] == ("sliding" if layer == 0 else "full")
    errors = [compare_block(llm, layer, position) for position in (520, 600, 700, 800)]
    assert max(errors) < 1e-3 and sorted(errors)[2] < 1e-5, errors


def test_decode_steps_read_the_cos_sin_of_their_position(quantized: dict) -> None:
    """A decode step's RoPE (FastDecoder.rope_at, from tables of 64 positions) is, bit for bit,
    what the rows step computes for a lone row there, for both of Gemma's RoPE kinds, at and
    across the tables' edges and after older tables were dropped."""
    llm = get(quantized, "gemma3-270m")
    model, decoder = llm.model, llm.model.fast_decoder()
    for position in (0, 63, 64, 65, 700, 4095, 9000, 130, 1):
        alone = model._rows_rope(torch.tensor([position]), torch.float32)[0]  # [kinds, 2, D]
        assert alone.shape[0] == 2 and torch.equal(decoder.rope_at(position), alone), position


def test_fast_path_is_used_for_quantized_weights_only(quantized: dict, smollm2) -> None:
    assert get(quantized, "smollm2").model.fast_decoder() is not None
    assert smollm2.model.fast_decoder() is None  # fp32 weights: torch path


@pytest.mark.slow
def test_token_by_token_perplexity_matches_the_torch_path(quantized: dict) -> None:
    """Whole model: decoding one token at a time in C scores Hamlet like the torch path (SDPA). They
    differ in float summation order, which int8 activation rounding amplifies: measured KLD 0.0032
    (top-1 97%) over 512 tokens, perplexity +0.6-1.2% at 128-512 tokens with either the per-position
    or the tiled attention, so the bounds are set above that; a wrong attention moves both far more.
    The same 128 tokens as one prompt-sized chunk run the C rows step and give the same bits."""
    llm = get(quantized, "smollm2")
    ids = llm.tokenizer.encode(play_text("hamlet"))[:129]
    fast = score(llm.model, llm.generator.new_cache, ids, chunk_size=1, keep_distributions=True)
    whole = score(llm.model, llm.generator.new_cache, ids, chunk_size=128, keep_distributions=True)
    assert torch.equal(whole.distributions, fast.distributions)
    llm.model.use_fast_decode = False
    try:
        reference = score(llm.model, llm.generator.new_cache, ids, chunk_size=1, keep_distributions=True)
    finally:
        llm.model.use_fast_decode = True
    assert kl_divergence(reference, fast) < 0.01
    assert abs(fast.perplexity - reference.perplexity) / reference.perplexity < 0.02, (fast.perplexity, reference.perplexity)


def test_threads_sharing_a_model_get_their_own_results(quantized: dict) -> None:
    """The C path and quantized layers reuse scratch memory; concurrent requests must not mix."""
    from concurrent.futures import ThreadPoolExecutor

    from kvgen import SamplingParams

    llm = get(quantized, "smollm2")
    prompts = ["The three primary colors are", "def fibonacci(n):\n    ", "In a distant galaxy, the starship"] * 2
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = [llm.generate(p, params).token_ids for p in prompts]
    with ThreadPoolExecutor(max_workers=3) as pool:
        together = list(pool.map(lambda p: llm.generate(p, params).token_ids, prompts))
    assert together == alone


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_rows_of_a_batch_decode_in_c_as_each_row_alone(quantized: dict, name: str, monkeypatch) -> None:
    """forward_batch over one-token rows of one paged store runs every layer in C for all rows
    (FastDecoder.step_rows: one tiled GEMM per weight). Each row's logits equal, bit for bit, that
    row decoded alone by the batch-1 C step: the one-row GEMV sums in the tiled GEMM's order, so a
    row's numbers do not depend on the batch. Gemma rows run past its 512-token sliding window."""
    from kvgen.kv import CacheSpec, PagedCache, PagedStorage
    from kvgen.kv.block_pool import BlockPool
    from kvgen.models.fast_decode import FastDecoder

    llm = get(quantized, name)
    model = llm.model
    window = model.config.sliding_window or 64
    ids = llm.tokenizer.encode(play_text("hamlet"))
    histories = [ids[: window + 20], ids[40:70], ids[100 : window + 90], ids[7:12]]
    storage = PagedStorage(CacheSpec.for_model(model.config), BlockPool(4 * (window + 128) // 16, 16))
    batched, alone = ([PagedCache(storage) for _ in histories] for _ in range(2))
    calls = []
    original = FastDecoder.step_rows
    monkeypatch.setattr(FastDecoder, "step_rows", lambda self, *a: calls.append(1) or original(self, *a))
    with torch.inference_mode():
        for caches in (batched, alone):
            for cache, history in zip(caches, histories):
                model(torch.tensor([history[:-1]]), cache)
        logits = model.forward_batch([h[-1:] for h in histories], batched)
        references = [model(torch.tensor([h[-1:]]), cache)[0, -1] for h, cache in zip(histories, alone)]
    assert len(calls) == 1
    for row, reference in enumerate(references):
        assert torch.equal(logits[row], reference), (row, (logits[row] - reference).abs().max().item())
        assert batched[row].seq_len == alone[row].seq_len == len(histories[row])


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_decode_and_rows_steps_give_the_prompts_bits_with_1_2_or_3_threads(quantized: dict, name: str) -> None:
    """The batch-1 step and the rows step each run all their layers in one parallel region: each
    matmul split by output groups, attention by positions, heads and columns (batch-1) or by head
    units (rows), barriers where a phase reads the last one's outputs. Whatever the team (3 threads
    on this machine's 2 cores split work differently from 2), each decoded token's logits, and
    each row's of verify-sized forwards (2 to 8 tokens: the few-rows kernels, attention one row a
    unit or in blocks of rows that share each key tile) and of the whole prompt (40 rows: the
    16-output kernels), are those of the prompt run at the default thread count."""
    from tests.support.models import PROMPTS
    from tests.support.step_invariance import assert_steps_give_the_prompts_bits

    llm = get(quantized, name)
    assert_steps_give_the_prompts_bits(llm, llm.tokenizer.encode(" ".join(PROMPTS))[:40])


def test_gemma_keeps_the_files_q8_0_and_q5_0_blocks_exactly(quantized: dict, gemma3) -> None:
    """The head (Q8_0) stays in q8s blocks (f16 scale, no offset: 34 bytes per 32 weights, as in the
    file), the Q5_0 projections in q5 (22 bytes), a QKV with a Q8_0 part in q8s; every value is the
    file's dequantized one bit for bit."""
    model, reference = get(quantized, "gemma3-270m").model, gemma3.model
    head = model.lm_head
    assert head.kind == "q8s" and head.blocks.numel() == head.out_features * head.in_features // 32 * 34
    assert torch.equal(head.dequantized(), reference.lm_head.weight)
    for layer, qkv_kind in ((0, "q8s"), (2, "q5")):  # layer 0's v is Q8_0, layer 2's Q5_0, like q and k
        ours, exact = model.layers[layer], reference.layers[layer]
        assert (ours.attn.qkv.kind, ours.mlp.gate_up.kind) == (qkv_kind, "q5")
        assert torch.equal(ours.attn.qkv.dequantized(), exact.attn.qkv.weight)
        assert torch.equal(ours.mlp.gate_up.dequantized(), exact.mlp.gate_up.weight)


def test_fp32_attention_gives_the_same_bits_with_any_instruction_set(quantized: dict, tmp_path) -> None:
    """Prompt rows and decodes over fp32 K/V attend through one per-query procedure (decode.c
    attend_heads): its sums run in one order, so the AVX-512, AVX2 and scalar builds agree bit for
    bit (ranges that start and end off the 8- and 32-position tiles, a window, GQA), and a row's
    heads give the same bits whichever run of heads of its kv head they are computed in. The
    batch-1 C step's attention (scores split by positions, sums by columns) gives those bits too,
    with any thread count. So do whole rows steps of Gemma 3 and SmolLM2 (a 50-token prompt, whose
    rows share their key tiles, then a 5-token verify: Gemma's GeGLU, q5 and q8 linears, QK-norms)."""
    from tests.unit.test_quantized_kv_attention import instruction_sets
    from kvgen.kernels.build import build, open_library

    torch.manual_seed(5)
    heads, kv_heads, d, length = 6, 2, 64, 301
    keys, values = torch.randn(1, kv_heads, length, d) * 2, torch.randn(1, kv_heads, length, d)
    starts, ends = torch.tensor([0, 0, 37, 180]), torch.tensor([1, 301, 290, 250])
    q = torch.randn(len(starts), heads, d)
    table = torch.zeros(len(starts), dtype=torch.int64)

    def attend(library, rows: slice = slice(None)) -> torch.Tensor:
        query, first, last = q[rows].contiguous(), starts[rows].contiguous(), ends[rows].contiguous()
        out = torch.empty_like(query)
        library.kvgen_paged_decode_attention(
            query.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(), len(first), heads, kv_heads, d, 0.125,
            keys.stride(1), keys.stride(2), keys.stride(0), length, table.data_ptr(), 1, first.data_ptr(), last.data_ptr(),
        )  # fmt: skip
        return out

    def attend_one(library, r: int) -> torch.Tensor:  # the batch-1 C step's attention: work split by positions and columns
        out = torch.empty(heads, d)
        library.kvgen_decode_attention(q[r].contiguous().data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                       heads, kv_heads, d, 0.125, keys.stride(1), keys.stride(2), starts[r], ends[r])  # fmt: skip
        return out

    native = attend(load())
    # A lone row splits each kv head's 3 query heads into runs of 2 and 1 (4 rows: runs of 3).
    assert all(torch.equal(attend(load(), slice(r, r + 1))[0], native[r]) for r in range(len(starts)))
    threads = torch.get_num_threads()
    for count in (1, 2, 3):  # each thread's share of positions and columns depends on the count
        torch.set_num_threads(count)
        try:
            assert all(torch.equal(attend_one(load(), r), native[r]) for r in range(len(starts))), count
        finally:
            torch.set_num_threads(threads)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], keys.expand(len(starts), -1, -1, -1), values.expand(len(starts), -1, -1, -1), scale=0.125,
        enable_gqa=True, attn_mask=((torch.arange(length) >= starts[:, None]) & (torch.arange(length) < ends[:, None]))[:, None, None],
    )[:, :, 0]  # fmt: skip
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
    ids = torch.randint(100, 5000, (55,), generator=torch.Generator().manual_seed(1))
    models = [get(quantized, name) for name in ("gemma3-270m", "smollm2")]  # 256- and 64-channel heads

    def verify(library, llm) -> torch.Tensor:  # a 50-row prompt (its key tiles shared: the cached order), then 5 rows
        decoder, cache = llm.model.fast_decoder(), llm.generator.new_cache(len(ids))
        decoder.library = library
        try:
            with torch.inference_mode():
                prompt = llm.model(ids[None, :50], cache, logits_to_keep=50)[0]
                return torch.cat([prompt, llm.model(ids[None, 50:], cache, logits_to_keep=None)[0]])
        finally:
            decoder.library = load()

    verified = [verify(load(), llm) for llm in models]
    for name, flags in instruction_sets().items():
        build(tmp_path / f"{name}.so", flags)
        library = open_library(tmp_path / f"{name}.so")
        assert torch.equal(attend(library), native), name
        assert all(torch.equal(attend_one(library, r), native[r]) for r in range(len(starts)))
        assert all(torch.equal(verify(library, llm), reference) for llm, reference in zip(models, verified)), name


@pytest.mark.parametrize("d", [16, 80, 96])
def test_batch1_attention_splits_heads_off_32_column_slices_with_the_rows_bits(d: int) -> None:
    """The batch-1 step's value sums go to threads by (kv head, 32-column slice) units; a head
    narrower than a slice (16) or with columns past its last whole slice (80, 96: Phi-3) keeps
    them with a thread, so every thread count gives the rows step's bits and SDPA's values."""
    torch.manual_seed(d)
    heads, kv_heads, length = 6, 3, 97
    keys, values = torch.randn(1, kv_heads, length, d), torch.randn(1, kv_heads, length, d)
    q = torch.randn(heads, d)
    library = load()
    rows = torch.empty(1, heads, d)
    first, last, table = torch.tensor([0]), torch.tensor([length]), torch.zeros(1, dtype=torch.int64)
    library.kvgen_paged_decode_attention(
        q.data_ptr(), rows.data_ptr(), keys.data_ptr(), values.data_ptr(), 1, heads, kv_heads, d, 0.125,
        keys.stride(1), keys.stride(2), keys.stride(0), length, table.data_ptr(), 1, first.data_ptr(), last.data_ptr(),
    )  # fmt: skip
    threads = torch.get_num_threads()
    for count in (1, 2, 3, 4):
        torch.set_num_threads(count)
        try:
            out = torch.empty(heads, d)
            library.kvgen_decode_attention(q.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(), heads,
                                           kv_heads, d, 0.125, keys.stride(1), keys.stride(2), 0, length)  # fmt: skip
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(out, rows[0]), (count, (out - rows[0]).abs().max().item())
    reference = torch.nn.functional.scaled_dot_product_attention(
        q[None, :, None], keys, values, scale=0.125, enable_gqa=True
    )[0, :, 0]
    torch.testing.assert_close(rows[0], reference, rtol=1e-5, atol=1e-5)
