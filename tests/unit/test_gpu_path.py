"""The GPU path's parts that a CPU can check: the CUDA graphs' step computation run eagerly (same
math, no capture) against kvgen's torch path on real fp32 weights, the greedy runs that advance the
position on the device, and the clear refusals. tests/gpu/ runs the captured graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM
from kvgen.kv.contiguous import ContiguousCache
from kvgen.models.cuda_graphs import CudaGraphDecoder, _PositionedKV, bucket_for, device_capacity
from kvgen.models.device import gpu_weights_mode, resolve_device


def _decode_both_ways(llm: LLM, prompt: list[int], steps: int) -> tuple[float, list[int], list[int], list[int]]:
    """Greedy from the same prefill by the torch path and by the graphs' step (eager), then by the
    graphs' greedy runs -> (largest logit difference, torch tokens, step tokens, run tokens)."""
    model = llm.model
    graphs = CudaGraphDecoder(model, capture=False)
    caches = [llm.generator.new_cache(len(prompt) + steps + 1) for _ in range(3)]
    with torch.inference_mode():
        first = [int(model(torch.tensor([prompt]), cache)[0, -1].argmax()) for cache in caches]
        torch_tokens, step_tokens, largest = [first[0]], [first[1]], 0.0
        for _ in range(steps):
            expected = model(torch.tensor([[torch_tokens[-1]]]), caches[0])[0, -1]
            got = graphs.step(torch.tensor([[step_tokens[-1]]]), caches[1])[0, -1]
            largest = max(largest, float((expected - got).abs().max()))
            torch_tokens.append(int(expected.argmax()))
            step_tokens.append(int(got.argmax()))
        run = graphs.greedy(first[2], caches[2], steps)
    assert caches[2].seq_len == caches[1].seq_len == len(prompt) + steps
    return largest, torch_tokens[1:], step_tokens[1:], run


def test_graph_step_computes_what_the_torch_path_does(smollm2: LLM) -> None:
    prompt = smollm2.tokenizer.encode("The three primary colors are")
    largest, torch_tokens, step_tokens, run = _decode_both_ways(smollm2, prompt, 12)
    assert largest < 1e-3  # fp32: only attention's masked bucket vs exact-length keys rounds apart
    assert step_tokens == torch_tokens
    assert run == step_tokens  # argmax fed back and the position advanced on the device


def test_graph_step_crosses_the_sliding_window_and_a_bucket(gemma3: LLM) -> None:
    """Gemma 3's local layers see the last 512 positions: decode from 505 to 517 crosses the window
    and the 512-position bucket."""
    prompt = [(7 * i) % 5000 + 100 for i in range(505)]
    largest, torch_tokens, step_tokens, run = _decode_both_ways(gemma3, prompt, 12)
    assert largest < 1e-3
    assert step_tokens == torch_tokens and run == step_tokens


def test_buckets_and_capacities_are_powers_of_two() -> None:
    assert [bucket_for(p, 4096) for p in (0, 255, 256, 1000, 5000)] == [256, 256, 512, 1024, 4096]
    assert [device_capacity(n, 8192) for n in (1, 256, 257, 9000)] == [256, 256, 512, 8192]


def test_graphs_refuse_what_they_cannot_run(smollm2: LLM) -> None:
    graphs = CudaGraphDecoder(smollm2.model, capture=False)
    contiguous = smollm2.generator.new_cache(4)
    assert graphs.supports(contiguous)
    assert not graphs.supports(ContiguousCache(contiguous.spec, 8, batch_size=2))  # batched rows
    quantized = smollm2.generator.caches.quantized(8, "int8", "int8")
    assert not graphs.supports(quantized)
    assert graphs.step(torch.tensor([[1]]), quantized) is None and quantized.seq_len == 0  # left untouched
    full = ContiguousCache(contiguous.spec, 4, max_capacity=4)
    full.commit(4)
    assert graphs.greedy(1, full, 2) is None and full.seq_len == 4


def test_unusable_devices_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="not supported"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA build of PyTorch"):
            LLM.load("smollm2", device="cuda")
    with pytest.raises(ValueError, match="torch_compile compiles the decode step a GPU captures"):
        LLM.load("smollm2", torch_compile=True)  # refused before any weight is read
    with pytest.raises(ValueError, match="--weights q4 runs kvgen's CPU kernels"):
        gpu_weights_mode("q4")
    assert gpu_weights_mode("auto") == "fp32"


def test_c_row_ops_take_only_host_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvgen's C row ops read host memory: a model on a GPU in float32 (dtype='float32') must take the
    torch ops for its norms and rotary (here a meta tensor stands for a device one)."""
    from kvgen.models import layers, rotary

    calls: list[str] = []

    class Library:  # records which C ops were asked for
        def __getattr__(self, name: str):
            return lambda *args: calls.append(name)

    monkeypatch.setattr(layers, "load", Library)
    monkeypatch.setattr(rotary, "load", Library)
    on_device = layers.RMSNorm(torch.ones(8, device="meta"), 1e-6)
    assert on_device(torch.ones(1, 3, 8, device="meta")).device.type == "meta"
    cos = sin = torch.ones(3, 8, device="meta")
    assert rotary.apply_rotary(torch.ones(1, 2, 3, 8, device="meta"), cos, sin).device.type == "meta"
    assert calls == []
    layers.RMSNorm(torch.ones(8), 1e-6)(torch.ones(1, 3, 8))  # a host tensor does take the C op
    assert calls == ["kvgen_rms_norm_rows"]


def test_a_compiled_step_is_refused_where_steps_run_without_graphs(tmp_path) -> None:
    """LongRoPE (Phi-3) picks its factors on the host each step, so its steps never replay graphs:
    compiling them would do nothing, and the option says so instead of being ignored."""
    from tests.support.tiny_hf import save_tiny_decoder, tokenizer_folder

    save_tiny_decoder("phi3", tmp_path / "phi3", tokenizer_folder(tmp_path / "tokenizer"))
    model = LLM.load(tmp_path / "phi3", progress=False, weights="fp32").model
    assert not CudaGraphDecoder(model, capture=False).runs_graphs
    with pytest.raises(ValueError, match="LongRoPE picks its factors on the host"):
        CudaGraphDecoder(model, capture=False, compiled=True)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_the_compiled_step_traces_as_one_graph(tmp_path, family: str) -> None:
    """torch_compile compiles the graphs' step: a break inside it (a host-only check traced per layer)
    splits the step into pieces that run uncompiled past dynamo's recompile limit. bf16 on the CPU
    takes the same torch ops as a GPU, so dynamo traces here what it traces there."""
    from tests.support.tiny_hf import save_tiny_decoder, tokenizer_folder

    save_tiny_decoder(family, tmp_path / family, tokenizer_folder(tmp_path / "tokenizer"))
    llm = LLM.load(tmp_path / family, progress=False, weights="fp32", dtype="bfloat16")
    graphs = CudaGraphDecoder(llm.model, capture=False)
    buffers = llm.generator.new_cache(256).static_buffers(1)
    view = _PositionedKV(buffers, graphs.position, bucket_for(0, buffers[0].shape[3]))
    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            explained = torch._dynamo.explain(graphs._forward)(view)
    finally:
        torch._dynamo.reset()
    assert [reason.reason for reason in explained.break_reasons] == []
    assert explained.graph_count == 1
