"""kvgen and llama.cpp (llama-cpp-python's `lora_path`) apply the same GGUF LoRA file alike: a random
all-linear adapter written by kvgen's writer, on SmolLM2's GGUF. llama.cpp computes on the file's
4-bit weights and kvgen on their fp32 dequantization, so the logits differ by that much without the
adapter; with it they must differ by no more, while the adapter itself moves the logits far more (a
wrong Q/K row order or scale would show). Skipped when llama_cpp is not installed (`make
.venv/.bench-deps`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgen import SamplingParams
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
