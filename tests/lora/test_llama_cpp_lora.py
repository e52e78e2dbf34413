"""kvgen and llama.cpp (llama-cpp-python's `lora_path`) apply the same GGUF LoRA file alike: a random
all-linear adapter written by kvgen's writer, on SmolLM2's GGUF. llama.cpp computes on the file's
4-bit weights and kvgen on their fp32 dequantization, so the logits differ by that much without the
adapter; with it they must differ by no more, while the adapter itself moves the logits far more (a
wrong Q/K row order or scale would show). The hybrids the same way on all-F32 files of random tiny
models (LFM2, Nemotron-H, Granite 4.0-H with RoPE), a peft adapter on their attention, MLPs and
mixers. Skipped when llama_cpp is not installed (`make .venv/.bench-deps`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.lora.adapter import LoraAdapter, build_adapter, projection_shapes
from kvgen.lora.gguf_lora import write_gguf_lora
from tests.conftest import load_llm
from tests.lora.conftest import PROMPT
from tests.support.models import model_path

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow
RANK, NEW_TOKENS = 8, 8


def random_adapter(config, seed: int = 0) -> LoraAdapter:
    """Rank-RANK deltas on every linear, large enough to change the text (scaling 1)."""
    generator = torch.Generator().manual_seed(seed)
    pairs, scalings = {}, {}
    for layer in range(config.num_layers):
        for proj, (out_features, in_features) in projection_shapes(config, layer).items():
            pairs[layer, proj] = {"A": torch.randn(RANK, in_features, generator=generator) / in_features**0.5,
                                  "B": torch.randn(out_features, RANK, generator=generator) * 0.1}  # fmt: skip
            scalings[layer, proj] = 1.0
    return build_adapter("random", Path("random"), pairs, scalings, config)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean KL(p || q) over positions."""
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def llama_cpp_run(lora: Path | None, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """llama.cpp's logits over the prompt [S, V] and its greedy continuation."""
    options = {"lora_path": str(lora)} if lora else {}
    model = llama_cpp.Llama(model_path=str(model_path("smollm2")), n_ctx=256, n_threads=2, logits_all=True, verbose=False, **options)
    model.eval(ids)
    logits = torch.tensor(model.scores[: len(ids)])
    model.reset()
    tokens = []
    for token in model.generate(ids, temp=0.0, top_k=1, reset=True):
        tokens.append(token)
        if len(tokens) == NEW_TOKENS:
            break
    return logits, tokens


def kvgen_run(llm, adapter: str | None, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    cache = llm.generator.new_cache(len(ids) + 1)
    try:
        with torch.inference_mode():
            logits = llm.model(torch.tensor([ids]), cache, logits_to_keep=None, **({"adapter": adapter} if adapter else {}))[0]
    finally:
        cache.release()
    tokens = llm.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, adapter=adapter)).token_ids
    return logits, tokens


def test_llama_cpp_applies_kvgens_gguf_lora_alike(tmp_path) -> None:
    llm = load_llm("smollm2")  # fp32: the GGUF's weights dequantized
    path = tmp_path / "random-lora.gguf"
    write_gguf_lora(random_adapter(llm.config), llm.config, path, alpha=float(RANK))
    llm.load_adapter("gguf", path)
    try:
        ids = llm.tokenizer.encode(PROMPT)
        ours, our_tokens = kvgen_run(llm, "gguf", ids)
        base, base_tokens = kvgen_run(llm, None, ids)
    finally:
        llm.unload_adapter("gguf")
    theirs, their_tokens = llama_cpp_run(path, ids)
    their_base, _ = llama_cpp_run(None, ids)
    floor = kl(base, their_base)  # 4-bit vs fp32 arithmetic, no adapter
    effect = kl(ours, base)  # what the adapter changes
    print(f"KL: adapter effect {effect:.4f}, kvgen vs llama.cpp with it {kl(ours, theirs):.4f}, without {floor:.4f}")
    assert effect > 20 * max(floor, 1e-4), (effect, floor)  # not a vacuous comparison
    assert kl(ours, theirs) < 2 * max(floor, 1e-4), (kl(ours, theirs), floor, effect)
    assert our_tokens != base_tokens
    assert our_tokens == their_tokens, (llm.tokenizer.decode(our_tokens), llm.tokenizer.decode(their_tokens))


HYBRIDS = {  # llama.cpp's architecture -> (tiny model writer, its GGUF writer, peft's targets)
    "lfm2": ("save_tiny_lfm2", "write_lfm2_gguf", ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"]),
    "nemotron_h": ("save_tiny_nemotron_h", "write_nemotron_h_gguf", ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"]),
    "granitehybrid": ("save_tiny_granite_hybrid", "write_granite_hybrid_gguf", ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj"]),
}  # fmt: skip
HYBRID_OPTIONS = {"lfm2": {"conv_bias": False}, "granitehybrid": {"experts": 0, "rope": True}}  # llama.cpp reads no conv bias; RoPE shows Q/K order


@pytest.mark.parametrize("arch", HYBRIDS)
def test_llama_cpp_applies_a_hybrids_gguf_lora_alike(arch: str, tmp_path: Path) -> None:
    """A peft adapter on every linear of a hybrid (its mixers' in_proj / out_proj included),
    written by kvgen's writer under llama.cpp's names (ssm_in, shortconv.in_proj, ...): llama.cpp's
    logits over the prompt move from kvgen's by no more than without the adapter (measured: LFM2
    4.5e-4 both, Nemotron-H 3.5e-4 against 2.1e-4, Granite 4.0-H 4.8e-5 both), while the adapter
    moves them by 0.18-1.2."""
    from tests.support import tiny_gguf, tiny_hf
    from tests.support.lora import save_halved_peft_adapter
    from tests.support.recurrent import random_ids

    save, write, targets = HYBRIDS[arch]
    ids = random_ids(24, 5)
    model = getattr(tiny_hf, save)(tmp_path / "model", tiny_hf.tokenizer_folder(tmp_path / "tokenizer"), **HYBRID_OPTIONS.get(arch, {}))
    model, _ = save_halved_peft_adapter(model, tmp_path / "peft", ids, 0, r=4, lora_alpha=8, target_modules=targets)
    file = getattr(tiny_gguf, write)(tmp_path / "model.gguf", model, model_path("smollm2"))
    llm = LLM.load(file, progress=False, weights="fp32")
    llm.load_adapter("peft", tmp_path / "peft")
    write_gguf_lora(llm.adapters._entries["peft"].adapter, llm.config, tmp_path / "lora.gguf", alpha=8.0, arch=arch)
    llm.load_adapter("gguf", tmp_path / "lora.gguf")
    with torch.inference_mode():
        ours, base = (llm.model(torch.tensor([ids]), llm.model.new_state_cache(), logits_to_keep=len(ids), adapter=a)[0] for a in ("gguf", None))
    theirs, their_base = (llama_cpp_logits(file, lora, ids) for lora in (tmp_path / "lora.gguf", None))
    floor, effect = (base - their_base).abs().max().item(), (ours - base).abs().max().item()
    assert effect > 100 * floor, (effect, floor)  # not a vacuous comparison
    assert (ours - theirs).abs().max().item() < 2 * floor + 1e-4, ((ours - theirs).abs().max().item(), floor)


def llama_cpp_logits(model: Path, lora: Path | None, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits over `ids` [S, V] with `model` (and `lora`)."""
    options = {"lora_path": str(lora)} if lora else {}
    llama = llama_cpp.Llama(model_path=str(model), n_ctx=128, n_threads=2, logits_all=True, verbose=False, **options)
    llama.eval(ids)
    return torch.tensor(llama.scores[: len(ids)])
