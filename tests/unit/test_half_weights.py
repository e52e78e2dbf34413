"""The 16bit weights mode: F16 / BF16 matmul weights kept as the checkpoint has them and widened to
fp32 as they are multiplied (models/half_linear.py). The fp32 mode over the same values is the
reference: only the order of the sums differs, so logits agree to rounding and greedy text matches,
and transformers on the same weights (upcast to fp32) gives the same tokens. Prompts on CPUs with
AVX512-BF16 round their activations to bf16 (kernels/bf16_gemm.c): their logits agree to bf16's
rounding, KVGEN_PREFILL_GEMM=fp32 gives the fp32 values there too."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file

from kvgen import LLM, SamplingParams, SpeculativeConfig
from kvgen.models.embedding import HalfRows, QuantizedEmbedding
from kvgen.models.half_linear import GEMM_ROWS_THRESHOLD, HalfLinear, bf16_gemm_built, default_prefill, pair_interleaved, row_major
from tests.conftest import load_reference
from tests.support.lora import make_peft_adapter
from tests.support.models import model_path
from tests.support.recompute import logits_from_scratch
from tests.support.tiny_gguf import write_gguf_from_hf
from tests.support.tiny_hf import save_tiny_decoder, tokenizer_folder

Q = gguf.GGMLQuantizationType
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
PROMPT = "The capital of France is Paris. The capital of Germany is"
needs_bf16_kernel = pytest.mark.skipif(not bf16_gemm_built(), reason="the kernels are built without AVX512-BF16")


def _prompt_tolerance(llm: LLM, fp32_tolerance: float) -> float:
    """How far a prompt's logits may sit from the fp32 mode's, relative to their largest: bf16's
    rounding of the activations where the prompt runs the bf16 kernel."""
    rounds = any(isinstance(m, HalfLinear) and m.prefill == "bf16" for m in llm.model.modules())
    return 1e-2 if rounds else fp32_tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_linear_equals_an_fp64_matmul_and_a_row_gets_its_bits_at_any_row_count(dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "fp32")  # the widened GEMM's rows (the bf16 kernel's: below)
    torch.manual_seed(0)
    weight, bias = torch.randn(100, 96).to(dtype), torch.randn(100)
    layer = HalfLinear(weight, bias)
    for rows in (1, 3, 9, GEMM_ROWS_THRESHOLD + 5):
        x = torch.randn(rows, 96)
        reference = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        for row_invariant in (False, True):
            assert torch.allclose(layer(x, row_invariant=row_invariant).double(), reference, atol=1e-4, rtol=1e-5)
        together = layer(x, row_invariant=True)
        for r in range(rows):  # the C kernel: each row's bits as when it runs alone
            assert torch.equal(together[r], layer(x[r : r + 1])[0])
    assert layer(torch.randn(2, 5, 96)).shape == (2, 5, 100)


@needs_bf16_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_bf16_kernel_rounds_the_activations_alone_and_a_row_gets_its_bits_at_any_row_count(dtype: torch.dtype) -> None:
    """Many rows on AVX512-BF16: the activations rounded to bf16, the file's weights exact (an F16
    weight split into a bf16 part and the rest), fp32 sums; each row's bits as in any other batch,
    across the kernel's tiles of 4 rows x 4 outputs and its panels of rows (64 at 2,048 values)."""
    torch.manual_seed(4)
    weight, bias = torch.randn(102, 2048).to(dtype), torch.randn(102)
    layer = HalfLinear(weight, bias)
    assert layer.prefill == "bf16"
    x = torch.randn(70, 2048)
    together = layer(x)
    rounded = torch.nn.functional.linear(x.bfloat16().double(), weight.double(), bias.double())
    assert torch.allclose(together.double(), rounded, atol=1e-3, rtol=1e-5)
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    assert not torch.allclose(together.double(), exact, atol=1e-2)  # the rounding is there
    for first, count in ((0, 8), (5, 9), (61, 9), (3, 33)):
        assert torch.equal(layer(x[first : first + count]), together[first : first + count]), (first, count)


def test_half_kernels_give_the_same_bits_with_any_instruction_set(tmp_path: Path) -> None:
    """The AVX2 loop and the portable one sum in the same order, for F16 rows and for BF16 rows in
    their pair-interleaved layout; the widening for the GEMM undoes that layout exactly."""
    from kvgen.kernels import load
    from kvgen.kernels.build import build, open_library
    from tests.unit.test_quantized_kv_attention import instruction_sets

    torch.manual_seed(1)
    x = torch.randn(3, 96)
    weights = {"f16": torch.randn(37, 96).half(), "bf16": pair_interleaved(torch.randn(37, 96).bfloat16()).reshape(37, 96)}
    native = load()
    expected = {}
    for kind, w in weights.items():
        expected[kind] = torch.empty(3, 37)
        getattr(native, f"kvgen_linear_{kind}")(w.data_ptr(), x.data_ptr(), expected[kind].data_ptr(), 3, 37, 96)
    widened = torch.empty(37, 96)
    native.kvgen_widen_bf16_pairs(weights["bf16"].data_ptr(), widened.data_ptr(), 37, 96)
    assert torch.equal(widened, row_major(weights["bf16"]).float())
    for name, flags in instruction_sets().items():
        build(tmp_path / f"{name}.so", flags)
        library = open_library(tmp_path / f"{name}.so")
        for kind, w in weights.items():
            y = torch.empty(3, 37)
            getattr(library, f"kvgen_linear_{kind}")(w.data_ptr(), x.data_ptr(), y.data_ptr(), 3, 37, 96)
            assert torch.equal(y, expected[kind]), (name, kind)
            # AVX512-BF16 is beyond these targets: the many-row kernel says it is absent
            assert getattr(library, f"kvgen_gemm_{kind}_rows")(w.data_ptr(), x.data_ptr(), y.data_ptr(), 3, 37, 96) == -1
        assert library.kvgen_bf16_gemm_built() == 0
        again = torch.empty(37, 96)
        library.kvgen_widen_bf16_pairs(weights["bf16"].data_ptr(), again.data_ptr(), 37, 96)
        assert torch.equal(again, widened), name


def test_kvgen_prefill_gemm_picks_the_many_row_path(monkeypatch) -> None:
    """auto: the bf16 kernel where built, else the C kernel where it runs rows in pairs (AVX-512),
    else fp32; fp32: the widened GEMM; int8: the C kernel at every row count (each row's bits
    alone); bf16: activations rounded to bf16 (the kernel, or oneDNN's bf16 GEMM without it);
    anything else refused."""
    torch.manual_seed(3)
    weight, x = torch.randn(64, 96).bfloat16(), torch.randn(40, 96)
    exact = torch.nn.functional.linear(x.double(), weight.double())
    outputs = {}
    for choice in ("auto", "fp32", "int8", "bf16"):
        monkeypatch.setenv("KVGEN_PREFILL_GEMM", choice)
        layer = HalfLinear(weight)
        outputs[choice] = layer(x)
        assert layer.prefill == (default_prefill() if choice == "auto" else choice)
        if choice == "int8":
            assert torch.equal(outputs[choice], layer(x, row_invariant=True))
    assert torch.equal(outputs["auto"], outputs[default_prefill()])
    assert torch.allclose(outputs["fp32"].double(), exact, atol=1e-4)
    assert not torch.allclose(outputs["bf16"].double(), exact, atol=1e-4)  # rounded, as documented
    assert torch.allclose(outputs["bf16"].double(), exact, atol=0.05 * exact.abs().max().item())
    for dtype in (torch.bfloat16, torch.float16):  # without the kernel: oneDNN over rows laid out as the weights
        layer = HalfLinear(weight.to(dtype))
        layer._bf16_built = False
        rounded = torch.nn.functional.linear(x.bfloat16().double(), weight.to(dtype).bfloat16().double())
        assert torch.allclose(layer(x).double(), rounded, atol=1e-2 * rounded.abs().max().item())
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "fp16")
    with pytest.raises(ValueError, match="KVGEN_PREFILL_GEMM"):
        HalfLinear(weight)


def test_half_linear_refuses_other_weights() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        HalfLinear(torch.randn(8, 32))


@pytest.fixture(scope="module")
def smollm2_bf16_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's real weights (the GGUF's, as transformers reads them) saved by transformers in bf16."""
    model, tokenizer = load_reference("smollm2")
    folder = tmp_path_factory.mktemp("smollm2-bf16")
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # transformers' note that it read a GGUF
    (folder / "config.json").write_text(json.dumps(config))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # a tied checkpoint omits its head
    save_file({name: t.to(torch.bfloat16) for name, t in model.state_dict().items() if name not in tied}, folder / "model.safetensors")
    tokenizer.save_pretrained(folder)
    return folder


def test_a_bf16_folder_loads_16bit_by_default_with_the_fp32_modes_text(smollm2_bf16_folder: Path, monkeypatch) -> None:
    half, exact = LLM.load(smollm2_bf16_folder, progress=False), LLM.load(smollm2_bf16_folder, progress=False, weights="fp32")
    assert half.weights == "16bit" and exact.weights == "fp32"
    model = half.model
    block = model.layers[0]
    assert isinstance(block.attn.qkv, HalfLinear) and block.attn.qkv.weight16.dtype == torch.bfloat16
    assert isinstance(model.lm_head, HalfLinear)
    # Tied: the embedding reads the head's rows, held once.
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and isinstance(model.embed_tokens.table, HalfRows)
    assert model.embed_tokens.table.table.data_ptr() == model.lm_head.weight16.data_ptr()
    assert torch.equal(model.embed_tokens(torch.arange(49152)), exact.model.embed_tokens.data)

    ids = half.tokenizer.encode(PROMPT)
    got, want = logits_from_scratch(half, ids), logits_from_scratch(exact, ids)
    assert (got - want).abs().max() < _prompt_tolerance(half, 2e-3) * want.abs().max()
    text = half.generate(PROMPT, GREEDY).text
    assert text == exact.generate(PROMPT, GREEDY).text
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "fp32")  # prompts widened to fp32 too: the order of the sums alone
    widened = LLM.load(smollm2_bf16_folder, progress=False)
    assert (logits_from_scratch(widened, ids) - want).abs().max() < 2e-3 * want.abs().max()


def test_16bit_prompts_through_the_c_rows_step_keep_the_fp32_modes_values(smollm2_bf16_folder: Path, monkeypatch) -> None:
    """KVGEN_PREFILL_GEMM=int8 (the default on AVX-512 builds without BF16): prompts run the C rows
    step over fp32 activations, so their logits are the fp32 mode's to rounding and do not depend
    on how the prompt is chunked."""
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "int8")
    llm, exact = LLM.load(smollm2_bf16_folder, progress=False), LLM.load(smollm2_bf16_folder, progress=False, weights="fp32")
    assert llm.model.fast_decoder().runs_prompts
    ids = llm.tokenizer.encode(PROMPT)

    def prompt_logits(model_llm: LLM, chunks: list[list[int]]) -> torch.Tensor:
        cache = model_llm.generator.new_cache(len(ids))
        with torch.inference_mode():
            for chunk in chunks:
                logits = model_llm.model(torch.tensor([chunk]), cache, logits_to_keep=1)[0, -1]
        return logits

    whole = prompt_logits(llm, [ids])
    want = prompt_logits(exact, [ids])
    assert (whole - want).abs().max() < 2e-3 * want.abs().max()
    assert torch.equal(prompt_logits(llm, [ids[:5], ids[5:]]), whole)
    assert llm.generate(PROMPT, GREEDY).text == exact.generate(PROMPT, GREEDY).text


def test_a_bf16_folder_gives_transformers_tokens(smollm2_bf16_folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(smollm2_bf16_folder, dtype=torch.float32).eval()  # bf16 widened exactly
    llm = LLM.load(smollm2_bf16_folder, progress=False)
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert llm.generate(PROMPT, GREEDY).token_ids == expected


def test_16bit_decode_steps_run_in_c_with_the_same_tokens_alone_batched_and_speculative(smollm2_bf16_folder: Path) -> None:
    """The C decode step takes the 16-bit rows (qlinear kinds f16 / bf16): one kernel per output at
    every row count, so a row's tokens do not depend on the batch or on a verify."""
    llm = LLM.load(smollm2_bf16_folder, progress=False)
    assert llm.model.fast_decoder() is not None
    prompts = [PROMPT, "Once upon a time", "def fibonacci(n):", "Water boils at"]
    alone = [llm.generate(prompt, GREEDY).token_ids for prompt in prompts]
    assert [r.token_ids for r in llm.generate_batch(prompts, GREEDY)] == alone
    quote = "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox"
    plain = llm.generate(quote, GREEDY).token_ids
    for method in ("lookup", "self", "eagle"):  # EAGLE's draft rows: the 16-bit head's, as 8-bit blocks
        assert llm.generate(quote, GREEDY, speculative=SpeculativeConfig(method)).token_ids == plain, method
    llm.model.use_fast_decode = False  # the torch path, the C step's reference: the same greedy tokens
    assert [llm.generate(prompt, GREEDY).token_ids for prompt in prompts] == alone


@pytest.mark.parametrize("matmul_type", [Q.F16, Q.BF16])
def test_a_float16_gguf_loads_16bit_by_default_with_the_fp32_modes_tokens(matmul_type, tmp_path: Path, monkeypatch) -> None:
    model = save_tiny_decoder("qwen3", tmp_path / "hf", tokenizer_folder(tmp_path / "tokenizer"))
    path = write_gguf_from_hf(tmp_path / "m.gguf", model, model_path("smollm2"), matmul_type, embedding_type=matmul_type)
    half, exact = LLM.load(path, progress=False), LLM.load(path, progress=False, weights="fp32")
    assert half.weights == "16bit"
    kinds = {layer.kind for layer in half.model.modules() if isinstance(layer, HalfLinear)}
    assert kinds == {"f16" if matmul_type == Q.F16 else "bf16"}
    ids = list(range(100, 140))
    got, want = logits_from_scratch(half, ids), logits_from_scratch(exact, ids)
    assert (got - want).abs().max() < _prompt_tolerance(half, 1e-3) * want.abs().max()
    assert half.generate(ids, GREEDY).token_ids == exact.generate(ids, GREEDY).token_ids
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "fp32")
    widened = LLM.load(path, progress=False)
    assert (logits_from_scratch(widened, ids) - want).abs().max() < 1e-3 * want.abs().max()


def test_a_lora_adapter_on_16bit_weights_gives_the_fp32_modes_tokens(smollm2_bf16_folder: Path, tmp_path: Path) -> None:
    adapter = make_peft_adapter("smollm2", tmp_path / "adapter", PROMPT, rank=8, targets=["q_proj", "v_proj", "down_proj"], alpha=16)
    tokens = []
    for weights in ("16bit", "fp32"):
        llm = LLM.load(smollm2_bf16_folder, progress=False, weights=weights)
        llm.load_adapter("a", adapter.path)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=True)
        tuned = llm.generate(PROMPT, dataclasses.replace(params, adapter="a"))
        base = llm.generate(PROMPT, params)
        assert tuned.logprobs[0].logprob != base.logprobs[0].logprob  # the adapter takes part
        tokens.append(tuned.token_ids)
    assert tokens[0] == tokens[1]


def test_quantized_weights_keep_a_half_folders_embedding_16_bit(smollm2_bf16_folder: Path) -> None:
    """Under int8 / q4 a bf16 folder's token embedding stays bf16 rows (half an fp32 table), looked up
    with the fp32 table's values, so the logits keep their bits."""
    llm, exact = LLM.load(smollm2_bf16_folder, progress=False, weights="q4"), LLM.load(smollm2_bf16_folder, progress=False, weights="fp32")
    table = llm.model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and isinstance(table.table, HalfRows) and table.table.table.dtype == torch.bfloat16
    assert torch.equal(table(torch.arange(49152)), exact.model.embed_tokens.data)
    ids = llm.tokenizer.encode(PROMPT)
    want = logits_from_scratch(llm, ids)
    llm.model.embed_tokens = torch.nn.Parameter(exact.model.embed_tokens.data, requires_grad=False)  # the fp32 table it replaces
    assert torch.equal(logits_from_scratch(llm, ids), want)


def _family_gguf(family: str, kind, folder: Path) -> Path:
    from tests.support.tiny_gguf import write_granite_hybrid_gguf, write_mamba_gguf
    from tests.support.tiny_hf import save_tiny_granite_hybrid, save_tiny_mamba2

    tokenizer = tokenizer_folder(folder / "tokenizer")
    if family == "mamba2":
        return write_mamba_gguf(folder / "m.gguf", save_tiny_mamba2(folder / "hf", tokenizer), model_path("smollm2"), kind)
    if family == "granite-hybrid":
        return write_granite_hybrid_gguf(folder / "m.gguf", save_tiny_granite_hybrid(folder / "hf", tokenizer), model_path("smollm2"), kind)
    model = save_tiny_decoder(family, folder / "hf", tokenizer)
    return write_gguf_from_hf(folder / "m.gguf", model, model_path("smollm2"), kind, embedding_type=kind)


@pytest.mark.parametrize("family, kind", [("mamba2", Q.BF16), ("granite-hybrid", Q.F16), ("deepseek-v2", Q.F16), ("gpt-oss", Q.BF16)])
def test_every_c_step_takes_16bit_weights(family: str, kind, tmp_path: Path) -> None:
    """The state-space, hybrid, latent-attention and mixture steps read the 16-bit rows too: the fp32
    mode's greedy tokens, and a row's tokens the same batched as alone."""
    from kvgen.models.hybrid_decode import hybrid_runs_in_c
    from kvgen.models.mamba_decode import runs_in_c

    path = _family_gguf(family, kind, tmp_path)
    half, exact = LLM.load(path, progress=False), LLM.load(path, progress=False, weights="fp32")
    assert half.weights == "16bit" and any(isinstance(m, HalfLinear) for m in half.model.modules())
    in_c = {"mamba2": runs_in_c, "granite-hybrid": hybrid_runs_in_c}.get(family, lambda m: m.fast_decoder() is not None)
    assert in_c(half.model)
    prompts = [list(range(100, 130)), list(range(200, 210))]
    alone = [half.generate(ids, GREEDY).token_ids for ids in prompts]
    assert alone[0] == exact.generate(prompts[0], GREEDY).token_ids
    assert [r.token_ids for r in half.generate_batch(prompts, GREEDY)] == alone


def test_16bit_is_refused_where_no_weight_is_16_bit(smollm2_bf16_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--weights 16bit .* quantized"):
        LLM.load(model_path("smollm2"), progress=False, weights="16bit")
    model = save_tiny_decoder("qwen3", tmp_path / "hf", tokenizer_folder(tmp_path / "tokenizer"))  # saved in fp32
    with pytest.raises(ValueError, match="--weights 16bit .* has none"):
        LLM.load(tmp_path / "hf", progress=False, weights="16bit")
    assert LLM.load(tmp_path / "hf", progress=False).weights == "fp32"  # auto: fp32 weights stay fp32
    assert model is not None
