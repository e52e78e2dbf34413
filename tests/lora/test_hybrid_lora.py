"""LoRA on the hybrids (LFM2, Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1): adapters on attention, the dense MLPs and
the state layers' mixers (a Mamba-2 or short-conv in_proj and out_proj) apply as peft applies them,
on the torch path and in the C steps, per row in the engine, and through a prefix-cache hit; a
GGUF LoRA with llama.cpp's mixer names loads as the same adapter; what LoRA does not reach is
refused before anything changes.

No hybrid checkpoint installs offline: the models are small random-weight ones that transformers
builds (tests/support/tiny_hf.py), the adapters random ones that peft makes on them."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvgen.engine import EngineConfig, LLMEngine
from kvgen.llm import LLM
from kvgen.lora.adapter import AdapterError
from kvgen.lora.gguf_lora import write_gguf_lora
from kvgen.sampling.params import SamplingParams
from kvgen.speculative.config import SpeculativeConfig
from tests.engine.test_engine import drain
from tests.support.lora import save_halved_peft_adapter
from tests.support.models import model_path
from tests.support.recurrent import (SpoiledOracle, assert_a_chain_is_one_token_steps, assert_prefill_is_chunk_invariant, prefill_and_steps,
                                     random_ids)  # fmt: skip
from tests.support.tiny_gguf import write_falcon_h1_gguf
from tests.support.tiny_hf import (save_tiny_bamba, save_tiny_falcon_h1, save_tiny_granite_hybrid, save_tiny_lfm2, save_tiny_nemotron_h,
                                   tokenizer_folder)  # fmt: skip

pytestmark = pytest.mark.slow
PROMPT = random_ids(40, 7)
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)
MIXERS = ["in_proj", "out_proj"]
# family -> (its tiny model's writer, peft's target modules: every linear but the head and the
# embedding; the mixers'). peft refuses a Mamba out_proj on nemotron_h and falcon_h1 models
# (transformers' fused kernel reads its weight directly), so their adapters leave it out. The tiny
# Falcon-H1 has every µP multiplier away from 1: its adapters' B are folded as its weights are.
FAMILIES: dict[str, tuple[Callable[..., Any], list[str], list[str]]] = {
    "lfm2": (save_tiny_lfm2, ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"], MIXERS),
    "granite": (lambda folder, tokenizer: save_tiny_granite_hybrid(folder, tokenizer, experts=0),
                ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear", "output_linear"], MIXERS),
    "bamba": (save_tiny_bamba, ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "gate_proj", "up_proj", "down_proj"],
              MIXERS),
    "nemotron-h": (save_tiny_nemotron_h, ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj"], ["in_proj"]),
    "falcon-h1": (save_tiny_falcon_h1, ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "gate_proj", "up_proj", "down_proj"],
                  ["in_proj"]),
}  # fmt: skip


@dataclasses.dataclass
class Built:
    folder: Path
    adapters: dict[str, tuple[Path, torch.Tensor]]  # name -> (peft's folder, peft's logits over PROMPT)
    fp32: LLM
    int8: LLM


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    """Per family: the model, two peft adapters (every linear at rank 4; the mixers alone at rank
    2), and the model loaded with fp32 and int8 weights, both adapters loaded on each."""
    tokenizer = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    families = {}
    for family, (save, targets, mixers) in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        model = save(root / "model", tokenizer)
        adapters = {}
        for seed, (name, rank, modules) in enumerate((("all", 4, targets), ("mixers", 2, mixers))):
            model, logits = save_halved_peft_adapter(model, root / name, PROMPT, seed, r=rank, lora_alpha=8, target_modules=modules)
            adapters[name] = (root / name, logits)
        loaded = [LLM.load(root / "model", progress=False, weights=weights) for weights in ("fp32", "int8")]
        for llm in loaded:
            for name, (path, _) in adapters.items():
                llm.load_adapter(name, path)
        families[family] = Built(root / "model", adapters, *loaded)
    return families


def prompt_logits(llm: LLM, adapter: str | None) -> torch.Tensor:
    with torch.inference_mode():
        return llm.model(torch.tensor([PROMPT]), llm.model.new_state_cache(), logits_to_keep=len(PROMPT), adapter=adapter)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_on_attention_mlps_and_mixers_match_peft(family: str, built: dict[str, Built]) -> None:
    """Logits over a 40-token prompt under each adapter against peft's on the transformers model
    (the torch path: fp32 weights)."""
    case = built[family]
    base = prompt_logits(case.fp32, None)
    for name, (_, expected) in case.adapters.items():
        assert (expected - base).abs().max().item() > 0.05, f"{name} changes nothing: a vacuous check"
        assert (prompt_logits(case.fp32, name) - expected).abs().max().item() < 2e-3, name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_c_steps_apply_them_as_the_torch_path(family: str, built: dict[str, Built], monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 weights: under each adapter, the prompt's C blocks and 8 C decode steps give the torch
    path's logits (c_decode off: torch mixers, MLPs and deltas over the same linears). The two
    deltas differ in the last bits (1e-7), and the 8-bit rounding of the next linear's input can
    turn that into one rounding step there, so they are held to a fraction of the adapter's own
    effect, not to the base step's 1e-4 (measured on LFM2, Granite 4.0-H, Bamba and Nemotron-H:
    1.5-4.8e-7 for 6 of 8 pairs, 0.012 and 0.029 for two, against effects of 0.23 to 1.7)."""
    llm = built[family].int8
    assert llm.model._c_step() is not None
    more = random_ids(8, 3)
    base = prefill_and_steps(llm, PROMPT, more)
    for adapter in built[family].adapters:
        in_c = prefill_and_steps(llm, PROMPT, more, adapter)
        with monkeypatch.context() as patch:
            patch.setattr(llm.model, "c_decode", False)
            in_torch = prefill_and_steps(llm, PROMPT, more, adapter)
        difference, effect = (in_c - in_torch).abs().max().item(), (in_c - base).abs().max().item()
        assert difference < 0.05 and effect > 10 * difference, (adapter, difference, effect)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_under_an_adapter_gives_the_same_bits_however_it_is_split(family: str, built: dict[str, Built]) -> None:
    """int8 weights: the prompt's attention blocks add their deltas in C, its torch mixers and MLPs
    theirs through the C step's row-by-row delta, so chunking a prompt does not move its logits, a
    one-token chunk (the decode step) included."""
    splits = [[66, 4], [31, 39], [1, 69], [17, 17, 36], [35, 1, 34], [69, 1]]
    assert_prefill_is_chunk_invariant(built[family].int8, random_ids(70, 31), splits, "all")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_verify_under_an_adapter_runs_as_one_token_steps(family: str, built: dict[str, Built]) -> None:
    """int8 weights: a speculative verify's chain of rows (the C step over 8 positions at once)
    adds each row's deltas as the one-token step does: logits and states bit for bit."""
    assert_a_chain_is_one_token_steps(built[family].int8, PROMPT, random_ids(8, 5), "all")


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_rows_under_different_adapters_equal_each_alone(family: str, built: dict[str, Built]) -> None:
    """Six requests over both adapters and the base model decode together in the C rows step (each
    row its own deltas) and give the tokens each gives alone; a second run of one prompt resumes
    from the prefix cache under its adapter and decodes the same tokens (the prompt's deltas do not
    round by the chunk)."""
    llm = built[family].int8
    names = [None, "all", "mixers"]
    prompts = [random_ids(n, 60 + n) for n in (9, 30, 17, 41, 5, 24)]
    params = [dataclasses.replace(GREEDY, adapter=names[i % 3]) for i in range(len(prompts))]
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=16, block_size=8))
    requests = [engine.add_request(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]
    drain(engine, requests)
    together = [r.output_ids for r in requests]
    assert together == [llm.generate(p, q).token_ids for p, q in zip(prompts, params)]
    again = engine.add_request("again", prompts[3], params[3])
    drain(engine, [again])
    assert again.cached_tokens >= 32 and again.output_ids == together[3]
    engine.check_invariants()
    assert engine.scheduler.num_blocks_in_use() == engine.scheduler.prefix.num_units > 0  # all the requests held is freed


@pytest.mark.parametrize("family", FAMILIES)
def test_drafts_under_an_adapter_give_the_adapters_greedy_tokens(family: str, built: dict[str, Built],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A speculative request under an adapter verifies its drafts under it: drafts accepted and
    rejected at every step give the adapter's plain greedy tokens, alone and in the engine."""
    llm = built[family].int8
    params = dataclasses.replace(GREEDY, adapter="all")
    plain = llm.generate(PROMPT, params).token_ids
    assert plain != llm.generate(PROMPT, GREEDY).token_ids  # the adapter's own text: not a vacuous check
    monkeypatch.setattr(SpeculativeConfig, "build_proposer", lambda self, generator: SpoiledOracle(PROMPT + plain))
    speculative = SpeculativeConfig("lookup", num_draft_tokens=4, adaptive=False)
    result = llm.generate(PROMPT, params, speculative=speculative)
    stats = result.speculative
    assert result.token_ids == plain
    assert 0 < stats.accepted_tokens < stats.proposed_tokens, stats  # rollbacks happened
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=16, block_size=8))
    request = engine.add_request("drafted", PROMPT, params, speculative=speculative)
    drain(engine, [request])
    assert request.output_ids == plain and engine.speculative_totals.accepted_tokens > 0


def test_a_gguf_lora_with_llama_cpps_mixer_names_loads_the_same_adapter(built: dict[str, Built], tmp_path: Path) -> None:
    """The LFM2 adapter written as llama.cpp's GGUF LoRA (blk.N.shortconv.in_proj, ffn_gate, ...
    under the `lfm2` architecture) gives the logits the peft folder gives."""
    case = built["lfm2"]
    llm = case.fp32
    adapter = llm.adapters._entries["all"].adapter
    path = tmp_path / "all.gguf"
    write_gguf_lora(adapter, llm.config, path, alpha=8.0, arch="lfm2")
    llm.load_adapter("all-gguf", path)
    try:
        assert (prompt_logits(llm, "all-gguf") - prompt_logits(llm, "all")).abs().max().item() < 1e-5
    finally:
        llm.unload_adapter("all-gguf")


def test_what_lora_does_not_reach_is_refused_and_changes_nothing(built: dict[str, Built], tmp_path: Path) -> None:
    """An adapter whose tensor names a projection on a layer without it (an attention projection on
    a conv layer) is refused naming the layer; a Falcon-H1 GGUF refuses adapters (its converter
    folded the µP multipliers without recording them). The adapters loaded before are untouched."""
    from safetensors.torch import load_file, save_file

    case = built["lfm2"]
    llm = case.fp32
    before = prompt_logits(llm, "all")
    source = case.adapters["mixers"][0]
    wrong = tmp_path / "wrong-layer"
    shutil.copytree(source, wrong)
    tensors = load_file(str(source / "adapter_model.safetensors"))
    stem = "base_model.model.model.layers.0.self_attn.q_proj"  # layer 0 is a conv layer
    tensors |= {f"{stem}.lora_A.weight": torch.randn(2, 64), f"{stem}.lora_B.weight": torch.randn(64, 2)}
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="layer 0 q_proj: layer 0 is a conv layer without that projection"):
        llm.load_adapter("wrong-layer", wrong)
    assert llm.adapters.names() == ["all", "mixers"]
    assert torch.equal(prompt_logits(llm, "all"), before)
    import transformers

    falcon = built["falcon-h1"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(falcon.folder)
    gguf_model = LLM.load(write_falcon_h1_gguf(tmp_path / "falcon.gguf", reference, model_path("smollm2")), progress=False)
    with pytest.raises(AdapterError, match="LoRA adapters on a Falcon-H1 GGUF are not supported"):
        gguf_model.load_adapter("mixers", falcon.adapters["mixers"][0])
