"""kvgen on a CUDA GPU against transformers on the same weights: bf16 prefill and CUDA-graph decode
logits as close to the fp32 reference as transformers' own bf16, greedy runs that equal one-token
steps, graphs captured once and reused, stops inside a run. Skipped without a GPU (CI has none).

The weights are random (transformers' own init) on the real models' architectures, shapes and
tokenizers (tests/support/random_like.py): GPU machines here have no copy of the real weights.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kvgen import LLM
from kvgen.sampling.params import SamplingParams
from tests.support.random_like import save_random_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU and a CUDA build of torch")


class Pair:
    def __init__(self, name: str, folder: Path):
        reference = save_random_like(name, folder)
        self.bf16 = copy.deepcopy(reference).to("cuda", torch.bfloat16)
        self.fp32 = reference.to("cuda")
        self.llm = LLM.load(folder, device="cuda", progress=False)
        self.folder = folder
        self.vocab = self.llm.config.vocab_size

    def prompt(self, length: int, seed: int = 0) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(100, min(self.vocab, 30000), (length,), generator=generator).tolist()

    @torch.inference_mode()
    def reference_logits(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.tensor([ids], device="cuda")
        return self.fp32(tokens).logits[0].float(), self.bf16(tokens).logits[0].float()


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def pair(request, tmp_path_factory) -> Pair:
    return Pair(request.param, tmp_path_factory.mktemp("models") / request.param)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def test_weights_run_in_bf16_on_the_gpu(pair: Pair) -> None:
    model = pair.llm.model
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.embed_tokens  # a tied head stays one copy


def test_prefill_logits_as_close_as_transformers_bf16(pair: Pair) -> None:
    ids = pair.prompt(96)
    cache = pair.llm.generator.new_cache(128)
    with torch.inference_mode():
        ours = pair.llm.model(torch.tensor([ids]), cache, logits_to_keep=None)[0]
    fp32, bf16 = pair.reference_logits(ids)
    assert relative_error(ours, fp32) <= 1.5 * relative_error(bf16, fp32) + 1e-3


def test_graph_decode_logits_as_close_as_transformers_bf16(pair: Pair) -> None:
    """Teacher-forced: kvgen decodes the fp32 reference's own continuation one graph step at a time;
    every step's logits are compared with the reference's at that position. Gemma 3's run starts
    at 500 positions, so its local layers' 512-position window and a graph bucket are crossed."""
    start = 500 if "gemma" in pair.llm.config.architecture else 64
    ids = pair.prompt(start + 24)
    model = pair.llm.model
    graphs = model.cuda_graphs()
    cache = pair.llm.generator.new_cache(len(ids))
    with torch.inference_mode():
        model(torch.tensor([ids[:start]]), cache)
        captured = graphs.captures
        steps = torch.stack([model(torch.tensor([[t]]), cache)[0, -1] for t in ids[start:]])
    assert graphs.captures > captured  # the steps ran from captured graphs
    fp32, bf16 = pair.reference_logits(ids)
    want, theirs = fp32[start:], bf16[start:]
    assert relative_error(steps, want) <= 1.5 * relative_error(theirs, want) + 1e-3
    agree = (steps.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= (theirs.argmax(-1) == want.argmax(-1)).float().mean() - 0.1


def test_greedy_runs_equal_one_token_steps_and_reuse_their_graphs(pair: Pair) -> None:
    llm, model = pair.llm, pair.llm.model
    ids = pair.prompt(40, seed=1)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    run = llm.generate(ids, params).token_ids  # runs of GREEDY_BURST graph replays, argmax on the device
    captured = model.cuda_graphs().captures
    assert llm.generate(ids, params).token_ids == run
    assert model.cuda_graphs().captures == captured  # the second request replayed the same graphs
    stepwise = llm.generate(ids, SamplingParams(max_new_tokens=48, ignore_eos=True, logprobs=True))  # one at a time
    assert stepwise.token_ids == run


def test_a_compiled_step_decodes_as_close_to_fp32_and_as_the_graphs_do(pair: Pair) -> None:
    """torch_compile: the graphs' step goes through torch.compile before it is captured. Teacher-forced
    logits stay as close to the fp32 reference as transformers' bf16, and to the uncompiled graphs'
    closer than that; greedy runs equal the compiled one-token steps; a second request captures
    nothing new."""
    from torch._dynamo.utils import counters

    compiled = LLM.load(pair.folder, device="cuda", progress=False, torch_compile=True)
    graphs_before, breaks_before = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())

    def teacher_forced(llm: LLM, ids: list[int]) -> torch.Tensor:
        cache = llm.generator.new_cache(len(ids))
        with torch.inference_mode():
            llm.model(torch.tensor([ids[:64]]), cache)
            return torch.stack([llm.model(torch.tensor([[t]]), cache)[0, -1] for t in ids[64:]])

    ids = pair.prompt(64 + 24)
    steps = teacher_forced(compiled, ids)
    assert compiled.model.cuda_graphs().captures > 0
    assert counters["stats"]["unique_graphs"] > graphs_before  # the step went through torch.compile
    assert sum(counters["graph_break"].values()) == breaks_before  # ... whole: one graph, every layer fused
    fp32, bf16 = pair.reference_logits(ids)
    want, theirs = fp32[64:], bf16[64:]
    assert relative_error(steps, want) <= 1.5 * relative_error(theirs, want) + 1e-3
    assert relative_error(steps, teacher_forced(pair.llm, ids).float()) <= relative_error(theirs, want) + 1e-3

    prompt, params = pair.prompt(40, seed=1), SamplingParams(max_new_tokens=48, ignore_eos=True)
    run = compiled.generate(prompt, params).token_ids
    captured = compiled.model.cuda_graphs().captures
    assert compiled.generate(prompt, params).token_ids == run
    assert compiled.model.cuda_graphs().captures == captured
    stepwise = compiled.generate(prompt, SamplingParams(max_new_tokens=48, ignore_eos=True, logprobs=True))
    assert stepwise.token_ids == run


def test_float32_weights_on_the_gpu_decode_at_the_fp32_reference(pair: Pair) -> None:
    """dtype='float32' on a GPU: the torch ops throughout (kvgen's C row ops read host memory only);
    prefill and graph-step logits sit far closer to the fp32 reference than bf16's, and greedy runs
    equal one-token steps."""
    llm = LLM.load(pair.folder, device="cuda", dtype="float32", progress=False)
    assert llm.model.device.type == "cuda" and llm.model.dtype == torch.float32
    ids = pair.prompt(64 + 16, seed=6)
    cache = llm.generator.new_cache(len(ids))
    with torch.inference_mode():
        prefill = llm.model(torch.tensor([ids[:64]]), cache, logits_to_keep=None)[0]
        steps = torch.stack([llm.model(torch.tensor([[t]]), cache)[0, -1] for t in ids[64:]])
    assert llm.model.cuda_graphs().captures > 0
    fp32, bf16 = pair.reference_logits(ids)
    got, want = torch.cat([prefill, steps]), fp32[: len(ids)]
    assert relative_error(got, want) <= 0.1 * relative_error(bf16, fp32) + 1e-5
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    run = llm.generate(ids[:40], params).token_ids
    stepwise = llm.generate(ids[:40], SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=True))
    assert stepwise.token_ids == run


def test_a_stop_inside_a_run_ends_the_text_there(pair: Pair) -> None:
    llm = pair.llm
    for seed in range(2, 10):  # random weights often repeat one token: find a prompt whose output changes
        ids = pair.prompt(24, seed=seed)
        full = llm.generate(ids, SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids
        # A token first produced inside the first run of 16 (the first token comes from the prefill).
        stop_at = next((i for i in range(2, 16) if full[i] not in full[:i]), None)
        if stop_at is not None:
            break
    else:
        pytest.skip("no prompt tried gave a new token inside the first greedy run")
    stopped = llm.generate(ids, SamplingParams(max_new_tokens=40, ignore_eos=True, stop_token_ids=(full[stop_at],)))
    assert stopped.token_ids[: stop_at + 1] == full[: stop_at + 1] and len(stopped.token_ids) <= stop_at + 1
    assert stopped.finish_reason == "stop"


def test_a_session_keeps_its_gpu_cache_between_turns(pair: Pair) -> None:
    session, params = pair.llm.session(), SamplingParams(max_new_tokens=20, ignore_eos=True)
    ids = pair.prompt(16, seed=3)
    first = session.stream(ids, params)
    list(first)
    generated = first.result.token_ids
    second = session.stream(ids + generated + pair.prompt(6, seed=4), params)
    assert len(list(second)) == 20
    # Everything but the first turn's last token (never fed back) was reused from the GPU cache.
    assert second.result.usage.cached_tokens == len(ids) + len(generated) - 1


def test_generation_continues_past_the_context_with_shift_on_the_gpu(pair: Pair, monkeypatch) -> None:
    """context_shift on a GPU cache: the kept keys are re-rotated in the graphs' own buffers, every
    step after a shift replays a graph (one token at a time), and generation runs past the context."""
    from kvgen.generate import Generator

    small = Generator(pair.llm.model, pair.llm.tokenizer, max_context=48)
    ids = pair.prompt(14, seed=7)
    stopped = small.generate(ids, SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert stopped.finish_reason == "length" and len(ids) + len(stopped.token_ids) == 48
    graphs, replayed = pair.llm.model.cuda_graphs(), []
    step = graphs.step

    def counted(input_ids: torch.Tensor, cache) -> torch.Tensor | None:
        logits = step(input_ids, cache)
        replayed.append(logits is not None)
        return logits

    monkeypatch.setattr(graphs, "step", counted)
    stream = small.stream(ids, SamplingParams(max_new_tokens=100, ignore_eos=True, context_shift=True))
    list(stream)
    assert len(stream.result.token_ids) == 100 and stream.shifted > 0
    assert stream.result.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # same until the first shift
    assert stream.cache.seq_len <= 48
    assert len(replayed) >= 100 - len(stopped.token_ids) and all(replayed)


def test_samples_share_one_prefill_on_the_gpu(pair: Pair) -> None:
    ids = pair.prompt(20, seed=5)
    greedy = pair.llm.generate(ids, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    samples = pair.llm.generate_n(ids, SamplingParams(n=2, max_new_tokens=12, ignore_eos=True))
    assert [s.token_ids for s in samples] == [greedy, greedy]  # each fork of the GPU cache decodes alike
    seeded = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=3)
    first, again = pair.llm.generate_n(ids, seeded), pair.llm.generate_n(ids, seeded)
    assert [s.token_ids for s in first] == [s.token_ids for s in again]  # seeds reproduce on the GPU too


def test_gpu_models_refuse_cpu_only_features(pair: Pair) -> None:
    from kvgen.config import CacheConfig
    from kvgen.engine.engine import LLMEngine
    from kvgen.speculative import SpeculativeConfig

    llm = pair.llm
    with pytest.raises(ValueError, match="the engine runs on the CPU"):
        LLMEngine(llm)
    with pytest.raises(ValueError, match="generate_batch runs on the CPU"):
        llm.generate_batch(["a", "b"])
    with pytest.raises(ValueError, match="speculative decoding runs on the CPU"):
        llm.generate([1, 2, 3], SamplingParams(max_new_tokens=4), speculative=SpeculativeConfig(method="lookup"))
    llm.generator.cache_config = CacheConfig(kind="paged")
    try:
        with pytest.raises(ValueError, match="keeps its keys and values in the default contiguous cache"):
            llm.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    finally:
        llm.generator.cache_config = CacheConfig()
